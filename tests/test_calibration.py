"""A model's grading calibration (ingest.quality.calibration) and `uflash calibrate` (ingest.calibration): grading
reads the thresholds of the model's calibration file, a key the user sets in ``[quality]`` overrides it, a model
without one (or with one of other weights) gets the conservative thresholds and says so; `uflash calibrate` decodes a
small ladder with the demo model on the CPU, writes the file with its figures and identity, goes on where it stopped
and keeps to its budget."""

from __future__ import annotations

import json
import shutil
from dataclasses import fields

import pytest

from ingest.calibration.decode import read_lines
from ingest.commands.cli import main, parse_budget
from ingest.config import Thresholds, load_settings
from ingest.errors import UsageError
from ingest.quality.calibration import (
    CONSERVATIVE,
    FILE_NAME,
    FITTED,
    grading_thresholds,
    model_identity,
    read_calibration,
)
from tests.conftest import DEMO, needs_demo, write_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture()
def model_copy(tmp_path, tiny_model_dir):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    return folder


def _calibration(folder, **thresholds) -> None:
    rec = {"identity": model_identity(folder), "date": "2026-01-02T03:04:05+00:00", "pages": 10,
           "thresholds": {**{k: getattr(Thresholds(), k) for k in FITTED}, **thresholds},
           "held_out": {"recall_poor": 0.95, "precision_poor": 0.9, "good_cer_median": 0.01}}
    (folder / FILE_NAME).write_text(json.dumps(rec), encoding="utf-8")


def test_grading_reads_the_models_calibration_and_the_users_keys_override_it(tmp_path, model_copy):
    _calibration(model_copy, mean_logprob_poor=-0.7, unsure_words_poor=0.4)
    s = load_settings(write_config(tmp_path, model={"path": str(model_copy)}))
    g = grading_thresholds(s)
    assert g.calibrated and g.thresholds.mean_logprob_poor == -0.7 and g.thresholds.unsure_words_poor == 0.4
    assert "calibrated for this model on 2026-01-02" in g.summary() and "recall 0.95" in g.summary()
    assert g.stamp()["calibrated"] is True
    # a key set in the config wins over the calibration; the others stay the model's
    s = load_settings(write_config(tmp_path, model={"path": str(model_copy)}, quality={"mean_logprob_poor": -0.2}))
    g = grading_thresholds(s)
    assert (g.thresholds.mean_logprob_poor, g.thresholds.unsure_words_poor) == (-0.2, 0.4)
    assert g.user_set == ("mean_logprob_poor",) and "set in the config over it: mean_logprob_poor" in g.summary()


def test_a_model_without_calibration_is_graded_conservatively_and_says_so(tmp_path, model_copy):
    s = load_settings(write_config(tmp_path, model={"path": str(model_copy)}))
    g = grading_thresholds(s)
    assert not g.calibrated and g.stamp() == {"calibrated": False}
    assert all(getattr(g.thresholds, k) == v for k, v in CONSERVATIVE.items())
    assert "NOT calibrated" in g.summary() and "uflash calibrate" in g.summary()
    # conservative: no looser than any calibration's poor rules
    assert CONSERVATIVE["mean_logprob_poor"] >= Thresholds().mean_logprob_poor
    assert CONSERVATIVE["unsure_words_poor"] <= Thresholds().unsure_words_poor
    # a calibration of other weights does not count: the weights changed since
    _calibration(model_copy, mean_logprob_poor=-0.7)
    weights = sorted(model_copy.glob("*.safetensors"))[0]
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    rec, why = read_calibration(s, str(model_copy))
    assert rec is None and why == "its calibration is of other weights"
    assert not grading_thresholds(s).calibrated


def test_a_read_only_model_folder_keeps_its_calibration_beside_the_config(tmp_path, model_copy, monkeypatch):
    from ingest.quality import calibration

    s = load_settings(write_config(tmp_path, model={"path": str(model_copy)}))
    real = calibration.Path.write_text

    def refuse_model_folder(self, *a, **k):
        if self.parent == model_copy:
            raise PermissionError("read-only")
        return real(self, *a, **k)

    monkeypatch.setattr(calibration.Path, "write_text", refuse_model_folder)
    rec = {"identity": model_identity(model_copy), "thresholds": {"mean_logprob_poor": -0.5}}
    path = calibration.write_calibration(s, str(model_copy), rec)
    assert path.parent == tmp_path / "var" / "calibrations" and not (model_copy / FILE_NAME).exists()
    assert read_calibration(s, str(model_copy))[0] == rec


