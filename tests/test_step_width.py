"""The step-width choice (`engine.batch.step_width`) on synthetic step costs and acceptance: plain decoding is
measured first, wide steps are taken only when measured costs and acceptance say they pay, plain's cost is
re-measured while wide steps run, and a drafter switched off by hard pages is probed again and comes back."""

from __future__ import annotations

import pytest

from engine.batch import step_width as sw
from engine.batch.step_width import StepWidth, expected_tokens

WIDTHS = [1, 2, 4, 8, 16, 17]
ROWS, PREFIX = 8, 384


def flat(p: float, k: int = 16) -> list[float]:
    return [p] * k  # every draft position accepted with chance p


def measured(costs: dict[int, float], rows: int = ROWS, prefix: int = PREFIX) -> StepWidth:
    """A chooser that has run each width of ``costs`` (seconds) in one cell (after the measures left out, inflated)."""
    chooser = StepWidth(WIDTHS)
    for width, seconds in costs.items():
        for _ in range(sw.DROPPED):
            chooser.observe(rows, prefix, width, False, 10.0)
        chooser.observe(rows, prefix, width, False, seconds)
    return chooser


def run(chooser: StepWidth, acceptance: float, costs: dict[int, float], steps: int, rows: int = ROWS) -> list[int]:
    """``steps`` steps of rows whose drafts are accepted position by position with chance ``acceptance``: the
    widths chosen (None: the rows did not draft). Each step commits what it was expected to and costs ``costs``."""
    chosen = []
    for _ in range(steps):
        if not chooser.drafting(rows, PREFIX):
            chooser.observe(rows, PREFIX, 1, False, costs[1], rows, rows)
            chosen.append(None)
            continue
        w = chooser.choose(rows, PREFIX, [chooser.accept_at("ngram", [], [], 16)] * rows, False)
        accepted = round(sum(acceptance ** (j + 1) for j in range(w - 1)))
        for _ in range(rows):
            if w > 1:
                chooser.record("ngram", w - 1, accepted)
        chooser.observe(rows, PREFIX, w, False, costs[w], rows * (1 + accepted), rows)
        chosen.append(w)
    return chosen


def test_expected_tokens():
    assert expected_tokens([1.0] * 4, 4) == 5 and expected_tokens([0.0] * 16, 16) == 1


def test_plain_decoding_is_measured_first():
    chooser = StepWidth(WIDTHS)
    for _ in range(sw.DROPPED + 1):
        assert chooser.choose(ROWS, PREFIX, [flat(0.99)] * ROWS, False) == 1  # the first measures are left out
        chooser.observe(ROWS, PREFIX, 1, False, 0.010)
    assert chooser.choose(ROWS, PREFIX, [flat(0.99)] * ROWS, False) == 2  # the next width, at plain's cost
    for _ in range(sw.DROPPED + 1):
        chooser.observe(ROWS, PREFIX, 2, False, 0.0101)
    assert chooser.choose(ROWS, PREFIX, [flat(0.99)] * ROWS, False) == 17  # extrapolated from widths 1 and 2


def test_exploration_climbs_and_never_tries_a_very_wide_step_where_cost_grows_with_width():
    costs = {w: 0.0087 * w for w in WIDTHS}  # compute-bound: a step's cost grows with its width
    chosen = run(StepWidth(WIDTHS), 0.9, costs, 300, rows=256)
    assert max(w or 1 for w in chosen) <= 4
    seconds = sum(costs[w or 1] for w in chosen)
    assert seconds <= 1.025 * 300 * costs[1]  # each width explored is run DROPPED + 1 times before it is priced


def test_measured_costs_and_acceptance_decide():
    chooser = measured({1: 0.010, 4: 0.012, 17: 0.040})
    assert chooser.choose(ROWS, PREFIX, [flat(0.02)] * ROWS, False) == 1  # bad drafts: plain
    assert chooser.choose(ROWS, PREFIX, [flat(0.99)] * ROWS, False) == 17  # good drafts pay for the width
    assert chooser.choose(ROWS, PREFIX, [[0.9, 0.8, 0.6, 0.4] + [0.05] * 12] * ROWS, False) == 4


def test_wide_steps_that_do_not_pay_are_not_taken():
    """At a large batch a wide step costs more than its expected tokens buy (10%-wrong drafts, compute-bound)."""
    chooser = measured({1: 0.0087, 2: 0.016, 4: 0.019, 8: 0.020, 16: 0.021, 17: 0.021}, rows=256)
    assert chooser.choose(256, PREFIX, [flat(0.05)] * 256, False) == 1
    assert chooser.choose(256, PREFIX, [[0.9, 0.81, 0.73] + [0.0] * 13] * 256, False) == 4  # 3.44x for 2.2x
    assert chooser.choose(256, PREFIX, [[0.5] + [0.0] * 15] * 256, False) == 1  # 1.5x for 1.8x: plain


def test_a_width_never_run_costs_what_another_cell_says_relative_to_plain():
    chooser = measured({1: 0.010, 17: 0.030}, rows=64)
    for seconds in [1.0] * sw.DROPPED + [0.020]:
        chooser.observe(128, PREFIX, 1, False, seconds)
    assert chooser.estimate(128, PREFIX, 17, False) == pytest.approx(0.060)  # 3x plain, as at 64 rows
    assert chooser.choose(128, PREFIX, [flat(0.1)] * 128, False) == 1  # so it is not tried at a loss


def test_the_choice_never_loses_to_plain_when_drafts_are_wrong():
    costs = {1: 0.0087, 2: 0.016, 4: 0.018, 8: 0.019, 16: 0.020, 17: 0.020}
    chooser = StepWidth(WIDTHS)
    chosen = run(chooser, 0.0, costs, 400, rows=256)
    seconds = sum(costs[w or 1] for w in chosen)
    assert seconds <= 1.03 * 400 * costs[1]  # exploration and probes cost at most 3%
    assert chosen.count(None) > 300  # the rows stop drafting ...
    assert chooser.probes >= 5  # ... but for a probe now and then


