"""`uflash calibrate --from-corrections` (ingest.calibration.corrections) against `uflash calibrate` on the same pages:
a ladder read by a scripted model that misreads some pages (with less confidence), calibrated on the ladder; then the
same readings stored in a ledger with the ladder's truth as people's corrections (db.reviews), calibrated from the
corrections: the same thresholds and the same held-out recall and precision. With fewer corrected pages than it needs,
it refuses and says how many."""

from __future__ import annotations

import json
import shutil

from db.models import Document, Page, ReviewKind, Run
from db.reviews import record_review
from db.session import Database
from ingest.calibration.calibrate import calibrate
from ingest.calibration.corrections import MIN_PAGES
from ingest.calibration.decode import read_lines
from ingest.calibration.fit import graded_pages
from ingest.commands.cli import main
from ingest.config import load_settings
from ingest.quality.calibration import FILE_NAME, grading_thresholds
from ingest.synth.ladder import ladder_rung
from tests.conftest import needs_demo, write_config
from tests.ladder_reader import ScriptedLadderReader, key_pages, labels

pytestmark = needs_demo
DOCS = 10  # seeds 600000-600009: 28 pages, 14 labelled and 14 held out


class ErringReader(ScriptedLadderReader):
    """Reads a page as its label, except every third page (by seed and page), which it misreads (every third word
    backwards), mostly with less confidence; some pages read right get little confidence, some misread ones full
    confidence (so that no threshold is perfect). A page reads the same alone."""

    model_name = "erring-reader"

    def read(self, key, n):
        seed, pages = key_pages(key)
        out = []
        for page in pages:
            text, lp = labels(seed)[page - 1], -0.03
            if (seed * 7 + page) % 3 == 0:  # misread: every third word backwards (as long as the print)
                text = " ".join(w[::-1] if i % 3 == 0 else w for i, w in enumerate(text.split(" ")))
                lp = -0.03 if (seed + page) % 4 == 0 else -0.4 - 0.1 * (page % 3)  # some misread with confidence
            elif (seed + page) % 5 == 0:
                lp = -0.6  # read right, with little confidence
            out.append((text, lp))
        return out


def _store_readings_with_corrections(db: Database, rows: list[dict], only: int | None = None) -> None:
    """The ladder's readings as pages of one run (a document per ladder document, in seed order), each corrected to
    its truth by a person (the first ``only`` pages, when given)."""
    with db.engine.begin() as conn:
        run = conn.execute(Run.__table__.insert().values(mode="plain", model="erring-reader", engine_version="0")
                           ).inserted_primary_key[0]
        docs = {}
        for seed in sorted({r["seed"] for r in rows}):
            docs[seed] = conn.execute(Document.__table__.insert().values(
                sha256=f"{seed:064d}", original_path=f"/ladder/{seed}.pdf", original_name=f"{seed}.pdf", size_bytes=1,
                mtime_ns=1, kind="pdf", page_count=ladder_rung(seed).pages, status="done")).inserted_primary_key[0]
        conn.execute(Page.__table__.insert(), [
            dict(document_id=docs[r["seed"]], run_id=run, page_index=r["page"], text=r["text"], boxes=[],
                 stats={"quality": r["quality"], "word_confidence": r["word_confidence"]}) for r in rows])
    with db.session() as s:
        pages = {(p.document_id, p.page_index): p for p in s.query(Page)}
    for r in rows[:only]:
        record_review(db, pages[(docs[r["seed"]], r["page"])], ReviewKind.CORRECTED, text=labels(r["seed"])[r["page"] - 1])


def test_thresholds_from_corrections_equal_the_ladders_on_the_same_pages(tmp_path, tiny_model_dir, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    cfg = write_config(tmp_path, model={"path": str(model), "device": "cpu", "dtype": "float32"})
    s = load_settings(cfg)
    base = grading_thresholds(s).thresholds  # what graded the pages before any calibration
    work = tmp_path / "work"
    ladder, path = calibrate(s, DOCS, work=work, progress=False, decoder=ErringReader())
    assert ladder["documents"] == DOCS and ladder["held_out"]["bad_pages"] >= 3 and ladder["labelled"]["bad_pages"] >= 3
    docs = sorted(read_lines(work / "decoded.jsonl"), key=lambda d: d["seed"])
    alone = {r["key"]: r for r in read_lines(work / "repaired.jsonl")}
    rows = graded_pages(docs, alone, base, ErringReader().loaded.tokenizer)  # the pages as the pipeline graded them
    assert len(rows) == ladder["pages"] >= MIN_PAGES

    db = Database(s.database_url)
    _store_readings_with_corrections(db, rows, only=MIN_PAGES - 1)
    assert main(["--config", str(cfg), "calibrate", "--from-corrections"]) == 2  # too few: it says how many
    err = capsys.readouterr().err
    assert f"needs at least {MIN_PAGES} corrected pages" in err and f"has {MIN_PAGES - 1} in" in err
    for r in rows[MIN_PAGES - 1:]:  # the rest corrected too
        with db.session() as ss:
            page = ss.query(Page).join(Document, Document.id == Page.document_id).filter(
                Document.original_name == f"{r['seed']}.pdf", Page.page_index == r["page"]).one()
        record_review(db, page, ReviewKind.CORRECTED, text=labels(r["seed"])[r["page"] - 1])
    assert main(["--config", str(cfg), "calibrate", "--from-corrections"]) == 0
    out = capsys.readouterr().out
    assert f"on {DOCS} corrected documents ({len(rows)} pages)" in out
    mine = json.loads((model / FILE_NAME).read_text(encoding="utf-8"))
    assert mine["source"] == "corrections" and mine["read_by"] == ["erring-reader"]
    assert mine["thresholds"] == ladder["thresholds"]
    for half in ("labelled", "held_out"):
        a, b = mine[half], ladder[half]
        assert (a["pages"], a["bad_pages"]) == (b["pages"], b["bad_pages"])
        for key in ("recall_poor", "precision_poor"):
            assert abs(a[key] - b[key]) <= 0.1, (half, key, a[key], b[key])  # within noise (the repair's choices)
    assert grading_thresholds(s).calibrated and "corrected pages" in grading_thresholds(s).summary()
    with capsys.disabled():
        print(f"\nheld out, ladder: {ladder['held_out']['recall_poor']}/{ladder['held_out']['precision_poor']}, "
              f"corrections: {mine['held_out']['recall_poor']}/{mine['held_out']['precision_poor']}; "
              f"thresholds {mine['thresholds']}")
    db.dispose()
