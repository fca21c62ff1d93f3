"""Scans turned sideways or upside down are turned back before the model reads them (ingest/pages/orientation.py): the
stripes and ragged edges that find them, the probes that choose the turn, the worker that records it, and
document.pdf that shows the page that way."""

from __future__ import annotations

import base64
import io
import json
import math
from pathlib import Path

import pymupdf
import pytest
from PIL import Image

from ingest.config import OrientationSettings
from ingest.outputs.searchable_pdf import write_searchable_pdf
from ingest.pages.orientation import choose_turn, ragged_edges, stripe_ratio, turn
from ingest.pages.render import render_pages
from tests.conftest import DEMO, SAMPLES, make_pdf, needs_demo

CONFIG = OrientationSettings()


def rendered(path: Path, page: int = 1) -> Image.Image:
    return render_pages(path, "pdf", page, page)[0].image


def shown_turned(pdf: Path, scan: Image.Image) -> int:
    """Degrees clockwise the first page of ``pdf`` shows ``scan`` turned (0, 90, 180, 270), from its pixels: however
    the PDF says it (a /Rotate, or the page drawn turned, as Ghostscript writes a PDF/A)."""
    import numpy as np

    with pymupdf.open(pdf) as doc:
        pix = doc[0].get_pixmap(dpi=24, colorspace=pymupdf.csGRAY)
    shown = np.asarray(Image.frombytes("L", (pix.width, pix.height), pix.samples), dtype=float)
    diffs = {}
    for degrees in (0, 90, 180, 270):
        t = turn(scan.convert("L"), degrees).resize((pix.width, pix.height))
        diffs[degrees] = np.abs(np.asarray(t, dtype=float) - shown).mean()
    return min(diffs, key=diffs.get)


def image_pdf(path: Path, images: list[Image.Image]) -> Path:
    """An image-only PDF (as a scanner writes it): one page per image, one point per pixel."""
    doc = pymupdf.open()
    for im in images:
        buf = io.BytesIO()
        im.save(buf, "PNG")
        page = doc.new_page(width=im.width, height=im.height)
        page.insert_image(page.rect, stream=buf.getvalue())
    doc.save(path)
    return path


def letter(tmp_path: Path) -> Image.Image:
    """Paragraphs of left-aligned lines of different lengths, each paragraph's last line short."""
    line = "Line {}: the council met on Tuesday and agreed the budget for the year {}."
    lines = []
    for i in range(30):
        text = line.format(i, 1900 + i)
        lines.append(text[: 40 + 7 * (i % 4)] if i % 5 == 4 else text)  # each fifth line ends a paragraph: short
    return rendered(make_pdf(tmp_path / "letter.pdf", ["\n".join(lines)]))


def test_lines_across_are_upright_and_lines_up_and_down_are_sideways(tmp_path):
    page = letter(tmp_path)
    assert stripe_ratio(page) > 1.5
    for t in (90, 270):
        assert stripe_ratio(turn(page, t)) < CONFIG.sideways_below
    assert stripe_ratio(turn(page, 180)) > 1.5  # the stripes cannot tell upside down ...
    assert ragged_edges(page) > 0.5 and ragged_edges(turn(page, 180)) < CONFIG.upside_down_below  # ... the edges can
    assert stripe_ratio(Image.new("RGB", (600, 800), "white")) is None
    assert ragged_edges(Image.new("RGB", (600, 800), "white")) is None
    # a list (a register, an index): short lines down the left, most of the page blank; measured over the whole
    # page it read upright as sideways (0.44) and sideways as upright (2.29)
    register = rendered(make_pdf(tmp_path / "register.pdf", ["\n".join(f"{i}. Meyer, Anna" for i in range(34))]))
    assert stripe_ratio(register) > 1.5 and stripe_ratio(turn(register, 90)) < CONFIG.sideways_below
    assert turn(turn(page, 90), 270).tobytes() == page.tobytes()  # quarter turns lose no pixel