def test_plain_cost_is_refreshed_while_wide_steps_run():
    costs = {1: 0.010, 2: 0.0105, 4: 0.011, 8: 0.012, 16: 0.013, 17: 0.013}
    chosen = run(StepWidth(WIDTHS), 0.95, costs, 200)
    wide = [w for w in chosen[20:] if w]
    assert max(wide) >= 8 and 1 in wide  # mostly wide, with plain steps to keep its cost measured
    assert wide.count(1) <= len(wide) // sw.REFRESH_EVERY + 2


def test_a_drafter_switched_off_by_hard_pages_comes_back_on_easy_pages():
    costs = {1: 0.010, 2: 0.011, 4: 0.012, 8: 0.013, 16: 0.014, 17: 0.014}
    chooser = StepWidth(WIDTHS)
    hard = run(chooser, 0.0, costs, 200)
    assert hard[-50:].count(None) > 40  # switched off
    easy = run(chooser, 0.95, costs, 200)
    assert sum(1 for w in easy[-100:] if w and w >= 8) > 80  # back at wide steps


def test_calibration_follows_what_wide_steps_commit():
    costs = {1: 0.010, 2: 0.012, 4: 0.014, 8: 0.016, 16: 0.018, 17: 0.018}
    chooser = measured(costs)
    for _ in range(20):  # the records say 0.5 a position, steps commit nothing beyond the target's token
        w = chooser.choose(ROWS, PREFIX, [flat(0.5)] * ROWS, False)
        chooser.observe(ROWS, PREFIX, w, False, costs[w], ROWS, ROWS)
    assert chooser.calibration < 0.2
    assert chooser.choose(ROWS, PREFIX, [flat(0.5)] * ROWS, False) == 1


def test_rows_with_nothing_to_draft_stop_drafting_but_for_a_probe_now_and_then():
    """A scan: no row ever has a draft. The rows draft for the first few steps, then only for a probe every
    ``PROBE_MIN_GAP`` steps at most (each one counted, so drafting stays off between them), and the host time spent
    drafting stays within ``PROBE_BUDGET`` of the steps' time."""
    chooser, step, draft = StepWidth(WIDTHS), 0.019, 0.0023  # 19 ms steps, 2.3 ms of host drafting (148 rows)
    drafted = []
    for _ in range(2000):
        rows_draft = chooser.drafting(ROWS, PREFIX)
        if rows_draft:
            assert chooser.choose(ROWS, PREFIX, [[] for _ in range(ROWS)], False) == 1
        chooser.observe(ROWS, PREFIX, 1, False, step, ROWS, ROWS, draft if rows_draft else None)
        drafted.append(rows_draft)
    later = drafted[sw.SKIP_AFTER + 1:]
    gaps = [i for i, d in enumerate(later) if d]
    assert len(gaps) >= 10 and min(b - a for a, b in zip(gaps, gaps[1:])) >= sw.PROBE_MIN_GAP
    assert chooser.probes == len(gaps)
    assert sum(later) * draft <= sw.PROBE_BUDGET * len(later) * step * 1.05


def test_host_drafting_is_paid_for_by_the_tokens_it_buys():
    """Drafts that would buy 10% more tokens a step do not pay for drafting that costs 20% of a step; drafts that buy
    twice the tokens do."""
    chooser = measured({1: 0.010, 2: 0.010, 4: 0.010})
    chooser.observe(ROWS, PREFIX, 1, False, 0.010, ROWS, ROWS, draft_seconds=0.002)
    assert chooser.choose(ROWS, PREFIX, [[0.1] + [0.0] * 3] * ROWS, False) == 1
    assert chooser.choose(ROWS, PREFIX, [[0.9, 0.8, 0.7]] * ROWS, False) == 4


def test_a_busy_host_spike_does_not_make_a_width_look_dear_for_the_rest_of_the_run():
    """Five wide steps that ran while the host was busy (20x their cost) move it less than 3x, so good drafts keep
    their width; a faster step moves it by the usual ``EMA``."""
    chooser = measured({1: 0.010, 17: 0.015})
    for _ in range(5):
        chooser.observe(ROWS, PREFIX, 17, False, 0.300)
    spiked = chooser.cost[ROWS, PREFIX, 17, False]
    assert spiked < 3 * 0.015
    assert chooser.choose(ROWS, PREFIX, [flat(0.95)] * ROWS, False) == 17
    chooser.observe(ROWS, PREFIX, 17, False, 0.005)
    assert chooser.cost[ROWS, PREFIX, 17, False] == pytest.approx((1 - sw.EMA) * spiked + sw.EMA * 0.005)


def test_a_busy_host_spike_in_drafting_does_not_switch_drafting_off():
    """The rows' host drafting met a busy host for a few steps (100x its usual 0.2 ms): its price moves so little
    that replay drafts (every position right) keep their width, where a plain average made the chunk decode plainly
    (a re-run measured 3,486 forwards for 3,492 tokens)."""
    chooser = measured({1: 0.020, 17: 0.021})
    chooser.observe(ROWS, PREFIX, 1, False, 0.020, ROWS, ROWS, draft_seconds=0.0002)
    for _ in range(3):
        chooser.observe(ROWS, PREFIX, 17, False, 0.021, ROWS, ROWS, draft_seconds=0.020)
    assert chooser.draft_cost[ROWS] < 0.002
    assert chooser.choose(ROWS, PREFIX, [flat(0.99)] * ROWS, False) == 17
