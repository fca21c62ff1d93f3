"""Page preparation in processes of its own (``worker.prepare_processes``, ingest.pages.pool): the same pages, measures,
model inputs and errors as in the worker's thread, the same texts and grades out of the worker, a killed process
started again, and commands that stop on time with nothing left behind."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from PIL import Image
from sqlalchemy import select

from db.models import Document, Page
from db.session import Database
from engine.loading import load_decoder
from engine.model.load import load_processor
from engine.official import chunk_inputs
from ingest.config import OrientationSettings, load_settings
from ingest.errors import InfrastructureError
from ingest.intake.enqueue import intake_file
from ingest.pages.inputs import model_inputs, turned_inputs
from ingest.pages.orientation import turn
from ingest.pages.pool import PreparationDied, PreparePool, process_count
from ingest.pages.prepare import PageJob, PagesReady, Unrenderable, prepare_pages
from ingest.pages.prepare_process import describe_error, error_from
from ingest.worker.worker import Worker
from tests.conftest import ROOT, make_pdf, text_page, worker_config
from tests.test_orientation import image_pdf
from tests.test_worker import serve_until_done

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ORIENTATION = OrientationSettings()


def turned_pdf(path: Path) -> Path:
    """Three scans: upright, a quarter turn (probed for 90 and 270), upside down (probed for 180)."""
    return image_pdf(path, [text_page(1), turn(text_page(2), 90), turn(text_page(3), 180)])


def job(path: Path, kind: str = "pdf", first: int = 1, last: int = 3, max_page_pixels: int = 150_000_000) -> PageJob:
    return PageJob(str(path), kind, first, last, max_page_pixels, ORIENTATION)


def prepared_in(pool: PreparePool, jobs: list[PageJob], timeout: float = 300) -> list:
    """Each job's result from the pool, in order."""
    results: dict[int, object] = {}
    done = threading.Event()

    def keep(i: int):
        def put(result):
            results[i] = result
            if len(results) == len(jobs):
                done.set()
        return put

    for i, j in enumerate(jobs):
        pool.submit(j, keep(i))
    assert done.wait(timeout), f"{len(results)} of {len(jobs)} jobs came back"
    return [results[i] for i in range(len(jobs))]


def same_pages(a: PagesReady, b: PagesReady) -> None:
    assert [(p.index, p.text_layer, p.image.mode, p.image.size, p.image.tobytes()) for p in a.pages] == \
        [(p.index, p.text_layer, p.image.mode, p.image.size, p.image.tobytes()) for p in b.pages]
    assert (a.ink, a.prints) == (b.ink, b.prints)
    assert set(a.inputs) == set(b.inputs) and all(
        torch.equal(a.inputs[k], b.inputs[k]) if torch.is_tensor(a.inputs[k]) else a.inputs[k] == b.inputs[k]
        for k in a.inputs)
    assert set(a.probe_inputs) == set(b.probe_inputs)
    for key in a.probe_inputs:
        assert torch.equal(a.probe_inputs[key]["pixel_values"], b.probe_inputs[key]["pixel_values"]), key


def test_auto_is_one_fewer_than_the_cores_at_most_eight():
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert process_count("auto") == max(0, min(cores - 1, 8))
    assert (process_count(0), process_count(3)) == (0, 3)


