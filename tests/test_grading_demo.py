"""Grades with the demo model through the real ``uflash run`` (CPU): documents it reads correctly keep the grade they
had before the grades were calibrated, and a 3-page document of nearly empty pages on which it writes page 1's text
again as page 2 (and more pages than it was given) has that page caught and repaired."""

from __future__ import annotations

import json

import pytest

from ingest.config import load_settings
from ingest.quality.grades import plain_text, repeats
from ingest.quality.measures import Thresholds, normalized_edit_distance
from ingest.synth.documents import make_document, strip_markup
from tests.conftest import DEMO, ROOT, needs_demo, uflash, write_config

pytestmark = [needs_demo, pytest.mark.xdist_group("grading_demo")]  # run in parallel: on one worker, the run once

# Pages the demo model reads correctly (CER <= 0.03 against the truth; the bundled example has no truth file but
# reads word for word), with the grade the rules before calibration gave them (recorded with that code, this run):
READ_CORRECTLY = {("sample", 1): "good", ("sample", 2): "good", ("synth-800100", 1): "good",
                  ("synth-800100", 2): "good", ("synth-800102", 1): "good"}
COPYING = 900_034  # ingest.synth.documents.make_document(COPYING, 3, kind="sparse"): the demo model writes page 1's text again
# as page 2 (found with the generator among 3-page documents of nearly empty pages)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo-grades")
    cfg = write_config(root, model={"path": str(DEMO), "device": "cpu"}, orientation={"auto": False})
    s = load_settings(cfg)
    s.ensure_folders()
    (s.inbox / "sample.pdf").write_bytes((ROOT / "examples" / "sample.pdf").read_bytes())
    labels = {}
    for seed, scan, kind in ((800_100, False, "document"), (800_102, True, "document"), (COPYING, False, "sparse")):
        pdf, labels[f"synth-{seed}"] = make_document(seed, 3 if kind == "sparse" else 2, scan=scan, kind=kind)
        (s.inbox / f"synth-{seed}.pdf").write_bytes(pdf)
    r = uflash("--config", str(cfg), "run", timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    docs = {p.name: json.loads((p / "document.json").read_text(encoding="utf-8"))
            for p in s.outbox.iterdir() if (p / "document.json").is_file()}
    return s, docs, labels


def test_pages_read_correctly_keep_their_grade(demo_run):
    _, docs, labels = demo_run
    for (name, index), before in READ_CORRECTLY.items():
        page = docs[name]["pages"][index - 1]
        if name in labels:  # still read correctly
            truth = strip_markup(labels[name][index - 1])
            assert normalized_edit_distance(strip_markup(page["text"]), truth) <= 0.03, (name, index)
        assert page["stats"]["quality"]["grade"] == before, (name, index, page["stats"]["quality"])


def test_a_page_copied_from_its_neighbour_is_caught_and_repaired(demo_run):
    _, docs, labels = demo_run
    doc = docs[f"synth-{COPYING}"]
    truth = [strip_markup(x) for x in labels[f"synth-{COPYING}"]]
    page2 = doc["pages"][1]
    rep = page2["stats"]["repair"]
    assert "repeats_page" in rep["checks"] and rep["kept"] == "alone"
    copied = plain_text(rep["chunk"]["text"])
    assert rep["chunk"]["text"] != rep["alone"]["text"] == page2["text"]
    # the chunk's page 2 is page 1's text again; read alone, page 2 is much nearer its truth
    page1_in_chunk = plain_text(doc["pages"][0]["stats"]["repair"]["chunk"]["text"])
    assert repeats([page1_in_chunk, copied], Thresholds())[1]["page"] == 1
    assert normalized_edit_distance(strip_markup(rep["chunk"]["text"]), truth[1]) > 0.6
    assert normalized_edit_distance(strip_markup(page2["text"]), truth[1]) < 0.4
    assert "repeats_page" not in page2["stats"]["quality"]["reasons"]
    assert all(p["stats"].get("repair") for p in doc["pages"])  # the chunk came back with more pages than given
