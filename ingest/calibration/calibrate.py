"""`uflash calibrate`: the grading thresholds of the configured model, chosen for it on the labelled ladder.

1. decode the ladder (``ingest.synth.ladder``: documents of 1-4 pages whose truth is known, from print the model reads
   well to print it reads badly) with the pipeline's own decoder, and read alone the pages the repair checks catch
   (ingest.calibration.decode; cached in the work folder, so a stopped run goes on where it stopped);
2. grade every page as the pipeline does, choose the thresholds on the labelled half (even seeds) and measure them on
   the held-out half (odd seeds: no part in choosing; ingest.calibration.fit);
3. write the calibration beside the model (ingest.quality.calibration): the thresholds, the held-out recall of pages
   with CER > 0.10 among the ``poor`` ones, the precision of ``poor``, the median CER of ``good`` pages, the date and
   the model's identity.
"""

from __future__ import annotations

import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ingest.calibration.decode import SEED0, TOKENS_PER_PAGE, decode_ladder, read_lines
from ingest.calibration.fit import fit, graded_pages, summary
from ingest.config import Settings
from ingest.errors import ModelUnavailable, UsageError
from ingest.quality.calibration import FITTED, grading_thresholds, model_identity, write_calibration

DOCS_GPU = 360  # documents of the ladder (about 900 pages) on a GPU: minutes
DOCS_CPU = 40  # on a CPU (about 100 pages): the figures are rougher


def work_folder(settings: Settings, identity: str) -> Path:
    """Where the ladder's readings of a model are cached (one folder per model identity)."""
    return settings.resolve(Path("var") / "calibration" / identity[:16])


def calibrate(settings: Settings, docs: int | None = None, budget_pages: int = 0, budget_s: float = 0.0,
              work: Path | None = None, progress: bool = True, decoder=None) -> tuple[dict[str, Any], Path]:
    """Calibrate the configured model (see the module); (the calibration record, the file written). ``decoder``: one
    with ``engine.chunk_decode.EngineDecoder``'s interface instead of the model's (tests)."""
    model = settings.model_path
    identity = model_identity(model)
    if identity is None:
        raise ModelUnavailable(f"{model}: no model folder with a config.json to calibrate (model.path)")
    if decoder is None:
        from engine.loading import load_decoder
        from ingest.quality.measures import loop_stopper

        decoder = load_decoder(model, settings.model.device, settings.model.dtype, mode="plain",
                               max_batch=settings.engine.max_batch, max_pages_per_chunk=4,
                               kernels=settings.engine.kernels,
                               loop_check=loop_stopper(grading_thresholds(settings).thresholds))
    on_gpu = str(decoder.device).startswith("cuda")
    docs = docs or (DOCS_GPU if on_gpu else DOCS_CPU)
    if docs < 2:
        raise UsageError("--docs: at least 2 documents (one labelled, one held out)")
    folder = work or work_folder(settings, identity)
    tokens_per_page = settings.engine.max_tokens_per_page or TOKENS_PER_PAGE
    run = decode_ladder(folder, model, docs, SEED0, mode="plain", tokens_per_page=tokens_per_page,
                        context_limit=settings.engine.context_limit, budget_s=budget_s, budget_pages=budget_pages,
                        progress=progress, decoder=decoder)
    done = {d["seed"]: d for d in read_lines(folder / "decoded.jsonl") if "seed" in d and d["seed"] < SEED0 + docs}
    ladder = [done[k] for k in sorted(done)]
    if not any(d["half"] == "labelled" for d in ladder) or not any(d["half"] == "held_out" for d in ladder):
        raise UsageError(f"the ladder in {folder} has no document of one half yet: run `uflash calibrate` again "
                         "(it goes on where it stopped) or give a larger --budget")
    alone = {r["key"]: r for r in read_lines(folder / "repaired.jsonl") if "key" in r}
    tokenizer = decoder.loaded.tokenizer
    base = grading_thresholds(settings, model).thresholds
    rows = graded_pages(ladder, alone, base, tokenizer)
    chosen = fit([r for r in rows if r["half"] == "labelled"], base)
    rows = graded_pages(ladder, alone, chosen, tokenizer)  # repaired and graded under the chosen thresholds
    halves = {h: summary([r for r in rows if r["half"] == h]) for h in ("labelled", "held_out")}
    pages = sum(d["rung"]["pages"] for d in ladder)
    record = {
        "identity": identity, "model": Path(model).name,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "thresholds": {k: getattr(chosen, k) for k in FITTED},
        "held_out": halves["held_out"], "labelled": halves["labelled"],
        "documents": len(ladder), "pages": pages, "complete": len(ladder) == docs,
        "decoded": {"device": str(decoder.device), "dtype": str(decoder.loaded.dtype).removeprefix("torch."),
                    "mode": "plain", "tokens_per_page": tokens_per_page, "seed0": SEED0,
                    "seconds_this_run": run["this_run"]["seconds"], "stopped": run["this_run"]["stopped"],
                    "python": platform.python_version()},
        "how": "uflash calibrate (ingest.calibration.calibrate)",
    }
    return record, write_calibration(settings, model, record)


def format_calibration(record: dict[str, Any], path: Path) -> str:
    """What `uflash calibrate` prints."""
    source = "corrected" if record.get("source") == "corrections" else "ladder"
    lines = [f"calibrated {record['model']} on {record['documents']} {source} documents ({record['pages']} pages) "
             f"-> {path}"]
    if not record["complete"]:
        lines.append(f"  stopped early ({record['decoded']['stopped']}): run it again to read the rest and fit again")
    for half in ("labelled", "held_out"):
        s = record[half]
        lines.append(f"  {half:<9} {s['pages']:>4} pages, {s['bad_pages']} with CER > 0.10: recall of poor "
                     f"{s['recall_poor']}, precision {s['precision_poor']}, good median CER {s['good_cer_median']}")
    lines.append("  thresholds: " + ", ".join(f"{k} {v}" for k, v in record["thresholds"].items()))
    return "\n".join(lines)
