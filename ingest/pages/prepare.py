"""A claimed chunk made ready to decode: its original found and checked, its pages rendered (with their text layers and
ink measures), the drafts the ledger holds for it, and, when a page-preparation process did the work
(ingest.pages.pool), the model's inputs built from its pages (ingest.pages.inputs). The worker then turns pages
scanned sideways upright with the model's help (ingest.worker.probes).

Two halves, so that the pages can be prepared in another process: ``locate`` reads the ledger and checks the original
(this process: it holds the ledger), ``prepare_pages`` renders and measures the pages of a ``PageJob`` (no ledger, no
model: any process); ``prepare`` is both, in the caller's thread. A chunk that cannot be read is ``Unreadable`` with
the reason it fails for (permanently: another try reads the same file). An original whose folder cannot be reached
from this machine (a share not mounted) is the machine's trouble, not the file's: ``InfrastructureError``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from db.chunks import replay_ids
from db.documents import get_document, note_file_stamp
from db.models import Document
from db.pages import EarlierReading, earlier_readings
from db.queue import Claim
from ingest.config import OrientationSettings, Settings
from ingest.errors import InfrastructureError, infrastructure_problem
from ingest.files import sha256_file
from ingest.pages.ink import ink_text
from ingest.pages.inputs import model_inputs
from ingest.pages.orientation import InkMeasures, TurnChoice, measure_ink
from ingest.pages.render import RenderedPage, render_pages


@dataclass
class PreparedChunk:
    claim: Claim
    label: str  # "<name> pages a-b", for the log
    pages: list[RenderedPage]
    references: list[str]  # per page: its latest earlier text (a re-run), else its PDF text layer
    replay: list[int] | None  # token ids of an earlier decode of exactly these pages
    earlier: list[EarlierReading | None] = field(default_factory=list)  # per page: its earlier readings (a re-run)
    ink: list[InkMeasures | None] = field(default_factory=list)  # per page, when orientation is on
    prints: list[dict] = field(default_factory=list)  # per page, the print measured on it (pages.ink), as rendered
    turned: dict[int, TurnChoice] = field(default_factory=dict)  # page index -> the turn chosen, for probed pages
    inputs: Any = None  # the model's inputs of the pages as rendered (ingest.pages.inputs), None: built at submit
    probe_inputs: dict[tuple[int, int], Any] = field(default_factory=dict)  # (position, turn) -> a probe's inputs


@dataclass(frozen=True)
class Unreadable:
    claim: Claim
    label: str
    reason: str
    permanent: bool = True  # the file's own fault; False: a try that may go better (its attempt counts)


@dataclass(frozen=True)
class PageJob:
    """What rendering and measuring a chunk's pages needs, without the ledger (sent to a page-preparation process)."""

    path: str
    kind: str
    first: int
    last: int
    max_page_pixels: int
    orientation: OrientationSettings | None  # measure each page for the turn check; None: orientation.auto is off


@dataclass
class Located:
    """A claimed chunk whose original is there and unchanged, with what the ledger holds for it."""

    claim: Claim
    label: str
    job: PageJob
    earlier: dict[int, EarlierReading]  # page index -> its latest earlier reading (a re-run)
    replay: list[int] | None


@dataclass
class PagesReady:
    """A ``PageJob`` done: the pages rendered and measured, and the model's inputs when a processor was at hand."""

    pages: list[RenderedPage]
    ink: list[InkMeasures | None]
    prints: list[dict]
    inputs: Any = None
    probe_inputs: dict[tuple[int, int], Any] = field(default_factory=dict)
    seconds: float = 0.0  # the time the work took
    cpu_seconds: float = 0.0  # the processor time of the thread that did it


@dataclass(frozen=True)
class Unrenderable:
    reason: str  # why the pages cannot be rendered: the file's fault


def chunk_label(doc: Document, c: Claim) -> str:
    return f"{doc.original_name} pages {c.first_page}-{c.last_page}"


def prepare(settings: Settings, db, c: Claim) -> PreparedChunk | Unreadable:  # noqa: ANN001
    """Render the chunk's pages from its original and gather its drafts, in this thread (see the module docstring)."""
    found = locate(settings, db, c)
    return found if isinstance(found, Unreadable) else chunk_ready(found, prepare_pages(found.job))


