"""Which draft to verify each round, and how long: one proposal per round, K adapted per drafter.

- Every active drafter proposes up to its own K (capped by the room left); the longest proposal wins
  (the first drafter in order on ties).
- After a round the winner's K becomes ``min(cap, 2 * (accepted + 1))``: it doubles while drafts are
  fully accepted and shrinks to just past what was accepted otherwise; a drafter that declares ``keeps_k = True``
  keeps its cap (the block drafter on a GPU, where its draft costs the same at any K and a width-9 verify little
  more than a width-3 one). ``cap`` is ``k_max``, or the drafter's
  own entry in ``caps`` (e.g. a longer one for the replay drafter of a re-run, whose drafts are nearly always
  right); a drafter starts at its cap.
- A drafter that declares ``max_draft`` (the longest draft it can make, e.g. the block drafter's block) is not
  asked when a draft at least that long (or as long as its K) is already in hand: it could not win the round.
  Drafters are asked in their configured order, so the cheap copy drafters go before the block network.
- A drafter whose draft was wholly rejected sits out ``backoff`` rounds (1, 2, 4 .. 16, reset by any
  acceptance), so an always-wrong drafter costs little more than plain decoding. A host drafter that proposed
  nothing sits out the same way (1, 2, 4 .. ``MAX_IDLE_BACKOFF`` rounds, reset by any proposal): on a page it has
  nothing for (a scan: no repeated phrase, no header) it is asked now and then (the probe), not every round, so
  drafting that never hits costs next to nothing. A drafter that declares
  ``sits_out = False`` never sits out: its proposal costs nothing and it re-aligns itself after a miss (the
  replay drafter of a re-run), and its K already fell to 2, so a wrong draft costs a width-3 verify (sitting it
  out would turn the rounds after the re-run's text re-joins the earlier one into single steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.drafters import Drafter

MAX_BACKOFF = 16
MAX_IDLE_BACKOFF = 16


@dataclass
class DrafterStats:
    rounds: int = 0  # rounds in which its draft was verified
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens accepted
    proposed_at: list[int] = field(default_factory=list)  # [j]: rounds whose draft had a token at position j
    accepted_at: list[int] = field(default_factory=list)  # [j]: rounds that accepted the token at position j

    def as_dict(self) -> dict:
        rate = self.accepted / self.proposed if self.proposed else 0.0
        by_position = [round(a / p, 4) for a, p in zip(self.accepted_at, self.proposed_at)]
        return {"rounds": self.rounds, "proposed": self.proposed, "accepted": self.accepted,
                "acceptance": round(rate, 4), "acceptance_by_position": by_position}


class DraftPolicy:
    def __init__(self, drafters: list[Drafter], k_max: int, caps: dict[str, int] | None = None):
        if k_max < 1 or any(cap < 1 for cap in (caps or {}).values()):
            raise ValueError("k_max and every cap must be >= 1")
        self.drafters = list(drafters)
        self.cap = {d.name: (caps or {}).get(d.name, k_max) for d in self.drafters}
        self.k = dict(self.cap)
        self.stats = {d.name: DrafterStats() for d in self.drafters}
        self._sit_out = {d.name: 0 for d in self.drafters}
        self._backoff = {d.name: 1 for d in self.drafters}
        self._idle_backoff = {d.name: 1 for d in self.drafters}
        self._benched = {d.name: getattr(d, "sits_out", True) for d in self.drafters}
        self._keeps_k = {d.name: getattr(d, "keeps_k", False) for d in self.drafters}

    def propose(self, committed_ids: list[int], room: int) -> tuple[str | None, list[int], int]:
        """(drafter name, draft of at most ``room`` tokens, device k): the longest proposal of this round.
        A drafter with ``on_device = True`` (the block drafter: its drafts are made for many rows in one forward
        and stay on the device) is not asked here: when it would win (its K beats every host draft) the result
        is (its name, [], its K) and the engine drafts it; (None, [], 0) when nobody has a draft."""
        best: tuple[str | None, list[int], int] = (None, [], 0)
        for drafter in self.drafters:
            if self._sit_out[drafter.name] > 0:
                self._sit_out[drafter.name] -= 1
                continue
            limit = min(self.k[drafter.name], room)
            cap = getattr(drafter, "max_draft", None)
            longest = len(best[1]) or best[2]
            if cap is not None and longest >= min(limit, cap):
                continue  # it cannot propose a longer draft: skip its (costly) forward
            if getattr(drafter, "on_device", False):
                if limit > 0 and drafter.ready(committed_ids):
                    best = (drafter.name, [], min(limit, cap or limit))
                continue
            draft = drafter.propose(committed_ids, limit)
            self._idle(drafter.name, bool(draft))
            if len(draft) > longest:
                best = (drafter.name, draft, 0)
        return best

    def _idle(self, name: str, proposed: bool) -> None:
        """Back a host drafter off while it proposes nothing (see the module docstring)."""
        if proposed:
            self._idle_backoff[name] = 1
        elif self._benched[name]:
            self._sit_out[name] = max(self._sit_out[name], self._idle_backoff[name])
            self._idle_backoff[name] = min(MAX_IDLE_BACKOFF, 2 * self._idle_backoff[name])

    def record(self, name: str, proposed: int, accepted: int) -> None:
        stats = self.stats[name]
        stats.rounds += 1
        stats.proposed += proposed
        stats.accepted += accepted
        for counts in (stats.proposed_at, stats.accepted_at):
            counts.extend([0] * (proposed - len(counts)))
        for j in range(proposed):
            stats.proposed_at[j] += 1
            stats.accepted_at[j] += j < accepted
        self.k[name] = self.cap[name] if self._keeps_k[name] else min(self.cap[name], 2 * (accepted + 1))
        if accepted == 0 and self._benched[name]:
            self._sit_out[name] = self._backoff[name]
            self._backoff[name] = min(MAX_BACKOFF, 2 * self._backoff[name])
        else:
            self._backoff[name] = 1
