"""The one acceptance rule: which of a row's staged tokens a step commits, and what it emits.

A row's step ran ``[last, d1 .. dk]`` (k drafted tokens, then padding) at positions ``len .. len + w - 1``;
``rows[i]`` is the step's summary of token i (`engine.model.forward.summarize`): the greedy choice after ``d1 .. di``
before any ban, its logit, the row's logsumexp, the logit of d_{i+1} and d_{i+1} itself.
- the target's token at row i is the greedy choice after the official no-repeat-ngram bans computed on
  prompt + committed + ``d1 .. di`` (a drafted token is judged exactly as ``generate`` would judge it); when the
  argmax itself is banned, the row's full logits give the greedy choice after the bans (first index on ties);
- accept the longest prefix with ``d_i`` equal to the target's token, then emit the target's own token at the first
  mismatch (or after the last draft): every emitted token is the target's choice, so the output is the official
  greedy output token for token; stop at EOS (tokens after an accepted EOS are never emitted);
- ``fast_threshold`` set (mode ``fast``): a draft token that is not the target's choice is also accepted while the
  target gives it probability >= the threshold, unless it is banned or it or the target's token is one of
  ``strict_ids`` (EOS, the page separator: fast mode neither ends a page early nor merges pages); the token after
  the accepted drafts is still the target's own;
- the row commits the states of ``last`` and the accepted drafts (``len(emitted)`` positions); the rest of the
  step is rolled back for free (`engine.model.kv_slots`).
Each emitted token's log-probability is recorded (log-softmax of the logits before the bans).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.ngram_rule import NoRepeatNgramRule, greedy_token


@dataclass
class Accepted:
    emitted: list[int]
    logprobs: list[float]
    relaxed: int = 0  # draft tokens accepted by fast mode's relaxed rule although not the target's choice


def accept(rows: Sequence[Sequence[float]], n_draft: int, rule: NoRepeatNgramRule, eos_token_id: int,
           logits_row: Callable[[int], torch.Tensor], fast_threshold: float | None = None,
           strict_ids: frozenset[int] = frozenset(), bans: Sequence[set[int]] = ()) -> Accepted:
    """The rule of the module docstring for one row; ``rows`` [>= n_draft + 1][5], ``logits_row(i)`` fp32 [vocab].
    ``bans[i]``, where given, is ``rule.banned(d1 .. di)`` computed ahead (the engine does it while the device runs
    the step); the rest are computed here."""
    draft = [int(rows[i][4]) for i in range(n_draft)]
    log_threshold = math.log(fast_threshold) if fast_threshold else None
    out = Accepted([], [])
    for i in range(n_draft + 1):
        banned = bans[i] if i < len(bans) else rule.banned(draft[:i])
        target, best, lse, drafted = int(rows[i][0]), float(rows[i][1]), float(rows[i][2]), float(rows[i][3])
        if target in banned:  # rare: the argmax itself is banned; take the row's greedy choice after the bans
            row = logits_row(i)
            target = greedy_token(row, banned)
            best = float(row[target])
        if (i < n_draft and draft[i] != target and log_threshold is not None and drafted - lse >= log_threshold
                and draft[i] not in banned and draft[i] not in strict_ids and target not in strict_ids):
            out.emitted.append(draft[i])
            out.logprobs.append(drafted - lse)
            out.relaxed += 1
            continue
        out.emitted.append(target)
        out.logprobs.append(best - lse)
        if i == n_draft or draft[i] != target or target == eos_token_id:
            break
    return out
