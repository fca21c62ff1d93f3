"""The review page (ingest.review.page) of a run over ../shared/samples/real, opened in a real headless Chromium
(driven with Selenium): the element boxes lie on the print of the page image shown (turned pages included), a box
and its text light up together, the grade filter and the copy buttons work, and so does the keyboard. A screenshot
is written and its path printed in the test log.

The run is the real worker over the real sample files (rendering, orientation, ledger, grading, report), with a
scripted model that "reads" each page where its print is: one element per block of lines of ink, boxes from the
image itself, so that a box drawn anywhere but on the print is the page's fault, not the model's."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import numpy as np
import pytest
from sqlalchemy import select

from db.models import Document, Page
from db.session import Database
from engine.chunk_output import assemble
from engine.official import DecodeResult
from ingest.config import load_settings
from ingest.intake.enqueue import intake_file
from ingest.pages.ink import ink_mask
from ingest.pages.orientation import ragged_edges, stripe_ratio
from ingest.review.report import write_html_report
from ingest.worker.worker import Worker
from tests.conftest import DEMO, SAMPLES, headless_chromium, needs_demo, serve_until, worker_config

WORDS = "minutes register parish entry accounts letter council year page record index deed".split()

pytestmark = [pytest.mark.skipif(not SAMPLES.is_dir(), reason="../shared/samples/real not present"),
              needs_demo,
              pytest.mark.xdist_group("review_page")]  # run in parallel: on one worker, the run and browser once


def blocks(image, most: int = 10) -> list[tuple[int, int, int, int]]:
    """Pixel boxes of the blocks of print on a page: runs of rows with ink, merged across small gaps."""
    gray = np.asarray(image.convert("L"), dtype=np.float32)
    mask = ink_mask(gray)
    rows = mask.sum(axis=1) >= 3
    out, start, gap = [], None, 0
    for y, on in enumerate(list(rows) + [False] * 20):
        if on:
            start, gap = (y if start is None else start), 0
        elif start is not None:
            gap += 1
            if gap > 12:
                band = mask[start : y - gap + 1]
                cols = np.flatnonzero(band.sum(axis=0) >= 1)
                if cols.size and y - gap + 1 - start >= 4:
                    out.append((int(cols.min()), start, int(cols.max()) + 1, y - gap + 1))
                start, gap = None, 0
    return sorted(out, key=lambda b: -(b[2] - b[0]) * (b[3] - b[1]))[:most]


class InkReader:
    """A scripted model: each block of print becomes an element whose box is the block's, with a few words; a page
    that does not look upright reads with low confidence (so the worker's orientation probes turn it); the words of
    some pages are read unsure. Token ids are the demo tokenizer's."""

    mode, model_name, device = "lossless", "ink-reader", "cpu"

    def __init__(self):
        from transformers import AutoTokenizer

        self.loaded = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(str(DEMO)))
        self.pages = 0

    def describe(self):
        return {}

    def free_memory(self):
        pass

    def _page(self, image) -> tuple[str, float]:
        w, h = image.size
        elements = []
        for n, (x0, y0, x1, y1) in enumerate(sorted(blocks(image), key=lambda b: b[1])):
            box = [round(x0 / w * 999), round(y0 / h * 999), round(x1 / w * 999), round(y1 / h * 999)]
            words = " ".join(WORDS[(n + k) % len(WORDS)] for k in range(3 + n % 4))
            elements.append(f"<|det|>text [{box[0]}, {box[1]}, {box[2]}, {box[3]}]<|/det|>{words}")
        ratio, edges = stripe_ratio(image), ragged_edges(image)
        upright = (ratio is None or ratio >= 0.75) and (edges is None or edges >= -0.5)
        return "\n".join(elements), -0.02 if upright else -3.0

    def decode(self, images, context_limit, max_new_tokens=None, **hints):
        read = [self._page(im) for im in images]
        tok = self.loaded.tokenizer
        ids, lps, text = [], [], ""
        for body, lp in read:
            self.pages += 1
            piece = ("<PAGE>" if len(images) > 1 else "") + body
            piece_ids = tok(piece, add_special_tokens=False)["input_ids"]
            unsure = self.pages % 3 == 0  # every third page: its words read unsure
            ids += piece_ids
            lps += [lp if not unsure else (-1.2 if k % 4 == 0 else lp) for k in range(len(piece_ids))]
            text += piece
        if max_new_tokens is not None and len(ids) > max_new_tokens:  # an orientation probe: the first tokens
            ids, lps = ids[:max_new_tokens], lps[:max_new_tokens]
        res = DecodeResult(prompt_ids=[0] * 10, output_ids=ids, finish_reason="eos", seconds=0.01, text=text,
                           prompt_kind="multi" if len(images) > 1 else "single", n_pages=len(images), logprobs=lps)
        return assemble(res, len(images), hit_context=False)


