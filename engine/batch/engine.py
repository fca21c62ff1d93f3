"""Continuous batching with lossless speculation: B rows, each a chunk from its prefill to its end, one loop.

``submit`` queues chunks (`ChunkRequest`, made by ``prepare``: the processor runs on the caller's thread);
``step`` runs the one decode loop's next turn and returns the chunks that ended in it:
1. admission (`engine.batch.admission`): while rows are free and chunks wait, a bounded piece of the queue (at
   most ``admit_tokens`` prefix tokens a turn, in groups of at most ``admit_pages`` pages) goes through the vision
   tower together (`engine.model.vision`), each chunk is prefilled into its row (`engine.model.forward`) and takes
   its first token; the rows already decoding wait for that piece only;
2. each row's draft policy proposes its own draft (reference, replay, markup, ngram on the host; the block
   drafter for all rows in one device forward); `engine.batch.step_width` picks the step width from the rows'
   acceptance and the measured cost of each width at this batch size and prefix (plain decoding is width 1, taken
   whenever a wider step does not promise more tokens per second);
3. one forward runs every row's ``[last token, drafts, padding]`` (a CUDA graph per rows x width x prefix bucket
   on a GPU), one copy brings each token's greedy choice to the host; when the next step is a plain one whose inputs
   are then known, it goes to the device at once, before this step's bookkeeping (`engine.batch.overlap`);
4. each row applies the one acceptance rule (`engine.batch.acceptance`): it commits what the target itself chose, so
   every chunk's tokens equal official ``generate()`` of that chunk alone; a row that reaches EOS or its token limit
   ends, its results leave at once and its row is free for the next chunk.
Batch 1 is the same code; the CPU runs it without graphs.

Out of memory while stepping: the chunks of the highest rows go back to the front of the queue (decoded again from
their start: nothing is lost, the tokens are the same) and the batch stays smaller from then on; while admitting:
see `engine.batch.admission`.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np
import torch
from loguru import logger

from engine.batch.acceptance import accept
from engine.batch.admission import ADMIT_PAGES, ADMIT_TOKENS, VISION_GROUP, admit
from engine.batch.loop_watch import LOOP_EVERY, LoopWatch
from engine.batch.memory import admission_bytes, free_bytes, rows_to_drop
from engine.batch.overlap import Launched, admission_waits, next_plain_step, stage_inputs
from engine.batch.requests import ChunkRequest, ChunkResult
from engine.batch.rows import DRAFTERS, MODES, Row, make_drafters
from engine.batch.step_width import StepWidth
from engine.batch.vision_ahead import VisionAhead
from engine.drafters.block_rows import BlockRows
from engine.kernels.step_graphs import GraphCaptureError, StepGraphs, cuda_graphs_available
from engine.model.forward import BatchForward
from engine.model.kv_slots import PREFIX_BUCKETS, KVSlots, bucket, pow2_buckets
from engine.model.load import LoadedModel
from engine.model.sam_attention import resolve as resolve_vision_attention
from engine.ngram_rule import official_rule
from engine.official import chunk_inputs

TRACE_EVERY = 1.0  # seconds between two points of ``BatchEngine.trace``


class BatchEngine:
    """mode: plain | lossless | fast (fast_threshold). max_batch: rows. k_max: most drafted tokens per row and step.
    graphs: use CUDA graphs (auto: on CUDA). kernels/moe/attn/linear: `engine.model.forward`. block_net: a trained
    `BlockDrafterNet` (drafts when the chunk has no full copy source, unless block_beside_copies).
    prefix_capacity: prefix tokens the rows hold from the start (grown on demand). vision_group: pages per vision
    batch; padded to it with batch-invariant kernels. drafter_factory(request) -> host drafters, replacing the
    named ones (benchmarks feed drafts of a controlled quality). adaptive_width False: every step runs the widest
    draft its rows want (no `engine.batch.step_width` choice), for tests and for measuring the draft policy alone.
    admit_pages, admit_tokens: the bounds of one admission group and of one turn's admission
    (`engine.batch.admission`). admission_hook(requests): called before each admission group reaches the device
    (tests inject an out-of-memory error there). loop_check(page_ids) -> bool: a page caught looping ends its row at
    the check point, finish reason ``repetition`` (`engine.batch.loop_watch`; every ``loop_every`` page tokens);
    None: rows run to EOS or their limit, as ``generate()``. step_tokens: the most tokens one step runs over all its
    rows (its logits and activations are sized by it; a step of many rows then runs narrower: `widest_at`); default:
    every row at the widest width. vision_attention: SAM's attention in the engine's vision calls
    (`engine.model.sam_attention`: auto = a fused kernel on CUDA in bf16/fp16, the model's own code elsewhere).
    vision_ahead: the pages of chunks waiting for a row through the vision tower while the rows decode
    (`engine.batch.vision_ahead`; auto: on CUDA in bf16/fp16, on a second stream). tune_tiles: with the invariant
    kernels on CUDA in bf16/fp16, their tiles measured first, before the cache takes the memory (once a process:
    `engine.kernels.tiles`; only configurations bitwise equal to the default are kept). overlap: the next plain step
    goes to the device before the host commits this one (`engine.batch.overlap`; the same tokens)."""

    def __init__(self, loaded: LoadedModel, mode: str = "lossless", *, max_batch: int = 1, k_max: int = 16,
                 drafters: tuple[str, ...] = DRAFTERS, fast_threshold: float = 0.3, block_net=None,
                 block_beside_copies: bool = False, block_sits_out: bool = True, block_full_k: bool = False,
                 graphs: str | bool = "auto", kernels: str = "torch", moe: str = "auto", attn: str = "auto",
                 linear: str = "auto", prefix_capacity: int = 0, vision_group: int = VISION_GROUP, drafter_factory=None,
                 adaptive_width: bool = True, admit_pages: int = ADMIT_PAGES, admit_tokens: int = ADMIT_TOKENS,
                 loop_check=None, loop_every: int = LOOP_EVERY, step_tokens: int | None = None,
                 vision_attention: str = "auto", vision_ahead: str | bool = "auto", tune_tiles: bool = True,
                 overlap: bool = True):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        if set(drafters) - set(DRAFTERS) or k_max < 1 or max_batch < 1 or not 0.0 < fast_threshold <= 1.0:
            raise ValueError(f"drafters among {DRAFTERS}, k_max >= 1, max_batch >= 1, fast_threshold in (0, 1]")
        model, config = loaded.model, loaded.model.config.text_config
        if block_net is not None and block_net.config.target_hidden != config.hidden_size:
            raise ValueError(f"the block drafter was made for hidden size {block_net.config.target_hidden}, "
                             f"the model has {config.hidden_size}")
        self.loaded, self.mode, self.k_max = loaded, mode, k_max
        self.overlap, self.in_flight = overlap, None  # the step launched ahead (`engine.batch.overlap`), if any
        self.steps_ahead = 0  # steps launched before the host committed the one before
        self.drafter_names, self.fast_threshold = tuple(drafters), fast_threshold
        self.block_beside_copies, self.block_sits_out, self.block_full_k = \
            block_beside_copies, block_sits_out, block_full_k
        self.drafter_factory, self.adaptive_width = drafter_factory, adaptive_width
        self.admit_pages, self.admit_tokens = max(1, admit_pages), max(1, admit_tokens)
        self.admit_waited = 0  # turns the next admission group has waited to fill a vision call (`admission`)
        self.admission_hook = lambda requests: None
        self.loop_check, self.loop_every = loop_check, loop_every
        self.rules = {kind: official_rule(loaded, kind) for kind in ("single", "multi")}
        self.eos = loaded.eos_token_id
        self.strict = frozenset(i for i in (self.eos, loaded.page_sep_id) if i is not None)
        if kernels == "invariant" and tune_tiles:
            from engine.kernels.invariant import measure_tiles

            measure_tiles(model)
        max_width = k_max + 1  # plain runs width 1 only, but the ring (and so every row's key walk) is the same
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.kv = KVSlots(num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
                          head_dim=head_dim, window=config.sliding_window, max_batch=max_batch, max_width=max_width,
                          prefix_capacity=bucket(max(prefix_capacity, 1), PREFIX_BUCKETS), dtype=loaded.dtype,
                          device=loaded.device)
        use_block = block_net is not None and mode != "plain" and "block" in drafters
        layers = tuple(block_net.config.layers) if use_block else ()
        self.widths = [1] if mode == "plain" else pow2_buckets(max_width)
        self.step_tokens = max(max_batch, max(self.widths), min(max_batch * max(self.widths), step_tokens or 2**62))
        self.forward = BatchForward(model, self.kv, kernels=kernels, moe=moe, attn=attn, linear=linear,
                                    capture_layers=layers, step_tokens=self.step_tokens)
        if graphs == "auto":
            graphs = loaded.device.type == "cuda" and cuda_graphs_available()[0]
        # the graphs' body is the forward's, not a method of the engine: no reference cycle keeps a done engine alive
        self.graphs = StepGraphs(self.forward.step_key, loaded.device) if graphs else None
        self.block = BlockRows(block_net, model.get_input_embeddings(), model.lm_head, max_batch,
                               graphs=bool(graphs)) if use_block else None
        self.vision_group, self.pad_vision = vision_group, kernels == "invariant"
        self.vision_attention = resolve_vision_attention(vision_attention, loaded.device, loaded.dtype)
        half_on_cuda = loaded.device.type == "cuda" and loaded.dtype != torch.float32  # (fp32: the exactness path)
        self.ahead = VisionAhead(loaded.device, half_on_cuda if vision_ahead == "auto" else bool(vision_ahead),
                                 ahead_pages=max(self.admit_pages, vision_group))
        self.row_buckets = pow2_buckets(max_batch)
        self.step_width = StepWidth(self.widths)
        self.max_batch = self.row_limit = max_batch
        self.rows: list[Row | None] = [None] * max_batch
        self.pending: deque[ChunkRequest] = deque()
        self.steps = 0
        self.decoded = 0  # tokens the rows committed (first tokens at admission included), chunks in flight too
        self.trace: list[tuple[float, int, int, int]] = []  # (wall clock, steps, decoded, rows) about once a second
        self.width_steps: dict[int, int] = {}  # steps run at each width
        self.timing = {"vision_s": 0.0, "prefill_s": 0.0, "steps_s": 0.0,  # wall time of the engine's work
                       "vision_ahead_s": 0.0}  # (vision ahead: the host's share; its kernels run beside the steps)
        self.memory_events: list[dict] = []  # each shrink after out of memory (`_shrink`)
        # what one admission group takes on the device at most: the model's estimate, raised by what admissions
        # measured (`engine.batch.admission`); 0 off CUDA (no figures: an out-of-memory error halves the batch)
        self.admission_need = admission_bytes(loaded, vision_group=vision_group) if loaded.device.type == "cuda" else 0
        self.admission_peak = 0  # the largest admission measured, bytes above what was allocated before it
        self.admission_measured = 0  # the most an admission took or asked for (peaks, and failures: held + asked)
        self.fit_rows()

    def prepare(self, images: list, max_new_tokens: int, key: Any = None, reference_texts: list[str] | None = None,
                replay_ids: list[int] | None = None, inputs: Any = None) -> ChunkRequest:
        """A chunk of ``images`` (1 page: the single-page prompt, else the multi-page one) to decode up to
        ``max_new_tokens``; the processor runs here, on the caller's thread, unless ``inputs`` holds its outputs for
        these images already (``engine.official.chunk_inputs``, built elsewhere: a page-preparation process)."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        kind = "single" if len(images) == 1 else "multi"
        if inputs is None:
            inputs = chunk_inputs(self.loaded, images, kind)
        return ChunkRequest(key, inputs, kind, len(images), max_new_tokens, reference_texts, replay_ids)

    def submit(self, request: ChunkRequest) -> None:
        if self.row_limit == 0:  # `close` gave the cache back: a chunk queued here would wait forever
            raise RuntimeError("this engine was closed (its memory given back): load the model again to decode")
        self.pending.append(request)

    @property
    def active(self) -> int:
        return sum(r is not None for r in self.rows)

    @property
    def busy(self) -> bool:
        return bool(self.pending) or self.active > 0

    def run(self, requests: list[ChunkRequest]) -> list[ChunkResult]:
        """Decode ``requests`` to their ends; results in the order given."""
        for r in requests:
            self.submit(r)
        done: dict[int, ChunkResult] = {}
        while self.busy:
            for res in self.step():
                done[id(res.request)] = res
        return [done[id(r)] for r in requests]

    @torch.inference_mode()
    def step(self) -> list[ChunkResult]:
        """Admit what fits, run one step over every row, return the chunks that ended."""
        # a step launched ahead is completed before an admission changes the rows (it then launches nothing ahead)
        finished = self._step() if self.in_flight is not None and admission_waits(self) else []
        finished += admit(self)
        if not self.active:
            return finished
        self.ahead.launch(self)
        try:
            finished += self._step()
            return finished
        except torch.OutOfMemoryError:
            if self.active <= 1:
                raise  # one chunk alone does not fit: the caller decides (e.g. split it)
        # shrink outside the handler, whose traceback held the failed step's tensors
        self._shrink(max(1, self.active // 2), "out of memory in a step (OutOfMemoryError)")
        return finished

    def shrink_for_admission(self, reason: str) -> None:
        """One chunk ran out of memory at admission beside rows in flight: keep fewer rows until the free memory
        covers what admission needs (what admissions measured, the failed one's held memory and failed allocation
        included, ``admission_measured``; before any measure the model's estimate, ``admission_need``;
        `engine.batch.memory`), dropping at once the rows whose memory it lacks. Without figures (off CUDA) the batch
        halves."""
        need = self.admission_measured or self.admission_need
        if need <= 0:
            self._shrink(max(1, self.kv.rows // 2), reason)
            return
        while True:
            free = self.free_memory()
            keep = max(1, self.kv.rows - rows_to_drop(self.kv.bytes_per_row(), need, free))
            self._shrink(keep, f"{reason}; {need / 2**30:.1f} GiB needed, {free / 2**30:.1f} GiB free")
            if self.kv.rows == 1 or self.free_memory() >= need:
                return

    def free_memory(self) -> int:
        """Bytes a new allocation can take on the device now (`engine.batch.memory.free_bytes`); 0 off CUDA."""
        return free_bytes(self.loaded.device) if self.loaded.device.type == "cuda" else 0

    def fit_rows(self) -> None:
        """Keep the batch within the rows the key/value cache holds (fewer than ``max_batch`` when memory was short,
        `engine.model.kv_slots`): the rows above go back to the queue."""
        if self.kv.rows < self.row_limit:
            self._shrink(self.kv.rows, f"the key/value cache holds {self.kv.rows} rows of {self.kv.capacity} "
                                       f"prefix tokens")
        self.row_buckets = pow2_buckets(self.kv.rows)

    @torch.inference_mode()
    def drop_rows(self) -> list[ChunkRequest]:
        """Free every row (after an error the caller handles); returns their requests. The queue stays."""
        self.in_flight = None  # a step launched ahead is dropped with its rows (nothing of it was committed)
        dropped = [r.request for r in self.rows if r is not None]
        for row in [r for r in self.rows if r is not None]:
            self.rows[row.index] = None
            self.kv.close_row(row.index)
        return dropped

    def reset(self) -> list[ChunkRequest]:
        """Drop every row and the queue; returns their requests."""
        dropped = self.drop_rows() + list(self.pending)
        self.pending.clear()
        return dropped

    def close(self) -> None:
        """Give the device memory back now: rows and queue dropped, the graphs, the key/value cache, the step buffers
        and the block drafter's buffers freed, whoever still holds the engine. It cannot decode again: ``submit``
        raises."""
        self.reset()
        if self.graphs is not None:
            self.graphs.close()
        if self.block is not None:
            self.block.close()
        self.graphs = self.block = None
        self.kv.release()
        self.forward.release()
        self.row_limit = 0
        if self.loaded.device.type == "cuda":
            torch.cuda.empty_cache()

    def _step(self) -> list[ChunkResult]:
        """One step: the one launched ahead by the last call, or a new one; its results committed. With ``overlap``, the
        next plain step goes to the device before this one's bookkeeping (`engine.batch.overlap`)."""
        launched = self.in_flight or self._launch()
        self.in_flight = None
        rows = self._collect(launched)
        ahead = next_plain_step(self, launched, rows) if self.overlap else None
        finished = self._commit(launched, rows)
        if ahead is not None:
            ahead.t0 = ahead.t_plan = ahead.t_draft = time.perf_counter()  # its wall time runs from here
            self.in_flight, self.steps_ahead = ahead, self.steps_ahead + 1
        return finished

    def _launch(self) -> Launched:
        """Plan the rows' drafts, choose the width, stage the inputs and start the step on the device."""
        t0 = time.perf_counter()
        live = [r for r in self.rows if r is not None]
        n = bucket(live[-1].index + 1, self.row_buckets)
        prefix_bucket = bucket(max(r.prefix_len for r in live), PREFIX_BUCKETS)
        drafting = self.mode != "plain" and (not self.adaptive_width or self.step_width.drafting(n, prefix_bucket))
        plans = [r.plan() if drafting else (None, [], 0) for r in live]
        w, widest = 1, self.widest_at(n)
        if drafting and not self.adaptive_width:
            w = min(bucket(1 + max(len(d) or k for _, d, k in plans), self.widths), widest)
        elif drafting:
            wants = [self._accept_at(row, name, min(len(d) or k, widest - 1)) for row, (name, d, k) in zip(live, plans)]
            w = self.step_width.choose(n, prefix_bucket, wants, any(k for _, _, k in plans))
        t_plan = time.perf_counter()  # the rows' host drafting, and the width chosen on it
        ks = [min(len(d) or dk, w - 1) for _, d, dk in plans]
        stage_inputs(self, live, n, [r.output[-1] for r in live], [r.length for r in live])
        ids = self.kv.host_ids
        block_rows = np.zeros(n, dtype=bool)
        for row, (_, draft, device_k), k in zip(live, plans, ks):
            if k and draft:
                ids[row.index, 1 : 1 + k] = draft[:k]
            elif k:
                block_rows[row.index] = True
        t_draft = time.perf_counter()
        self.kv.stage()
        if block_rows.any():
            out = self.block.draft(n, ids[:n, 0].copy())
            width = min(w - 1, self.block.block)
            mask = torch.as_tensor(block_rows, device=out.device)[:, None]
            self.kv.ids[:n, 1 : 1 + width] = torch.where(mask, out[:, :width], self.kv.ids[:n, 1 : 1 + width])
        captures = self._captures()
        summary = self._run(n, w, min(prefix_bucket, self.kv.capacity))
        return Launched(live, n, w, prefix_bucket, plans, ks, bool(block_rows.any()), drafting, captures, summary,
                        t0, t_plan, t_draft)

    def _collect(self, launched: Launched) -> np.ndarray:
        """While the device runs the step: each row's bans after each prefix of its host draft (the acceptance rule's
        only host work that grows with the draft; a device (block) draft is known only after the step) and the loop
        watch of what the rows committed so far (`engine.batch.loop_watch`). Then the step's one host sync."""
        launched.bans = [[row.rule.banned(draft[:i]) for i in range(k + 1 if draft else 1)]
                         for row, (_, draft, _), k in zip(launched.live, launched.plans, launched.ks)]
        for row in launched.live:
            if row.watch is not None:
                row.watch.scan(row.output)
        return launched.summary.cpu().numpy()

    def _commit(self, launched: Launched, rows: np.ndarray) -> list[ChunkResult]:
        """Each row applies the acceptance rule to the step's results; the step's costs and counts are kept."""
        live, n, w, plans, ks = launched.live, launched.n, launched.w, launched.plans, launched.ks
        finished, counts = [], {}
        for row, (name, _, _), k, row_bans in zip(live, plans, ks, launched.bans):
            r = rows[row.index]
            if not k and not row_bans[0]:  # the common case: one token, the argmax
                row.take(int(r[0, 0]), float(r[0, 1] - r[0, 2]))
                counts[row.index] = 1
                continue
            res = accept(r, k, row.rule, self.eos, lambda i, b=row.index: self._logits_row(n, w, b, i),
                         self.fast_threshold if self.mode == "fast" else None, self.strict, row_bans)
            row.commit(res, name, k)
            if k:
                self.step_width.record(name, k, len(res.emitted) - 1)
            counts[row.index] = len(res.emitted)
        if self.block is not None:
            self.block.feed(counts, self.forward.step_features(n, w))
        seconds = time.perf_counter() - launched.t0
        self.timing["steps_s"] += seconds
        drafted = launched.t_plan - launched.t0
        # a step that captured graphs says nothing of cost; drafting is priced apart (`engine.batch.step_width`)
        timed = seconds - drafted if self._captures() == launched.captures else None
        self.step_width.observe(n, launched.prefix_bucket, w, launched.block, timed, sum(counts.values()), len(live),
                                drafted if launched.drafting else None)
        share, draft_share = seconds / len(live), (launched.t_draft - launched.t0) / len(live)
        for row, k in zip(live, ks):
            row.account(share, draft_share, bool(k), len(live))
            if row.done(self.eos):
                finished.append(self._finish(row))
        self.steps += 1
        self.decoded += sum(counts.values())
        now = time.time()
        if not self.trace or now - self.trace[-1][0] >= TRACE_EVERY:
            self.trace.append((now, self.steps, self.decoded, len(live)))
        self.width_steps[w] = self.width_steps.get(w, 0) + 1
        return finished

    def widest_at(self, n: int) -> int:
        """The widest step ``n`` rows (a rows bucket) may run within ``step_tokens``."""
        return max(w for w in self.widths if w * n <= self.step_tokens or w == 1)

    def _logits_row(self, n: int, w: int, row: int, i: int) -> torch.Tensor:
        return self.forward.step_logits(n, w)[row, i].float()

    def _captures(self) -> int:
        return sum(g.captured for g in (self.graphs, self.block and self.block.graphs) if g is not None)

    def _run(self, n: int, w: int, prefix_bucket: int) -> torch.Tensor:
        if self.graphs is not None:
            try:
                if self.graphs.ready((n, w, prefix_bucket)):  # else: this shape runs eagerly until captured
                    return self.graphs.replay((n, w, prefix_bucket))
            except GraphCaptureError as exc:
                logger.opt(exception=exc).warning("CUDA graphs off, steps run eagerly from now on: {}", exc)
                self.graphs = None
        return self.forward.step_body(n, w, prefix_bucket)

    def _accept_at(self, row: Row, drafter: str | None, k: int) -> list[float]:
        if drafter is None or not k:
            return []
        stats = row.policy.stats[drafter]
        return self.step_width.accept_at(drafter, stats.accepted_at, stats.proposed_at, k)

    def _drafters_for(self, request: ChunkRequest, row_index: int) -> list:
        if self.mode == "plain":
            return []
        if self.drafter_factory is not None:
            return self.drafter_factory(request)
        return make_drafters(self, request, row_index)

    def _finish(self, row: Row) -> ChunkResult:
        self.rows[row.index] = None
        self.kv.close_row(row.index)
        reason = row.end(self.eos)
        stats = row.stats(mode=self.mode, k_max=self.k_max, cache_bytes=self.kv.bytes_per_row(),
                          ring_slots=self.kv.ring_size, backend="graphs" if self.graphs is not None else "eager",
                          kernels=self.forward.kernels, moe=self.forward.moe)
        return ChunkResult(row.request, row.output, row.logprobs, reason,
                           time.perf_counter() - row.started + row.times["prefill_s"], stats)

    def watch_for_loops(self) -> LoopWatch | None:
        """A new row's loop watch (`engine.batch.loop_watch`), when the engine stops loops."""
        if self.loop_check is None:
            return None
        return LoopWatch(self.loop_check, self.loop_every, self.loaded.page_sep_id)

    def _shrink(self, limit: int, reason: str) -> None:
        """Out of memory: the rows at ``limit`` and above go back to the front of the queue (from their start) and
        the key/value cache gives their memory back (`KVSlots.keep_rows`); the batch stays at ``limit`` rows."""
        self.in_flight = None  # not committed: the rows kept run those positions again
        back = [r for r in self.rows[limit:] if r is not None]
        for row in back:
            self.rows[row.index] = None
            self.kv.close_row(row.index)
        self.pending.extendleft(reversed([r.request for r in back]))
        rows_before = self.kv.rows
        self.row_limit = limit
        if self.graphs is not None:
            self.graphs.clear()  # captured over the buffers about to move
        self.kv.keep_rows(limit)
        self.row_buckets = pow2_buckets(self.kv.rows)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        event = {"reason": reason, "rows_before": rows_before, "rows": self.kv.rows, "queued_again": len(back)}
        if self.loaded.device.type == "cuda":  # where the memory is after the shrink
            event.update(allocated_gb=round(torch.cuda.memory_allocated(self.loaded.device) / 2**30, 2),
                         reserved_gb=round(torch.cuda.memory_reserved(self.loaded.device) / 2**30, 2),
                         driver_free_gb=round(torch.cuda.mem_get_info(self.loaded.device)[0] / 2**30, 2))
        self.memory_events.append(event)
        logger.warning("{}: batch limited to {} rows (the cache held {}); {} chunk(s) queued again from their start",
                       reason, limit, rows_before, len(back))
