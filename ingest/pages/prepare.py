"""A claimed chunk made ready to decode: its original found and checked, its pages rendered (with their text layers and
ink measures), the drafts the ledger holds for it; then, with the model, its pages turned upright.

``prepare`` needs no model (a background thread can run it ahead of the decode); ``turn_upright`` asks the model. A
chunk that cannot be read is ``Unreadable`` with the reason it fails for (permanently: another try reads the same
file). An original whose folder cannot be reached from this machine (a share not mounted) is the machine's trouble,
not the file's: ``InfrastructureError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from db.chunks import replay_ids
from db.documents import get_document, note_file_stamp
from db.models import Document
from db.pages import earlier_texts
from db.queue import Claim
from ingest.config import Settings
from ingest.errors import InfrastructureError, infrastructure_problem
from ingest.files import sha256_file
from ingest.pages.ink import ink_text
from ingest.pages.orientation import InkMeasures, TurnChoice, choose_turn, decoder_probe, measure_ink, turn
from ingest.pages.render import RenderedPage, render_pages


@dataclass
class PreparedChunk:
    claim: Claim
    label: str  # "<name> pages a-b", for the log
    pages: list[RenderedPage]
    references: list[str]  # per page: its latest earlier text (a re-run), else its PDF text layer
    replay: list[int] | None  # token ids of an earlier decode of exactly these pages
    ink: list[InkMeasures | None] = field(default_factory=list)  # per page, when orientation is on
    prints: list[dict] = field(default_factory=list)  # per page, the print measured on it (pages.ink), as rendered
    turned: dict[int, TurnChoice] = field(default_factory=dict)  # page index -> the turn chosen, for probed pages


@dataclass(frozen=True)
class Unreadable:
    claim: Claim
    label: str
    reason: str


def chunk_label(doc: Document, c: Claim) -> str:
    return f"{doc.original_name} pages {c.first_page}-{c.last_page}"


def prepare(settings: Settings, db, c: Claim) -> PreparedChunk | Unreadable:  # noqa: ANN001
    """Render the chunk's pages from its original and gather its drafts (see the module docstring)."""
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
    try:
        pages = render_pages(path, doc.kind, c.first_page, c.last_page, max_page_pixels=settings.watch.max_page_pixels)
    except Exception as e:
        if infrastructure_problem(e):  # the disk or the share, not the file: the chunk goes back, nothing fails
            raise
        return Unreadable(c, label, f"cannot render: {type(e).__name__}: {e}")
    earlier = earlier_texts(db, c.document_id, c.first_page, c.last_page, c.chunk_id)
    ink = [measure_ink(p.image, settings.orientation) for p in pages] if settings.orientation.auto else []
    return PreparedChunk(c, label, pages, [earlier.get(p.index) or p.text_layer or "" for p in pages],
                         replay_ids(db, c), ink, [ink_text(p.image).dict() for p in pages])


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


class Turns:
    """Turns the pages that were scanned sideways or upside down (ingest.pages.orientation) so that the chunk's decode
    reads them upright. A page probed before (its chunk was cut and re-queued) keeps the turn chosen then."""

    LIMIT = 4096  # a watcher runs for weeks: the memory of turns made stays small

    def __init__(self, settings: Settings):
        self.settings = settings
        self.made: dict[tuple[int, int], TurnChoice] = {}  # (document, page) -> the turn chosen for a probed page

    def turn_upright(self, decoder, chunk: PreparedChunk) -> None:  # noqa: ANN001
        """Probe the pages that look turned (``decoder.decode``) and turn them in place; record the choices."""
        o = self.settings.orientation
        if not o.auto:
            return
        probe = decoder_probe(decoder, self.settings.engine.context_limit, o.probe_tokens)
        for page, ink in zip(chunk.pages, chunk.ink):
            key = (chunk.claim.document_id, page.index)
            earlier = self.made.get(key)
            choice = earlier or choose_turn(page.image, probe, o, ink)
            if choice.scores is None:
                continue
            if earlier is None:
                if len(self.made) >= self.LIMIT:
                    self.made.clear()
                self.made[key] = choice
            chunk.turned[page.index] = choice
            if choice.turn:
                page.image = turn(page.image, choice.turn)
            logger.info("{}: page {} looks {}; probes {}{}: {}", chunk.label, page.index, choice.looks,
                        choice.record()["probe_mean_logprob"], " (made before)" if earlier else "",
                        f"turned {choice.turn} degrees clockwise" if choice.turn else "left as it is")
