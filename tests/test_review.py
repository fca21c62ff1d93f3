"""Review workflow end to end with the real CLI on a tiny random model: fast mode, grades, report (table, JSON,
HTML in a real headless chromium), re-runs in lossless mode with history, and diff."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
from sqlalchemy import func, select

from db.models import Chunk, Document, Page, Run
from db.session import Database
from engine.chunk_decode import OfficialDecoder
from engine.model.load import load_model
from engine.model.tiny import build_tiny_model
from ingest.config import load_settings
from ingest.intake.enqueue import intake_file
from ingest.quality.measures import normalized_edit_distance
from ingest.review.report import collect_report, render_html
from ingest.worker.worker import Worker
from tests.conftest import SQLITE_URL, fresh_pg_database, make_pdf, serve_until, uflash, worker_config

# run in parallel, this module's tests stay on one worker: the runs of the `review` fixture and the browser, once
pytestmark = pytest.mark.xdist_group("review")

PAGES = ["Register of deeds. Entry one, 1851.", "Entry two: a parish record.", "Entry three, the index."]


def _doc(folder: Path) -> dict:
    return json.loads((folder / "document.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def review(request, tmp_path_factory, tiny_model_dir):
    """Folder A: `uflash run --mode fast`, then `uflash rerun --mode lossless --grade poor`.
    Folder B: a first `uflash run --mode lossless` of the same PDF (the text a re-run must equal).
    Each folder's ledger: a SQLite file, or a database on the session's PostgreSQL server."""
    root = tmp_path_factory.mktemp("review")
    out = {}
    for name, mode in (("fast", "fast"), ("lossless", "lossless")):
        folder = root / name
        folder.mkdir()
        url = SQLITE_URL if request.param == "sqlite" else fresh_pg_database(request.getfixturevalue("pg_server"))[1]
        cfg = worker_config(folder, tiny_model_dir, engine={"max_tokens_per_page": 40, "max_pages_per_chunk": 3,
                                                            "fast_threshold": 0.01}, database={"url": url})
        s = load_settings(cfg)
        s.ensure_folders()
        pdf = make_pdf(s.inbox / "deeds.pdf", PAGES)
        r = uflash("--config", str(cfg), "run", "--mode", mode, str(pdf), timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        out[name] = (cfg, s, r)
    cfg, s, _ = out["fast"]
    out["fast_doc"] = _doc(s.outbox / "deeds")
    out["fast_md"] = (s.outbox / "deeds" / "document.md").read_text(encoding="utf-8")
    out["rerun"] = uflash("--config", str(cfg), "rerun", "--mode", "lossless", "--grade", "poor", timeout=600)
    return out


def test_fast_mode_marks_pages_and_gives_complete_output(review):
    doc = review["fast_doc"]
    _, s, r = review["fast"]
    assert doc["run"]["mode"] == "fast" and [p["index"] for p in doc["pages"]] == [1, 2, 3]
    assert all(p["stats"]["mode"] == "fast" for p in doc["pages"])
    assert review["fast_md"].count(" (fast mode) -->") == 3  # the Markdown says so too
    db = Database(s.database_url)
    with db.session() as ss:
        chunks = ss.scalars(select(Chunk).where(Chunk.run_id.is_not(None)).order_by(Chunk.id)).all()
    first = chunks[0].stats
    # relaxed acceptance is counted; a random model's output gives its drafters nothing to propose, so the width
    # choice soon stops drafting and nothing is relaxed here (tests/test_batch_engine.py and tests/test_quality.py
    # show relaxed acceptance on drafts that are nearly right)
    assert first["mode"] == "fast" and first["relaxed_tokens"] >= 0 and first["draft_tokens"] >= 0
    _, sl, _ = review["lossless"]
    lossless = _doc(sl.outbox / "deeds")
    for fp, lp in zip(doc["pages"], lossless["pages"]):  # same limits, nothing cut short
        assert fp["stats"]["finish_reason"] == lp["stats"]["finish_reason"]
    assert sum(p["stats"]["tokens"] for p in doc["pages"]) >= sum(p["stats"]["tokens"] for p in lossless["pages"]) - 3
    assert "report  " in r.stdout and (s.outbox / "reports").is_dir()


def test_every_page_has_quality_stats_and_a_grade(review):
    for p in review["fast_doc"]["pages"]:
        q = p["stats"]["quality"]
        assert {"finish_reason", "distinct_20", "distinct_35", "mean_logprob", "min_logprob", "low_confidence_share",
                "text_layer_ned", "neighbour_chars_ratio", "grade", "reasons"} <= set(q)
        assert q["text_layer_ned"] > 0.5  # the PDF has a text layer, and a random model's text is far from it
        # a random model capped at 40 tokens a page: cut output, text unlike the page: poor, with reasons
        assert q["grade"] == "poor" and "length" in q["reasons"]
        assert q["calibration"] == {"calibrated": False}  # the tiny model has no calibration


def test_rerun_keeps_history_and_equals_a_first_lossless_run(review):
    r = review["rerun"]
    assert r.returncode == 0, r.stdout + r.stderr
    assert "re-run  3 pages" in r.stdout
    _, s, _ = review["fast"]
    db = Database(s.database_url)
    with db.session() as ss:
        runs = ss.scalars(select(Run).order_by(Run.id)).all()
        per_index = ss.execute(select(Page.page_index, func.count()).group_by(Page.page_index)).all()
        doc = ss.scalar(select(Document))
    assert [run.mode for run in runs] == ["fast", "lossless"]
    assert runs[1].settings["rerun_of"] == [runs[0].id] and runs[1].finished_at is not None
    assert sorted(per_index) == [(1, 2), (2, 2), (3, 2)]  # history: both versions of every page are kept
    assert doc.status == "done"
    rewritten = _doc(s.outbox / "deeds")
    assert rewritten["run"]["id"] == runs[1].id and rewritten["run"]["mode"] == "lossless"
    _, sl, _ = review["lossless"]
    first_lossless = _doc(sl.outbox / "deeds")
    assert [p["text"] for p in rewritten["pages"]] == [p["text"] for p in first_lossless["pages"]]
    md = (s.outbox / "deeds" / "document.md").read_text(encoding="utf-8")
    assert md == (sl.outbox / "deeds" / "document.md").read_text(encoding="utf-8")
    assert all(p["stats"]["mode"] == "lossless" for p in rewritten["pages"])
    with db.session() as ss:  # the re-run drafted from the fast output (replay of the same chunk)
        stats = [c.stats for c in ss.scalars(select(Chunk).where(Chunk.run_id == runs[1].id))]
    assert any("replay" in st["drafters"] for st in stats)


def test_diff_prints_per_page_distances(review):
    cfg, s, _ = review["fast"]
    r = uflash("--config", str(cfg), "diff", "1", "2", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    db = Database(s.database_url)
    with db.session() as ss:
        texts = {(p.run_id, p.page_index): p.text for p in ss.scalars(select(Page))}
    assert [row["page"] for row in d["pages"]] == [1, 2, 3]
    for row in d["pages"]:
        assert row["edit_distance"] == pytest.approx(
            normalized_edit_distance(texts[1, row["page"]], texts[2, row["page"]]), abs=1e-6)
    assert d["max_edit_distance"] == max(row["edit_distance"] for row in d["pages"])
    table = uflash("--config", str(cfg), "diff", "1", "2")
    assert table.returncode == 0 and re.search(r"deeds\.pdf\s+2\s+\d\.\d{4}", table.stdout), table.stdout
    assert "mean " in table.stdout
    bad = uflash("--config", str(cfg), "diff", "1", "99")
    assert bad.returncode == 2 and "no run 99" in bad.stderr


def test_report_json_agrees_with_the_database(review):
    cfg, s, _ = review["fast"]
    db = Database(s.database_url)
    with db.session() as ss:
        pages = {p.id: p for p in ss.scalars(select(Page))}
    for run_id in (1, 2):
        r = uflash("--config", str(cfg), "report", "--run", str(run_id), "--json")
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout)
        assert rep["run"]["id"] == run_id and rep["run"]["finished_at"]  # `uflash run` and `rerun` close their run
        assert "NOT calibrated" in rep["not_calibrated"] and "uflash calibrate" in rep["not_calibrated"]
        shown = [p for d in rep["documents"] for p in d["pages"]]
        assert sorted(p["page_id"] for p in shown) == sorted(i for i, p in pages.items() if p.run_id == run_id)
        for p in shown:
            row = pages[p["page_id"]]
            q = row.stats["quality"]
            assert (p["index"], p["grade"], p["reasons"], p["tau"], p["mode"]) == \
                (row.page_index, q["grade"], q["reasons"], row.stats["tau"], row.stats["mode"])
            assert p["tokens_per_second"] == pytest.approx(row.stats["tokens"] / row.stats["seconds"], rel=1e-2)
        assert (s.outbox / "reports" / f"run-{run_id}.html").exists()
    good = json.loads(uflash("--config", str(cfg), "report", "--run", "1", "--grade", "good", "--json").stdout)
    assert good["pages"] == 0 and good["documents"] == []
    table = uflash("--config", str(cfg), "report")  # default: the latest run
    assert table.returncode == 0 and table.stdout.startswith("run 2 (lossless")
    assert "grades NOT calibrated" in table.stdout.splitlines()[1] and "uflash calibrate" in table.stdout
    assert re.search(r"^\s+1\s+poor\s+length\s+\S+\s+\S+\s+length", table.stdout, re.M), table.stdout


# -- the HTML report in a real headless browser ------------------------------------------------------------

def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def _dom(browser: str, html_file: Path, fragment: str = "") -> str:
    r = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                        "--no-first-run", "--user-data-dir=" + str(html_file.parent / ".chromium"),
                        "--dump-dom", html_file.as_uri() + fragment], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def _visible(dom: str) -> list[tuple[str, str]]:
    """(page id, grade) of the page sections the script left visible."""
    out = []
    for tag in re.findall(r"<section class=\"page[ \"][^>]*>", dom):
        if " hidden" not in tag:
            out.append((re.search(r'id="(\w+)"', tag).group(1), re.search(r'data-grade="(\w+)"', tag).group(1)))
    return out


@pytest.fixture(scope="module")
def browser():
    b = _chromium()
    if b is None:
        pytest.skip("chromium is not installed (CI installs it: apt-get install chromium)")
    return b


def test_html_report_shows_every_page_of_the_run_in_chromium(review, browser):
    _, s, _ = review["fast"]
    db = Database(s.database_url)
    for run_id in (1, 2):
        html_file = s.outbox / "reports" / f"run-{run_id}.html"
        with db.session() as ss:
            pages = ss.scalars(select(Page).where(Page.run_id == run_id)).all()
        dom = _dom(browser, html_file)
        assert sorted(_visible(dom)) == sorted((f"p{p.id}", p.stats["quality"]["grade"]) for p in pages)
        assert 'data-filter="all"' in dom and f'<span id="shown">{len(pages)}</span>' in dom
        assert dom.count("data:image/jpeg;base64,") == len(pages)  # a thumbnail beside every page
        assert _visible(_dom(browser, html_file, "#grade=good")) == []
        assert len(_visible(_dom(browser, html_file, "#grade=poor"))) == len(pages)


def test_html_grade_filter_in_chromium(tmp_path, browser):
    """A report with all three grades: each filter shows exactly that grade's pages, and 'all' shows all."""
    grades = ["good", "poor", "fair", "good", "poor", "poor"]
    rep = {"run": {"id": 7, "mode": "fast", "model": "tiny"}, "pages": len(grades),
           "grades": {g: grades.count(g) for g in set(grades)},
           "documents": [{"id": 1, "name": "a & b.pdf", "page_count": 6, "pages": [
               {"page_id": 10 + i, "index": i + 1, "grade": g, "reasons": [] if g == "good" else ["low_mean_logprob"],
                "mode": "fast", "tau": 1.5, "tokens_per_second": 10.0, "seconds": 1.0, "finish_reason": "eos",
                "quality": {"grade": g}, "text": f"<script>alert({i})</script> text {i}"}
               for i, g in enumerate(grades)]}]}
    html_file = tmp_path / "run-7.html"
    html_file.write_text(render_html(rep), encoding="utf-8")
    assert len(_visible(_dom(browser, html_file))) == 6
    for g in ("good", "fair", "poor"):
        dom = _dom(browser, html_file, f"#grade={g}")
        assert [v[1] for v in _visible(dom)] == [g] * grades.count(g)
        assert f'<span id="shown">{grades.count(g)}</span>' in dom and f'data-filter="{g}"' in dom
    assert "alert(0)</script>" not in _dom(browser, html_file).split("<script>")[0]  # page text is escaped