def test_status_says_whether_the_models_grades_are_calibrated(tmp_path, model_copy, capsys):
    cfg = write_config(tmp_path, model={"path": str(model_copy)})
    assert main(["--config", str(cfg), "status"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("grades:"))
    assert "NOT calibrated" in line and "uflash calibrate" in line
    _calibration(model_copy)
    assert main(["--config", str(cfg), "status", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["grades"]["calibrated"] and "calibrated for this model on 2026-01-02" in st["grades"]["summary"]


def test_the_review_page_of_calibrated_grades_has_no_warning():
    from ingest.review.page import render_html

    rep = {"run": {"id": 1, "mode": "plain", "model": "m", "started_at": "2026-01-01T00:00:00"}, "documents": [],
           "pages": 0, "grades": {}, "not_calibrated": None}
    assert "NOT calibrated" not in render_html(rep) and "class='warn'" not in render_html(rep)


def test_budget_is_pages_or_seconds():
    assert parse_budget("200") == (200, 0.0) and parse_budget("600s") == (0, 600.0) and parse_budget(None) == (0, 0.0)
    with pytest.raises(UsageError):
        parse_budget("soon")


@needs_demo
def test_uflash_calibrate_on_the_cpu_writes_resumes_and_keeps_to_its_budget(tmp_path, capsys):
    """The demo model (a copy: the shipped folder is left alone) on a 2-document ladder, pages cut at 16 tokens so
    that it takes CI seconds: the figures are those of cut pages, the mechanics are the real ones."""
    model = tmp_path / "demo"
    shutil.copytree(DEMO, model, ignore=shutil.ignore_patterns("drafter", FILE_NAME))
    cfg = write_config(tmp_path, model={"path": str(model), "device": "cpu", "dtype": "float32"},
                       engine={"max_tokens_per_page": 16, "max_batch": 4})
    work = tmp_path / "work"
    assert main(["--config", str(cfg), "calibrate", "--docs", "2", "--work", str(work)]) == 0
    out = capsys.readouterr().out
    rec = json.loads((model / FILE_NAME).read_text(encoding="utf-8"))
    assert rec["identity"] == model_identity(model) and rec["date"] and rec["complete"]
    assert set(rec["thresholds"]) == set(FITTED) and rec["documents"] == 2 and rec["pages"] == 4
    assert {"recall_poor", "precision_poor", "good_cer_median", "pages", "grades"} <= set(rec["held_out"])
    assert rec["held_out"]["pages"] == 2 and rec["labelled"]["pages"] == 2  # seeds 600000 (2 pages), 600001 (2)
    assert rec["decoded"]["device"] == "cpu" and rec["decoded"]["tokens_per_page"] == 16
    assert "calibrated demo on 2 ladder documents" in out and "held_out" in out
    s = load_settings(cfg)
    g = grading_thresholds(s)
    assert g.calibrated and all(getattr(g.thresholds, k) == v for k, v in rec["thresholds"].items())
    assert {f.name for f in fields(Thresholds)} >= set(FITTED)

    # run again on a larger ladder with a budget of 1 page: the 2 documents read are not read again (cached), it
    # stops after the first new document and fits on the 3 it has
    assert main(["--config", str(cfg), "calibrate", "--docs", "4", "--budget", "1", "--work", str(work)]) == 0
    runs = read_lines(work / "runs.jsonl")
    assert runs[-1]["this_run"]["stopped"] == "budget of 1 page reached" and runs[-1]["this_run"]["documents"] == 1
    assert runs[-1]["in_folder"]["documents"] == 3
    again = json.loads((model / FILE_NAME).read_text(encoding="utf-8"))
    assert not again["complete"] and again["documents"] == 3
    assert "run it again to read the rest" in capsys.readouterr().out
