"""ALTO 4.4 (Library of Congress), one file per page: ``<outbox>/<doc>/alto/<page>.xml`` (``0001.xml``...), the page
number zero-padded so that the files sort in page order and map to the page images one to one.

- ``Description``: ``MeasurementUnit`` pixel; ``sourceImageInformation`` (the original file's name, its SHA-256 and
  the page number); one ``Processing`` step naming uflash, the model and the decode mode, how word positions were
  estimated and how WC is computed.
- ``Tags``: one ``LayoutTag`` per element label the model used (``title``, ``text``, ``table``, ``image``...);
  blocks point to theirs with ``TAGREFS``.
- ``Page``: ``WIDTH``/``HEIGHT`` of the page image the model read (pixels), ``PHYSICAL_IMG_NR`` its number in the
  document, and ``ROTATION`` when it was read turned (the scan's text runs that many degrees counterclockwise;
  coordinates are in the turned image, where it reads upright).
- One block per element, in the model's reading order: ``TextBlock`` for text and tables (a table's rows are its
  lines, its cells' words its Strings), ``Illustration`` for pictures (followed by a ``TextBlock`` of the same box
  when the model also read text in it); ``TextLine`` per line; ``String`` per word with ``CONTENT``, estimated
  ``HPOS``/``VPOS``/``WIDTH``/``HEIGHT`` (ingest.reading.words) and ``WC`` (ingest.reading.confidence); ``SP`` between
  words.
- A page a person corrected (``uflash review``): a second ``Processing`` step (``contentModification``, when, by
  whom) and ``CS="true"`` (correction status) on its text blocks; the words the person wrote have ``WC`` 1.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from lxml import etree

from ingest.files import write_atomic
from ingest.reading.confidence import FORMULA
from ingest.reading.words import LAYOUT_NOTE, Block, PageLayout

NS = "http://www.loc.gov/standards/alto/ns-v4#"
XLINK = "http://www.w3.org/1999/xlink"
XSI = "http://www.w3.org/2001/XMLSchema-instance"
SCHEMA_LOCATION = f"{NS} http://www.loc.gov/alto/v4/alto-4-4.xsd"


def alto_name(index: int, page_count: int) -> str:
    return f"{index:0{max(4, len(str(page_count)))}d}.xml"


def _e(parent: etree._Element, tag: str, text: str | None = None, **attrs: Any) -> etree._Element:
    el = etree.SubElement(parent, f"{{{NS}}}{tag}", {k: _num(v) for k, v in attrs.items() if v is not None})
    if text is not None:
        el.text = text
    return el


def _num(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _tag_id(label: str) -> str:
    return "TAG_" + re.sub(r"[^A-Za-z0-9_.-]", "_", label)


def page_alto(layout: PageLayout, document: dict[str, Any], run: dict[str, Any], page: dict[str, Any]) -> bytes:
    """The ALTO file of one page."""
    stats = page.get("stats") or {}
    root = etree.Element(f"{{{NS}}}alto", nsmap={None: NS, "xlink": XLINK, "xsi": XSI})
    root.set(f"{{{XSI}}}schemaLocation", SCHEMA_LOCATION)
    root.set("SCHEMAVERSION", "4.4")
    desc = _e(root, "Description")
    _e(desc, "MeasurementUnit", "pixel")
    src = _e(desc, "sourceImageInformation")
    _e(src, "fileName", document.get("name") or "")
    if document.get("sha256"):
        _e(src, "fileIdentifier", document["sha256"], fileIdentifierLocation="sha256")
    _e(src, "documentIdentifier", f"page {layout.index} of {document.get('page_count', '?')}",
       documentIdentifierLocation="page")
    proc = _e(desc, "Processing", ID="OCR_1")
    _e(proc, "processingCategory", "contentGeneration")
    when = run.get("started_at") or datetime.now(timezone.utc).isoformat(timespec="seconds")
    _e(proc, "processingDateTime", when)
    mode = stats.get("mode") or run.get("mode") or "unknown"
    _e(proc, "processingStepDescription",
       f"page parsed by the model {run.get('model') or 'unknown'} in {mode} mode; blocks are the model's elements, "
       "their boxes and labels the model's")
    _e(proc, "processingStepDescription", LAYOUT_NOTE)
    _e(proc, "processingStepDescription", FORMULA)
    settings = f"mode={mode}; model={run.get('model') or 'unknown'}; page image {layout.width}x{layout.height} px"
    if layout.rotation:
        settings += f", the scan turned {layout.rotation} degrees clockwise to be read"
    _e(proc, "processingStepSettings", settings)
    sw = _e(proc, "processingSoftware")
    _e(sw, "softwareCreator", "uflash")
    _e(sw, "softwareName", "uflash")
    _e(sw, "softwareVersion", str(run.get("engine_version") or ""))
    _e(sw, "applicationDescription", "watch-folder batch OCR with Unlimited-OCR and lossless speculative decoding")
    corrected = stats.get("correction")
    if corrected:  # a person's reading (ingest.review.corrections): a second step, and every block marked corrected
        fix = _e(desc, "Processing", ID="OCR_2")
        _e(fix, "processingCategory", "contentModification")
        _e(fix, "processingDateTime", corrected.get("at") or when)
        _e(fix, "processingStepDescription", "the page's text corrected by a person on the review page (uflash "
           "review), block by block, the model's blocks and boxes kept; the words the person wrote have WC 1")
        _e(_e(fix, "processingSoftware"), "softwareName", "uflash review")
    labels = list(dict.fromkeys(b.label for b in layout.blocks))
    if labels:
        tags = _e(root, "Tags")
        for label in labels:
            _e(tags, "LayoutTag", ID=_tag_id(label), LABEL=label, DESCRIPTION="element label given by the model")
    lay = _e(root, "Layout")
    pid = f"P{layout.index}"
    pg = _e(lay, "Page", ID=pid, PHYSICAL_IMG_NR=layout.index, WIDTH=layout.width, HEIGHT=layout.height,
            ROTATION=layout.rotation or None, PROCESSING="OCR_1")
    space = _e(pg, "PrintSpace", HPOS=0, VPOS=0, WIDTH=layout.width, HEIGHT=layout.height)
    for n, block in enumerate(layout.blocks, start=1):
        _block(space, block, f"{pid}_B{n}", bool(corrected))
    return etree.tostring(root, xml_declaration=True, encoding="UTF-8", pretty_print=True)


def _pos(b) -> dict[str, int]:
    return {"HPOS": b.x0, "VPOS": b.y0, "WIDTH": b.width, "HEIGHT": b.height}


def _block(parent: etree._Element, block: Block, bid: str, corrected: bool = False) -> None:
    tag = _tag_id(block.label)
    if block.kind == "picture":
        _e(parent, "Illustration", ID=bid, TAGREFS=tag, TYPE=block.label, **_pos(block.box))
        if not block.lines:
            return
        bid += "_T"
    tb = _e(parent, "TextBlock", ID=bid, TAGREFS=tag, CS="true" if corrected else None, **_pos(block.box))
    for ln, line in enumerate(block.lines, start=1):
        lid = f"{bid}_L{ln}"
        tl = _e(tb, "TextLine", ID=lid, **_pos(line.box))
        for wn, w in enumerate(line.words, start=1):
            if wn > 1:
                prev = line.words[wn - 2].box
                _e(tl, "SP", HPOS=prev.x1, VPOS=line.box.y0, WIDTH=max(0, w.box.x0 - prev.x1))
            _e(tl, "String", ID=f"{lid}_S{wn}", CONTENT=w.text, WC=None if w.confidence is None else
               round(min(1.0, max(0.0, w.confidence)), 4), **_pos(w.box))


def write_alto(folder: Path, layouts: list[PageLayout], document: dict[str, Any], run: dict[str, Any],
               pages: list[dict[str, Any]]) -> list[Path]:
    """``folder/alto/<page>.xml`` for each page; files of pages the document no longer has are removed."""
    out_dir = folder / "alto"
    out_dir.mkdir(parents=True, exist_ok=True)
    by_index = {p["index"]: p for p in pages}
    runs = {r.get("id"): r for r in [run, *run.get("earlier_runs", [])]}
    written = []
    for layout in layouts:
        page = by_index[layout.index]
        path = out_dir / alto_name(layout.index, document.get("page_count") or len(pages))
        write_atomic(path, page_alto(layout, document, runs.get(page.get("run_id"), run), page))
        written.append(path)
    for stale in set(out_dir.glob("*.xml")) - set(written):
        stale.unlink(missing_ok=True)
    return written
