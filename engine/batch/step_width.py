"""How wide a batched step runs: the width that commits the most tokens per second at this batch's load, and width 1
(plain decoding) whenever a wider one does not promise more.

**Tokens.** Every row of a step pays for the step's width w (its widest draft + 1, padded to a bucket). A row whose
draft holds k tokens commits ``1 + p_1 + .. + p_m`` tokens on average when the draft is cut to ``m = min(k, w - 1)``,
p_j being the share of its drafter's rounds that accepted draft position j (and so every position before it): the
row's own record pulled towards the drafter's record over all rows while the row has little. The drafter-wide
record fades (``DECAY`` a step), so what the last pages showed counts, not what the first ones did. What wide steps
really committed, against what was expected of them, scales the expected gain down (``calibration``): acceptance that
the records overrate does not keep buying wide steps.

**Cost.** Measured, never assumed: the wall time of the steps run so far (an exponential average per rows bucket, prefix
bucket, width and whether the block drafter drafted, moved by ``EMA`` towards a faster step and by ``EMA_UP`` only
towards a slower one: a host busy with other work slows the steps that happen to run then, and a width whose few steps
met such a spike must not look dear for the rest of the run; the first ``DROPPED`` steps of each are left out: one-off
work lands there, the first runs of a shape on the CPU, the eager run before a CUDA graph is captured). A width whose
first measures were inflated would otherwise look too dear ever to be tried again. A cell (rows, prefix) runs width 1
first, so plain decoding is always the measured baseline. A width not yet run in a cell costs what the nearest cell that
ran it and width 1 says it costs relative to width 1; else it is interpolated between the cell's known widths, or, above
them all, extrapolated along the line through the two widest (never falling). With only width 1 known, the next width is
priced at width 1's cost and tried when it looks best, the wider ones wait: exploration climbs from narrow to wide, so
where a step's cost grows with its width (many rows, short prefixes) no very wide step is ever tried at a loss.

**Host drafting.** The rows' drafts are made on the host before the step runs, so a step whose rows draft costs
their drafting time too (measured per rows bucket: ``draft_cost``, averaged as the step costs are: a busy host's
spike in one step's drafting must not switch drafting off for the rest of the chunk), on top of the step's own time
(the cost table holds the step without it). A wide step must pay for both; plain decoding pays for neither.

**Choice.** The width with the most expected tokens per second (drafting included), if it beats plain decoding by
``MARGIN``; else 1. Exploration is cheap and periodic:
- a cell that runs wide steps runs one plain step every ``REFRESH_EVERY`` steps (plain's cost stays current);
- after ``SKIP_AFTER`` plain steps in a row the rows stop drafting (no host work spent for nothing), but once the
  plain steps since the last probe took ``1 / PROBE_BUDGET`` times what a probe costs beyond a plain step, they draft
  again and the step runs at ``PROBE_WIDTH`` (a probe), and the step after it chooses again on that evidence: a
  drafter switched off by hard pages gets evidence again when easy pages follow, for about ``PROBE_BUDGET`` of the
  time. A probe whose rows had nothing to draft (a scan) is a probe too: it costs its drafting time, and the rows
  go back to not drafting until the next one.
Drafting then never makes a batch slower than plain decoding by more than what those few steps cost.
"""

from __future__ import annotations

import math

import numpy as np

PRIOR_WEIGHT = 4.0  # rounds of weight the drafter-wide record has against a row's own
EMA = 0.2
EMA_UP = 0.02  # a step slower than its cost so far moves the cost this little: a busy host's spikes pass
DECAY = 0.97  # a step: the drafter-wide acceptance record fades (about the last 30 steps count)
DROPPED = 2  # measures of a (rows, prefix, width, block) left out before its cost is kept
MARGIN = 1.03  # a wide step must promise this many times plain decoding's tokens per second
REFRESH_EVERY = 32  # a cell running wide steps runs one plain step this often
SKIP_AFTER = 8  # plain steps in a row after which the rows stop drafting ...
PROBE_BUDGET = 0.02  # ... but for a probe step once the plain steps since the last one took 50x its extra cost
PROBE_MIN_GAP = 16  # and at least this many steps apart
PROBE_WIDTH = 4  # the probe's width: 3 draft positions of evidence a row
CALIBRATION_RANGE = (0.05, 1.0)  # a brake only: never more than the records promise


def expected_tokens(accept_at: list[float], m: int) -> float:
    """Committed tokens of a step whose draft is cut to m tokens: 1 (the target's own) + the chances of each draft
    position being accepted."""
    return 1.0 + sum(accept_at[:m])