def test_the_processor_prepares_each_page_on_its_own(tiny_model_dir):
    """A page's pixels do not depend on the other pages of the processor's call (so a turned page's probe pixels can
    stand in for it in the chunk's inputs): with the tiny model's processor (256 px, resized) and the demo model's
    (1024 px, resized keeping its shape and padded), over pages of different sizes and shapes."""
    from transformers import AutoProcessor

    from engine.model.load import PageProcessor

    tiny = load_processor(str(tiny_model_dir))
    big = PageProcessor(AutoProcessor.from_pretrained(tiny_model_dir), tiny.bos_token_id)
    big.processor.image_processor.size = {"height": 1024, "width": 1024}
    pages = [text_page(1), turn(text_page(2), 90), text_page(3).resize((500, 380)), Image.new("RGB", (1024, 800),
                                                                                             "white")]
    ink = [None, None, None, None]
    for processor in (tiny, big):
        together = chunk_inputs(processor, pages, "multi")
        for i, page in enumerate(pages):
            assert torch.equal(chunk_inputs(processor, [page], "single")["pixel_values"][0],
                               together["pixel_values"][i]), i
        # a chunk whose pages 2 and 3 are turned after their probes: as if the processor had read them turned
        from ingest.pages.orientation import InkMeasures

        ink = [None, InkMeasures(0.4, None, (90, 270)), InkMeasures(2.0, -0.9, (180,)), None]
        inputs, probes = model_inputs(processor, pages, ink)
        assert set(probes) == {(1, 0), (1, 90), (1, 270), (2, 0), (2, 180)}
        swapped = turned_inputs(inputs, probes, {1: 270, 2: 180, 3: 0})
        direct = chunk_inputs(processor, [pages[0], turn(pages[1], 270), turn(pages[2], 180), pages[3]], "multi")
        assert torch.equal(swapped["pixel_values"], direct["pixel_values"])
        assert torch.equal(swapped["input_ids"], direct["input_ids"])
        assert torch.equal(inputs["pixel_values"], together["pixel_values"])  # the original is left as it was
        assert turned_inputs(inputs, probes, {0: 90}) is None  # no probe inputs for that page: built at submit
        assert turned_inputs(inputs, probes, {}) is inputs


def test_processes_prepare_what_the_worker_thread_prepares(tmp_path, tiny_model_dir):
    """Pages rendered, measured and made into the model's inputs in two processes equal those of the worker's own
    thread, bit for bit: a PDF with pages turned (their probes' inputs too), a TIFF, a PNG."""
    pdf = turned_pdf(tmp_path / "turned.pdf")
    tiff = tmp_path / "scan.tif"
    text_page(4).save(tiff, save_all=True, append_images=[text_page(5), turn(text_page(6), 270)])
    png = tmp_path / "one.png"
    text_page(7).convert("L").save(png)
    jobs = [job(pdf), job(tiff, "tiff", 1, 3), job(png, "png", 1, 1), job(pdf, first=2, last=2)]
    processor = load_processor(str(tiny_model_dir))
    with PreparePool(2, str(tiny_model_dir)) as pool:
        got = prepared_in(pool, jobs)
        assert pool.timing["jobs"] == 4 and pool.timing["pages"] == 8 and pool.timing["restarts"] == 0
    for j, there in zip(jobs, got):
        assert isinstance(there, PagesReady), there
        same_pages(there, prepare_pages(j, processor))
    assert set(got[0].probe_inputs) == {(1, 0), (1, 90), (1, 270), (2, 0), (2, 180)}
    assert got[3].probe_inputs[(0, 0)] is got[3].inputs  # one page: its probe as it is reads the chunk's inputs


def test_a_bad_file_fails_with_the_reason_the_worker_thread_gives(tmp_path, tiny_model_dir):
    """A file that cannot be rendered comes back as the same ``Unrenderable``, word for word, as in the worker's
    thread; errors that are not the file's come back as the same types."""
    broken = tmp_path / "broken.pdf"
    broken.write_bytes(b"%PDF-1.4\n" + os.urandom(2000))
    big = tmp_path / "big.png"
    Image.new("RGB", (400, 300), "white").save(big)
    jobs = [job(broken), job(big, "png", 1, 1, max_page_pixels=1000)]
    with PreparePool(1, str(tiny_model_dir)) as pool:
        got = prepared_in(pool, jobs)
    for j, there in zip(jobs, got):
        here = prepare_pages(j)
        assert isinstance(here, Unrenderable) and there == here, (there, here)
    assert "page 1 is 400x300 pixels, over 1000" in got[1].reason
    full = OSError(errno.ENOSPC, "No space left on device", "/outbox/x")
    back = error_from(describe_error(full))
    assert isinstance(back, InfrastructureError) and "No space left on device" in str(back)
    back = error_from(describe_error(ValueError("a bug")))
    assert type(back) is ValueError and str(back) == "a bug"