def test_only_sideways_or_upside_down_pages_are_probed_and_a_turn_needs_a_clear_gain(tmp_path):
    upright = letter(tmp_path)
    calls = []

    def probe(image):  # the "model" reads the upright page best, the others badly
        calls.append(image.size)
        return -0.2 if image.tobytes() == upright.tobytes() else -0.9

    choice = choose_turn(upright, probe, CONFIG)
    assert (choice.turn, choice.scores, calls) == (0, None, [])  # upright: no model call at all
    sideways = turn(upright, 270)  # needs a quarter turn clockwise
    choice = choose_turn(sideways, probe, CONFIG)
    assert choice.turn == 90 and choice.scores == {0: -0.9, 90: -0.2, 270: -0.9} and len(calls) == 3
    assert choice.record()["turned"] == 90 and choice.record()["probe_mean_logprob"]["90"] == -0.2
    assert choose_turn(sideways, probe, OrientationSettings(min_gain=0.8)).turn == 0  # not clearly better: kept
    assert choose_turn(sideways, lambda im: -math.inf, CONFIG).turn == 0  # reads nothing anywhere: kept
    unsure = choose_turn(sideways, lambda im: probe(im) - 0.6, CONFIG)  # clearly better, but read badly (-0.8)
    assert unsure.turn == 0 and unsure.scores[90] == pytest.approx(-0.8)
    assert choose_turn(sideways, probe, OrientationSettings(sideways_below=0.01)).scores is None  # gate closed
    calls.clear()
    upside_down = choose_turn(turn(upright, 180), probe, CONFIG)
    assert upside_down.turn == 180 and upside_down.scores == {0: -0.9, 180: -0.2} and len(calls) == 2
    assert upside_down.note() == "scanned upside down: turned 180 degrees clockwise to be read"
    assert upside_down.looks.startswith("upside down (ragged edges -") and upside_down.record()["ragged_edges"] < -0.5
    assert choose_turn(turn(upright, 180), probe, OrientationSettings(upside_down_below=-1.0)).scores is None


@pytest.mark.parametrize("turned", [90, 180])
def test_a_turned_page_is_shown_turned_in_the_searchable_pdf(tmp_path, turned):
    size = (800, 600) if turned == 90 else (600, 800)  # a sideways portrait is landscape; upside down it is not
    src = image_pdf(tmp_path / "scan.pdf", [Image.new("L", size, 255)])
    page = {"index": 1, "text": "", "stats": {"orientation": {"turned": turned}},
            "boxes": [{"label": "title", "box": [100, 50, 900, 120], "text": "Protokoll des Stadtrats"}]}
    out = write_searchable_pdf(tmp_path / "document.pdf", src, "pdf", [page])
    with pymupdf.open(out) as doc:
        p = doc[0]
        assert p.rotation == turned and (p.rect.width, p.rect.height) == (600, 800)  # shown upright, as read
        (hit,) = p.search_for("Protokoll")
        assert hit.y0 < 800 * 0.2 and hit.x0 < 600 * 0.5  # at the top left of the upright page


@pytest.mark.skipif(not SAMPLES.is_dir(), reason="../shared/samples/real not present")
def test_the_real_turned_samples_are_looked_at_and_upright_real_pages_are_not():
    """cardinal.pdf holds one sheet four ways: upright, a quarter turn, upside down, three quarters."""
    sideways = rendered(SAMPLES / "cardinal.pdf", 2)  # the LinnSequencer sheet, its lines running top to bottom
    assert stripe_ratio(sideways) < CONFIG.sideways_below
    assert stripe_ratio(rendered(SAMPLES / "cardinal.pdf", 1)) > 1 / CONFIG.sideways_below
    assert ragged_edges(rendered(SAMPLES / "cardinal.pdf", 3)) < CONFIG.upside_down_below
    for name in ("skew.pdf", "epson.pdf", "francais.pdf", "kcs.pdf", "c02-22.pdf", "aspect.pdf", "typewriter.png",
                 "cardinal.pdf", "jbig2.pdf", "multipage.pdf"):
        image = render_pages(SAMPLES / name, "png" if name.endswith(".png") else "pdf", 1, 1)[0].image
        ratio, edges = stripe_ratio(image), ragged_edges(image)
        assert ratio is None or ratio >= CONFIG.sideways_below, name
        assert edges is None or edges >= CONFIG.upside_down_below, name


@needs_demo
@pytest.mark.skipif(not SAMPLES.is_dir(), reason="needs ../shared/samples/real")
def test_a_model_that_cannot_read_the_page_turns_nothing():
    """The demo model (synthetic pages only) cannot read the real sideways sheet: its probes are all low, and one
    of them (the wrong way, upside down) 0.1 above the page as it is; the floor keeps it from turning the page.
    The same for the sheet upside down."""
    from engine.loading import load_decoder
    from ingest.pages.orientation import decoder_probe

    decoder = load_decoder(str(DEMO), "cpu", "float32", "lossless")
    for page, turns in ((2, {0, 90, 270}), (3, {0, 180})):
        choice = choose_turn(rendered(SAMPLES / "cardinal.pdf", page),
                             decoder_probe(decoder, 32_768, CONFIG.probe_tokens), CONFIG)
        assert choice.scores is not None and set(choice.scores) == turns
        assert max(choice.scores.values()) < CONFIG.min_logprob and choice.turn == 0


