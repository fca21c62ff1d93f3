"""Shared test helpers: real config files, real ledgers (a SQLite file, or a database on a real PostgreSQL server),
real PDFs and images made with pymupdf/PIL."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Without CUDA, Triton kernels (engine.kernels.invariant) run under Triton's interpreter; it must be on before
# anything imports triton.language (transformers' generate() does).
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests in parallel (pytest-xdist, README's `-n 2`): every worker, and every process a test starts (uflash, its page
# preparation processes), computes on one thread. Two workers running two OpenMP threads each on two cores spin
# against each other: a demo-model test took 279 s instead of 18 s, for twice the processor time.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT.parent / "shared" / "samples" / "real"
DEMO = ROOT / "models" / "demo"  # the shipped demo model (with its block drafter)
HAS_DEMO = all((DEMO / f).is_file() for f in ("config.json", "tokenizer.json", "drafter/drafter_config.json"))
needs_demo = pytest.mark.skipif(not HAS_DEMO, reason="models/demo is not in this checkout")


# The quick subset, `python -m pytest -m "not slow"` (README), leaves out these modules: each runs uflash processes end
# to end, decodes through the whole pipeline or the batched engine, trains, makes PDF/As, or drives a browser (together
# most of the suite's time).
SLOW_MODULES = frozenset({
    "test_archival", "test_batch_engine", "test_batch_worker", "test_bench_pipeline", "test_block_drafter",
    "test_calibration", "test_crashes", "test_demo_model", "test_engine_admission", "test_engine_exact",
    "test_exactness_windows", "test_finish_queue", "test_gpu_scripts", "test_grades_ladder", "test_grading",
    "test_grading_demo", "test_infrastructure", "test_ocrmypdf_plugin", "test_orientation", "test_pdfa",
    "test_postgres_pipeline", "test_prepare_pool", "test_review", "test_review_page", "test_review_server",
    "test_standin", "test_calibrate_corrections", "test_step_graphs", "test_train_demo", "test_watch", "test_worker",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.stem in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from threads, and a busy 2-core box makes OpenMP threads spin
    (modules use it with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def write_config(folder: Path, **sections: dict) -> Path:
    """A config.toml in ``folder`` with var/ folders inside it, plus the given section overrides."""
    base = {
        "folders": {"inbox": "inbox", "outbox": "outbox", "archive": "archive", "failed": "failed", "logs": "logs"},
        "database": {"url": SQLITE_URL},
        "watch": {"settle_seconds": 1.0, "rescan_seconds": 2.0},
        "worker": {"lease_seconds": 5.0, "heartbeat_seconds": 1.0, "backoff_seconds": 0.0, "poll_seconds": 0.2},
    }
    for k, v in sections.items():
        base.setdefault(k, {}).update(v)
    lines = []
    for sec, kv in base.items():
        lines.append(f"[{sec}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in kv.items()]
    cfg = folder / "config.toml"
    cfg.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return cfg


SQLITE_URL = "sqlite:///uflash.db"  # write_config's default: a file beside the config
_databases = itertools.count(1)


@pytest.fixture(scope="session")
def pg_server():
    """One throw-away PostgreSQL server for the whole session (tests/pg_server.py); each test gets its own database
    on it (``ledger_url``)."""
    from tests.pg_server import start_postgres

    server = start_postgres(Path(tempfile.mkdtemp(prefix="uflash-pg-")), max_connections=200)
    if server is None:
        pytest.skip("PostgreSQL server binaries not installed (.ci/run installs them)")
    yield server
    server.stop()
    shutil.rmtree(server.folder, ignore_errors=True)


def fresh_pg_database(server) -> tuple[str, str]:  # noqa: ANN001
    """(name, URL) of a new empty database on ``server``."""
    name = f"uflash_test_{os.getpid()}_{next(_databases)}"
    return name, server.create_database(name)


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request) -> str:
    """The ledger a test runs on, for ``database.url``: a SQLite file beside the config, or a fresh database on the
    session's PostgreSQL server (dropped after the test)."""
    if request.param == "sqlite":
        yield SQLITE_URL
        return
    server = request.getfixturevalue("pg_server")
    name, url = fresh_pg_database(server)
    yield url
    server.drop_database(name)


@pytest.fixture
def config_path(tmp_path: Path, ledger_url: str) -> Path:
    return write_config(tmp_path, database={"url": ledger_url})


@pytest.fixture
def settings(config_path: Path):
    from ingest.config import load_settings

    s = load_settings(config_path)
    s.ensure_folders()
    return s


@pytest.fixture
def db(settings):
    from db.session import Database

    d = Database(settings.database_url)
    yield d
    d.dispose()


def make_pdf(path: Path, pages: list[str] | int = 1, size: tuple[float, float] = (595, 842)) -> Path:
    """A real PDF with a text layer: one page per string (or n numbered pages)."""
    import pymupdf

    texts = [f"Page {i + 1} of {path.stem}" for i in range(pages)] if isinstance(pages, int) else pages
    doc = pymupdf.open()
    for t in texts:
        page = doc.new_page(width=size[0], height=size[1])
        page.insert_textbox(pymupdf.Rect(50, 50, size[0] - 50, size[1] - 50), t, fontsize=14)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc.save(path)
    doc.close()
    return path


