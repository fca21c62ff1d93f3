"""scripts.check_figures: the repository's docs pass, and a doc whose cited number is changed fails."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from scripts.check_figures import check

ROOT = Path(__file__).resolve().parent.parent


def copy_repo_docs(tmp_path: Path) -> Path:
    """README.md, docs/ (with its records), config.toml and models/demo's weights files in a temporary root."""
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", root / "docs")
    shutil.copy(ROOT / "README.md", root / "README.md")
    shutil.copy(ROOT / "config.toml", root / "config.toml")
    for weights in (ROOT / "models").rglob("*.safetensors"):
        target = root / weights.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(weights)
    return root


def test_the_repository_passes_as_ci_runs_it():
    out = subprocess.run([sys.executable, "-m", "scripts.check_figures"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    blocks = int(re.search(r"figures: (\d+) blocks", out.stderr).group(1))
    assert blocks >= 20, out.stderr  # the docs do cite their figures through blocks


def test_a_changed_figure_in_a_doc_fails(tmp_path):
    root = copy_repo_docs(tmp_path)
    assert check(root) == []
    doc = root / "docs" / "benchmarks.md"
    text = doc.read_text()
    assert "| 1 | 43 (51) |" in text
    doc.write_text(text.replace("| 1 | 43 (51) |", "| 1 | 44 (51) |", 1))
    problems = [str(p) for p in check(root)]
    assert any(p.startswith("docs/benchmarks.md:") and "43 is not in the text above the block" in p for p in problems)
    out = subprocess.run([sys.executable, "-m", "scripts.check_figures", "--root", str(root)], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 1 and "43 is not in the text" in out.stdout


def test_a_mapping_that_disagrees_with_its_record_fails(tmp_path):
    root = copy_repo_docs(tmp_path)
    doc = root / "docs" / "benchmarks.md"
    text = doc.read_text()
    # The doc and its mapping both say 44 where the record says 43.4: the value check catches it.
    text = text.replace("| 1 | 43 (51) |", "| 1 | 44 (51) |", 1).replace("\n43 = ", "\n44 = ", 1)
    doc.write_text(text)
    problems = [str(p) for p in check(root)]
    assert any("44 shown, bench_engine_demo_batch_cpu.json gives 43.4" in p for p in problems), problems


def test_a_missing_record_fails(tmp_path):
    root = copy_repo_docs(tmp_path)
    (root / "docs" / "results" / "bench_engine_demo_batch_cpu.json").unlink()
    problems = [str(p) for p in check(root)]
    assert any("bench_engine_demo_batch_cpu.json does not exist" in p for p in problems)


def test_other_weights_than_the_record_measured_fail(tmp_path):
    root = copy_repo_docs(tmp_path)
    shard = root / "models" / "demo" / "model-00001-of-00003.safetensors"
    shard.unlink()
    shard.write_bytes(b"retrained")
    problems = [str(p) for p in check(root)]
    assert any("measured other weights than models/demo/model-00001-of-00003.safetensors" in p for p in problems)


def test_rounding_and_approximate_figures():
    from scripts.check_figures import matches

    assert matches("0.090", 0.0895) and not matches("0.089", 0.0895)
    assert matches("12,744", 12744.4) and not matches("12,744", 12745.0)
    assert matches("0.95x", 0.953) and matches("35%", 35.4)
    assert matches("~7,900", 7874.0) and not matches("~7,900", 7960.0)
    assert matches("505", 505.3) and not matches("514", 505.3)


def test_one_of_two_equal_figures_changed_fails(tmp_path):
    """demo_model.md shows 0.089 twice in the plain-English row (all characters, mean of pages): editing one of them
    leaves the figure in the text once, fewer times than the block maps it."""
    root = copy_repo_docs(tmp_path)
    doc = root / "docs" / "demo_model.md"
    row = "| one sentence at the top of a page, plain English (20 pt) | 6 | 0.089 | 0.089 | 0 |"
    text = doc.read_text()
    assert row in text
    doc.write_text(text.replace(row, row.replace("| 0.089 | 0 |", "| 0.090 | 0 |")))
    problems = [str(p) for p in check(root)]
    assert any(p.startswith("docs/demo_model.md:") and "0.089 is not in the text above the block" in p
               for p in problems), problems
