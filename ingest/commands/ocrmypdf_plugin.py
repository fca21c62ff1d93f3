"""uflash as an OCRmyPDF OCR engine.

    ocrmypdf --plugin ingest.commands.ocrmypdf_plugin in.pdf out.pdf

OCRs ``in.pdf`` with Unlimited-OCR through uflash's own pipeline and lets OCRmyPDF build the PDF (PDF/A-2b by
default, OCRmyPDF's own default output type) from the words. How:

1. Before any page is processed (the ``validate`` hook, once per file, in OCRmyPDF's main process) the whole input
   file goes through what ``uflash run FILE`` does (the same rendering, chunks, turned-page probing and decode, in
   ``lossless`` mode with the model of uflash's config: ``--uflash-config PATH``, else ``UFLASH_CONFIG``, else
   ``./config.toml``), with a private ledger and outbox in OCRmyPDF's work folder. So the text of every page equals
   what ``uflash run`` writes for the same file: it is the same code on the same pages.
2. For each page OCRmyPDF asks for (``generate_ocr``), the page's words come from that ``document.json`` through
   the one word layout (ingest.reading.words), scaled from the page image the model read to OCRmyPDF's image of the
   page. A page the model read turned is reported to OCRmyPDF as turned (``get_orientation``; ``rotate_pages`` is
   switched on when a page was turned), so the words sit on the page as OCRmyPDF shows it.

``--uflash-pages FILE`` (a ``document.json`` uflash wrote) skips the decode and uses those pages: this is how
uflash's own ``document.pdf`` step calls OCRmyPDF (ingest.outputs.pdfa), with no second decode.

OCRmyPDF loads this plugin only when asked (``--plugin ingest.commands.ocrmypdf_plugin``, or ``plugins=[...]`` in
its Python API): installing uflash registers no OCRmyPDF entry point, so a plain ``ocrmypdf in.pdf out.pdf`` in the
same environment keeps OCRmyPDF's own engine (Tesseract). Once loaded, the plugin replaces Tesseract (OCRmyPDF's
built-in engine is blocked, so Tesseract need not be installed) and keeps Tesseract's option names accepted, as
OCRmyPDF's own checks expect them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
import threading
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ocrmypdf import hookimpl
from ocrmypdf.exceptions import ExitCode, ExitCodeException
from ocrmypdf.hocrtransform import BoundingBox, OcrClass, OcrElement
from ocrmypdf.pluginspec import OcrEngine, OrientationConfidence

log = logging.getLogger(__name__)
TESSERACT = "ocrmypdf.builtin_plugins.tesseract_ocr"
PRIVATE = "ocrmypdf-uflash"  # the plugin's folder in OCRmyPDF's work folder


class UflashFailed(ExitCodeException):
    exit_code = ExitCode.child_process_error


def _option(options: Any, name: str) -> Any:
    value = getattr(options, name, None)
    if value is None and hasattr(options, "extra_attrs"):
        value = options.extra_attrs.get(name)
    return value


@lru_cache(maxsize=4)
def _pages(path: str, mtime_ns: int) -> dict[int, dict[str, Any]]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return {p["index"]: p for p in data.get("pages", [])}


def stored_pages(options: Any) -> dict[int, dict[str, Any]]:
    path = _option(options, "uflash_pages")
    if not path:
        raise UflashFailed("uflash: no decoded pages (the validate step did not run)")
    return _pages(str(path), Path(path).stat().st_mtime_ns)


def decode_with_uflash(source: Path, work: Path, config: str | None = None) -> Path:
    """Decode ``source`` as ``uflash run`` does, in ``lossless`` mode, with a private ledger and outbox under
    ``work``; return the ``document.json`` written."""
    from db.session import Database
    from ingest.commands.batch import run_batch
    from ingest.config import load_settings
    from ingest.worker.worker import make_worker

    settings = load_settings(config)
    for name in ("inbox", "outbox", "archive", "failed", "logs"):
        setattr(settings.folders, name, work / name)
    settings.database.url = f"sqlite:///{work / 'uflash.db'}"
    settings.engine.mode = "lossless"
    settings.outputs.formats = ["json"]  # the words only: OCRmyPDF makes the PDF
    settings.ensure_folders()
    db = Database(settings.database_url)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # OCRmyPDF may be writing the PDF to standard output
            res = run_batch(settings, db, [source], make_worker, threading.Event(), report=lambda run_id: None)
    finally:
        db.dispose()
    found = sorted(settings.outbox.glob("*/document.json"))
    if res.done != 1 or not found:
        raise UflashFailed(f"uflash could not decode {source}; see the messages above")
    return found[0]


class UflashEngine(OcrEngine):
    """Words of the pages uflash decoded (``--uflash-pages`` or the validate step's), as OCRmyPDF's OcrElement."""

    @staticmethod
    def version() -> str:
        import engine

        return engine.__version__

    @staticmethod
    def creator_tag(options: Any) -> str:
        return f"uflash {UflashEngine.version()} (Unlimited-OCR)"

    def __str__(self) -> str:
        return f"uflash {self.version()} (Unlimited-OCR)"

    @staticmethod
    def languages(options: Any) -> set[str]:
        return set(getattr(options, "languages", None) or ["eng"])  # the model reads any script; accept what is asked

    @staticmethod
    def get_orientation(input_file: Path, options: Any) -> OrientationConfidence:
        """The turn uflash read the page with (OCRmyPDF names the preview ``<page>_...``, 1-based)."""
        m = re.match(r"(\d+)_", Path(input_file).name)
        page = stored_pages(options).get(int(m.group(1))) if m else None
        turned = ((page or {}).get("stats") or {}).get("orientation", {}).get("turned", 0)
        # OCRmyPDF turns the page by the counterclockwise correction of the angle it is told: uflash turned clockwise
        return OrientationConfidence(angle=(-turned) % 360, confidence=100.0 if turned else 0.0)

    @staticmethod
    def get_deskew(input_file: Path, options: Any) -> float:
        return 0.0

    @staticmethod
    def supports_generate_ocr() -> bool:
        return True

    @staticmethod
    def generate_ocr(input_file: Path, options: Any, page_number: int = 0) -> tuple[OcrElement, str]:
        from PIL import Image

        from ingest.reading.words import stored_layout

        with Image.open(input_file) as im:
            width, height = im.size
            dpi = float((im.info.get("dpi") or (300, 300))[0])
        root = OcrElement(ocr_class=OcrClass.PAGE, bbox=BoundingBox(0, 0, width, height), dpi=dpi,
                          page_number=page_number)
        page = stored_pages(options).get(page_number + 1)
        if page is None:
            return root, ""
        layout = stored_layout(page, (width, height))
        sx, sy = width / layout.width, height / layout.height

        def box(b) -> BoundingBox:
            return BoundingBox(b.x0 * sx, b.y0 * sy, b.x1 * sx, b.y1 * sy)

        lines_text = []
        for block in layout.blocks:
            if not block.lines:
                continue
            lines = []
            for line in block.lines:
                words = [OcrElement(ocr_class=OcrClass.WORD, bbox=box(w.box), text=w.text, confidence=w.confidence)
                         for w in line.words]
                lines.append(OcrElement(ocr_class=OcrClass.LINE, bbox=box(line.box), children=words))
                lines_text.append(" ".join(w.text for w in line.words))
            root.children.append(OcrElement(ocr_class=OcrClass.PARAGRAPH, bbox=box(block.box), children=lines))
        return root, "\n".join(lines_text) + ("\n" if lines_text else "")

    @staticmethod
    def generate_hocr(input_file: Path, output_hocr: Path, output_text: Path, options: Any) -> None:
        raise NotImplementedError("uflash gives OcrElement trees (generate_ocr)")

    @staticmethod
    def generate_pdf(input_file: Path, output_pdf: Path, output_text: Path, options: Any) -> None:
        raise NotImplementedError("uflash gives OcrElement trees: use --pdf-renderer auto or fpdf2")


# -- hooks ----------------------------------------------------------------------------------------------------
@hookimpl
def initialize(plugin_manager) -> None:  # noqa: ANN001
    plugin_manager.set_blocked(TESSERACT)


@hookimpl
def register_options() -> dict[str, Any]:
    from ocrmypdf.builtin_plugins.tesseract_ocr import TesseractOptions

    return {"tesseract": TesseractOptions}  # OCRmyPDF's checks read options.tesseract even with another engine


@hookimpl
def add_options(parser) -> None:  # noqa: ANN001
    group = parser.add_argument_group("uflash", "OCR with Unlimited-OCR through uflash")
    group.add_argument("--uflash-config", metavar="PATH", default=None,
                       help="uflash's config.toml (its model); default: UFLASH_CONFIG, else ./config.toml")
    group.add_argument("--uflash-pages", metavar="FILE", default=None,
                       help="a document.json written by uflash for this file: use its pages, decode nothing")
    if "--tesseract-timeout" not in parser._option_string_actions:
        from ocrmypdf.builtin_plugins.tesseract_ocr import TesseractOptions

        TesseractOptions.add_arguments_to_parser(parser)


@hookimpl
def validate(pdfinfo, options) -> None:  # noqa: ANN001
    if not _option(options, "uflash_pages"):
        origin = Path(pdfinfo.filename)
        given = options.input_file
        source = Path(given) if isinstance(given, (str, Path)) and str(given) != "-" and Path(given).is_file() \
            else origin
        pages_json = decode_with_uflash(source, origin.parent / PRIVATE, _option(options, "uflash_config"))
        options.extra_attrs["uflash_pages"] = str(pages_json)
    pages = stored_pages(options)
    if any(((p.get("stats") or {}).get("orientation") or {}).get("turned") for p in pages.values()):
        options.rotate_pages = True  # so that OCRmyPDF asks get_orientation and turns those pages as uflash read them


@hookimpl
def get_ocr_engine(options) -> OcrEngine:  # noqa: ANN001
    return UflashEngine()


# An environment installed from a uflash that registered this plugin through an ``ocrmypdf`` entry point still names
# ``installed`` in its package metadata until uflash is installed again (``pip install -e .``); that entry point now
# loads an object without hooks, so such an environment keeps OCRmyPDF's own engine too, and OCRmyPDF still starts.
installed = SimpleNamespace()