def locate(settings: Settings, db, c: Claim) -> Located | Unreadable:  # noqa: ANN001
    """The chunk's original checked (there, unchanged) and what the ledger holds for its pages."""
    doc = get_document(db, c.document_id)
    label = chunk_label(doc, c)
    path = Path(doc.original_path)
    if doc.archived_path and Path(doc.archived_path).exists():
        path = Path(doc.archived_path)  # a re-run of a finished document reads the archived original
    if not path.exists():
        if not path.parent.is_dir():  # not the file: its folder is not reachable from here (a share not mounted)
            raise InfrastructureError(f"the folder {path.parent} of {doc.original_name} cannot be reached from "
                                      f"this machine (every worker needs the inbox and the archive at the same "
                                      f"path; `uflash check`)")
        return Unreadable(c, label, f"original file is gone: {path}")
    if path == Path(doc.original_path) and (why := replaced(db, doc, path)):
        return Unreadable(c, label, why)
    job = PageJob(str(path), doc.kind, c.first_page, c.last_page, settings.watch.max_page_pixels,
                  settings.orientation if settings.orientation.auto else None)
    return Located(c, label, job, earlier_readings(db, c.document_id, c.first_page, c.last_page, c.chunk_id),
                   replay_ids(db, c))


def prepare_pages(job: PageJob, processor: Any = None) -> PagesReady | Unrenderable:
    """Render the job's pages, measure each (its ink for the turn check, its print), and with ``processor`` (an
    ``engine.model.load.PageProcessor``) build the model's inputs (ingest.pages.inputs). Needs no ledger and no
    model: a page-preparation process runs it."""
    t0, cpu0 = time.perf_counter(), time.thread_time()
    try:
        pages = render_pages(Path(job.path), job.kind, job.first, job.last, max_page_pixels=job.max_page_pixels)
    except Exception as e:
        if infrastructure_problem(e):  # the disk or the share, not the file: the chunk goes back, nothing fails
            raise
        return Unrenderable(f"cannot render: {type(e).__name__}: {e}")
    ink = [measure_ink(p.image, job.orientation) for p in pages] if job.orientation is not None else []
    ready = PagesReady(pages, ink, [ink_text(p.image).dict() for p in pages])
    if processor is not None:
        ready.inputs, ready.probe_inputs = model_inputs(processor, [p.image for p in pages], ink)
    ready.seconds, ready.cpu_seconds = time.perf_counter() - t0, time.thread_time() - cpu0
    return ready


def chunk_ready(found: Located, ready: PagesReady | Unrenderable) -> PreparedChunk | Unreadable:
    """The chunk made of what ``locate`` found and what ``prepare_pages`` made of its pages."""
    if isinstance(ready, Unrenderable):
        return Unreadable(found.claim, found.label, ready.reason)
    pages = ready.pages
    earlier = [found.earlier.get(p.index) for p in pages]
    return PreparedChunk(found.claim, found.label, pages,
                         [e.text if e else p.text_layer or "" for e, p in zip(earlier, pages)], found.replay,
                         earlier, ready.ink, ready.prints, inputs=ready.inputs, probe_inputs=ready.probe_inputs)


def replaced(db, doc: Document, path: Path) -> str | None:  # noqa: ANN001
    """Why the file waiting at ``path`` is no longer the content the document was queued with, or None when it still
    is. A file touched in place (same content) is; one replaced by other content under the same name is not: decoding
    it would give the new pages under the old document's name and checksum (the new content is taken in as a document
    of its own by the next look at the inbox)."""
    st = path.stat()
    if (st.st_size, st.st_mtime_ns) == (doc.size_bytes, doc.mtime_ns):
        return None
    sha = sha256_file(path)
    if sha == doc.sha256:
        note_file_stamp(db, doc.id, st.st_size, st.st_mtime_ns)
        return None
    return (f"the file at {path} was replaced by other content (sha256 {sha[:12]}...) before this document "
            f"(sha256 {doc.sha256[:12]}...) was decoded; that content is queued as a document of its own")
