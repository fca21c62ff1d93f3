"""Finishing a document once its chunks are all done: grade its pages, write its outputs, archive its original.

The outputs show the **latest** version of each page (db.pages.latest_pages), so a re-run's pages replace the earlier
ones there while the ledger keeps both; a page a person corrected on the review page shows their reading instead
(db.reviews, ingest.reading.corrected), until they undo it. Each page is graded against its neighbours with the
``[quality]`` thresholds (grade and reasons are written into its stats). A document that cannot be finished (a page
missing, its outputs refused by the file system, its original not archivable) is failed with that reason (its original
put in failed/), and the others go on; a full or failing disk is not the document's fault (ingest.errors): it waits and
is finished once there is room.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger

from db.documents import (
    WAITING,
    claim_finish,
    fail_document,
    finish_document,
    finishing_owner,
    get_document,
    ready_to_finish,
    release_finish,
    unfinished_documents,
)
from db.models import Document, Page, Run
from db.pages import done_documents_with_pages_of_run, latest_pages, set_page_stats
from db.reviews import page_states
from db.runs import runs
from db.session import Database
from ingest.config import Settings
from ingest.errors import infrastructure_problem
from ingest.files import file_away, free_name
from ingest.intake.failed import file_failed
from ingest.ledger.owners import is_gone, this_process
from ingest.outputs.write import holds_another_document, write_document_outputs
from ingest.quality.calibration import grading_thresholds
from ingest.quality.grades import grade_document, plain_text
from ingest.reading.corrected import with_reading


@dataclass
class Finisher:
    settings: Settings
    db: Database
    document_ids: frozenset[int] | None = None  # only these documents (uflash run FILE...); None: any
    owner: str = field(default_factory=this_process)  # who finishes (db.documents.claim_finish)

    def finish_ready(self, skip: Callable[[int], bool] = lambda doc_id: False) -> None:
        """Finish this worker's documents whose chunks are all done but whose outputs were not written (a crash between
        the last chunk and the outputs leaves exactly this), but those ``skip`` names (to be finished anyway) and those
        another worker is finishing now."""
        for doc_id in unfinished_documents(self.db, self.document_ids):
            if not skip(doc_id) and ready_to_finish(self.db, doc_id):
                self.finish(doc_id, unfinished_only=True)

    def claim(self, doc_id: int) -> bool:
        """Take or renew the document's finishing (one worker at a time: db.documents.claim_finish); a holder known to
        be gone (ingest.ledger.owners) gives it up at once."""
        if claim_finish(self.db, doc_id, self.owner):
            return True
        holder = finishing_owner(self.db, doc_id)  # looked up only when the claim is held: the holder may be gone
        return bool(holder) and is_gone(holder) and claim_finish(self.db, doc_id, self.owner, [holder])

    def rewrite_after_rerun(self, run_id: int, doc_ids: list[int]) -> None:
        """Rewrite the outputs of the finished documents (of this worker's) that ``run_id`` stored pages of, once the
        chunks it left were cancelled: the outputs show each page's latest version."""
        mine = [d for d in doc_ids if self.document_ids is None or d in self.document_ids]
        for doc_id in done_documents_with_pages_of_run(self.db, run_id, mine) if mine else []:
            if ready_to_finish(self.db, doc_id):
                self.finish(doc_id)

    def finish(self, doc_id: int, unfinished_only: bool = False) -> Path | None:
        """Write the document's outputs, archive its original, mark it done. Returns the output folder, or None when
        the document could not be finished (then it is failed with the reason), when another worker is finishing it,
        or, with ``unfinished_only``, when it is finished already."""
        if not self.claim(doc_id):
            logger.debug("document {} is being finished by {}", doc_id, finishing_owner(self.db, doc_id))
            return None
        doc = get_document(self.db, doc_id)
        if unfinished_only and doc.status not in WAITING:  # finished meanwhile, by whoever held the claim before
            release_finish(self.db, doc_id, self.owner)
            return None
        pages = latest_pages(self.db, doc_id)
        self._grade(pages)
        indexes = [p.page_index for p in pages]
        if indexes != list(range(1, doc.page_count + 1)):
            missing = sorted(set(range(1, doc.page_count + 1)) - set(indexes))
            return self._not_finished(doc, f"pages missing after all chunks finished: {missing}")
        document = {"id": doc.id, "name": doc.original_name, "sha256": doc.sha256, "kind": doc.kind,
                    "page_count": doc.page_count, "original_path": doc.original_path}
        produced_by = runs(self.db, {p.run_id for p in pages})
        run = run_record(produced_by[-1]) if produced_by else {}
        if len(produced_by) > 1:
            run["earlier_runs"] = [run_record(r) for r in produced_by[:-1]]
        page_dicts = [{"index": p.page_index, "text": p.text, "boxes": p.boxes, "stats": p.stats, "run_id": p.run_id,
                       **({"note": p.stats["note"]} if p.stats.get("note") else {})} for p in pages]
        states = page_states(self.db, [doc_id])  # a page a person corrected shows their reading
        page_dicts = [with_reading(p, states.get((doc_id, p["index"]))) for p in page_dicts]
        # the scan under the searchable PDF: the archived original on a re-run, else the one still in place
        scan = next((Path(q) for q in (doc.archived_path, doc.original_path) if q and Path(q).exists()), None)
        try:
            folder, archive_name = self._places(doc)
            md, _ = write_document_outputs(folder, document, run, page_dicts, source=scan,
                                           formats=self.settings.outputs.formats)
        except OSError as e:  # a file in the way, access denied, a name or path the OS refuses
            if infrastructure_problem(e):  # a full or failing disk: the document waits, finished once it is fixed
                raise
            return self._not_finished(doc, f"outputs could not be written: {e}")
        archived, error, src = None, None, Path(doc.original_path)
        if not self.claim(doc_id):  # the outputs took longer than the claim and another worker took it over
            logger.warning("{}: outputs written, its finishing taken over by {}", doc.original_name,
                           finishing_owner(self.db, doc_id))
            return None
        if archive_name is None:
            archived = Path(doc.archived_path)  # archived by an earlier pass (this is a re-run)
        elif src.exists():
            try:
                archived = file_away(src, self.settings.archive, self.settings.inbox, archive_name)
            except OSError as e:
                if infrastructure_problem(e):
                    raise
                return self._not_finished(doc, f"outputs written to {folder}, but the original could not be "
                                               f"archived: {e}", folder)
        else:
            error = f"original was no longer at {src} when archiving"
        finish_document(self.db, doc_id, folder, archived, error)
        logger.success("{} done: {}", doc.original_name, md)
        return folder

    def _places(self, doc: Document) -> tuple[Path, str | None]:
        """Where the document's outputs go, and the name its original is archived under (None: it is archived
        already). The folder they were written to before is kept (a re-run, or a retry, rewrites them there, even
        when that was a `uflash run --out DIR`), and so is the archived original. Else one name serves both, by the
        rule for names in use (ingest.files.free_name): the original's name, or "stem (2).ext", ..., the first under
        which the archive holds no file and the outbox no other document's folder, so that the original archived as
        "sample (2).pdf" has its outputs in "sample (2)"."""
        outbox, archive = self.settings.outbox, self.settings.archive
        earlier = Path(doc.output_dir) if doc.output_dir else None
        if earlier is not None and (not earlier.parent.is_dir() or holds_another_document(earlier, doc.sha256)):
            logger.warning("{}: {}, where its outputs were written before, is gone or holds another document: "
                           "written to the outbox {}", doc.original_name, earlier, outbox)
            earlier = None
        archived = Path(doc.archived_path) if doc.archived_path and Path(doc.archived_path).exists() else None

        def folder_of(name: str) -> Path:
            return outbox / (Path(name).stem or "document")

        def archive_taken(name: str) -> bool:
            return (archive / name).exists() or (archive / f"{name}.error.txt").exists()

        def folder_taken(name: str) -> bool:
            return holds_another_document(folder_of(name), doc.sha256)

        if earlier is not None:
            return earlier, None if archived else free_name(earlier.name + Path(doc.original_name).suffix,
                                                            archive_taken)
        if archived is not None:
            return folder_of(free_name(archived.name, folder_taken)), None
        name = free_name(doc.original_name, lambda n: archive_taken(n) or folder_taken(n))
        return folder_of(name), name

    def _not_finished(self, doc: Document, reason: str, output_dir: Path | None = None) -> None:
        """Fail a document whose chunks are all done with ``reason``. Nothing is lost: its pages stay in the ledger and
        its original goes to failed/ beside its reason (ingest.intake.failed), where `uflash retry` takes it back;
        being failed, it is not finished again (and failing again) at every start."""
        fail_document(self.db, doc.id, reason, output_dir)
        logger.error("{}: {}", doc.original_name, reason)
        file_failed(self.settings, self.db, [doc.id])

    def _grade(self, pages: list[Page]) -> None:
        """Grade the document's latest pages against each other (ingest.quality.grades) with the thresholds of the
        model this worker decodes with (its calibration, ingest.quality.calibration); store grade, reasons and whether
        the thresholds were calibrated for the model in their stats."""
        grading = grading_thresholds(self.settings)
        graded = grade_document([{**(p.stats.get("quality") or {}), "plain": plain_text(p.text),
                                  "chunk_id": p.chunk_id} for p in pages], grading.thresholds)
        for p, q in zip(pages, graded):
            p.stats = {**p.stats, "quality": {**q, "calibration": grading.stamp()}}
        set_page_stats(self.db, {p.id: p.stats for p in pages})


def run_record(r: Run) -> dict[str, Any]:
    """What document.json says of a run."""
    return {"id": r.id, "mode": r.mode, "model": r.model, "engine_version": r.engine_version, "host": r.host,
            "started_at": r.started_at.isoformat() if r.started_at else None}