@pytest.fixture(scope="module")
def review(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("review-page")
    cfg = worker_config(root, tiny_model_dir, engine={"max_pages_per_chunk": 4, "max_tokens_per_page": None})
    s = load_settings(cfg)
    s.ensure_folders()
    db = Database(s.database_url)
    ids = []
    for path in sorted(SAMPLES.iterdir()):
        if path.suffix.lower() in (".pdf", ".png"):
            shutil.copy(path, s.inbox / path.name)
            res = intake_file(db, s, s.inbox / path.name)
            if res.document_id is not None:
                ids.append(res.document_id)
    decoder = InkReader()

    def done():
        with db.session() as ss:
            return all(ss.get(Document, i).status in ("done", "failed") for i in ids)

    worker = Worker(s, db, lambda: decoder)
    serve_until(worker, done, timeout=900)
    run_id = worker.close_run()
    html = write_html_report(db, s.outbox, run_id, cfg, s.quality.unsure_word_prob)
    with db.session() as ss:
        pages = ss.scalars(select(Page).where(Page.run_id == run_id)).all()
    return SimpleNamespace(cfg=cfg, settings=s, html=html, pages=pages, run_id=run_id)


@pytest.fixture(scope="module")
def browser(review):
    driver = headless_chromium()
    driver.execute_cdp_cmd("Browser.grantPermissions", {"permissions": ["clipboardReadWrite",
                                                                        "clipboardSanitizedWrite"]})
    driver.get(review.html.as_uri())
    yield driver
    driver.quit()


def _clipboard(driver) -> str:
    return driver.execute_async_script("const done=arguments[0]; navigator.clipboard.readText().then(done, "
                                       "e => done('ERROR ' + e))")


def _visible(driver) -> list:
    return driver.execute_script("return [].slice.call(document.querySelectorAll('section.page'))"
                                 ".filter(s => !s.hidden).map(s => [s.id, s.dataset.grade])")


INK_UNDER_BOXES = """
const out = [];
for (const sec of document.querySelectorAll('section.page')) {
  const img = sec.querySelector('.scan img'); if (!img) continue;
  img.scrollIntoView();
  const c = document.createElement('canvas'); c.width = img.naturalWidth; c.height = img.naturalHeight;
  const g = c.getContext('2d'); g.drawImage(img, 0, 0);
  const px = g.getImageData(0, 0, c.width, c.height).data;
  const r = img.getBoundingClientRect(), sx = c.width / r.width, sy = c.height / r.height;
  let paper = []; for (let i = 0; i < px.length; i += 4 * 97) paper.push(px[i]); paper.sort((a, b) => a - b);
  const light = paper[Math.floor(paper.length * 0.75)];
  for (const rect of sec.querySelectorAll('svg rect')) {
    const b = rect.getBoundingClientRect();
    const x0 = Math.max(0, Math.floor((b.left - r.left) * sx)), x1 = Math.min(c.width, Math.ceil((b.right - r.left) * sx));
    const y0 = Math.max(0, Math.floor((b.top - r.top) * sy)), y1 = Math.min(c.height, Math.ceil((b.bottom - r.top) * sy));
    let dark = 0, n = 0;
    for (let y = y0; y < y1; y++) for (let x = x0; x < x1; x++) { n++; if (px[(y * c.width + x) * 4] < light - 40) dark++; }
    const inside = b.left >= r.left - 1 && b.right <= r.right + 1 && b.top >= r.top - 1 && b.bottom <= r.bottom + 1;
    out.push([sec.id, rect.dataset.el, inside, n ? dark / n : 0, b.width * b.height]);
  }
}
return out;
"""


def test_the_review_page_is_one_self_contained_file(review):
    html = review.html.read_text(encoding="utf-8")
    assert "<link" not in html and "http://" not in html and "https://" not in html and "@import" not in html
    # the tiny model that graded these pages has no calibration: the page says so, and how to calibrate
    assert "<p class='warn' role='alert'>grades NOT calibrated" in html and "uflash calibrate" in html
    assert html.count("<section class='page") == len(review.pages) > 15
    assert html.count("src='data:image/jpeg;base64,") == len(review.pages)  # every page shown
    turned = [p for p in review.pages if (p.stats.get("orientation") or {}).get("turned")]
    assert turned, "cardinal.pdf holds pages scanned turned: the scripted model's probes turn them"


def test_boxes_are_drawn_on_the_print_of_the_page(review, browser):
    rows = browser.execute_script(INK_UNDER_BOXES)
    assert len(rows) >= 15 and len({sec for sec, *_ in rows}) >= len(review.pages) - 3  # blank samples have none
    assert all(inside for _, _, inside, _, _ in rows)
    inked = [share for _, _, _, share, _ in rows]
    assert min(inked) > 0.02 and float(np.median(inked)) > 0.08, sorted(inked)[:5]
    # and a box put elsewhere would not pass: the same boxes moved off the print find (next to) no ink
    moved = browser.execute_script(
        "document.querySelectorAll('svg rect').forEach(r => r.setAttribute('y', 999 - (+r.getAttribute('y')) - "
        "(+r.getAttribute('height')) )); " + INK_UNDER_BOXES)
    browser.refresh()
    assert float(np.median([share for *_, share, _ in moved])) < float(np.median(inked))


def test_a_box_and_its_text_light_up_together(browser):
    from selenium.webdriver.common.action_chains import ActionChains

    browser.execute_script("location.hash=''")
    rect = browser.find_element("css selector", "section.page svg rect")
    key = rect.get_attribute("data-el")
    browser.execute_script("arguments[0].scrollIntoView({block:'center'})", rect)
    ActionChains(browser).move_to_element(rect).perform()
    text = browser.find_element("css selector", f".el[data-el='{key}']")
    assert "hl" in text.get_attribute("class")
    ActionChains(browser).move_to_element(browser.find_element("css selector", "header.top h1")).perform()
    assert "hl" not in text.get_attribute("class")
    browser.execute_script("arguments[0].scrollIntoView({block:'center'})", text)  # clear of the sticky header
    text.click()  # focus from the text side (it is focusable)
    browser.execute_script("arguments[0].focus()", text)
    assert "hl" in rect.get_attribute("class")


def test_the_grade_filter_shows_exactly_that_grade(review, browser):
    grades = sorted(p.stats["quality"]["grade"] for p in review.pages)
    assert len(set(grades)) >= 2, grades
    for g in ("good", "fair", "poor"):
        browser.find_element("css selector", f".bar button[data-grade='{g}']").click()
        shown = _visible(browser)
        assert [x[1] for x in shown] == [g] * grades.count(g)
        assert browser.find_element("id", "shown").text == str(grades.count(g))
        assert browser.find_element("css selector", f".bar button[data-grade='{g}']").get_attribute(
            "aria-pressed") == "true"
    browser.find_element("css selector", ".bar button[data-grade='all']").click()
    assert len(_visible(browser)) == len(review.pages)


def test_the_copy_buttons_copy_the_exact_rerun_commands(review, browser):
    browser.find_element("css selector", ".bar button[data-grade='all']").click()
    by_doc: dict[int, list[int]] = {}
    for p in review.pages:
        by_doc.setdefault(p.document_id, []).append(p.page_index)
    doc, pages = next((d, sorted(v)) for d, v in sorted(by_doc.items()) if len(v) >= 3)
    other = next(d for d in sorted(by_doc) if d != doc)
    prefix = f"uflash --config {review.cfg} rerun --mode lossless"
    for d, i in ((doc, pages[0]), (doc, pages[1]), (doc, pages[-1]), (other, 1)):
        sec = browser.find_element("css selector", f"section.page[data-doc='{d}'][data-page='{i}']")
        box = sec.find_element("css selector", "input.pick")
        browser.execute_script("arguments[0].scrollIntoView({block:'center'})", box)
        box.click()
    browser.find_element("id", "copy-picked").click()
    lines = {doc: [f"{prefix} --doc {doc} --pages {pages[0]}-{pages[1]}",  # one line per run of pages
                   f"{prefix} --doc {doc} --pages {pages[-1]}-{pages[-1]}"],
             other: [f"{prefix} --doc {other} --pages 1-1"]}
    expected = "\n".join(lines[min(doc, other)] + lines[max(doc, other)])  # in the page's order
    assert _clipboard(browser) == expected
    assert browser.find_element("id", "command").text == expected
    assert browser.find_element("id", "npicked").text == "4"
    assert "Copied" in browser.find_element("id", "status").text
    sec = browser.find_element("css selector", f"section.page[data-doc='{other}'][data-page='1']")
    sec.find_element("css selector", "button.copy").click()
    assert _clipboard(browser) == f"{prefix} --doc {other} --pages 1-1"
    assert sec.find_element("css selector", "code.cmd").text == f"{prefix} --doc {other} --pages 1-1"
    browser.find_element("id", "pick-none").click()
    assert browser.find_element("id", "npicked").text == "0"


def test_the_page_is_usable_with_the_keyboard(review, browser, tmp_path, capsys):
    from selenium.webdriver.common.keys import Keys

    browser.refresh()
    body = browser.find_element("tag name", "body")
    body.send_keys("p")  # poor pages only
    poor = [x for x in _visible(browser)]
    assert poor and all(g == "poor" for _, g in poor)
    body.send_keys("j")
    assert browser.switch_to.active_element.get_attribute("id") == poor[0][0]
    browser.switch_to.active_element.send_keys("x")
    first = browser.find_element("id", poor[0][0])
    assert first.find_element("css selector", "input.pick").is_selected()
    browser.switch_to.active_element.send_keys("c")
    assert _clipboard(browser) == (f"uflash --config {review.cfg} rerun --mode lossless --doc "
                                   f"{first.get_attribute('data-doc')} --pages {first.get_attribute('data-page')}-"
                                   f"{first.get_attribute('data-page')}")
    if len(poor) > 1:
        browser.switch_to.active_element.send_keys("j")
        assert browser.switch_to.active_element.get_attribute("id") == poor[1][0]
    browser.switch_to.active_element.send_keys("a")
    assert len(_visible(browser)) == len(review.pages)
    # Tab reaches the controls: the filter buttons first, then the re-run buttons
    from selenium.webdriver.common.action_chains import ActionChains

    browser.execute_script("window.scrollTo(0, 0)")
    ActionChains(browser).click(browser.find_element("css selector", "header.top h1")).send_keys(Keys.TAB).perform()
    assert browser.switch_to.active_element.get_attribute("data-grade") == "all"
    browser.switch_to.active_element.send_keys(Keys.TAB)
    browser.switch_to.active_element.send_keys(Keys.ENTER)  # "good"
    assert all(g == "good" for _, g in _visible(browser))
    body.send_keys("a")
    shot = tmp_path / "review-page.png"
    browser.execute_script("window.scrollTo(0, 0)")
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    with capsys.disabled():
        print(f"\nreview page: {review.html}\nscreenshot of it in headless Chromium: {shot}")