class StepWidth:
    def __init__(self, widths: list[int]):
        self.widths = widths
        self.cost: dict[tuple[int, int, int, bool], float] = {}  # (rows, prefix, width, block draft) -> seconds
        self.records: dict[str, tuple[list[float], list[float]]] = {}  # drafter -> (accepted_at, proposed_at)
        self.calibration = 1.0  # committed beyond one a row / expected of wide steps (EMA)
        self.steps = 0
        self.probes = 0
        self._seen: dict[tuple[int, int, int, bool], int] = {}  # measures left out so far
        self._priors: dict[str, list[float]] = {}  # drafter -> its prior per position (see _prior)
        self._plain_run = 0  # plain steps since the last wide step that was not a probe (measuring steps aside)
        self._measuring = False  # this step runs plain to measure it, not because plain won
        self._since_probe = (0, 0.0)  # steps and seconds since the last probe
        self._probing = False  # this step runs wide as a probe
        self._probe_drafts = False  # this step's rows draft for a probe (they had stopped drafting)
        self.draft_cost: dict[int, float] = {}  # rows bucket -> seconds the rows' host drafting takes a step (EMA)
        self._since_plain: dict[tuple[int, int], int] = {}  # cell -> steps since it last ran width 1
        self._expected = 0.0  # extra tokens the last chosen wide step was expected to commit
        self.reasons: dict[str, int] = {}  # why each choice was made (`choose`), for the benchmarks' records

    # --- acceptance ------------------------------------------------------------------------------------------

    def record(self, drafter: str, proposed: int, accepted: int) -> None:
        """One verified draft of ``drafter`` over all rows: ``proposed`` tokens, the first ``accepted`` accepted."""
        acc, prop = self.records.setdefault(drafter, ([], []))
        for counts in (acc, prop):
            counts.extend([0.0] * (proposed - len(counts)))
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
        return list(np.minimum.accumulate(out)) if out else out  # a position is accepted only after the one before

    def _prior(self, drafter: str) -> list[float]:
        """The drafter's record over all rows per draft position (Laplace-smoothed), kept until its next record: a
        step computes it once, not once a row."""
        prior = self._priors.get(drafter)
        if prior is None:
            acc, prop = self.records.get(drafter, ([], []))
            prior = [(a + 1) / (p + 2) for a, p in zip(acc, prop)]
            prior = self._priors[drafter] = list(np.minimum.accumulate(prior)) if prior else prior
        return prior

    def _fade(self) -> None:
        for acc, prop in self.records.values():
            for counts in (acc, prop):
                counts[:] = [c * DECAY for c in counts]
        self._priors.clear()

    # --- cost --------------------------------------------------------------------------------------------------

    def _known(self, rows: int, prefix: int, block: bool) -> dict[int, float]:
        """Widths of this cell measured here, or priced from another cell relative to width 1 (the nearest cell
        in rows, then in prefix, that ran both)."""
        base = self.cost[rows, prefix, 1, False]
        known, near = {}, {}
        for (r, p, w, b), c in self.cost.items():
            if b != block:
                continue
            if r == rows and p == prefix:
                known[w] = c
            elif (r, p, 1, False) in self.cost:
                distance = (abs(math.log2(r / rows)), abs(p - prefix))
                if w not in near or distance < near[w][0]:
                    near[w] = (distance, base * c / self.cost[r, p, 1, False])
        return {**{w: c for w, (_, c) in near.items()}, **known}

    def estimate(self, rows: int, prefix: int, width: int, block: bool) -> float | None:
        """Seconds of a step (see the module docstring); None when not to be tried yet (width 1 never measured in this
        cell, or a width beyond the next one while only width 1 is known)."""
        if (rows, prefix, 1, False) not in self.cost:
            return None
        known = self._known(rows, prefix, block)
        if block:
            known = {**self._known(rows, prefix, False), **known}
        if width in known:
            return known[width]
        below = sorted(w for w in known if w < width)
        above = min((w for w in known if w > width), default=None)
        if above is not None:
            if not below:
                return known[above]
            t = (width - below[-1]) / (above - below[-1])
            return (1 - t) * known[below[-1]] + t * known[above]
        if len(below) >= 2:  # beyond every known width: the line through the two widest, never falling
            a, b = below[-2], below[-1]
            return known[b] + max(0.0, (known[b] - known[a]) / (b - a)) * (width - b)
        return known[1] if width == self.widths[1] else None  # only plain known: the next width, at plain's cost

    # --- the choice --------------------------------------------------------------------------------------------

    def drafting(self, rows: int, prefix: int) -> bool:
        """Should the rows draft this step (of ``rows`` at ``prefix``)? Not after ``SKIP_AFTER`` plain steps in a
        row, but for a probe."""
        self._probe_drafts = self._plain_run >= SKIP_AFTER and self._probe_due(rows, prefix)
        return self._plain_run < SKIP_AFTER or self._probe_drafts

    def skips_drafting(self, rows: int, prefix: int) -> bool:
        """What ``drafting`` would say against, without deciding anything: the rows stopped drafting and no probe is
        due (`engine.batch.overlap` asks it before the last step's ``observe``: a probe then comes a step later)."""
        return self._plain_run >= SKIP_AFTER and not self._probe_due(rows, prefix)

    def _probe_due(self, rows: int, prefix: int) -> bool:
        """A probe once the plain steps since the last one took ``1 / PROBE_BUDGET`` times what the probe costs
        beyond a plain step (its wider step, where known, and its drafting), and ``PROBE_MIN_GAP`` steps at least."""
        steps, seconds = self._since_probe
        if self._plain_run < SKIP_AFTER or steps < PROBE_MIN_GAP:
            return False
        base = self.cost.get((rows, prefix, 1, False))
        if base is None:
            return True
        probe = self.estimate(rows, prefix, PROBE_WIDTH, False)
        extra = (probe - base if probe is not None else 0.0) + self.draft_cost.get(rows, 0.0)
        return seconds * PROBE_BUDGET >= extra

    def choose(self, rows: int, prefix: int, wants: list[list[float]], block: bool) -> int:
        """The width for a step of ``rows`` (bucket) at ``prefix`` (bucket) whose rows' drafts have these per-position
        acceptance chances (one list per row, as long as its draft)."""
        self.steps += 1
        self._fade()
        self._expected, self._probing, self._measuring = 0.0, False, False
        widest = max((len(w) for w in wants), default=0) + 1
        if widest == 1:
            return self._because("nothing drafted", 1)
        cell = (rows, prefix)
        base = self.cost.get((rows, prefix, 1, False))
        if base is None:
            self._measuring = True
            return self._because("plain measured first", 1)  # the baseline every wider width must beat
        candidates = [w for w in self.widths if 1 < w < widest] + [next(w for w in self.widths if w >= widest)]
        chances = np.zeros((len(wants), widest), dtype=np.float64)  # column m: the chance of draft position m
        for i, p in enumerate(wants):
            chances[i, 1 : 1 + len(p)] = p
        extra = chances.sum(axis=0).cumsum() * self.calibration  # [m]: expected tokens beyond one a row, cut to m
        best, best_rate = 1, MARGIN * len(wants) / base
        drafting = self.draft_cost.get(rows, 0.0)
        for w in candidates:
            cost = self.estimate(rows, prefix, w, block)
            if cost is None:
                continue
            rate = (len(wants) + float(extra[min(w - 1, widest - 1)])) / (cost + drafting)
            if rate > best_rate * 1.0001:
                best, best_rate = w, rate
        if best == 1 and self._probe_due(rows, prefix):
            best = min((w for w in candidates if w >= PROBE_WIDTH), default=candidates[-1])
            self.probes, self._probing = self.probes + 1, True
            self._because("probe", best)
        elif best > 1 and self._since_plain.get(cell, 0) >= REFRESH_EVERY:
            best, self._measuring = 1, True  # keep plain decoding's cost current
            self._because("plain refreshed", 1)
        else:
            self._because("wide pays" if best > 1 else "plain pays more", best)
        if best > 1:
            self._expected = float(extra[min(best - 1, widest - 1)]) / self.calibration
        return best

    def _because(self, reason: str, width: int) -> int:
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        return width

    def observe(self, rows: int, prefix: int, width: int, block: bool, seconds: float | None,
                committed: int = 0, n_rows: int = 0, draft_seconds: float | None = None) -> None:
        """A step ran: its width, its wall time without the rows' host drafting (None: not a measure of cost, e.g. it
        captured graphs), the tokens it committed over its ``n_rows`` rows, and the host drafting time when its rows
        drafted. The first ``DROPPED`` times of each (rows, prefix, width, block) are left out."""
        cell = (rows, prefix)
        if draft_seconds is not None:
            old = self.draft_cost.get(rows)
            rate = EMA if old is None or draft_seconds <= old else EMA_UP  # as the step costs: spikes pass
            self.draft_cost[rows] = draft_seconds if old is None else (1 - rate) * old + rate * draft_seconds
        probed = self._probing or self._probe_drafts
        if self._probe_drafts and not self._probing:
            self.probes += 1  # the rows drafted for a probe and had nothing to verify: they stop drafting again
        if self._probing:  # the next step drafts and chooses again, on the probe's evidence
            self._plain_run = SKIP_AFTER - 1
        elif not self._measuring:
            self._plain_run = self._plain_run + 1 if width == 1 else 0
        self._measuring = False
        steps, spent = self._since_probe
        self._since_probe = (0, 0.0) if probed else (steps + 1, spent + (seconds or 0.0))
        self._probing = self._probe_drafts = False
        self._since_plain[cell] = 0 if width == 1 else self._since_plain.get(cell, 0) + 1
        if width > 1 and self._expected > 0:
            ratio = (committed - n_rows) / self._expected
            low, high = CALIBRATION_RANGE
            self.calibration = min(high, max(low, (1 - EMA) * self.calibration + EMA * ratio))
        self._expected = 0.0
        key = (rows, prefix, width, block)
        if seconds is None:
            return
        if self._seen.get(key, 0) < DROPPED:
            self._seen[key] = self._seen.get(key, 0) + 1
            return
        old = self.cost.get(key)
        rate = EMA if old is None or seconds <= old else EMA_UP
        self.cost[key] = seconds if old is None else (1 - rate) * old + rate * seconds