# -- grades of looping and cut pages ---------------------------------------------------------------------

def test_looped_page_is_graded_poor_for_repetition(tmp_path):
    """A repeated-line document through `uflash run` on a tiny model whose greedy output loops (init 0.02)."""
    model = build_tiny_model(tmp_path / "looping-model", sliding_window=8, text_init=0.02)
    cfg = worker_config(tmp_path, model, engine={"max_tokens_per_page": 300})
    s = load_settings(cfg)
    s.ensure_folders()
    pdf = make_pdf(s.inbox / "repeated.pdf", ["The same line again.\n" * 30])
    r = uflash("--config", str(cfg), "run", str(pdf), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    q = _doc(s.outbox / "repeated")["pages"][0]["stats"]["quality"]
    assert q["finish_reason"] == "repetition" and q["grade"] == "poor"
    assert q["reasons"][0] == "repetition" and "low_distinct_20" in q["reasons"]
    rep = json.loads(uflash("--config", str(cfg), "report", "--grade", "poor", "--json").stdout)
    assert rep["documents"][0]["pages"][0]["reasons"][0] == "repetition"


def test_page_cut_at_the_context_limit_is_graded_poor(tmp_path, tiny_model_dir):
    from engine.chunk_decode import prompt_length

    cfg = worker_config(tmp_path, tiny_model_dir, engine={"max_tokens_per_page": None})
    s = load_settings(cfg)
    s.ensure_folders()
    db = Database(s.database_url)
    intake_file(db, s, make_pdf(s.inbox / "long.pdf", ["A page that runs into the limit."]))
    s.engine.context_limit = 110  # below the config floor on purpose: ~80 output tokens of room
    worker = Worker(s, db, lambda: OfficialDecoder(load_model(str(tiny_model_dir), "cpu", "float32")))
    stop = threading.Event()
    timer = threading.Timer(300, stop.set)
    timer.start()
    try:
        worker.serve(stop, until=lambda: collect_report(db)["pages"] == 1 and _doc_done(db))
    finally:
        timer.cancel()
        worker.close()
    with db.session() as ss:
        page = ss.scalar(select(Page))
    q = page.stats["quality"]
    assert page.stats["mode"] == "official"
    assert q["finish_reason"] == "context_limit" and q["grade"] == "poor" and q["reasons"][0] == "context_limit"
    assert {"distinct_20", "mean_logprob", "text_layer_ned", "grade", "reasons"} <= set(q)
    assert q["tokens"] == page.stats["tokens"] == 110 - prompt_length(load_model(str(tiny_model_dir)), 1)  # all room


def test_report_of_a_run_covers_its_own_pages_only(tmp_path, tiny_model_dir, ledger_url):
    """Workers one after the other on one ledger: each opens its own run, never one left open by a worker that
    stopped without closing it (a crash); a worker limited to some documents leaves the others queued; the report
    of a run (table data and HTML thumbnails) holds that run's pages only, and the default is the latest run."""
    from ingest.review.report import write_html_report

    cfg = worker_config(tmp_path, tiny_model_dir, engine={"max_tokens_per_page": 8}, database={"url": ledger_url})
    s = load_settings(cfg)
    s.ensure_folders()
    db = Database(s.database_url)
    loaded = load_model(str(tiny_model_dir), "cpu", "float32")
    a, b, c = (intake_file(db, s, make_pdf(s.inbox / f"{n}.pdf", k)).document_id for n, k in (("a", 2), ("b", 1),
                                                                                                  ("c", 3)))

    def status(doc_id):
        with db.session() as ss:
            return ss.get(Document, doc_id).status

    crashed = Worker(s, db, lambda: OfficialDecoder(loaded), document_ids=frozenset({a}))
    serve_until(crashed, lambda: status(a) == "done")  # never closed: as if killed
    second = Worker(s, db, lambda: OfficialDecoder(loaded), document_ids=frozenset({b}))
    serve_until(second, lambda: status(b) == "done")
    run_a, run_b = crashed.run_id(), second.close_run()
    assert run_b != run_a and status(c) == "queued"
    with db.session() as ss:
        assert ss.get(Run, run_a).finished_at is None and ss.get(Run, run_b).finished_at is not None
        assert ss.scalar(select(func.count()).select_from(Page).where(Page.document_id == c)) == 0
    for run_id, doc_id, n in ((run_a, a, 2), (run_b, b, 1)):
        rep = collect_report(db, run_id)
        shown = [(d["id"], [p["index"] for p in d["pages"]]) for d in rep["documents"]]
        assert shown == [(doc_id, list(range(1, n + 1)))]
        html = write_html_report(db, s.outbox, run_id).read_text(encoding="utf-8")
        assert html.count("data:image/jpeg;base64,") == n
    assert collect_report(db)["run"]["id"] == run_b
    assert collect_report(db, run_a)["run"]["finished_at"] is None


def _doc_done(db) -> bool:
    with db.session() as ss:
        return ss.scalar(select(Document.status)) == "done"


def test_bench_fast_smoke(tmp_path):
    """scripts/bench/fast.py end to end on a tiny random model (its figures mean nothing; the harness runs)."""
    from scripts.bench.fast import main

    rec = main(["--tiny", "--pages", "2", "--pages-per-doc", "2", "--max-tokens-per-page", "16",
                "--max-pages-per-chunk", "1", "--fast-threshold", "0.01,0.6", "--workdir", str(tmp_path)])
    assert rec["pages"] == 2 and rec["rerun_equals_lossless"] is True and rec["rerun_pages_equal"] == 2
    assert rec["fast"]["tokens"] == rec["lossless"]["tokens"] == 32  # fast never cuts output short
    assert {"speedup_fast_vs_lossless", "fast_edit_distance_mean", "fast_edit_distance_max", "env"} <= set(rec)
    assert [r["fast_threshold"] for r in rec["sweep"]] == [0.01, 0.6] and rec["sweep"][0]["fast"] == rec["fast"]
    low, high = rec["sweep"]
    assert high["fast"]["relaxed_tokens"] == 0 and high["fast_edit_distance_max"] == 0.0  # above 0.5: never relaxes
    assert rec["lossless"]["forwards"] >= 2 and all(r["rerun_pages_equal"] == 2 for r in rec["sweep"])


def test_rerun_plans_chunks_from_the_pages_picked(db):
    """Picked pages keep their earlier chunk's range when all are picked, else form their own runs."""
    from ingest.commands.rerun import parse_pages, rerun_chunks, select_pages
    from ingest.errors import UsageError

    with db.engine.begin() as conn:
        doc = conn.execute(Document.__table__.insert().values(
            sha256="a" * 64, original_path="/x.pdf", original_name="x.pdf", size_bytes=1, mtime_ns=1, kind="pdf",
            page_count=7, status="done")).inserted_primary_key[0]
        run = conn.execute(Run.__table__.insert().values(mode="fast", model="m", engine_version="0")).inserted_primary_key[0]
        c1, c2 = (conn.execute(Chunk.__table__.insert().values(document_id=doc, first_page=a, last_page=b,
                                                              status="done")).inserted_primary_key[0]
                  for a, b in ((1, 4), (5, 7)))
        grades = {1: "good", 2: "poor", 3: "poor", 4: "fair", 5: "poor", 6: "poor", 7: "poor"}
        conn.execute(Page.__table__.insert(), [
            dict(document_id=doc, run_id=run, chunk_id=c1 if i <= 4 else c2, page_index=i, text=f"p{i}",
                 boxes=[], stats={"quality": {"grade": g}}) for i, g in grades.items()])
    poor = select_pages(db, grade="poor")
    assert [p.page_index for p in poor] == [2, 3, 5, 6, 7]
    assert rerun_chunks(db, poor) == [(doc, 2, 3, c1), (doc, 5, 7, c2)]
    picked = select_pages(db, doc_id=doc, pages=parse_pages("3-5"))
    assert rerun_chunks(db, picked) == [(doc, 3, 4, c1), (doc, 5, 5, c2)]
    assert rerun_chunks(db, select_pages(db, doc_id=doc)) == [(doc, 1, 4, c1), (doc, 5, 7, c2)]
    with pytest.raises(UsageError):
        select_pages(db)
    from db.queue import claim

    with db.engine.begin() as conn:  # a chunk queued for a re-run's run is reserved for it
        reserved = conn.execute(Chunk.__table__.insert().values(document_id=doc, first_page=2, last_page=3,
                                                                run_id=run)).inserted_primary_key[0]
    assert claim(db, "watcher", 60, 3) is None  # an ordinary worker (e.g. uflash watch) leaves it alone
    taken = claim(db, "rerun", 60, 3, run_id=run)
    assert taken is not None and taken.chunk_id == reserved
    with pytest.raises(UsageError):
        parse_pages("7-3")


def test_rerun_of_a_split_chunk_decodes_its_first_range_again(db):
    """A chunk split at the context limit (pages 1-3 from chunk 1-4, page 4 from its child chunk): re-running all
    of 1-4 decodes 1-4 as one chunk again (the first pass's prompt), not 1-3 and 4 apart; a subset stays apart."""
    from ingest.commands.rerun import parse_pages, rerun_chunks, select_pages

    with db.engine.begin() as conn:
        doc = conn.execute(Document.__table__.insert().values(
            sha256="b" * 64, original_path="/y.pdf", original_name="y.pdf", size_bytes=1, mtime_ns=1, kind="pdf",
            page_count=6, status="done")).inserted_primary_key[0]
        run = conn.execute(Run.__table__.insert().values(mode="fast", model="m", engine_version="0")).inserted_primary_key[0]

        def chunk(a, b, status="done", parent=None):
            return conn.execute(Chunk.__table__.insert().values(document_id=doc, first_page=a, last_page=b,
                                                                status=status, parent_id=parent)).inserted_primary_key[0]

        split = chunk(1, 4, status="split")
        child = chunk(4, 4, parent=split)
        rest = chunk(5, 6)
        producer = {1: split, 2: split, 3: split, 4: child, 5: rest, 6: rest}
        conn.execute(Page.__table__.insert(), [
            dict(document_id=doc, run_id=run, chunk_id=c, page_index=i, text=f"p{i}", boxes=[],
                 stats={"quality": {"grade": "poor"}}) for i, c in producer.items()])
    assert rerun_chunks(db, select_pages(db, doc_id=doc)) == [(doc, 1, 4, split), (doc, 5, 6, rest)]
    assert rerun_chunks(db, select_pages(db, doc_id=doc, pages=parse_pages("2-4"))) == [(doc, 2, 3, split),
                                                                                        (doc, 4, 4, child)]
