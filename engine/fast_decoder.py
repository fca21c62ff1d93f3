"""`plain` / `lossless` / `fast` decoding on the static runner, with CUDA graphs on a GPU: the fast path of issue 6.

`FastDecoder` is a `SpeculativeDecoder` (same modes, drafters, `decode()` contract and stats) whose decode
loop runs on `engine.static_runner.StaticRswaRunner`:
- backend ``graphs``: prefill and vision eager; every verify/plain step replays a CUDA graph captured per
  (width bucket, prefix bucket) right after the prefill of a chunk (widths 1, 2, 4 ... k_max + 1);
- backend ``static``: the same static buffers and step, run eagerly (any device; the CPU tests use it);
- backend ``eager``: the eager engine (`SpeculativeDecoder.generate`);
- ``auto`` (default): ``graphs`` on CUDA, else ``eager``.
If graph capture (or anything else in the static path) fails, the decoder logs why, with the traceback, and
decodes with the eager engine from then on (the chunk is decoded again from its start: nothing is lost).

A round is the eager engine's (`engine.verify`) with the argmax taken on the device: the host gets the
k + 1 greedy choices in one copy and asks for a full logits row only when the no-repeat-ngram rule bans
the argmax of that row (then the row's greedy choice after the bans is computed as `greedy_token` does).
In ``fast`` mode the same copy carries each draft token's logit, so the relaxed rule (`engine.verify`) costs no
extra sync. The block drafter's draft never visits the host before its verify (``device_drafts``): the step
copies it into its static input on the device and the same copy brings the drafted ids back, so the host launches
draft and verify back to back and waits once a round (then ``draft_s`` is the draft's launch only; its GPU time
lands in ``verify_s``). Extra stats: backend, moe, linear, attn, graphs (number captured), capture_s (inside
prefill_s), device_drafts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from loguru import logger

from engine.cuda_graphs import GraphCaptureError, StepGraphs, cuda_graphs_available
from engine.drafters import DeviceDraft, Drafter
from engine.drafters.block_static import StaticBlockDrafter
from engine.drafters.policy import DraftPolicy
from engine.model import LoadedModel
from engine.ngram_rule import NoRepeatNgramRule, greedy_token
from engine.official import DecodeResult, decode_text, official_inputs
from engine.speculative import DRAFTERS, SpeculativeDecoder, run_rounds
from engine.static_runner import StaticRswaRunner

BACKENDS = ("auto", "graphs", "static", "eager")
DrafterFactory = Callable[[str, "list[str] | None", "list[int] | None"], list[Drafter]]


class FastDecoder(SpeculativeDecoder):
    """moe: routed-expert implementation of the static step (`engine.static_moe`); attn: its attention
    (``auto``, ``sdpa``, ``matmul`` or ``matmul_t``, see `engine.static_runner`); compile_step: ``torch.compile``
    the step before the graphs capture it (fewer, fused kernels; `engine.static_runner`); linear: how the step
    writes its projections (``auto``, ``torch`` or ``bmv``, `engine.static_runner`); draft_linear: the same for the
    block drafter's static forward (``torch`` or ``bmv``, `engine.drafters.block_static`); compile_draft:
    ``torch.compile`` that forward before its graph captures it (`engine.drafters.block_static`); device_drafts:
    the block drafter's drafts stay on the device for the verify step to read (one host sync a round; False: the
    host reads each draft first, two syncs, as before session 15).
    drafter_factory: (prompt kind, reference_texts, replay_ids) -> drafters, replacing the named ones
    (benchmarks use it to feed drafts of a controlled quality). prefix_capacity: see StaticRswaRunner.
    engine_options: passed on to SpeculativeDecoder (e.g. fast_threshold for mode ``fast``)."""

    def __init__(self, loaded: LoadedModel, mode: str = "lossless", k_max: int = 16,
                 drafters: tuple[str, ...] = DRAFTERS, backend: str = "auto", moe: str = "auto",
                 drafter_factory: DrafterFactory | None = None, prefix_capacity: int = 0, attn: str = "auto",
                 compile_step: bool = False, linear: str = "auto", draft_linear: str = "torch",
                 compile_draft: bool = False, device_drafts: bool = True, **engine_options):
        super().__init__(loaded, mode=mode, k_max=k_max, drafters=drafters, **engine_options)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
        self.moe = moe  # resolved by the static runner (auto -> grouped/gather)
        self.drafter_factory = drafter_factory
        self.fallback_reason: str | None = None
        self.static: StaticRswaRunner | None = None
        self.static_block: StaticBlockDrafter | None = None  # the block drafter on static buffers (graphs on CUDA)
        if backend == "auto":
            ok, why = cuda_graphs_available()
            on_cuda = loaded.device.type == "cuda"
            backend = "graphs" if ok and on_cuda else "eager"
            if backend == "eager":
                self.fallback_reason = why if not ok else f"model on {loaded.device}"
                logger.info("fast path off ({}): eager engine", self.fallback_reason)
        if backend == "graphs" and loaded.device.type != "cuda":
            raise ValueError(f"backend 'graphs' needs the model on a CUDA device, not {loaded.device}")
        self.backend = backend
        if backend in ("graphs", "static"):
            block = self.block_net is not None and "block" in drafters and mode != "plain"
            layers = tuple(self.block_net.config.layers) if block else ()
            self.static = StaticRswaRunner(loaded.model, k_max + 1, moe=moe, prefix_capacity=prefix_capacity,
                                           attn=attn, capture_layers=layers, compile_step=compile_step,
                                           linear=linear)
            self.moe = self.static.moe
            if block:
                model = loaded.model
                self.static_block = StaticBlockDrafter(self.block_net, model.get_input_embeddings(), model.lm_head,
                                                       graphs=backend == "graphs", linear=draft_linear,
                                                       compile=compile_draft, device_drafts=device_drafts)
        if backend == "graphs":
            try:
                self.static.graphs = StepGraphs(self.static.body, loaded.device)
            except GraphCaptureError as exc:
                self._fall_back(exc)

    def describe(self) -> dict:
        return {**super().describe(), "backend": self.backend, "moe": self.moe if self.static else None,
                "fallback_reason": self.fallback_reason}

    def _fall_back(self, exc: Exception) -> None:
        self.fallback_reason = f"{type(exc).__name__}: {exc}"
        logger.opt(exception=exc).warning("fast path ({}) disabled, decoding with the eager engine from now on: {}",
                                          self.backend, self.fallback_reason)
        self.backend, self.static, self.static_block = "eager", None, None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _drafters(self, kind, reference_texts, replay_ids) -> list[Drafter]:
        if self.mode == "plain":
            return []
        if self.drafter_factory is not None:
            return self.drafter_factory(kind, reference_texts, replay_ids)
        return super()._drafters(kind, reference_texts, replay_ids)

    def _block_drafter(self) -> Drafter:
        if self.static_block is None:  # eager path (or after a fall-back)
            return super()._block_drafter()
        self.static_block.start()  # the static path: the same network, drafting by graph replay
        return self.static_block

    def generate(self, images: list, max_new_tokens: int, reference_texts: list[str] | None = None,
                 replay_ids: list[int] | None = None) -> DecodeResult:
        if self.backend == "eager":
            return super().generate(images, max_new_tokens, reference_texts, replay_ids)
        try:
            return self._generate_static(images, max_new_tokens, reference_texts, replay_ids)
        except Exception as exc:  # noqa: BLE001 - a fast-path failure must not lose the chunk
            self._fall_back(exc)
            return super().generate(images, max_new_tokens, reference_texts, replay_ids)

    def _generate_static(self, images, max_new_tokens, reference_texts, replay_ids) -> DecodeResult:
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        loaded, eos, runner = self.loaded, self.loaded.eos_token_id, self.static
        kind = "single" if len(images) == 1 else "multi"
        t0 = time.perf_counter()
        inputs = official_inputs(loaded, images, kind)
        prompt_ids = inputs["input_ids"][0].tolist()
        rule = NoRepeatNgramRule(*self._rules[kind], prompt_ids)
        logits = runner.prefill(inputs)
        drafters = self._drafters(kind, reference_texts, replay_ids)
        block = next((d for d in drafters if d.name == "block"), None)
        if block:
            block.feed(runner.features)
        output = [greedy_token(logits, rule.banned())]
        logprobs = [float(logits[output[0]] - torch.logsumexp(logits, dim=-1))]
        rule.extend(output)
        t_capture = time.perf_counter()
        captured = runner.capture_graphs()  # GraphCaptureError -> eager engine (caller)
        capture_s = time.perf_counter() - t_capture
        policy = DraftPolicy(drafters, self.k_max)  # the runner's widths end at k_max + 1: replay stays within k_max
        fast = self.fast_threshold if self.mode == "fast" else None
        strict = frozenset(i for i in (eos, loaded.page_sep_id) if i is not None)

        def one_round(last: int, draft: list[int]) -> tuple[list[int], list[float], int]:
            emitted, step_logprobs, relaxed = verify_static(runner, rule, last, draft, eos, fast, strict)
            if block:
                block.feed(runner.features[: len(emitted)])  # the inputs this round committed
            return emitted, step_logprobs, relaxed

        loop = run_rounds(policy, one_round, output, logprobs, rule, eos, max_new_tokens,
                          prefill_s=time.perf_counter() - t0)
        seconds = time.perf_counter() - t0
        stats = {"mode": self.mode, "k_max": self.k_max, "tokens": len(output), **loop,
                 "cache_bytes": runner.nbytes(), "ring_slots": runner.ring_size,
                 "backend": self.backend, "moe": self.moe, "attn": runner.attn,
                 "linear": runner.linear, "graphs": len(runner.graphs or ()),
                 "draft_linear": self.static_block.linear if self.static_block else None,
                 "draft_compiled": self.static_block.compiled if self.static_block else None,
                 "device_drafts": self.static_block.device_drafts if self.static_block else None,
                 "graphs_captured_now": captured, "capture_s": round(capture_s, 4), "compiled": runner.compiled,
                 **({"compile_error": runner.compile_error} if runner.compile_error else {})}
        text = decode_text(loaded, output) if loaded.tokenizer is not None else ""
        return DecodeResult(prompt_ids=prompt_ids, output_ids=output,
                            finish_reason="eos" if output[-1] == eos else "length", seconds=seconds,
                            text=text, prompt_kind=kind, n_pages=len(images), ngram_window=self._rules[kind][1],
                            extra={"speculative": stats}, logprobs=logprobs)


def verify_static(runner: StaticRswaRunner, rule: NoRepeatNgramRule, last_token: int,
                  draft: list[int] | DeviceDraft, eos_token_id: int, fast_threshold: float | None = None,
                  strict_ids: frozenset[int] | set[int] = frozenset()) -> tuple[list[int], list[float], int]:
    """`engine.verify.verify_round` on the static runner: emitted tokens d1..da + the target's own, EOS-truncated,
    their log-probabilities (log-softmax of the fp32 logits before the bans, as the eager engine records) and how
    many were accepted by fast mode's relaxed rule (``fast_threshold`` None: lossless, 0). A `DeviceDraft` is
    staged by a device copy and read back from the step's rows (the same judgement, one host sync)."""
    if isinstance(draft, DeviceDraft):
        rows = runner.step([last_token], device_tail=draft.ids)
        draft = [row[4] for row in rows[:-1]]
    else:
        rows = runner.step([last_token, *draft])
    log_threshold = math.log(fast_threshold) if fast_threshold else None
    emitted: list[int] = []
    logprobs: list[float] = []
    relaxed = 0
    for i in range(len(draft) + 1):
        banned = rule.banned(draft[:i])
        target, best, lse, drafted, _ = rows[i]
        if target in banned:  # rare: the argmax itself is banned; redo the row as generate() does
            row = runner.logits_row(i)
            target = greedy_token(row, banned)
            best = float(row[target])
        if (i < len(draft) and draft[i] != target and log_threshold is not None and drafted - lse >= log_threshold
                and draft[i] not in banned and draft[i] not in strict_ids and target not in strict_ids):
            emitted.append(draft[i])  # fast mode: the target finds the draft token likely enough
            logprobs.append(drafted - lse)
            relaxed += 1
            continue
        emitted.append(target)
        logprobs.append(best - lse)
        if i == len(draft) or draft[i] != target or target == eos_token_id:
            break
    runner.commit(len(emitted))
    return emitted, logprobs, relaxed
