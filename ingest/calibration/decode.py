"""Decode the calibration ladder (ingest/synth/ladder.py) as the pipeline decodes it, in one resumable job: the
first step of `uflash calibrate` (ingest.calibration.calibrate) and of ``python -m scripts.eval.grades decode``.

- Documents are drawn and rendered by a pool of processes (``render_document``: the PDF, its pages rendered as the
  pipeline renders them, and the print on each page measured by ``ingest.pages.ink``, as the worker measures it);
- each document is one chunk of 1-4 pages, decoded by the batched engine (``engine.chunk_decode.EngineDecoder``,
  many chunks in flight); a chunk that comes back short is followed by the chunks the worker would queue
  (``ingest.worker.outcome.requeue_rule``);
- once a document is read, the pages of its multi-page chunks that the repair checks catch
  (``ingest.quality.grades.checks`` under the loosest thresholds the fit may choose, ``LOOSE_INK``) are decoded
  again alone (the single-page prompt, the same mode): ``ingest.quality.repair`` picks between the two readings when
  the pages are graded (ingest.calibration.fit).

Writes into its folder, one JSON line per item as each ends (a stop loses only what is in flight; a restart goes on):
``decoded.jsonl`` (per document: rung, labels, print measured per page, image sizes, every chunk's pages with their
text, token ids and log-probabilities), ``repaired.jsonl`` (per page read alone, key ``"seed:page"``), and one line
per invocation in ``runs.jsonl`` (machine, settings, pages, seconds). It stops by itself ``budget_s`` seconds after
its start, or once ``budget_pages`` pages are read, keeping what is done; a progress bar (tqdm) counts the pages.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

SEED0 = 600_000  # below ingest.synth.documents.HELD_OUT_LIMIT: never used in training
TOKENS_PER_PAGE = 2500  # the demo model writes ~1 token per character; the ladder's densest page has ~1,400
# the text-vs-ink thresholds ``table --fit`` tries for the poor rules (and so for the repair checks)
INK_SHORT_GRID = (0.3, 0.4, 0.5, 0.6)
INK_LONG_GRID = (1.5, 2.0, 2.5, 3.0)
LOOSE_INK = {"ink_short": max(INK_SHORT_GRID), "ink_long": min(INK_LONG_GRID)}


def half(seed: int, seed0: int = SEED0) -> str:
    """Even documents are the labelled half (thresholds are chosen on them), odd ones the held-out half."""
    return "held_out" if (seed - seed0) % 2 else "labelled"


def render_document(seed: int) -> tuple[dict[str, Any], list]:
    """(the document's record without its chunks, its page images): the ladder document of ``seed`` rendered as the
    pipeline renders PDFs, with the print on each page measured (``ingest.pages.ink``)."""
    from ingest.pages.ink import ink_text
    from ingest.pages.render import render_pages
    from ingest.synth.ladder import ladder_document

    pdf, labels, rung = ladder_document(seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "doc.pdf"
        path.write_bytes(pdf)
        rendered = render_pages(path, "pdf", 1, rung.pages)
    images = [p.image for p in rendered]
    return {"seed": seed, "rung": rung.dict(), "labels": labels, "text_layer": [p.text_layer for p in rendered],
            "image_size": [list(im.size) for im in images], "ink": [ink_text(im).dict() for im in images]}, images


def _render_worker_init() -> None:
    """Render processes run one thread each and yield to the process that feeds the GPU."""
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        os.nice(5)
    except OSError:
        pass


def page_record(po) -> dict[str, Any]:
    return {"text": po.text, "ids": po.ids, "logprobs": [round(x, 5) for x in po.logprobs],
            "stats": {k: po.stats.get(k) for k in ("finish_reason", "tokens", "seconds", "tau", "note")}}


def chunk_outputs(doc: dict[str, Any]):
    """The document's chunks as (first page, ``engine.chunk_output.ChunkOutput``)."""
    from engine.chunk_output import ChunkOutput, PageOutput

    for ch in doc["chunks"]:
        pages = [PageOutput(text=p["text"], boxes=[], stats={k: v for k, v in p["stats"].items() if v is not None},
                            ids=p["ids"], logprobs=p["logprobs"]) for p in ch["pages"]]
        yield ch["first"], ChunkOutput(pages=pages, n_input_pages=ch["last"] - ch["first"] + 1,
                                       finish_reason=ch["finish_reason"], requeue=ch["requeue"], note=ch["note"],
                                       pages_returned=ch.get("pages_returned"))


def page_images(doc: dict[str, Any]) -> list:
    """What the figures need of the document's pages: when its record holds the print measured on each page, blank
    stand-ins of the pages' sizes (only the size is read); else the pages rendered again from the seed."""
    from PIL import Image

    if doc.get("ink"):
        return [Image.new("1", tuple(size)) for size in doc["image_size"]]
    return render_document(doc["seed"])[1]


def caught_pages(doc: dict[str, Any], images: list, tokenizer, t) -> list[int]:
    """Pages (1-based) of the document's multi-page chunks that fail a repair check under thresholds ``t``."""
    from ingest.quality.grades import checks
    from ingest.quality.repair import chunk_page_stats

    out = []
    for first, ch in chunk_outputs(doc):
        if ch.n_input_pages < 2:
            continue
        span = slice(first - 1, first - 1 + ch.n_input_pages)
        stats = chunk_page_stats(ch, images[span], [None] * ch.n_input_pages, tokenizer, t, first,
                                 inks=doc["ink"][span] if doc.get("ink") else None)
        out += [first + i for i, st in enumerate(stats) if checks(st["quality"], t)]
    return out


def alone_key(seed: int, page: int) -> str:
    return f"{seed}:{page}"


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of ``path``, or of ``path`` + ``.gz`` (a line cut by a stop is skipped: its item is decoded
    again)."""
    packed = path.with_name(path.name + ".gz")
    if not path.exists() and packed.exists():
        import gzip

        text = gzip.decompress(packed.read_bytes()).decode("utf-8")
    elif path.exists():
        text = path.read_text(encoding="utf-8")
    else:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def environment(decoder) -> dict[str, Any]:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
           "device": decoder.device, "dtype": str(decoder.loaded.dtype).removeprefix("torch.")}
    if torch.cuda.is_available() and decoder.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def decode_ladder(folder: Path, model: str, docs: int, seed0: int = SEED0, device: str = "auto", dtype: str = "auto",
                  mode: str = "plain", max_batch: int | str = 64, procs: int = 0, budget_s: float = 0.0,
                  tokens_per_page: int = TOKENS_PER_PAGE, context_limit: int = 32768, budget_pages: int = 0,
                  progress: bool = True, decoder=None) -> dict:
    """Decode documents ``seed0 .. seed0 + docs - 1`` into ``folder`` (see the module); returns the run's record.
    ``decoder``: one with ``EngineDecoder``'s submit / poll interface instead of the model's (tests)."""
    from dataclasses import replace

    from ingest.logs import counted, progress_bar
    from ingest.synth.documents import HELD_OUT_LIMIT
    from ingest.synth.ladder import ladder_rung

    t0 = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    decoded_path, alone_path = folder / "decoded.jsonl", folder / "repaired.jsonl"
    done_docs = {d["seed"]: d for d in read_lines(decoded_path) if "seed" in d}
    done_alone = {r["key"] for r in read_lines(alone_path) if "key" in r}
    seeds = [s for s in range(seed0, seed0 + docs) if s not in done_docs]
    if seed0 + docs > HELD_OUT_LIMIT:
        raise ValueError("ladder seeds must stay below ingest.synth.documents.HELD_OUT_LIMIT (never used in training)")
    procs = procs or max(1, min(15, (os.cpu_count() or 2) - 1))
    # the pool starts before torch does anything (spawned processes: no CUDA state copied)
    pool = mp.get_context("spawn").Pool(procs, initializer=_render_worker_init)

    from engine.loading import load_decoder
    from ingest.quality.measures import Thresholds, loop_stopper
    from ingest.worker.outcome import requeue_rule

    if decoder is None:
        decoder = load_decoder(model, device, dtype, mode=mode, max_batch=max_batch, max_pages_per_chunk=4,
                               loop_check=loop_stopper())
    tokenizer = decoder.loaded.tokenizer
    loose = replace(Thresholds(), **LOOSE_INK)
    # documents read earlier whose caught pages still wait for their reading alone (a stop between the two)
    unfinished = [s for s, d in sorted(done_docs.items())
                  if any(alone_key(s, p) not in done_alone for p in caught_pages(d, page_images(d), tokenizer, loose))]
    done_pages = sum(d["rung"]["pages"] for d in done_docs.values())
    bar = progress_bar(done_pages + sum(ladder_rung(s).pages for s in seeds), "ladder", initial=done_pages,
                       unit="page", disable=not progress, mininterval=1.0)
    bar.write(f"{len(done_docs)} documents read earlier ({len(unfinished)} with pages still to read alone), "
              f"{len(seeds)} to read; {procs} render processes; engine {decoder.describe()}")
    rendered = pool.imap_unordered(render_document, unfinished + seeds)
    to_render = len(unfinished) + len(seeds)

    docs_open: dict[int, dict[str, Any]] = {}
    images: dict[int, list] = {}
    waiting: deque[tuple[tuple, list]] = deque()  # (key, images) to submit: ("chunk", seed, a, b) | ("alone", seed, p)
    counts = {"documents": 0, "pages": 0, "alone": 0, "tokens": 0}
    stopped = None
    t_load = time.perf_counter() - t0

    def queue_alone(seed: int, doc: dict[str, Any], imgs: list) -> None:
        for p in caught_pages(doc, imgs, tokenizer, loose):
            if alone_key(seed, p) not in done_alone:
                waiting.appendleft((("alone", seed, p), [imgs[p - 1]]))

    def take(block: bool) -> bool:
        """One rendered document into the queue; False when none came."""
        nonlocal to_render
        try:
            meta, imgs = rendered.next(timeout=5.0 if block else 0.0)
        except mp.TimeoutError:
            return False
        to_render -= 1
        seed = meta["seed"]
        if seed in done_docs:
            queue_alone(seed, done_docs[seed], imgs)
            return True
        docs_open[seed] = {**meta, "half": half(seed, seed0), "mode": mode, "chunks": [], "open": 1}
        images[seed] = imgs
        waiting.append((("chunk", seed, 1, meta["rung"]["pages"]), imgs))
        return True

    with decoded_path.open("a", encoding="utf-8") as doc_sink, alone_path.open("a", encoding="utf-8") as alone_sink:
        while True:
            if budget_s and time.perf_counter() - t0 > budget_s:
                stopped = f"time budget of {budget_s:.0f} s reached"
                break
            if budget_pages and counts["pages"] >= budget_pages:
                stopped = f"budget of {counted(budget_pages, 'page')} reached"
                break
            while to_render and decoder.free_rows > len(waiting):
                if not take(block=not decoder.busy and not waiting):
                    break
            while waiting and decoder.free_rows > 0:
                key, imgs = waiting.popleft()
                n = key[3] - key[2] + 1 if key[0] == "chunk" else 1
                early = decoder.submit(key, imgs, context_limit, tokens_per_page * n)
                if early is not None:
                    raise RuntimeError(f"{key}: {early.note}")
            if not decoder.busy:
                if not to_render and not waiting:
                    break
                continue
            for key, out in decoder.poll():
                if isinstance(out, BaseException):
                    raise out
                counts["tokens"] += sum(len(p.ids) for p in out.pages)
                if key[0] == "alone":
                    _, seed, p = key
                    alone_sink.write(_line({"key": alone_key(seed, p), **page_record(out.pages[0])}))
                    alone_sink.flush()
                    counts["alone"] += 1
                    continue
                _, seed, a, b = key
                doc = docs_open[seed]
                doc["chunks"].append({"first": a, "last": b, "finish_reason": out.finish_reason, "note": out.note,
                                      "pages_returned": out.pages_returned,
                                      "requeue": out.requeue, "seconds": out.chunk_stats.get("seconds"),
                                      "pages": [page_record(p) for p in out.pages]})
                doc["open"] -= 1
                if out.requeue:
                    for na, nb in requeue_rule(a, b, len(out.pages), out.finish_reason):
                        waiting.append((("chunk", seed, na, nb), images[seed][na - 1 : nb]))
                        doc["open"] += 1
                if doc["open"] == 0:
                    del doc["open"]
                    doc_sink.write(_line(doc))
                    doc_sink.flush()
                    counts["documents"] += 1
                    counts["pages"] += doc["rung"]["pages"]
                    bar.update(doc["rung"]["pages"])
                    queue_alone(seed, doc, images.pop(seed))
                    del docs_open[seed]
            bar.set_postfix(alone=counts["alone"], rows=decoder.engine.active, refresh=False)
    dropped = decoder.abandon() if decoder.busy else []
    pool.terminate()
    bar.close()
    total = read_lines(decoded_path)
    record = {"args": {"model": model, "docs": docs, "seed0": seed0, "mode": mode, "max_batch": max_batch,
                       "procs": procs, "budget_s": budget_s, "budget_pages": budget_pages,
                       "tokens_per_page": tokens_per_page},
              "environment": environment(decoder), "this_run": {**counts, "seconds": round(time.perf_counter() - t0, 1),
                                                               "load_seconds": round(t_load, 1),
                                                               "stopped": stopped, "dropped_in_flight": len(dropped)},
              "in_folder": {"documents": len(total), "pages": sum(d["rung"]["pages"] for d in total),
                            "held_out_pages": sum(d["rung"]["pages"] for d in total if d["half"] == "held_out"),
                            "read_alone": len(read_lines(alone_path))}}
    with (folder / "runs.jsonl").open("a", encoding="utf-8") as sink:
        sink.write(json.dumps(record) + "\n")
    return record


def _line(item: dict[str, Any]) -> str:
    return json.dumps(item, ensure_ascii=False, separators=(",", ":")) + "\n"
