"""The next plain step on the device while the host commits this one: the host's per-row work after a step's sync
(committing each row's token, its counts, the no-repeat rule's index) no longer leaves the device idle.

After a step's results reach the host, `next_plain_step` launches the following step at once, before this one's
bookkeeping (`BatchEngine._commit`), when the following step is a plain one whose inputs are already known:
- this step ran width 1 and its rows did not draft, nor will the next one's (mode ``plain``, or the width choice has
  the rows not drafting and no probe due: `engine.batch.step_width.StepWidth.skips_drafting`), and there is no block
  drafter (its features are read after each step);
- every row goes on: none took EOS or reached its token limit, none was stopped by the loop watch;
- no row's greedy choice is banned by the no-repeat rule (its token then comes from the full logits, which the next
  step would overwrite);
- no admission can change the rows first (nothing waits for a free row).
Its inputs are each row's token of this step at the next position: exactly what `BatchEngine._launch` would stage
after the commit. So the tokens are the same, only the host's bookkeeping runs beside the device's work. The
engine processes the launched step at its next turn (`BatchEngine.in_flight`); before an admission that would change
the rows it completes it first, and dropping or shrinking the rows discards it (nothing of it was committed: the
rows' next step recomputes the same positions, rule 2 of `engine.model.kv_slots`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Launched:
    """A step on the device: its rows, shape and drafts, and what its timing needs."""

    live: list  # the rows it runs (`engine.batch.rows.Row`), in index order
    n: int  # rows bucket
    w: int  # width
    prefix_bucket: int
    plans: list  # per row: (drafter, host draft, device draft length)
    ks: list[int]  # per row: draft tokens verified
    block: bool  # the block drafter drafted for some row
    drafting: bool  # the rows drafted (their host drafting is priced)
    captures: int  # graph captures before it ran
    summary: torch.Tensor  # [n, w, 5] (`engine.model.forward.summarize`), valid until the next step runs
    t0: float
    t_plan: float
    t_draft: float
    bans: list = field(default_factory=list)  # per row, per draft prefix: the rule's bans (`BatchEngine._collect`)


def stage_inputs(engine, live: list, n: int, tokens: list[int], lengths: list[int]) -> None:
    """The host's staging buffers for a step of ``n`` rows: each live row's token at its next position, padding
    elsewhere (every width's columns staged: positions past the step's width are uncommitted ones)."""
    index = np.fromiter((r.index for r in live), dtype=np.int64, count=len(live))
    ids, pos, span = engine.kv.host_ids, engine.kv.host_pos, np.arange(engine.kv.max_width)
    ids[:n] = 0
    pos[:n] = span[None]
    ids[index] = np.asarray(tokens, dtype=np.int64)[:, None]
    pos[index] = np.asarray(lengths, dtype=np.int64)[:, None] + span


def next_plain_step(engine, launched: Launched, rows: np.ndarray) -> Launched | None:
    """Launch the step after ``launched`` (whose results ``rows`` the host holds) when the module docstring's
    conditions hold; else None."""
    live = launched.live
    if launched.w != 1 or any(launched.ks) or engine.block is not None or admission_waits(engine):
        return None
    tokens = rows[[r.index for r in live], 0, 0].astype(np.int64).tolist()
    for row, token, bans in zip(live, tokens, launched.bans):
        if token == engine.eos or token in bans[0] or len(row.output) + 1 >= row.request.max_new_tokens or \
                (row.watch is not None and row.watch.stop is not None):
            return None
    n, prefix_bucket = launched.n, launched.prefix_bucket
    if engine.mode != "plain" and (launched.drafting or not engine.adaptive_width or
                                   not engine.step_width.skips_drafting(n, prefix_bucket)):
        return None
    stage_inputs(engine, live, n, tokens, [r.length + 1 for r in live])
    engine.kv.stage()
    captures = engine._captures()
    summary = engine._run(n, 1, min(prefix_bucket, engine.kv.capacity))
    none = (None, [], 0)
    return Launched(live, n, 1, prefix_bucket, [none] * len(live), [0] * len(live), False, False, captures, summary,
                    0.0, 0.0, 0.0)


def admission_waits(engine) -> bool:
    """A chunk waits and a row is free: the next turn's admission would change the rows."""
    return bool(engine.pending) and any(r is None for r in engine.rows[: engine.row_limit])
