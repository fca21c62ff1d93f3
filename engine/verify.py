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

``verify_round`` also returns the log-probability of every emitted token (log-softmax of the fp32 logits,
before the no-repeat-ngram bans; ``engine.quality`` uses them) and, in ``fast`` mode (``fast_threshold`` set),
accepts a draft token that is not the argmax while the target gives it probability >= ``fast_threshold``
(never a banned token, never when the draft or the target token is one of ``strict_ids``, e.g. EOS and the
page separator, so fast mode neither ends a page early nor merges pages). The token after the accepted
drafts is still the target's own choice. The emitted tokens are chosen exactly as in ``verify``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine.ngram_rule import NoRepeatNgramRule, greedy_token
from engine.rswa_cache import RswaKVCache
from engine.runner import RswaRunner


def verify(runner: RswaRunner, cache: RswaKVCache, rule: NoRepeatNgramRule, last_token: int, draft: list[int],
           eos_token_id: int) -> list[int]:
    """Emitted tokens of the round: ``d1..da`` (accepted) + the target's next token, EOS-truncated."""
    return verify_round(runner, cache, rule, last_token, draft, eos_token_id).emitted


@dataclass
class Round:
    emitted: list[int]
    logprobs: list[float] = field(default_factory=list)  # one per emitted token
    relaxed: int = 0  # draft tokens accepted by the fast-mode rule although not the argmax


def verify_round(runner: RswaRunner, cache: RswaKVCache, rule: NoRepeatNgramRule, last_token: int,
                 draft: list[int], eos_token_id: int, fast_threshold: float | None = None,
                 strict_ids: frozenset[int] | set[int] = frozenset()) -> Round:
    """One round (see the module doc); ``fast_threshold`` None is lossless."""
    logits = runner.step(cache, [last_token, *draft])
    lse = torch.logsumexp(logits, dim=-1)
    draft_lp: list[float] = []
    if fast_threshold is not None and draft:
        rows = torch.arange(len(draft), device=logits.device)
        ids = torch.tensor(draft, device=logits.device)
        draft_lp = (logits[rows, ids] - lse[: len(draft)]).tolist()
    log_threshold = math.log(fast_threshold) if fast_threshold else None
    emitted: list[int] = []
    relaxed = 0
    for i in range(len(draft) + 1):
        banned = rule.banned(draft[:i])
        target = greedy_token(logits[i], banned)
        if (i < len(draft) and draft[i] != target and log_threshold is not None and draft_lp[i] >= log_threshold
                and draft[i] not in banned and draft[i] not in strict_ids and target not in strict_ids):
            emitted.append(draft[i])  # fast mode: the target finds the draft token likely enough
            relaxed += 1
            continue
        emitted.append(target)
        if i == len(draft) or draft[i] != target or target == eos_token_id:
            break
    cache.commit(len(emitted))
    rows = torch.arange(len(emitted), device=logits.device)
    chosen = logits[rows, torch.tensor(emitted, device=logits.device)] - lse[: len(emitted)]
    return Round(emitted, chosen.tolist(), relaxed)


def token_logprob(logits: torch.Tensor, token: int) -> float:
    """log-softmax of one row of fp32 logits at ``token`` (before any bans)."""
    return float(logits[token] - torch.logsumexp(logits, dim=-1))