def kill_when_busy(pool: PreparePool, killed: tuple[int, ...] = (), timeout: float = 120) -> int:
    """Kill (SIGKILL) a process once it is preparing a job (not one of those ``killed`` already); its pid."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = [pid for pid, working in pool.pids().items() if working and pid not in killed]
        if busy:
            os.kill(busy[0], signal.SIGKILL)
            return busy[0]
        time.sleep(0.01)
    raise AssertionError("no process was seen preparing a job")


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
def test_a_killed_process_is_started_again_and_its_pages_prepared_again(tmp_path, tiny_model_dir):
    """A process killed while it prepares a chunk: a new one starts and prepares the chunk again (the same pages);
    killed twice on the same chunk, the chunk comes back ``PreparationDied`` with the reason, and the pool goes on."""
    from ingest.synth.documents import make_document

    data, _ = make_document(880_010, 24, scan=True)  # seconds of work: long enough to be killed in the middle
    pdf = tmp_path / "long.pdf"
    pdf.write_bytes(data)
    long_job = job(pdf, last=24)
    with PreparePool(1, str(tiny_model_dir)) as pool:
        results: list = []
        came = threading.Event()
        pool.submit(long_job, lambda r: (results.append(r), came.set()))
        first = kill_when_busy(pool)
        assert came.wait(600)
        assert isinstance(results[0], PagesReady) and len(results[0].pages) == 24
        assert pool.timing["restarts"] == 1 and first not in pool.pids()
        results.clear()
        came.clear()
        pool.submit(long_job, lambda r: (results.append(r), came.set()))
        second = kill_when_busy(pool, (first,))
        kill_when_busy(pool, (first, second))
        assert came.wait(600)
        assert isinstance(results[0], PreparationDied)
        assert "the page preparation process died (killed by SIGKILL) twice" in str(results[0])
        (after,) = prepared_in(pool, [job(turned_pdf(tmp_path / "turned.pdf"))])
        assert isinstance(after, PagesReady) and pool.broken is None


def _texts(db: Database) -> dict:
    with db.session() as ss:
        rows = ss.execute(select(Document.original_name, Page.page_index, Page.text, Page.boxes, Page.stats)
                          .join(Document, Document.id == Page.document_id)).all()
    return {(name, i): (text, boxes, stats["quality"]["grade"], (stats.get("orientation") or {}).get("turned"))
            for name, i, text, boxes, stats in rows}


def test_the_worker_reads_the_same_with_and_without_preparation_processes(tmp_path, tiny_model_dir):
    """The same documents through the worker with pages prepared in its own thread (``prepare_processes = 0``) and
    in two processes: the same page texts, boxes, grades and turns, and the same document.md. Pages scanned turned
    are probed and turned (the probes' floor set low, so that the tiny model turns some): their inputs come from the
    processes' probe inputs, against the processor run on the worker's thread."""
    out = {}
    for processes in (0, 2):
        folder = tmp_path / f"p{processes}"
        folder.mkdir()
        cfg = worker_config(folder, tiny_model_dir, engine={"mode": "lossless", "max_batch": 2},
                            orientation={"min_logprob": -100.0, "min_gain": 0.0},
                            worker={"prepare_processes": processes})
        s = load_settings(cfg)
        s.ensure_folders()
        db = Database(s.database_url)
        for f in (turned_pdf(s.inbox / "turned.pdf"), make_pdf(s.inbox / "letter.pdf", ["Dear archivist,",
                                                                                         "the register.", "Yours."])):
            intake_file(db, s, f)
        decoder = load_decoder(str(tiny_model_dir), "cpu", "float32", "lossless", max_batch=2)
        worker = Worker(s, db, lambda d=decoder: d)
        serve_until_done(worker, db, timeout=600)
        if processes:
            assert worker.pool.timing["jobs"] >= 2 and worker.pool.timing["restarts"] == 0
            assert worker.pool.pids() == {}  # closed
        else:
            assert worker.pool is None
        out[processes] = (_texts(db), {d.name: (d / "document.md").read_text(encoding="utf-8")
                                       for d in s.outbox.iterdir() if (d / "document.md").is_file()})
        db.dispose()
    assert out[0] == out[2]
    pages, documents = out[2]
    assert len(pages) == 6 and set(documents) == {"turned", "letter"}
    assert any(turned for *_, turned in pages.values()), "no page was turned: the turned inputs went untested"


# -- commands that stop on time -----------------------------------------------------------------------------------
def start(cfg: Path, *args: str) -> subprocess.Popen:
    """``uflash --config CFG ARGS`` in a session of its own; ``proc.lines``: (seconds since start, line)."""
    proc = subprocess.Popen([sys.executable, "-m", "ingest.commands.cli", "--config", str(cfg), *args], cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    t0, proc.lines = time.monotonic(), []
    proc.reader = threading.Thread(target=lambda: proc.lines.extend(
        (time.monotonic() - t0, line) for line in iter(proc.stdout.readline, "")), daemon=True)
    proc.reader.start()
    proc.t0 = t0
    return proc


def preparation_pids(logs: Path) -> set[int]:
    text = (logs / "uflash.log").read_text(encoding="utf-8")
    return {int(line.rsplit("process ", 1)[1].split()[0]) for line in text.splitlines()
            if "page preparation: process" in line and line.rstrip().endswith("started")}


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie not yet reaped by init is gone too
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def _shutdown_config(tmp_path: Path, tiny_model_dir: Path) -> Path:
    return worker_config(tmp_path, tiny_model_dir, engine={"mode": "lossless", "max_batch": 2},
                         worker={"prepare_processes": 2})


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX process checks")
def test_uflash_run_with_preparation_processes_exits_on_time(tmp_path, tiny_model_dir):
    """`uflash run` of three small PDFs with two preparation processes ends 0, within seconds of its last line, and
    leaves no preparation process behind."""
    cfg = _shutdown_config(tmp_path, tiny_model_dir)
    s = load_settings(cfg)
    s.ensure_folders()
    files = [make_pdf(s.inbox / f"d{i}.pdf", [f"Document {i}, page {p}." for p in range(1, 3)]) for i in range(3)]
    proc = start(cfg, "run", *map(str, files))
    try:
        code = proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("uflash run did not end:\n" + "".join(line for _, line in proc.lines)) from None
    ended = time.monotonic() - proc.t0
    proc.reader.join(timeout=10)
    out = "".join(line for _, line in proc.lines)
    assert code == 0, out
    assert out.count("done    d") == 3 and "page preparation: 2 processes" in out
    last = max(t for t, line in proc.lines if line.startswith("report "))
    assert ended - last < 15, f"exited {ended - last:.1f} s after its report"
    pids = preparation_pids(s.logs)
    assert len(pids) == 2 and all(gone(p) for p in pids), pids


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_uflash_watch_with_preparation_processes_stops_on_time(tmp_path, tiny_model_dir, how):
    """`uflash watch` with two preparation processes stops within seconds, exit 0, and leaves none of them behind:
    on SIGTERM once its documents are done, and on Ctrl+C (SIGINT to the whole process group, the preparation
    processes included) while it is decoding; what it stopped before is decoded by the next run."""
    cfg = _shutdown_config(tmp_path, tiny_model_dir)
    s = load_settings(cfg)
    s.ensure_folders()
    proc = start(cfg, "watch")
    docs = 2 if how == "sigterm" else 4
    for i in range(docs):
        make_pdf(s.inbox / f"w{i}.pdf", [f"Watched {i}, page {p}." for p in range(1, 4)])
    db = Database(s.database_url)

    def done() -> int:
        with db.session() as ss:
            return len(ss.scalars(select(Document.id).where(Document.status == "done")).all())

    deadline = time.monotonic() + 600
    while done() < (docs if how == "sigterm" else 1) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert proc.poll() is None, "".join(line for _, line in proc.lines)
    sent = time.monotonic()
    if how == "sigterm":
        os.kill(proc.pid, signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("uflash watch did not stop:\n" + "".join(line for _, line in proc.lines)) from None
    took = time.monotonic() - sent
    proc.reader.join(timeout=10)
    out = "".join(line for _, line in proc.lines)
    assert code == 0, out
    assert took < 60, f"took {took:.1f} s to stop"
    assert "Traceback" not in out, out
    pids = preparation_pids(s.logs)
    assert len(pids) >= 2 and all(gone(p) for p in pids), pids
    r = subprocess.run([sys.executable, "-m", "ingest.commands.cli", "--config", str(cfg), "run"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert done() == docs
    db.dispose()
