"""Drafters: cheap guesses of the target's next tokens. Any guess is safe, `engine.verify` keeps only
what the target itself would have produced; a good drafter only makes decoding faster.

A drafter has a ``name`` and ``propose(committed_ids, k) -> list[int]``: up to ``k`` tokens expected to
follow ``committed_ids`` (the output so far, prompt excluded). It may keep state between calls, but
must accept any ``committed_ids`` that extends the previous one (rounds in which it was not asked
included). Optional: ``max_draft``, the longest draft it can ever make (`engine.drafters.policy` then skips
it in rounds where it could not win).

A drafter of the static fast path may return a `DeviceDraft` instead of a list: its ids stay on the device,
where the verify step reads them (`engine.static_runner.StaticRswaRunner.step`'s ``device_tail``), so the host
never waits for a draft; its length is known without looking. Only `engine.fast_decoder.verify_static` reads one.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Drafter(Protocol):
    name: str

    def propose(self, committed_ids: list[int], k: int) -> list[int]: ...


class DeviceDraft:
    """A draft whose ids are still on the device (``ids``, 1-D, length ``len()``): the output of a graph replay
    that the next one overwrites, so it must be verified before the drafter drafts again."""

    __slots__ = ("ids",)

    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __len__(self) -> int:
        return self.ids.numel()
