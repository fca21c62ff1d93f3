"""The block drafter on static buffers, one CUDA graph per page-memory bucket: the fast path's ``block`` drafter.

`engine.drafters.block.BlockDrafter` runs the drafter network eagerly: on a GPU its ~60 small kernels cost about
as much as a verify step of a small target (the demo model's block drafter took a third of the decode time on
an H200). `StaticBlockDrafter` keeps everything a draft reads at fixed addresses, so one graph replay drafts:

- ``ctx`` [1, C, F]: the target's features of the last C committed inputs, shifted in place by ``feed``;
- ``last`` [1]: the id of o_t (the last committed token), written before each replay;
- the page memory's keys and values per drafter layer, [1, heads, M, head_dim], for a bucket M >= the prompt
  length (a multiple of ``memory_bucket``), zero-padded, with ``allowed`` masking the padding; projected once per
  decode by the first ``feed``, as the eager drafter does;
- ``out`` [k]: the drafted ids, the graph's output.

Invariants: one object serves one decode at a time (``start`` begins one); ``feed`` gets every committed input
in order, exactly once; a graph captured for a bucket reads only these buffers, so replays after later feeds
draft from the new state. ``graphs=False`` runs the same body eagerly (any device; the CPU tests compare it
with `BlockDrafter`). The drafts are the same as the eager drafter's up to float rounding of the padded
attention; exactness never depends on them (every draft is verified).

``linear="bmv"`` runs the drafter's own linears as batched GEMVs (`engine.gemv`; not the target's LM head, where
F.linear measured faster at width 9: 4.6 against 6.7 us): the draft is a 40-row forward (32 context + 8 block rows)
whose fp32 projections may meet the slow cuBLAS GEMM kernel that ``bmv`` avoids in the target's step. Opt-in
until measured on a GPU (``torch`` is the default).

``compile=True`` runs the draft body through ``torch.compile`` (`engine.static_runner.compile_body`) before the
graph captures it: a draft is ~60 small kernels (layer norms, GELU, masks, residual adds between the GEMMs), and
inductor fuses the elementwise chains. If compiling fails the drafter logs why (``compile_error``) and drafts with
the plain body. The drafts may differ from the eager drafter's by float rounding; exactness never depends on them.
Opt-in until measured on a GPU.

``device_drafts=True`` (what `engine.fast_decoder.FastDecoder` asks for) returns each draft as a
`engine.drafters.DeviceDraft`: no copy to the host and no wait; the verify step copies the ids into its static
input on the device and hands them back with its own rows, so a round has one host sync instead of two and the
host stages the verify while the draft still runs.
"""

from __future__ import annotations

import math

import torch
from loguru import logger

from engine.cuda_graphs import StepGraphs
from engine.drafters import DeviceDraft
from engine.drafters.block import BlockDrafterNet, PageMemory, check_fed
from engine.gemv import with_gemv_linears

MEMORY_BUCKET = 256  # prompt lengths are rounded up to this for the memory buffers (one graph per bucket)
DRAFT_LINEARS = ("torch", "bmv")


