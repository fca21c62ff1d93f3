"""`uflash calibrate --from-corrections`: the grading thresholds fitted on the user's own pages, each page a person
corrected on the review page (``uflash review``, db.reviews) taken as the truth of the model's reading it corrected.

Nothing is decoded: every corrected page brings the figures the pipeline stored with the model's reading
(``stats.quality``, ``stats.word_confidence``) and that reading's CER against the correction (the ladder's CER:
ingest.quality.measures.character_error_rate). The corrected documents, in id order, alternate between the labelled
half (the thresholds are chosen on it, ingest.calibration.fit) and the held-out half (measured only), as the ladder's
seeds do. At least ``MIN_PAGES`` corrected pages in at least two documents are needed, else it refuses and says how
many more; the record is written beside the model like the ladder's (ingest.quality.calibration) and says where its
pages came from (``source``: ``corrections``).
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from db.reviews import standing_corrections
from db.runs import runs
from db.session import Database
from ingest.calibration.fit import fit, regrade, summary
from ingest.config import Settings
from ingest.errors import ModelUnavailable, UsageError
from ingest.quality.calibration import FITTED, grading_thresholds, model_identity, write_calibration
from ingest.quality.measures import character_error_rate

MIN_PAGES = 20  # corrected pages needed: fewer leave too few pages with CER > 0.10 on either half to fit or measure


def correction_rows(db: Database) -> list[dict[str, Any]]:
    """One row per corrected page whose model reading was graded, as ingest.calibration.fit takes them."""
    rows = []
    for review, page in standing_corrections(db):
        stats = page.stats or {}
        q = stats.get("quality") or {}
        if not q.get("grade"):
            continue
        rows.append({"document_id": page.document_id, "page": page.page_index, "run_id": page.run_id,
                     "cer": round(character_error_rate(page.text, review.text or ""), 4), "grade": q["grade"],
                     "reasons": q.get("reasons", []), "quality": q, "word_confidence": stats.get("word_confidence")})
    halves = {d: ("labelled", "held_out")[n % 2] for n, d in enumerate(sorted({r["document_id"] for r in rows}))}
    return [{**r, "half": halves[r["document_id"]]} for r in rows]


def calibrate_from_corrections(settings: Settings, db: Database) -> tuple[dict[str, Any], Path]:
    """Fit the configured model's thresholds on the corrected pages (see the module); (the record, the file)."""
    model = settings.model_path
    identity = model_identity(model)
    if identity is None:
        raise ModelUnavailable(f"{model}: no model folder with a config.json to calibrate (model.path)")
    rows = correction_rows(db)
    documents = len({r["document_id"] for r in rows})
    if len(rows) < MIN_PAGES or documents < 2:
        raise UsageError(f"--from-corrections needs at least {MIN_PAGES} corrected pages in at least 2 documents; "
                         f"the ledger has {len(rows)} in {documents}: correct {max(0, MIN_PAGES - len(rows))} more "
                         f"on the review page (`uflash review`), or calibrate on the ladder (`uflash calibrate`)")
    base = grading_thresholds(settings, model).thresholds
    chosen = fit([r for r in rows if r["half"] == "labelled"], base)
    halves = {h: summary(regrade([r for r in rows if r["half"] == h], chosen)) for h in ("labelled", "held_out")}
    read_by = sorted({r.model for r in runs(db, {r["run_id"] for r in rows})})
    record = {
        "identity": identity, "model": Path(model).name,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "thresholds": {k: getattr(chosen, k) for k in FITTED},
        "held_out": halves["held_out"], "labelled": halves["labelled"],
        "documents": documents, "pages": len(rows), "complete": True, "source": "corrections",
        "read_by": read_by, "how": "uflash calibrate --from-corrections (ingest.calibration.corrections)",
    }
    return record, write_calibration(settings, model, record)
