"""`uflash review` (ingest.review.server) as a real server process on a finished run, driven by a real headless
Chromium (Selenium) and by plain HTTP requests: a word corrected on page 2 is saved as a person's reading (the model's
kept), shown after a reload and carried by every output (ALTO valid against the schema, document.pdf still PDF/A);
undo restores the model's reading; a page marked checked is recorded; a picked page's re-run is queued and runs; the
report and `uflash diff --corrections` say what a person did. Requests without the token, from another origin or with
path-like identifiers are refused, and the server listens on 127.0.0.1.

The run is the real worker (rendering, ledger, grading, outputs, archiving) over a 3-page scan, with a scripted model
that reads each page as its print (two blocks: a title and a text), so that a correction changes a known word."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from types import SimpleNamespace

import numpy as np
import pytest
from sqlalchemy import select

from db.models import Document, Page, PageReview, Run
from db.session import Database
from engine.chunk_output import assemble
from engine.official import DecodeResult
from ingest.config import load_settings
from ingest.intake.enqueue import intake_file
from ingest.worker.worker import Worker
from tests.conftest import (
    DEMO,
    ROOT,
    assert_pdfa_2b,
    headless_chromium,
    make_pdf,
    needs_demo,
    serve_until,
    wait_until,
    worker_config,
)

pytestmark = [needs_demo, pytest.mark.xdist_group("review_server")]

PAGES = [("Register of deeds", "Entry one, 1851. The parish record."),
         ("Second register", "Entry two: a deed of sale, 1852."),
         ("Index", "Entry three, the index of names.")]
SCHEMA = ROOT.parent / "shared" / "schemas" / "alto-4-4.xsd"


def _small(image) -> np.ndarray:
    return np.asarray(image.convert("L").resize((48, 64)), dtype=np.float32)


class PrintReader:
    """A scripted model: each page is read as its print, a title block and a text block with the model's boxes; the
    page is known by its image (the nearest of the PDF's pages rendered beforehand)."""

    mode, model_name, device = "lossless", "print-reader", "cpu"

    def __init__(self, refs: list[np.ndarray]):
        from transformers import AutoTokenizer

        self.loaded = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(str(DEMO)))
        self.refs = refs

    def describe(self):
        return {}

    def free_memory(self):
        pass

    def decode(self, images, context_limit, max_new_tokens=None, **hints):
        tok = self.loaded.tokenizer
        ids, text = [], ""
        for im in images:
            title, body = PAGES[int(np.argmin([np.abs(_small(im) - r).mean() for r in self.refs]))]
            piece = ("<PAGE>" if len(images) > 1 else "") + \
                f"<|det|>title [60, 50, 940, 80]<|/det|>{title}\n<|det|>text [60, 90, 940, 160]<|/det|>{body}"
            ids += tok(piece, add_special_tokens=False)["input_ids"]
            text += piece
        if max_new_tokens is not None:
            ids = ids[:max_new_tokens]
        res = DecodeResult(prompt_ids=[0] * 10, output_ids=ids, finish_reason="eos", seconds=0.01, text=text,
                           prompt_kind="multi" if len(images) > 1 else "single", n_pages=len(images),
                           logprobs=[-0.05] * len(ids))
        return assemble(res, len(images), hit_context=False)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model_dir):
    """One finished run of deeds.tiff (a 3-page scan) on a SQLite ledger, and `uflash review` serving it."""
    from ingest.pages.render import render_pages

    root = tmp_path_factory.mktemp("review-server")
    cfg = worker_config(root, tiny_model_dir, engine={"max_pages_per_chunk": 3, "max_tokens_per_page": 60},
                        worker={"prepare_processes": 0})  # pages prepared in the worker's thread: no process to start
    s = load_settings(cfg)
    s.ensure_folders()
    db = Database(s.database_url)
    pdf = make_pdf(root / "deeds.pdf", [f"{t}\n{b}" for t, b in PAGES])
    scans = [p.image.convert("L") for p in render_pages(pdf, "pdf", 1, 3)]  # a scan: no text layer of its own
    scans[0].save(s.inbox / "deeds.tiff", save_all=True, append_images=scans[1:], dpi=(120, 120))
    refs = [_small(p.image) for p in render_pages(s.inbox / "deeds.tiff", "tiff", 1, 3)]
    doc_id = intake_file(db, s, s.inbox / "deeds.tiff").document_id
    worker = Worker(s, db, lambda: PrintReader(refs))

    def done():
        with db.session() as ss:
            return ss.get(Document, doc_id).status == "done"

    serve_until(worker, done, timeout=300)
    run_id = worker.close_run()
    proc = subprocess.Popen([sys.executable, "-m", "ingest.commands.cli", "--config", str(cfg), "review"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=(root / "review.log").open("w"), text=True)
    line = proc.stdout.readline()
    m = re.match(r"review  (http://([\d.]+):(\d+)/)\?token=(\S+)", line)
    assert m, line + (root / "review.log").read_text()
    yield SimpleNamespace(cfg=cfg, settings=s, db=db, doc_id=doc_id, run_id=run_id, folder=s.outbox / "deeds",
                          proc=proc, base=m.group(1), host=m.group(2), port=int(m.group(3)), token=m.group(4))
    proc.send_signal(signal.SIGINT)  # as Ctrl+C: the server stops (a re-run in hand would finish first)
    try:
        assert proc.wait(120) == 0, (root / "review.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        db.dispose()


def _request(f, path: str, body=None, token: str | None = "", origin: str | None = "", host: str | None = None,
             content_type: str = "application/json") -> tuple[int, dict | str]:
    """A request to the server with the headers asked for ("" = the right value, None = left out)."""
    headers = {"Content-Type": content_type}
    if token is not None:
        headers["X-Uflash-Token"] = token or f.token
    if origin is not None:
        headers["Origin"] = origin or f"http://{f.host}:{f.port}"
    if host is not None:
        headers["Host"] = host
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f.base.rstrip("/") + path, data=data, headers=headers,
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read().decode()
            return r.status, json.loads(raw) if r.headers.get("content-type", "").startswith("application/json") \
                else raw
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _model_page(f, index: int) -> Page:
    with f.db.session() as s:
        return s.scalar(select(Page).where(Page.document_id == f.doc_id, Page.page_index == index)
                        .order_by(Page.id.desc()).limit(1))


def _reviews(f) -> list[PageReview]:
    with f.db.session() as s:
        return list(s.scalars(select(PageReview).order_by(PageReview.id)))


def _outputs(f) -> tuple[str, dict, bytes, str]:
    import pymupdf

    with pymupdf.open(f.folder / "document.pdf") as pdf:
        pdf_text = pdf[1].get_text()
    return ((f.folder / "document.md").read_text(encoding="utf-8"),
            json.loads((f.folder / "document.json").read_text(encoding="utf-8")),
            (f.folder / "alto" / "0002.xml").read_bytes(), pdf_text)


def _assert_alto_valid(xml: bytes) -> None:
    from lxml import etree

    schema = etree.XMLSchema(etree.parse(str(SCHEMA)))
    doc = etree.fromstring(xml)
    assert schema.validate(doc), schema.error_log


def test_the_server_listens_on_127_0_0_1_only(finished):
    import psutil

    assert finished.host == "127.0.0.1"
    listening = [c for c in psutil.Process(finished.proc.pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    assert [c.laddr.ip for c in listening] == ["127.0.0.1"] and listening[0].laddr.port == finished.port


def test_requests_without_the_token_from_another_origin_or_with_path_like_ids_are_refused(finished):
    f = finished
    page = _model_page(f, 2)
    fix = {"blocks": {"1": "Entry two: a deed of sale, 1853."}}
    url = f"/api/pages/{page.id}/correction"
    before = _outputs(f)
    assert _request(f, "/", token=None)[0] == 403  # the page itself needs the token (?token=)
    assert _request(f, "/?token=wrong")[0] == 403
    assert _request(f, url, fix, token=None)[0] == 403
    assert _request(f, url, fix, token="not-the-token")[0] == 403
    assert _request(f, url, fix, origin="http://evil.example")[0] == 403
    assert _request(f, url, fix, origin=f"http://localhost.evil.example:{f.port}")[0] == 403
    assert _request(f, url, fix, origin=None)[0] == 403
    assert _request(f, url, fix, host=f"evil.example:{f.port}")[0] == 403  # DNS rebinding
    assert _request(f, url, fix, content_type="text/plain")[0] == 415  # a form post of another site
    for path in (f"/api/pages/..%2F..%2F{f.folder.name}%2Fdocument.md/correction", "/api/pages/%2Fetc%2Fpasswd/undo",
                 f"/api/pages/{page.id}%2F..%2F1/checked", "/api/pages/..\\..\\x/undo", f"/api/pages/{page.id}.md/undo"):
        status, _ = _request(f, path, fix)
        assert 400 <= status < 500, path
    status, answer = _request(f, "/api/reruns", {"pages": ["../deeds.pdf"]})
    assert status == 400 and "page ids" in answer
    assert _reviews(f) == [] and _outputs(f) == before  # nothing recorded, no output touched
    status, html = _request(f, f"/?token={f.token}", token=None, origin=None)
    assert status == 200 and "section class='page" in html


@pytest.fixture(scope="module")
def browser(finished):
    driver = headless_chromium()
    driver.get(f"{finished.base}?token={finished.token}")
    yield driver
    driver.quit()


def _section(browser, index: int):
    sec = browser.find_element("css selector", f"section.page[data-page='{index}']")
    browser.execute_script("arguments[0].scrollIntoView({block:'start'})", sec)
    return sec


def _click(browser, element) -> None:
    browser.execute_script("arguments[0].scrollIntoView({block:'center'})", element)  # clear of the sticky header
    element.click()


def _status(browser, wanted: str) -> str:
    assert wait_until(lambda: wanted in browser.find_element("id", "status").text, 120), \
        browser.find_element("id", "status").text
    return browser.find_element("id", "status").text


def test_a_correction_is_saved_shown_after_a_reload_kept_beside_the_models_reading_and_in_the_outputs(
        finished, browser):
    f = finished
    model = _model_page(f, 2)
    sec = _section(browser, 2)
    _click(browser, sec.find_element("css selector", "button.edit"))
    block = sec.find_element("css selector", ".cols .text .el[data-n='1'] .words")
    assert block.get_attribute("contenteditable") == "true" and "1852" in block.text
    browser.execute_script("arguments[0].innerText = arguments[0].innerText.replace('1852', '1853')", block)
    _click(browser, sec.find_element("css selector", "button.save"))
    _status(browser, "saved page 2")

    browser.refresh()  # the correction is what the page shows now
    sec = _section(browser, 2)
    assert "1853" in sec.find_element("css selector", ".cols .text").text
    assert "1852" not in sec.find_element("css selector", ".cols .text").text
    assert re.match(r"corrected \(model CER 0\.0\d+\)", sec.find_element("css selector", ".state.corrected").text)
    [rev] = _reviews(f)  # a person's reading; the model's reading untouched
    assert (rev.kind, rev.page_id, rev.page_index, rev.by) == ("corrected", model.id, 2, "person")
    assert rev.text == model.text.replace("1852", "1853") and rev.diff == [["replace", "1852.", "1853."]]
    assert 0 < rev.cer < 0.05 and _model_page(f, 2).text == model.text
    assert "<|det|>text [60, 90, 940, 160]<|/det|>" in rev.text  # the block structure is kept

    md, doc, alto, pdf_text = _outputs(f)
    assert "<!-- page 2 (corrected by a person) -->" in md and "1853" in md and "1852" not in md
    page2 = doc["pages"][1]
    assert "1853" in page2["text"] and page2["stats"]["correction"]["model_text"] == model.text
    _assert_alto_valid(alto)
    assert b'CONTENT="1853."' in alto and re.search(rb'CONTENT="1853\."[^>]*WC="1"', alto)
    assert b"contentModification" in alto and b'CS="true"' in alto
    assert "1853" in pdf_text and "1852" not in pdf_text
    assert_pdfa_2b(f.folder / "document.pdf")

    _click(browser, sec.find_element("css selector", "input.checked"))  # marked checked
    _status(browser, "page 2 checked")
    assert [r.kind for r in _reviews(f)] == ["corrected", "checked"]

    _click(browser, sec.find_element("css selector", "button.undo"))  # back to the model's reading
    _status(browser, "back to the model's reading")
    assert "1852" in sec.find_element("css selector", ".cols .text").text
    assert [r.kind for r in _reviews(f)] == ["corrected", "checked", "undone"]
    md, doc, alto, _ = _outputs(f)
    assert "1852" in md and "1853" not in md and "correction" not in doc["pages"][1]["stats"]
    assert b'CONTENT="1852."' in alto and b"contentModification" not in alto
    _assert_alto_valid(alto)


def _reruns(browser) -> list[tuple[str, str]]:
    """(state, text) of each re-run the page lists (read at once: the page renews the list every 2 s)."""
    return [tuple(x) for x in browser.execute_script(
        "return [].slice.call(document.querySelectorAll('#reruns li')).map(li => [li.dataset.state, li.textContent])")]


def test_a_picked_pages_rerun_is_queued_and_runs(finished, browser):
    f = finished
    sec = _section(browser, 2)
    _click(browser, sec.find_element("css selector", "input.pick"))
    _click(browser, browser.find_element("id", "rerun-picked"))
    assert "re-run queued: document" in _status(browser, "re-run queued")
    [(state, text)] = _reruns(browser)
    assert state in ("queued", "running", "done") and f"document {f.doc_id} page 2" in text
    assert wait_until(lambda: _reruns(browser)[0][0] in ("done", "failed"), 180)
    [(state, text)] = _reruns(browser)
    assert state == "done", text
    with f.db.session() as s:
        rerun = s.scalars(select(Run).order_by(Run.id.desc())).first()
        pages = s.scalars(select(Page).where(Page.run_id == rerun.id)).all()
    assert rerun.id != f.run_id and rerun.mode == "lossless" and rerun.settings["rerun_of"] == [f.run_id]
    assert [(p.document_id, p.page_index) for p in pages] == [(f.doc_id, 2)] and f"run {rerun.id}" in text
    browser.refresh()  # still the run being reviewed, not the re-run's
    assert len(browser.find_elements("css selector", "section.page")) == 3
    assert f"uflash run {f.run_id}" in browser.find_element("css selector", "header.top h1").text


def test_report_and_diff_say_which_pages_a_person_corrected_and_checked(finished, capsys):
    from ingest.commands.cli import main
    from ingest.review.report import collect_report, format_report

    f = finished
    page = _model_page(f, 3)  # through the API, as the page sends it
    status, answer = _request(f, f"/api/pages/{page.id}/correction",
                              {"blocks": {"0": "Index of deeds", "1": "Entry three, the index of names."}})
    assert status == 200 and answer["corrected"] and answer["recorded"] == "corrected", answer
    assert _request(f, f"/api/pages/{page.id}/checked", {"checked": True})[1]["checked"] is True
    status, refused = _request(f, f"/api/pages/{page.id}/correction", {"blocks": {"1": "<|det|>x [1, 1, 2, 2]<|/det|>"}})
    assert status == 400 and "markup" in refused
    rep = collect_report(f.db, f.run_id)
    by_index = {p["index"]: p for p in rep["documents"][0]["pages"]}
    assert by_index[3]["corrected"] and by_index[3]["checked"] and by_index[3]["cer_vs_correction"] > 0
    assert not by_index[2]["corrected"] and by_index[2]["checked"] and by_index[1]["cer_vs_correction"] is None
    table = format_report(rep)
    assert re.search(r"^\s+3\s+\w+.*corrected \(CER 0\.\d{4}\), checked$", table, re.M), table
    assert main(["--config", str(f.cfg), "diff", "--corrections", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [(r["page"], r["changes"]) for r in d["pages"]] == [(3, [["insert", "", "of deeds"]])]
    assert d["pages"][0]["cer"] == pytest.approx(answer["cer"], abs=1e-6)
    assert main(["--config", str(f.cfg), "diff", "--corrections"]) == 0
    assert "1 corrected page: the model's reading against the correction" in capsys.readouterr().out


def test_corrected_pages_are_exported_as_training_pairs(finished, tmp_path, capsys):
    from ingest.commands.cli import main
    from ingest.review.export import read_pairs

    f = finished
    assert main(["--config", str(f.cfg), "export-corrections", "--out", str(tmp_path / "pairs")]) == 0
    assert "exported 1 corrected pages" in capsys.readouterr().out
    [line] = [json.loads(x) for x in (tmp_path / "pairs" / "pairs.jsonl").read_text(encoding="utf-8").splitlines()]
    [rev] = [r for r in _reviews(f) if r.kind == "corrected" and r.page_index == 3]
    assert (line["document_id"], line["page"], line["text"], line["document"]) == (f.doc_id, 3, rev.text, "deeds.tiff")
    images, texts = read_pairs(tmp_path / "pairs")
    page = _model_page(f, 3)
    assert texts == [rev.text] and list(images[0].size) == page.stats["image_size"]  # the page as the model read it
