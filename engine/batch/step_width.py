"""How wide a batched step runs: the width that commits the most tokens per second at this batch's load.

Every row of a step pays for the step's width w (its widest draft + 1, padded to a bucket). A row whose draft
holds k tokens commits ``1 + p_1 + .. + p_m`` tokens on average when the draft is cut to ``m = min(k, w - 1)``,
p_j being the share of its drafter's rounds that accepted draft position j (and so every position before it):
the row's own record pulled towards the drafter's record over all rows while the row has little. The step costs
``t(rows, w)``, learnt from the steps run so far (an exponential average per rows bucket and width; a width never
run is interpolated between the nearest measured ones, or assumed to cost what the nearest did, so it is tried
once; every few dozen steps the next narrower width is run instead, so that a cheaper width is never forgotten).
The chosen width maximises expected committed tokens / ``t``: at batch 1 on a GPU, where a step costs nearly the
same at any width, drafts run whole; at a large batch, where a wide step costs more, they are cut or dropped
(width 1 is plain decoding), so drafting never makes a batch slower than plain decoding by more than what it takes
to learn the costs.
"""

from __future__ import annotations

import numpy as np

PRIOR_WEIGHT = 4.0  # rounds of weight the drafter-wide record has against a row's own
EMA = 0.2
EXPLORE_EVERY = 64  # every this many steps the next narrower width is run instead, to keep its cost known


def expected_tokens(accept_at: list[float], m: int) -> float:
    """Committed tokens of a step whose draft is cut to m tokens: 1 (the target's own) + the chances of each draft
    position being accepted."""
    return 1.0 + sum(accept_at[:m])


class StepWidth:
    def __init__(self, widths: list[int]):
        self.widths = widths
        self.cost: dict[tuple[int, int, bool], float] = {}  # (rows bucket, width, block draft) -> seconds
        self.records: dict[str, tuple[list[int], list[int]]] = {}  # drafter -> (accepted_at, proposed_at), all rows
        self.steps = 0
        self._seen: set[tuple[int, int, bool]] = set()
        self._priors: dict[str, list[float]] = {}  # drafter -> its prior per position (see _prior)

    def record(self, drafter: str, proposed: int, accepted: int) -> None:
        """One verified draft of ``drafter`` over all rows: ``proposed`` tokens, the first ``accepted`` accepted."""
        acc, prop = self.records.setdefault(drafter, ([], []))
        for counts in (acc, prop):
            counts.extend([0] * (proposed - len(counts)))
        for j in range(proposed):
            prop[j] += 1
            acc[j] += j < accepted
        self._priors.pop(drafter, None)

    def accept_at(self, drafter: str, row_accepted: list[int], row_proposed: list[int], k: int) -> list[float]:
        """Chance that each of a row's k draft positions is accepted (see the module docstring); a position no row has
        been proposed yet takes the chance of the position before it (0.5 for the first)."""
        prior = self._prior(drafter)
        out = [(a + PRIOR_WEIGHT * q) / (p + PRIOR_WEIGHT) for a, p, q in zip(row_accepted, row_proposed, prior)]
        out = out[:k] + prior[len(out) : k]
        if len(out) < k:
            out += [out[-1] if out else 0.5] * (k - len(out))
        return out

    def _prior(self, drafter: str) -> list[float]:
        """The drafter's record over all rows per draft position (Laplace-smoothed), kept until its next record: a
        step computes it once, not once a row."""
        prior = self._priors.get(drafter)
        if prior is None:
            acc, prop = self.records.get(drafter, ([], []))
            prior = self._priors[drafter] = [(a + 1) / (p + 2) for a, p in zip(acc, prop)]
        return prior

    def _cost(self, rows: int, width: int, block: bool) -> float | None:
        """Measured seconds of a step at this width; else interpolated between the nearest measured widths on either
        side, or the nearest one's (None: nothing measured yet)."""
        known = {w: c for (r, w, b), c in self.cost.items() if r == rows and b == block}
        if not known and block:
            return self._cost(rows, width, False)
        if not known:
            return None
        if width in known:
            return known[width]
        below = max((w for w in known if w < width), default=None)
        above = min((w for w in known if w > width), default=None)
        if below is None or above is None:
            return known[below if above is None else above]
        t = (width - below) / (above - below)
        return (1 - t) * known[below] + t * known[above]

    def choose(self, rows: int, wants: list[list[float]], block: bool) -> int:
        """The width for a step of ``rows`` (bucket) whose rows' drafts have these per-position acceptance chances
        (one list per row, as long as its draft)."""
        widest = max((len(w) for w in wants), default=0) + 1
        if widest == 1:
            return 1
        candidates = [w for w in self.widths if w < widest] + [next(w for w in self.widths if w >= widest)]
        chances = np.zeros((len(wants), widest), dtype=np.float64)  # column m: the chance of draft position m
        for i, p in enumerate(wants):
            chances[i, 1 : 1 + len(p)] = p
        committed = len(wants) + chances.sum(axis=0).cumsum()  # [m]: expected tokens of the rows with drafts cut to m
        best, best_rate = 1, -1.0
        for w in candidates:
            cost = self._cost(rows, w, block and w > 1) or 1.0
            rate = float(committed[min(w - 1, widest - 1)]) / cost
            if rate > best_rate * 1.0001:
                best, best_rate = w, rate
        self.steps += 1
        if self.steps % EXPLORE_EVERY == 0 and best > 1:  # keep the narrower width's cost fresh
            best = self.widths[self.widths.index(best) - 1]
        return best

    def observe(self, rows: int, width: int, block: bool, seconds: float) -> None:
        """A step's wall time; the first of each (rows, width, block) is dropped (one-off work lands there)."""
        key = (rows, width, block)
        if key not in self._seen:
            self._seen.add(key)
            return
        old = self.cost.get(key)
        self.cost[key] = seconds if old is None else (1 - EMA) * old + EMA * seconds