class StaticBlockDrafter:
    name = "block"

    def __init__(self, net: BlockDrafterNet, embed_tokens, lm_head, graphs: bool = False,
                 memory_bucket: int = MEMORY_BUCKET, linear: str = "torch", compile: bool = False,
                 device_drafts: bool = False):
        if linear not in DRAFT_LINEARS:
            raise ValueError(f"linear must be one of {DRAFT_LINEARS}, not {linear!r}")
        c = net.config
        p = next(net.parameters())
        self.net, self.embed_tokens, self.lm_head = net, embed_tokens, lm_head
        self.linear = linear
        self.device_drafts = device_drafts
        # what a draft runs: the same parameters, the linears written as ``linear`` says
        self._step_net = with_gemv_linears(net) if linear == "bmv" else net
        self.memory_bucket = memory_bucket
        self._compiled = None
        self.compile_error: str | None = None
        if compile:
            from engine.static_runner import compile_body

            self._compiled = compile_body(self._body)
        self.ctx = torch.zeros(1, c.context, len(c.layers) * c.target_hidden, device=p.device, dtype=p.dtype)
        self.last = torch.zeros(1, dtype=torch.long, device=p.device)
        self._memory: dict[int, PageMemory] = {}  # bucket -> static keys/values and mask
        self.graphs = StepGraphs(lambda _width, bucket: self._run(bucket), p.device) if graphs else None
        self.start()

    def start(self) -> None:
        """Begin a decode: nothing fed yet."""
        self.fed = 0
        self.prompt_len: int | None = None
        self.bucket = 0

    def _memory_buffers(self, bucket: int) -> PageMemory:
        if bucket not in self._memory:
            c, p = self.net.config, self.ctx
            head_dim = c.dim // c.num_heads
            kv = [tuple(torch.zeros(1, c.num_heads, bucket, head_dim, device=p.device, dtype=p.dtype)
                        for _ in range(2)) for _ in range(c.num_layers)]
            allowed = torch.zeros(1, 1, 1, bucket, dtype=torch.bool, device=p.device)
            self._memory[bucket] = PageMemory(kv, allowed)
        return self._memory[bucket]

    @torch.no_grad()
    def feed(self, features: torch.Tensor) -> None:
        """features [n, L*H] of the next n committed inputs (the prompt first, from the prefill)."""
        c = self.net.config
        if self.prompt_len is None:
            P = self.prompt_len = features.shape[0]
            if c.memory:
                self.bucket = self.memory_bucket * math.ceil(P / self.memory_bucket)
                static = self._memory_buffers(self.bucket)
                fresh = self.net.encode_memory(features[None])
                for (k, v), (sk, sv) in zip(fresh.kv, static.kv):
                    sk.zero_()
                    sv.zero_()
                    sk[:, :, :P].copy_(k)
                    sv[:, :, :P].copy_(v)
                static.allowed.zero_()
                static.allowed[..., :P] = True
        n, C = features.shape[0], c.context
        ctx = self.ctx[0]
        if n >= C:
            ctx.copy_(features[-C:])
        else:
            ctx[: C - n].copy_(ctx[n:].clone())
            ctx[C - n :].copy_(features)
        self.fed += n

    def _body(self, bucket: int) -> torch.Tensor:
        memory = self._memory[bucket] if self.net.config.memory else None
        last = self.embed_tokens(self.last).to(self.ctx.dtype)
        return self._step_net(self.ctx, last, self.lm_head, memory)[0].argmax(-1)

    def _run(self, bucket: int) -> torch.Tensor:
        """`_body`, compiled when asked for and compiling works: what drafts run and the graph captures."""
        if self._compiled is not None:
            try:
                return self._compiled(bucket)
            except Exception as exc:  # noqa: BLE001 - an inductor/dynamo failure: the plain body drafts the same
                self.compile_error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
                logger.warning("compiled block drafter unavailable ({}); drafting uncompiled", self.compile_error)
                self._compiled = None
        return self._body(bucket)

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    @property
    def max_draft(self) -> int:
        return self.net.config.block

    @torch.no_grad()
    def propose(self, committed_ids: list[int], k: int) -> list[int] | DeviceDraft:
        """Up to k drafted ids: a list, or with ``device_drafts`` a `DeviceDraft` (no host sync: the verify step
        reads the ids on the device; valid until the next draft)."""
        c = self.net.config
        if k < 1 or self.prompt_len is None or self.fed < c.context:
            return []
        check_fed(self.fed, self.prompt_len, committed_ids)
        self.last.fill_(committed_ids[-1])
        out = self.graphs.replay(0, self.bucket) if self.graphs is not None else self._run(self.bucket)
        ids = out[: min(k, c.block)]
        return DeviceDraft(ids) if self.device_drafts else ids.tolist()
