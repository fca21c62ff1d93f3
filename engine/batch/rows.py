"""One row of the batch: a chunk's decode state from its prefill to its end, and what it records.

A row holds the chunk's request, its no-repeat-ngram rule (prompt + committed output), its output ids and their
log-probabilities, its draft policy and drafters, and its counts. Position bookkeeping: the prefix holds positions
``0 .. L-1``; after the prefill the first output token o_0 is chosen from the prefix's last logits; a step runs
``[o_t, d1 .. dk]`` at positions ``L + t ..``, so ``length = L + len(output) - 1`` positions are committed.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from engine.batch.acceptance import Accepted
from engine.batch.loop_watch import LoopWatch
from engine.drafters.markup import MarkupDrafter
from engine.drafters.ngram import NgramDrafter
from engine.drafters.policy import DraftPolicy
from engine.drafters.suffix_match import ReferenceDrafter, ReplayDrafter
from engine.model.load import PAGE_SEPARATOR
from engine.ngram_rule import NoRepeatNgramRule, greedy_token

MODES = ("plain", "lossless", "fast")
DRAFTERS = ("reference", "replay", "markup", "ngram", "block")


def has_copy_source(names: tuple[str, ...], reference_texts: list[str] | None, replay_ids: list[int] | None) -> bool:
    """A configured copy drafter has something for every page of the chunk."""
    if replay_ids and "replay" in names:
        return True
    return bool(reference_texts) and "reference" in names and all(t.strip() for t in reference_texts)


def make_drafters(engine, request, row_index: int) -> list:
    """The configured drafters that have what they need for this chunk, in priority order (no reference drafter
    without a reference text: a scan's pages have none). The block drafter serves chunks with nothing to copy (a full
    copy source alone measured faster) unless block_beside_copies."""
    from engine.drafters.block_rows import BlockRowDrafter

    drafters: list = []
    copies = has_copy_source(engine.drafter_names, request.reference_texts, request.replay_ids)
    for name in engine.drafter_names:
        if name == "reference" and any(t.strip() for t in request.reference_texts or []):
            separator = PAGE_SEPARATOR if request.kind == "multi" else None
            drafters.append(ReferenceDrafter(engine.loaded.tokenizer, request.reference_texts, separator))
        elif name == "replay" and request.replay_ids:
            drafters.append(ReplayDrafter(request.replay_ids))
        elif name == "markup":
            drafters.append(MarkupDrafter(engine.loaded.tokenizer))
        elif name == "ngram":
            drafters.append(NgramDrafter())
        elif name == "block" and engine.block is not None and (engine.block_beside_copies or not copies):
            drafters.append(BlockRowDrafter(engine.block, row_index, engine.block_sits_out, engine.block_full_k))
    return drafters


class Row:
    def __init__(self, request, index: int, rule: tuple[int, int], drafters: list, k_max: int,
                 watch: LoopWatch | None = None):
        self.request, self.index = request, index
        self.watch = watch  # the loop watch (`engine.batch.loop_watch`), when the engine stops loops
        self.prompt_ids = request.prompt_ids
        self.prefix_len = len(self.prompt_ids)
        self.rule = NoRepeatNgramRule(*rule, self.prompt_ids)
        self.drafters = drafters
        self.policy = DraftPolicy(drafters, k_max) if drafters else None
        self.output: list[int] = []
        self.logprobs: list[float] = []
        self.started = time.perf_counter()
        self.counts = {"steps": 0, "verify_rounds": 0, "single_steps": 0, "relaxed_tokens": 0, "rows_sum": 0}
        self.times = {"prefill_s": 0.0, "draft_s": 0.0, "verify_s": 0.0, "single_s": 0.0}

    def start(self, logits: torch.Tensor, prefill_s: float, eos: int) -> None:
        """The first token: the greedy choice after the rule on the prompt."""
        first = greedy_token(logits, self.rule.banned())
        self.output.append(first)
        self.logprobs.append(float(logits[first] - torch.logsumexp(logits, dim=-1)))
        self.rule.extend([first])
        self.times["prefill_s"] = prefill_s

    @property
    def length(self) -> int:
        """Committed positions (prefix + every output token but the last, whose states the next step computes)."""
        return self.prefix_len + len(self.output) - 1

    @property
    def room(self) -> int:
        """Tokens a draft may hold: the step's own token must still fit under max_new_tokens."""
        return self.request.max_new_tokens - len(self.output) - 1

    def done(self, eos: int) -> bool:
        return self.output[-1] == eos or len(self.output) >= self.request.max_new_tokens or \
            (self.watch is not None and self.watch.stop is not None)

    def end(self, eos: int) -> str:
        """Close the row's output and say why it ended: a loop found in what it committed (the output cut at the stop,
        `engine.batch.loop_watch`), else eos or its token limit."""
        if self.watch is not None and self.watch.scan(self.output) is not None:
            del self.output[self.watch.stop:], self.logprobs[self.watch.stop:]
            return "repetition"
        return "eos" if self.output[-1] == eos else "length"

    def plan(self) -> tuple[str | None, list[int], int]:
        """This step's draft: (drafter, host draft, device draft length) from the row's policy."""
        if self.policy is None or self.room < 1:
            return None, [], 0
        return self.policy.propose(self.output, self.room)

    def take(self, token: int, logprob: float) -> None:
        """Commit the one token of a step that verified no draft."""
        self.output.append(token)
        self.logprobs.append(logprob)
        self.rule.extend([token])

    def commit(self, res: Accepted, drafter: str | None, k: int) -> None:
        """Commit what the acceptance rule emitted for this row's step of k drafted tokens."""
        self.output += res.emitted
        self.logprobs += res.logprobs
        self.rule.extend(res.emitted)
        if k:
            self.policy.record(drafter, k, len(res.emitted) - 1)
        self.counts["relaxed_tokens"] += res.relaxed

    def account(self, step_share: float, draft_share: float, verified: bool, n_rows: int) -> None:
        """Count a step this row took part in, with its share of the step's wall time (the step's time / rows)."""
        self.counts["steps"] += 1
        self.counts["verify_rounds" if verified else "single_steps"] += 1
        self.counts["rows_sum"] += n_rows
        self.times["draft_s"] += draft_share
        self.times["verify_s" if verified else "single_s"] += step_share - draft_share

    def stats(self, **extra: Any) -> dict[str, Any]:
        c, t = self.counts, self.times
        drafter_stats = self.policy.stats if self.policy else {}
        accepted = sum(s.accepted for s in drafter_stats.values())
        rounds = c["verify_rounds"]
        busy = sum(t.values())
        return {"tokens": len(self.output), "forwards": 1 + c["steps"], "verify_rounds": rounds,
                "single_steps": c["single_steps"], "draft_tokens": sum(s.proposed for s in drafter_stats.values()),
                "accepted_tokens": accepted, "tau": round(accepted / rounds, 4) if rounds else 0.0,
                "relaxed_tokens": c["relaxed_tokens"],
                "drafters": {name: s.as_dict() for name, s in drafter_stats.items()},
                "draft_share": round(t["draft_s"] / busy, 4) if busy else 0.0,
                "batch_rows": round(c["rows_sum"] / c["steps"], 2) if c["steps"] else 1.0,
                **{key: round(value, 4) for key, value in t.items()}, **extra}
