"""The OCRmyPDF plugin asks first: installing uflash leaves OCRmyPDF's own engine alone; ``--plugin
ingest.commands.ocrmypdf_plugin`` makes uflash its engine; uflash's own document.pdf step loads it itself."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from importlib.metadata import entry_points

import pymupdf

from tests.conftest import ROOT

PLUGIN = "ingest.commands.ocrmypdf_plugin"


def ocrmypdf(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ocrmypdf", *args], cwd=cwd or ROOT, capture_output=True, text=True,
                          timeout=300)


def test_uflash_registers_no_ocrmypdf_entry_point():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert "ocrmypdf" not in project.get("entry-points", {})
    ours = [ep for ep in entry_points(group="ocrmypdf") if ep.value.split(":")[0].split(".")[0] in ("ingest", "engine")
            or (ep.dist is not None and ep.dist.name == "uflash")]
    assert not ours, f"the installed uflash still registers {ours}: install it again (pip install -e .)"


def test_a_plain_ocrmypdf_run_keeps_its_own_engine(tmp_path):
    """Without --plugin, OCRmyPDF offers none of uflash's options and OCRs with Tesseract (or says Tesseract is
    missing); with it, uflash's options are there."""
    assert "--uflash-config" not in ocrmypdf("--help").stdout
    assert "--uflash-config" in ocrmypdf("--plugin", PLUGIN, "--help").stdout
    doc = pymupdf.open()
    doc.new_page().insert_image(pymupdf.Rect(0, 0, 200, 200), pixmap=pymupdf.Pixmap(pymupdf.csGRAY, (0, 0, 64, 64), 0))
    doc.save(tmp_path / "in.pdf")
    (tmp_path / "config.toml").write_text("this is not a uflash config\n", encoding="utf-8")  # uflash would refuse it
    r = ocrmypdf("--output-type", "pdf", str(tmp_path / "in.pdf"), str(tmp_path / "out.pdf"), cwd=tmp_path)
    said = r.stdout + r.stderr
    assert "uflash" not in said and "Unlimited-OCR" not in said
    if r.returncode == 0:  # Tesseract is installed: it read the page
        with pymupdf.open(tmp_path / "out.pdf") as out:
            assert "uflash" not in json.dumps(out.metadata)
    else:
        assert r.returncode == 3 and "tesseract" in said  # MissingDependencyError: OCRmyPDF wants its own engine