@needs_demo
def test_the_demo_model_reads_a_turned_scan_as_it_reads_the_upright_one(tmp_path):
    """A synthetic scan put in a PDF sideways, and upside down: the worker turns it back (the demo model reads the
    upright page with clearly more confidence) and reads the same text as from the upright original; with the check
    off it reads something else. The searchable PDF shows the page turned; document.md says so."""
    from db.session import Database
    from engine.loading import load_decoder
    from ingest.config import load_settings
    from ingest.intake.enqueue import intake_file
    from ingest.review.assets import THUMB_PX
    from ingest.review.page import page_images
    from ingest.review.report import collect_report, format_report
    from ingest.synth.documents import make_document
    from ingest.synth.documents import render_pages as synth_pages
    from ingest.worker.worker import Worker
    from tests.conftest import worker_config
    from tests.test_worker import serve_until_done

    data, _ = make_document(880_000, 1, scan=True)  # held out (training seeds are >= 1,000,000)
    upright = synth_pages(data, 1024)[0]

    def read(name: str, image: Image.Image, auto: bool = True) -> dict:
        folder = tmp_path / name
        folder.mkdir()
        s = load_settings(worker_config(folder, DEMO, engine={"max_tokens_per_page": None},
                                        orientation={"auto": auto}))
        s.ensure_folders()
        db = Database(s.database_url)
        intake_file(db, s, image_pdf(s.inbox / f"{name}.pdf", [image]))
        # each worker loads its own decoder: a worker's close gives its decoder's memory back for good
        serve_until_done(Worker(s, db, lambda: load_decoder(str(DEMO), "cpu", "float32", "lossless")), db,
                         timeout=600)
        report = format_report(collect_report(db))
        (thumb,) = page_images(str(s.archive / f"{name}.pdf"), "pdf", {1: THUMB_PX},
                               {1: collect_report(db)["documents"][0]["pages"][0]["turned"]}).values()
        db.dispose()
        (out,) = [f for f in s.outbox.iterdir() if f.name != "reports"]
        return {"json": json.loads((out / "document.json").read_text(encoding="utf-8"))["pages"][0],
                "md": (out / "document.md").read_text(encoding="utf-8"), "pdf": out / "document.pdf",
                "report": report, "thumb": Image.open(io.BytesIO(base64.b64decode(thumb.split(",", 1)[1])))}

    control = read("upright", upright)
    assert "orientation" not in control["json"]["stats"]  # an upright page is not probed
    sideways = read("sideways", turn(upright, 270))
    o = sideways["json"]["stats"]["orientation"]
    assert o["turned"] == 90, o
    assert sideways["json"]["text"] == control["json"]["text"]  # the same pixels, so the same tokens
    assert sideways["json"]["boxes"] == control["json"]["boxes"]
    assert "turned 90 degrees clockwise" in sideways["md"] and "turned 90" in sideways["report"]
    assert sideways["thumb"].height > sideways["thumb"].width  # the review thumbnail shows the page as read
    with pymupdf.open(sideways["pdf"]) as doc:
        assert doc[0].rect.width < doc[0].rect.height  # shown as read: upright
    assert shown_turned(sideways["pdf"], turn(upright, 270)) == 90
    upside_down = read("upside_down", turn(upright, 180))
    assert upside_down["json"]["stats"]["orientation"]["turned"] == 180
    assert (upside_down["json"]["text"], upside_down["json"]["boxes"]) == (control["json"]["text"],
                                                                          control["json"]["boxes"])
    assert "scanned upside down: turned 180 degrees" in upside_down["md"] and "turned 180" in upside_down["report"]
    assert shown_turned(upside_down["pdf"], turn(upright, 180)) == 180
    off = read("off", turn(upright, 270), auto=False)
    assert "orientation" not in off["json"]["stats"] and off["json"]["text"] != control["json"]["text"]
    assert off["json"]["stats"]["quality"]["mean_logprob"] < control["json"]["stats"]["quality"]["mean_logprob"]
