"""One lossless verify round: the target model checks a drafted continuation in a single forward.

Given the committed output (the rule holds prompt + committed ids) and the last committed token, whose
key/value states are not cached yet:
- forward [last, d1..dk] at positions ``length .. length+k``; row i holds the logits after ``d1..di``;
- the target's token at row i is the greedy choice after the official no-repeat-ngram bans computed on
  prompt + committed + ``d1..di`` (so a drafted token is judged exactly as generate would judge it);
- accept the longest prefix with ``d_i`` equal to the target's token, then emit the target's own token
  at the first mismatch (or after the last draft token): every emitted token is the target's choice;
- stop at EOS: tokens after an accepted EOS are never emitted;
- commit the states of ``last`` and the accepted drafts; the rest of the step is rolled back for free.
"""

from __future__ import annotations

from engine.ngram_rule import NoRepeatNgramRule, greedy_token
from engine.rswa_cache import RswaKVCache
from engine.runner import RswaRunner


def verify(runner: RswaRunner, cache: RswaKVCache, rule: NoRepeatNgramRule, last_token: int, draft: list[int],
           eos_token_id: int) -> list[int]:
    """Emitted tokens of the round: ``d1..da`` (accepted) + the target's next token, EOS-truncated."""
    logits = runner.step(cache, [last_token, *draft])
    emitted: list[int] = []
    for i in range(len(draft) + 1):
        target = greedy_token(logits[i], rule.banned(draft[:i]))
        emitted.append(target)
        if i == len(draft) or draft[i] != target or target == eos_token_id:
            break
    cache.commit(len(emitted))
    return emitted
