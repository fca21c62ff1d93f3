"""Drafters: cheap guesses of the target's next tokens. Any guess is safe, `engine.batch.acceptance` keeps only
what the target itself would have produced; a good drafter only makes decoding faster.

A host drafter has a ``name`` and ``propose(committed_ids, k) -> list[int]``: up to ``k`` tokens expected to
follow ``committed_ids`` (the output so far, prompt excluded). It may keep state between calls, but
must accept any ``committed_ids`` that extends the previous one (rounds in which it was not asked
included). Optional: ``max_draft``, the longest draft it can ever make (`engine.drafters.policy` then skips
it in rounds where it could not win).

The block drafter is not a host drafter: `engine.drafters.block_rows.BlockRows` drafts for every row of the batch
in one device forward, and each row's `BlockRowDrafter` (``on_device = True``) only tells its row's
`engine.drafters.policy.DraftPolicy` that it can draft. ``DraftPolicy.propose`` returns ``(name, draft,
device_k)``: a host draft, or, when the block drafter wins, an empty draft and the number of tokens the engine
takes from the device draft (`engine.batch.engine`), so the host never waits for a draft.
"""

from __future__ import annotations

from typing import Protocol


class Drafter(Protocol):
    name: str

    def propose(self, committed_ids: list[int], k: int) -> list[int]: ...