def uflash(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the real ``uflash`` command in a subprocess."""
    e = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "ingest.commands.cli", *args], cwd=cwd or ROOT, env=e,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random-weight Unlimited-OCR saved with its processor (R-SWA window 8), built once per session."""
    from engine.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-shared") / "model", sliding_window=8, seed=0)


def headless_chromium():
    """A headless Chromium driven by Selenium (the review page tests), or the test skipped where Chromium or its driver
    is not installed."""
    if not shutil.which("chromium") or not shutil.which("chromedriver"):
        pytest.skip("chromium and chromedriver are not installed (CI installs them: apt-get install chromium "
                    "chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(arg)
    options.binary_location = shutil.which("chromium")
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)


def worker_config(folder: Path, model_dir: Path, **sections: dict) -> Path:
    """A config for worker tests: the tiny model on the CPU, small chunks, short outputs, one chunk decoding at a time
    (the batched worker's tests set ``engine.max_batch``), pages prepared on the worker's own thread: a preparation
    process costs a process start and its imports, seconds on a 2-core machine, in every command a test runs. Tests of
    kills and signals, and of the preparation processes, ask for ``worker.prepare_processes = 1`` (one chunk claimed
    ahead of the free rows, whatever the machine's cores); test_prepare_pool shows the same pages out of either."""
    base = {"model": {"path": str(model_dir), "device": "cpu", "dtype": "float32"},
            "engine": {"max_pages_per_chunk": 4, "max_tokens_per_page": 30, "max_batch": 1},
            "worker": {"prepare_processes": 0}}
    for k, v in sections.items():
        base.setdefault(k, {}).update(v)
    for sec in base.values():  # None means "leave the key out" (TOML has no null)
        for key in [k for k, v in sec.items() if v is None]:
            del sec[key]
    return write_config(folder, **base)


def text_page(i: int):
    """A small white page with 8 lines of text that differ by page number (for engine tests)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (300, 420), "white")
    draw = ImageDraw.Draw(image)
    for line in range(8):
        draw.text((12, 12 + 48 * line + 5 * i), f"page {i} line {line} text {i * line}", fill="black")
    return image


def serve_until(worker, until, timeout: float = 300) -> None:
    """Run ``worker.serve`` until ``until()`` holds; fail the test if that takes longer than ``timeout``."""
    import threading

    stop = threading.Event()
    timer = threading.Timer(timeout, stop.set)
    timer.start()
    try:
        worker.serve(stop, until=until)
    finally:
        timer.cancel()
        worker.close()  # its page-preparation processes, if it started any
    assert not stop.is_set(), "timed out"


def probed_samples():
    """(path, Probed) of every real sample file the intake accepts (../shared/samples/real)."""
    from ingest.errors import InputRejected
    from ingest.intake.probe import probe_file

    for path in sorted(SAMPLES.iterdir()):
        try:
            yield path, probe_file(path, 150_000_000)
        except InputRejected:
            continue


def wait_until(pred, timeout: float) -> bool:
    """Poll ``pred()`` every 0.25 s until it holds (True) or ``timeout`` seconds pass (False)."""
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.25)
    return False


def assert_pdfa_2b(path: Path) -> None:
    """pikepdf's PDF/A validator approves the file, OCRmyPDF finds its PDF/A-2b claim, every font is embedded."""
    import pikepdf  # here, not at the top: the engine's tests run where no PDF library is installed (a GPU machine)
    from ocrmypdf.pdfa import file_claims_pdfa
    from pikepdf.pdfa import validate_written

    report = validate_written(path, "2b")
    assert report.passed, report.summary()
    assert file_claims_pdfa(path) == {"pass": True, "output": "pdfa", "conformance": "PDF/A-2b"}
    with pikepdf.open(path) as pdf:
        assert pdf.open_metadata().pdfa_status == "2B"
        fonts = list(pdf_fonts(pdf))
        for f in fonts:
            desc = f.get("/FontDescriptor")
            assert desc is not None and any(k in desc for k in ("/FontFile", "/FontFile2", "/FontFile3")), f
        assert fonts


def pdf_fonts(pdf: pikepdf.Pdf):  # noqa: F821 - pikepdf imported where it is used
    """Every simple and CID font the pages draw with, in their forms (OCRmyPDF's text layer is one) too."""
    import pikepdf
    seen: set = set()

    def walk(resources):
        if not isinstance(resources, pikepdf.Dictionary) or resources.objgen in seen and resources.objgen != (0, 0):
            return
        seen.add(resources.objgen)
        for _, font in (resources.get("/Font") or {}).items():
            for f in [font, *(font.get("/DescendantFonts") or [])]:
                if f.get("/Subtype") != "/Type0":  # a composite font's glyphs are in its descendant
                    yield f
        for _, xobj in (resources.get("/XObject") or {}).items():
            if xobj.get("/Subtype") == "/Form":
                yield from walk(xobj.get("/Resources"))

    for page in pdf.pages:
        yield from walk(page.Resources)


@contextlib.contextmanager
def reopened(db):
    """The ledger ``db`` closed and opened again by a new ``Database`` (which migrates an older schema on open), its
    schema checked to be this uflash's; the new one is disposed of on leaving."""
    from sqlalchemy import func, select

    from db.models import SchemaVersion
    from db.session import SCHEMA_VERSION, Database

    url = db.url
    db.dispose()
    again = Database(url)
    try:
        with again.session() as s:
            assert s.scalar(select(func.max(SchemaVersion.version))) == SCHEMA_VERSION == 6
        yield again
    finally:
        again.dispose()


@pytest.fixture
def equal_step_costs(monkeypatch):
    """Every engine step costs the width choice the same (10 ms): it measures real step times, which a busy CPU makes
    noisy enough that it may judge drafting not worth it and never verify a draft; with equal costs it verifies them,
    as it does where wide steps are nearly free (a GPU), and the shapes the steps take do not depend on the load."""
    from engine.batch.step_width import StepWidth

    observe = StepWidth.observe
    monkeypatch.setattr(StepWidth, "observe", lambda self, rows, prefix, width, block, seconds, *a, **k: observe(
        self, rows, prefix, width, block, None if seconds is None else 0.01, *a, **k))
