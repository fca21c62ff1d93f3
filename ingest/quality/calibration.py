"""A model's grading calibration: the thresholds that ``uflash calibrate`` (ingest.calibration) chose for that model
on the labelled ladder, and which thresholds grade its pages.

The calibration is a small JSON file, ``calibration.json`` in the model folder (or, where that folder is read-only,
``<config folder>/var/calibrations/<identity>.json``): the chosen thresholds (``FITTED``), the held-out figures, the
date, and the model's identity (``model_identity``: a hash of its config and weights). A file whose identity is not the
model's (weights changed since) does not count.

The thresholds that grade a model's pages (``grading_thresholds``), each field from the first of:
1. ``[quality]`` in config.toml (or ``UFLASH_QUALITY__*``) where the user set it;
2. the model's calibration;
3. ``CONSERVATIVE`` for a model without calibration: stricter than any calibration seen, so more pages are ``fair``
   or ``poor`` (a reviewer looks at more pages rather than skip bad ones); its grades say they are not calibrated;
4. the defaults of ``ingest.config.Thresholds`` (the fields no calibration chooses).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from ingest.config import Settings, Thresholds

FILE_NAME = "calibration.json"
FALLBACK_FOLDER = Path("var") / "calibrations"  # under the config folder, for read-only model folders
# the thresholds a calibration chooses (the rest are the model's own business no more than the pipeline's)
FITTED = ("unsure_word_prob", "unsure_words_poor", "unsure_words_fair", "mean_logprob_poor", "mean_logprob_fair",
          "ink_short", "ink_long", "ink_short_fair", "ink_long_fair")
CONSERVATIVE = {"unsure_word_prob": 0.5, "unsure_words_poor": 0.1, "unsure_words_fair": 0.03,
                "mean_logprob_poor": -0.08, "mean_logprob_fair": -0.03, "ink_short": 0.6, "ink_long": 1.5,
                "ink_short_fair": 0.8, "ink_long_fair": 1.3}
HOW_TO = "calibrate them with `uflash calibrate` (docs/grades.md)"
NOT_CALIBRATED = "grades NOT calibrated for the model that read {n} of these pages: its conservative thresholds " \
                 "grade more pages fair or poor; " + HOW_TO
_SAMPLE = 1 << 20  # bytes hashed at each end of a weights file


def model_identity(folder: Path | str) -> str | None:
    """A hash of the model folder's config.json, its weights index and, per weights file, its name, size and first and
    last MiB (any retrained or perturbed weights differ there; a 6 GB checkpoint is not read whole). None when the
    folder holds no config.json (a hub id, or no model)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        return None
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        if (folder / name).is_file():
            h.update(name.encode() + b"\0" + (folder / name).read_bytes())
    for path in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            h.update(f.read(_SAMPLE))
            f.seek(max(0, size - _SAMPLE))
            h.update(f.read(_SAMPLE))
    return h.hexdigest()


@dataclass(frozen=True)
class ModelGrading:
    """What grades a model's pages: the thresholds, and where they come from."""

    thresholds: Thresholds
    model: str
    calibration: dict[str, Any] | None  # the model's calibration record; None: not calibrated
    user_set: tuple[str, ...]  # the fields the config set
    note: str | None = None  # why there is no calibration (none yet, or one of other weights)

    @property
    def calibrated(self) -> bool:
        return self.calibration is not None

    def summary(self) -> str:
        """One line for status, check, the report and the review page."""
        if self.calibration is None:
            return f"grades NOT calibrated for the model {self.model} ({self.note}): conservative thresholds " \
                   f"grade more pages fair or poor; {HOW_TO}"
        c = self.calibration
        held = c.get("held_out") or {}
        over = [k for k in self.user_set if k in FITTED]
        user = f"; set in the config over it: {', '.join(over)}" if over else ""
        source = "corrected" if c.get("source") == "corrections" else "ladder"
        return f"grades calibrated for this model on {c.get('date', '?')[:10]} ({c.get('pages', '?')} {source} " \
               f"pages; held out: recall {held.get('recall_poor')}, precision {held.get('precision_poor')}, good " \
               f"median CER {held.get('good_cer_median')}){user}"

    def stamp(self) -> dict[str, Any]:
        """What a graded page records of it (stats.quality.calibration)."""
        if self.calibration is None:
            return {"calibrated": False}
        return {"calibrated": True, "date": self.calibration.get("date"),
                "identity": (self.calibration.get("identity") or "")[:16]}


def calibration_paths(settings: Settings, model_path: str) -> list[Path]:
    """Where a model's calibration may be: its folder, then the fallback folder named by its identity."""
    identity = model_identity(model_path)
    paths = [Path(model_path) / FILE_NAME]
    if identity:
        paths.append(settings.resolve(FALLBACK_FOLDER / f"{identity[:32]}.json"))
    return paths


def read_calibration(settings: Settings, model_path: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the model's calibration record, None) or (None, why there is none)."""
    identity = model_identity(model_path)
    if identity is None:
        return None, "no model folder with a config.json to calibrate"
    other = False
    for path in calibration_paths(settings, model_path):
        if not path.is_file():
            continue
        try:
            rec = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if rec.get("identity") == identity:
            return rec, None
        other = True
    return None, "its calibration is of other weights" if other else "no calibration file"


def write_calibration(settings: Settings, model_path: str, record: dict[str, Any]) -> Path:
    """Write ``record`` beside the model (its folder, or the fallback folder when that is read-only); the path."""
    text = json.dumps(record, indent=1) + "\n"
    for path in calibration_paths(settings, model_path):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(path)
            return path
        except OSError:
            continue
    raise OSError(f"cannot write the calibration of {model_path} in its folder nor in {FALLBACK_FOLDER}")


def user_set_thresholds(settings: Settings) -> dict[str, Any]:
    """The ``[quality]`` thresholds the config (or the environment) set, with their values."""
    q = settings.quality
    names = {f.name for f in fields(Thresholds)}
    return {k: getattr(q, k) for k in sorted(q.model_fields_set & names)}


_CACHE: dict[tuple, ModelGrading] = {}


def grading_thresholds(settings: Settings, model_path: str | None = None) -> ModelGrading:
    """The thresholds that grade the pages of ``model_path`` (default: the configured model), and their source (see
    the module). Read again when the model's files, its calibration file or the settings change."""
    model = model_path or settings.model_path
    user = user_set_thresholds(settings)
    identity = model_identity(model)
    files = tuple((str(p), p.stat().st_mtime_ns) for p in calibration_paths(settings, model) if p.is_file())
    key = (str(settings.config_file), model, identity, files, tuple(user.items()))
    if key in _CACHE:
        return _CACHE[key]
    rec, why = read_calibration(settings, model)
    chosen = {k: v for k, v in ((rec or {}).get("thresholds") or {}).items() if k in FITTED} if rec else CONSERVATIVE
    t = replace(Thresholds(), **{**chosen, **user})
    out = ModelGrading(thresholds=t, model=model, calibration=rec, user_set=tuple(user), note=why)
    _CACHE[key] = out
    return out


def uncalibrated_pages(qualities: list[dict[str, Any]]) -> int:
    """How many of these pages' grades (stats.quality) were made with thresholds not calibrated for their model."""
    return sum(1 for q in qualities if (q.get("calibration") or {}).get("calibrated") is False)
