"""The pipeline benchmark's pieces that need no GPU: documents of A-B pages, and the timeline wrapper finding every
function it times (a rename elsewhere would silently drop a line of the timeline)."""

from __future__ import annotations

import json
import subprocess
import sys

from scripts.bench.pipeline import page_counts
from scripts.bench.timeline import timeline_rows
from tests.conftest import ROOT


def test_page_counts_fixed_or_drawn_per_document():
    assert page_counts("4", 3, 860_000) == [4, 4, 4]
    drawn = page_counts("4-40", 200, 860_000)
    assert drawn == page_counts("4-40", 200, 860_000) and min(drawn) >= 4 and max(drawn) <= 40
    assert len(set(drawn)) > 20


def test_timeline_wraps_every_probe_and_writes_json(tmp_path):
    out = tmp_path / "timeline.json"
    r = subprocess.run([sys.executable, "-m", "scripts.bench.timeline", str(out), "--", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    t = json.loads(out.read_text())
    assert t["missing"] == [] and t["imports_s"] > 0 and t["wall_s"] >= t["imports_s"]
    rows = dict((name, main) for name, main, *_ in timeline_rows({**t, "startup_s": 0.5}))
    assert rows["imports"] == t["imports_s"] and rows["start-up (interpreter)"] == 0.5 and "decode steps" in rows
    assert {"page preparation", "orientation probes", "submit (processor)", "finishing documents"} <= set(rows)


def test_the_workers_bench_runs_one_and_two_watchers_on_one_ledger(tmp_path, tiny_model_dir, capsys):
    """`scripts.bench.workers` on the CPU: one `uflash watch`, then two on one SQLite ledger, over the same four
    documents: every document done in both settings, every page stored once, both watchers took pages."""
    from scripts.bench import workers

    out = tmp_path / "workers.json"
    workers.main(["--model", str(tiny_model_dir), "--docs", "4", "--doc-pages", "3", "--chunk-pages", "1",
                  "--max-tokens-per-page", "48", "--workers", "1,2", "--devices", "cpu", "--rows", "2",
                  "--max-seconds", "400", "--json", str(out)])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report == json.loads(out.read_text()) and report["pages"] == 12
    one, two = report["settings"]
    for s in (one, two):
        assert s["documents_done"] == 4 and s["documents_failed"] == 0 and s["cut_at_s"] is None, s
        assert s["pages"] == s["pages_distinct"] == 12 and s["stored_twice"] == 0, s
    assert (one["rows_each"], two["rows_each"]) == (2, 1) and len(two["devices"]) == 2
    assert len(two["pages_by_worker"]) == 2, two  # both watchers stored pages
    assert two["x_first"] == round(two["pages_per_hour"] / one["pages_per_hour"], 3)
    # each watcher ran under the timeline: what its engine decoded is counted; two tiny CPU watchers may not decode
    # at the same time at all (one takes every chunk before the other has loaded): then no figure, and why
    assert one["decoded_tok_s_after_load"] > 0 and len(one["decoded_by_worker"]) == 1, one
    if two["decoded_tok_s_after_load"] is None:
        assert "never decoded together" in two["decoded_omitted"] and two["x_first_decoded"] is None, two
    else:
        assert len(two["decoded_by_worker"]) == 2
        assert two["x_first_decoded"] == round(two["decoded_tok_s_after_load"] / one["decoded_tok_s_after_load"], 3)


def test_decoded_together_counts_every_worker_over_the_window_they_all_run():
    """Two engines' traces: the window runs from the last load to the first one's last point, each count read at
    both ends by interpolation; a worker with no trace after load gives no figure."""
    from scripts.bench.workers import decoded_together

    a = [[100.0 + s, s, 500 * s, 8] for s in range(0, 21)]  # 500 tokens a second, 100 s to 120 s
    b = [[104.5 + s, s, 300 * s, 8] for s in range(0, 11)]  # 300 a second, 104.5 s to 114.5 s
    out = decoded_together([a, b], loaded=105.0, tokens_per_page=1000)
    assert out["decoded_window_s"] == 9.5 and out["decoded_by_worker"] == [4750, 2850]
    assert out["decoded_tok_s_after_load"] == 800.0 and out["decoded_pages_per_hour_after_load"] == 2880
    assert decoded_together([a, []], loaded=105.0, tokens_per_page=None)["decoded_tok_s_after_load"] is None
    assert decoded_together([a], loaded=130.0, tokens_per_page=None)["decoded_tok_s_after_load"] is None


def test_decoded_rates_come_from_the_engines_trace():
    """Tokens decoded after load from the engine's own trace (chunks in flight counted), the steady window past the
    first third, pages-equivalent an hour at the stand-in's tokens a page, the rows over time."""
    from scripts.bench.pipeline import decoded_rates

    start = 1_000.0
    trace = [[start + 5 + s, 10 * s, 1000 * s, 100] for s in range(0, 31)]  # 1,000 tokens a second from 5 s
    rates = decoded_rates(trace, start, loaded_s=10.0, tokens_per_page=250)
    assert rates["decoded_tokens"] == 30_000 and rates["decoded_tok_s_after_load"] == 1000.0
    assert rates["steady_tok_s"] == 1000.0 and rates["decoded_pages_per_hour_after_load"] == 14_400
    assert rates["mean_rows_after_load"] == 100 and rates["rows_over_time"][0] == [5.0, 100]
    assert decoded_rates([], start, 10.0, 250) == {}


def test_stored_pages_an_hour_only_over_several_waves_and_the_steady_window_after_the_first():
    """One wave of chunks gives no stored rate (the figure would be when the wave ended), three do; the steady window
    starts once as many chunks as rows were stored, and its decoded rate comes from the engine's trace."""
    from scripts.bench.pipeline import stored_rates
    from scripts.bench.steady import steady_window

    one_wave = [(100.0 + i, i, 16) for i in range(4)]
    assert "pages_per_hour" not in stored_rates(one_wave, {"loaded_s": 50.0}, rows=4, seconds=110.0)
    assert "1.0 waves" in stored_rates(one_wave, {}, rows=4, seconds=110.0)["stored_rate_omitted"]
    three = [(60.0 + 10 * i, i, 4) for i in range(12)]
    rates = stored_rates(three, {"loaded_s": 20.0}, rows=4, seconds=200.0)
    assert rates["waves"] == 3.0 and rates["after_load_pages_per_hour"] == round(3600 * 48 / 180, 1)
    trace = [[s, s, 500 * s, 4] for s in range(0, 201, 10)]  # 500 tokens a second
    window = steady_window(three, trace, rows=4, end=200.0, tokens_per_page=250)
    assert window["steady_window"] == [90.0, 200.0] and window["steady_chunks"] == 8
    assert window["steady_decoded_tok_s"] == 500.0 and window["steady_decoded_pages_per_hour"] == 7200
    assert window["steady_stored_pages_per_hour"] == round(3600 * 32 / 110, 1)
    assert steady_window(one_wave, trace, rows=4, end=200.0, tokens_per_page=250)["steady_window"] is None


def test_the_steady_pipeline_bench_on_the_cpu(tmp_path, tiny_model_dir, capsys):
    """`scripts.bench.pipeline --steady` with the tiny model: `uflash watch` while the inbox is fed, cut after a while;
    the engine's own count covers every token of the pages stored (chunks in flight counted too), no page stored twice,
    the rows, step time and the decode loop's thread outside engine steps recorded, the chunk size in the row."""
    from scripts.bench import pipeline

    out = tmp_path / "pipeline.json"
    pipeline.main(["--model", str(tiny_model_dir), "--docs", "2", "--doc-pages", "2", "--chunk-pages", "1",
                   "--max-batch", "2", "--mode", "plain", "--device", "cpu", "--dtype", "float32",
                   "--max-tokens-per-page", "8", "--tokens-per-page", "8", "--prepare-processes", "0",
                   "--formats", "json", "--steady", "--steady-backlog", "4", "--max-seconds", "20",
                   "--docs-dir", str(tmp_path / "docs"), "--json", str(out)])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (row,) = report["settings"]
    assert row["steady"] and row["chunk_pages"] == 1 and row["files_fed"] >= 2 and row["cut_at_s"] == 20
    assert row["pages"] == row["pages_distinct"] > 0 and row["decoded_tokens"] >= row["tokens"] > 0, row
    assert row["engine_rows"] == 2 and row["ms_per_step"] > 0 and row["chunks_stored"] == row["pages"]
    assert 0 < row["main_outside_steps"]["outside_steps_share"] < 1 and row["first_page_s"] > 0
    assert "steady_window" in row and ("steady_why_not" in row or row["steady_stored_pages_per_hour"] > 0)
