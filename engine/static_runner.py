"""The decoder of Unlimited-OCR over static buffers: the step computation that CUDA graphs capture and replay.

Same model computation as `engine.runner.RswaRunner` (the model's own norms, projections, RoPE, router,
experts and lm_head, in the same order), but every tensor a decode step touches has a fixed address and a
shape fixed by two buckets, so one CUDA graph per (width bucket, prefix bucket) can replay it. On the CPU,
or on a GPU without graphs, the same code runs eagerly (``graphs`` None): that is what the CPU tests check
token for token against official ``generate()``.

Buffers (allocated at the first prefill, grown only when a longer prefix arrives; then graphs are dropped):
- per layer, keys and values ``[1, C + P, kv_heads, head_dim]`` (P = prefix capacity, a bucket). Slots
  ``[0, C)`` are the output ring, slots ``[C, C + L)`` the prefix of the current chunk (L tokens). Ring
  first, so that the keys a step needs, ``[0, C + Lb)`` for prefix bucket ``Lb >= L``, are one contiguous
  slice (a view, no copy; [slots, heads, dim] is the layout flash/efficient attention reads natively);
- ``tags[C]``: the absolute position held by each ring slot (``EMPTY`` = never written in this chunk);
- static inputs ``ids[Kmax]``, ``pos[Kmax]`` (Kmax = widest bucket) and the scalar ``prefix_len``;
  a pinned host staging tensor feeds ids and positions with one copy per step.

Invariants (those of `engine.rswa_cache` with padding counted as drafting):
1. A step of k tokens is run at width ``Kb`` = the smallest bucket >= k. Its positions are
   ``length .. length + Kb - 1``; positions past ``length + k - 1`` carry a pad id. Padding is just more
   rejected draft: it writes ring slots and tags that are never committed.
2. ``C >= W + Kmax - 1`` (rounded up to a multiple of 16 for aligned attention rows). So a step never
   overwrites a slot that one of its queries needs, and a committed position a later query needs is never
   overwritten by a padded or rejected write (that write's position is >= C ahead of it, i.e. out of the
   window of every query of any step that could read it).
3. Positions ``< length`` are committed. A query at p sees the prefix slots ``j < L`` (prefix bucket slots
   ``L .. Lb-1`` are masked) and the ring slots whose tag is in ``[p - W + 1, p]``; rejected or padded
   positions have tags ``>= length`` and are rewritten by the step that next holds those positions before
   any query reads them (the step writes before it attends, in every layer). Rollback = ``commit(n)`` only.
4. A step is a pure function of (static inputs, buffers): running it twice writes the same slots with the
   same values. So graph capture (which runs the step eagerly to warm up) at the committed length, with
   any ids, is harmless: it only writes positions ``>= length`` (invariant 3).
5. Buffer shapes never change within a chunk; memory is ``nbytes()`` whatever the output length.

``compile_step=True`` runs the body through ``torch.compile`` (inductor, no cudagraphs of its own; one compiled
graph per (width, prefix bucket)) before the graphs capture it: the same computation with its elementwise chains
(norms, RoPE, router, SiLU * up, residual adds) fused into fewer kernels, which is what a decode step of a few
hundred tiny kernels is bound by on a GPU. If compiling fails, the runner logs why (``compile_error``) and runs
the plain body.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from loguru import logger
from transformers.models.unlimited_ocr.modeling_unlimited_ocr import apply_rotary_pos_emb

from engine.gemv import batched_gemv
from engine.runner import RswaRunner
from engine.static_moe import experts_forward, resolve

# decode-step projections (attention q/k/v/o, dense and shared-expert MLPs; not the router or lm_head):
# ``torch`` = the modules' own F.linear; ``bmv`` = one matrix-vector product per step token, batched
# (`engine.gemv.batched_gemv`); ``auto`` = ``bmv`` for fp32 on CUDA, else ``torch``. Why: for fp32 [8-9, 384] x [384, 384] cuBLAS picks a ~31 us xmma GEMM kernel where width 4
# takes ~7 us and a batched GEMV ~3 us (H200, scripts/profile_linear.py,
# docs/results/profile_linear_h200_2026-12-04.json); the demo model's width-9 verify step cost 2.1 ms against
# 1.1 ms at width 4 (24 such projections a step). Each row is the same GEMV a single-token step runs.
LINEAR_IMPLS = ("auto", "torch", "bmv")

# decode-step attention: torch SDPA with a mask, matmul + fp32 softmax, or ``auto`` = SDPA for a single-token
# step and matmul for a verify of >= 2 tokens. Measured on the H200 at full size over a 16-page prefix (4,374
# keys; docs/results/profile_step_16p_h200_2026-12-04.json, uncompiled replays): SDPA 2.41 ms at width 1 but
# 3.90-4.14 ms at widths 2-17 (cuDNN's sm90 flash kernel, 110 us a layer for 2-17 queries against 13 us for one),
# matmul 2.57 ms at width 1 and 3.00-3.22 ms at widths 2-17. In fp32 on CUDA ``auto`` means matmul at every
# width: there SDPA runs a memory-efficient fp32 kernel (~64 us a layer for one query over ~400 keys); the demo
# model's plain step measured 1.04 ms with SDPA and 0.71 ms with matmul on the H200
# (docs/results/eval_drafter_demo_s12e_bmv{,_matmul}_h200_2026-12-04.json).
ATTN_IMPLS = ("sdpa", "matmul", "matmul_t", "auto")  # matmul_t: matmul with both products transposed
EMPTY = -(2**62)  # tag of a ring slot never written in this chunk: outside every window
ALIGN = 16
# prefix lengths a graph is kept for (steps of 128, 512, 1024): attention reads few slots it does not need
PREFIX_BUCKETS = [*range(128, 2048, 128), *range(2048, 8192, 512), *range(8192, 65536 + 1, 1024)]


def width_buckets(max_width: int) -> list[int]:
    """Verify widths a graph is kept for: powers of two below ``max_width``, and ``max_width``."""
    if max_width < 1:
        raise ValueError("max_width must be >= 1")
    return sorted({2**e for e in range(max_width.bit_length()) if 2**e < max_width} | {max_width})


def compile_body(fn):
    """``torch.compile`` of a step body: static shapes, one graph, no graph breaks. Dynamo keeps one compiled
    graph per (width, prefix bucket) pair (ints are specialised): raise its per-function cache limit (8 by
    default) to the number of pairs a long run can meet, so it does not silently fall back to eager."""
    import torch._dynamo

    cfg = torch._dynamo.config
    cfg.cache_size_limit = max(cfg.cache_size_limit, 256)
    if hasattr(cfg, "accumulated_cache_size_limit"):
        cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, 1024)
    return torch.compile(fn, dynamic=False, fullgraph=True)


def bucket(value: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= value:
            return b
    raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")


class StaticRswaRunner:
    """max_step_tokens: widest step (k_max drafts + the last committed token). moe: see `engine.static_moe`.
    prefix_capacity: allocate for at least this many prefix tokens at the first prefill (fewer regrowths).
    compile_step: run the body compiled (see the module docstring). linear: the step's projections (LINEAR_IMPLS)."""

    def __init__(self, model, max_step_tokens: int, moe: str = "auto", prefix_capacity: int = 0,
                 attn: str = "auto", capture_layers: tuple[int, ...] = (), compile_step: bool = False,
                 linear: str = "auto"):
        if linear not in LINEAR_IMPLS:
            raise ValueError(f"linear must be one of {LINEAR_IMPLS}, not {linear!r}")
        self.model = model
        self._compiled = compile_body(self.step_body) if compile_step else None
        self.compile_error: str | None = None
        # decoder layers whose outputs every prefill and step also return (the block drafter's features); fixed
        # for the runner's life, since the graphs are captured with them
        self.capture_layers = tuple(capture_layers)
        self.features: torch.Tensor | None = None  # [tokens, len(capture_layers) * hidden] of the last forward
        self.embedder = RswaRunner(model)  # validates the layer types; builds prompt embeddings (vision)
        self.text = model.model.language_model
        config = self.text.config
        self.window = config.sliding_window
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = self.embedder.head_dim
        self.groups = config.num_attention_heads // config.num_key_value_heads
        self.sparse = [kind == "sparse" for kind in config.mlp_layer_types]
        weight = self.text.embed_tokens.weight
        self.moe = resolve(moe, weight.device, weight.dtype)
        self._experts = experts_forward(self.moe)
        if attn not in ATTN_IMPLS:
            raise ValueError(f"attn must be one of {ATTN_IMPLS}, not {attn!r}")
        if attn == "auto" and weight.device.type == "cuda" and weight.dtype == torch.float32:
            attn = "matmul"
        self.attn = attn
        if linear == "auto":
            linear = "bmv" if weight.device.type == "cuda" and weight.dtype == torch.float32 else "torch"
        self.linear = linear
        self.widths = width_buckets(max_step_tokens)
        self.max_width = self.widths[-1]
        self.ring_size = math.ceil((self.window + self.max_width - 1) / ALIGN) * ALIGN
        self.dtype, self.device = weight.dtype, weight.device
        self.min_capacity = prefix_capacity
        with torch.inference_mode():
            self.ids = torch.zeros(self.max_width, dtype=torch.long, device=self.device)
            self.pos = torch.zeros(self.max_width, dtype=torch.long, device=self.device)
            self.prefix_len_t = torch.zeros((), dtype=torch.long, device=self.device)
            self.tags = torch.full((self.ring_size,), EMPTY, dtype=torch.long, device=self.device)
        pinned = self.device.type == "cuda"
        self._host = torch.zeros(2, self.max_width, dtype=torch.long, pin_memory=pinned)
        self._host_np = self._host.numpy()
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.capacity = 0
        self.prefix_len = 0
        self.prefix_bucket = 0
        self.length = 0
        self.graphs = None  # engine.cuda_graphs.StepGraphs, or None: run steps eagerly
        self._logits: torch.Tensor | None = None
        self._step_tokens = 0

    # --- buffers -----------------------------------------------------------------------------------------

    def _allocate(self, prefix_len: int) -> None:
        capacity = bucket(max(prefix_len, self.min_capacity), PREFIX_BUCKETS)
        shape = (1, self.ring_size + capacity, self.num_kv_heads, self.head_dim)
        if self.graphs is not None:
            self.graphs.clear()  # they were captured over the old buffers' addresses
        self.keys = self.values = []  # free the old buffers before taking the new ones
        # zeros, not empty: masked slots still enter the attention product, and garbage could be NaN
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.text.layers]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.text.layers]
        self._prefix_index = torch.arange(capacity, device=self.device)
        self.capacity = capacity

    def nbytes(self) -> int:
        """Bytes of the cache buffers and static inputs; constant for a chunk whatever its output length."""
        tensors = [*self.keys, *self.values, self.tags, self.ids, self.pos]
        return sum(t.numel() * t.element_size() for t in tensors)

    # --- prefill (eager) ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, inputs) -> torch.Tensor:
        """Write the prefix of ``inputs`` (processor inputs) into the buffers, commit it, and return the fp32
        logits [vocab] of its last position. Eager, with the model's own MoE modules."""
        embeds = self.embedder.prompt_embeddings(inputs)
        length = embeds.shape[1]
        if length > self.capacity:
            self._allocate(length)
        self.tags.fill_(EMPTY)
        self.prefix_len_t.fill_(length)
        self.prefix_len, self.length = length, length
        self.prefix_bucket = bucket(length, [b for b in PREFIX_BUCKETS if b <= self.capacity])
        positions = torch.arange(length, device=self.device)[None]
        cos, sin = self.text.rotary_emb(embeds, position_ids=positions)
        hidden, kept = embeds, []
        for i, layer in enumerate(self.text.layers):
            hidden = self._layer(i, layer, hidden, cos, sin, None)
            if i in self.capture_layers:
                kept.append(hidden[0])
        self.features = torch.cat(kept, dim=-1) if kept else None
        return self._final(hidden[0, -1])

    # --- one step (the graph body) -----------------------------------------------------------------------

    def step_body(self, width: int, prefix_bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 logits [width, vocab] of the staged step and a summary [width, 5] fp32 per row: argmax (exact
        as fp32 below 2**24), max logit, logsumexp, the logit of the next staged token (row i judges staged
        token i + 1, the draft: fast mode's relaxed rule needs its probability) and that token's id (the host
        learns a draft written on the device with the step's one copy); the last row's two entries are
        meaningless. With ``capture_layers`` also the features [width, F].
        Only device work on static tensors: no host sync, shapes fixed by (width, prefix_bucket)."""
        pos = self.pos[:width]
        slots = pos % self.ring_size
        self.tags.index_copy_(0, slots, pos)
        p = pos[:, None]
        sees_ring = (self.tags[None, :] <= p) & (self.tags[None, :] > p - self.window)
        sees_prefix = (self._prefix_index[None, :prefix_bucket] < self.prefix_len_t).expand(width, prefix_bucket)
        mask = torch.cat([sees_ring, sees_prefix], dim=1)[None, None]
        embeds = self.text.embed_tokens(self.ids[:width])[None]
        cos, sin = self.text.rotary_emb(embeds, position_ids=pos[None])
        hidden, kept = embeds, []
        for i, layer in enumerate(self.text.layers):
            hidden = self._layer(i, layer, hidden, cos, sin, (slots, mask, prefix_bucket))
            if i in self.capture_layers:
                kept.append(hidden[0])
        logits = self._final(hidden[0])
        argmax = logits.argmax(dim=-1)  # first index on ties, as generate's argmax
        following = torch.roll(self.ids[:width], -1)
        drafted = logits.gather(1, following[:, None])[:, 0]
        summary = torch.stack([argmax.float(), logits.amax(dim=-1), torch.logsumexp(logits, dim=-1), drafted,
                               following.float()], dim=1)
        return (logits, summary, torch.cat(kept, dim=-1)) if kept else (logits, summary)

    def body(self, width: int, prefix_bucket: int) -> tuple[torch.Tensor, ...]:
        """`step_body`, compiled when asked for and compiling works: what steps run and graphs capture."""
        if self._compiled is not None:
            try:
                return self._compiled(width, prefix_bucket)
            except Exception as exc:  # noqa: BLE001 - an inductor/dynamo failure: the plain body computes the same
                self.compile_error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
                logger.warning("compiled decode step unavailable ({}); running it uncompiled", self.compile_error)
                self._compiled = None
        return self.step_body(width, prefix_bucket)

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    def _layer(self, i: int, layer, hidden: torch.Tensor, cos, sin, step) -> torch.Tensor:
        """One decoder layer; ``step`` None = prefill (causal over the prefix), else (slots, mask, bucket)."""
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        n = x.shape[1]
        proj = (lambda module, t: module(t)) if step is None else self._proj
        q = proj(attn.q_proj, x).view(1, n, -1, self.head_dim).transpose(1, 2)
        k = proj(attn.k_proj, x).view(1, n, -1, self.head_dim).transpose(1, 2)
        v = proj(attn.v_proj, x).view(1, n, -1, self.head_dim)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = k.transpose(1, 2)
        keys, values, c = self.keys[i], self.values[i], self.ring_size
        if step is None:
            keys[:, c:c + n].copy_(k)
            values[:, c:c + n].copy_(v)
            out = self._attend(q, keys[:, c:c + n], values[:, c:c + n], None, attn.scaling)
        else:
            slots, mask, prefix_bucket = step
            keys.index_copy_(1, slots, k)
            values.index_copy_(1, slots, v)
            end = c + prefix_bucket
            out = self._attend(q, keys[:, :end], values[:, :end], mask, attn.scaling)
        hidden = hidden + proj(attn.o_proj, out.transpose(1, 2).reshape(1, n, -1))
        x = layer.post_attention_layernorm(hidden)
        if step is None:
            return hidden + layer.mlp(x)  # the model's own module (eager MoE with host syncs in prefill)
        if not self.sparse[i]:
            return hidden + self._mlp(layer.mlp, x)
        mlp = layer.mlp
        _, top_k_weights, top_k_index = mlp.gate(x)
        routed = self._experts(mlp.experts, x.reshape(n, -1), top_k_index, top_k_weights).view_as(x)
        return hidden + routed + self._mlp(mlp.shared_experts, x)

    def _proj(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """A step's projection ``module(x)`` for x [1, n, in], written as ``self.linear`` says."""
        return module(x) if self.linear == "torch" else batched_gemv(module, x)

    def _mlp(self, mlp, x: torch.Tensor) -> torch.Tensor:
        """``UnlimitedOcrTextMLP.forward`` (down(act(gate(x)) * up(x))) with the step's projections."""
        return self._proj(mlp.down_proj, mlp.act_fn(self._proj(mlp.gate_proj, x)) * self._proj(mlp.up_proj, x))

    def _attend(self, q, keys, values, mask, scaling) -> torch.Tensor:
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [1, kv_heads, slots, dim] views
        if self.groups > 1:
            keys = keys.repeat_interleave(self.groups, dim=1)
            values = values.repeat_interleave(self.groups, dim=1)
        if mask is not None and self.attn == "matmul_t":
            # the same with both products written transposed (keys x queries^T, values^T x probs^T): cuBLAS then
            # sees [slots, dim] x [dim, n] instead of [n, dim] x [dim, slots]; for the fp32 projections that
            # shape measured ~7 us where n = 8-9 took ~31 us (scripts/profile_linear.py). Not measured here yet.
            scores = torch.matmul(keys, q.transpose(2, 3)).transpose(2, 3) * scaling
            probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.matmul(values.transpose(2, 3), probs.transpose(2, 3)).transpose(2, 3)
        if mask is not None and (self.attn == "matmul" or (self.attn == "auto" and q.shape[2] > 1)):
            # as transformers' eager attention: scores in the model dtype, softmax in fp32. For 1-17 queries
            # over thousands of keys this is two batched GEMVs that spread over the whole key range, where a
            # fused kernel may run one block per (head, query tile)
            scores = torch.matmul(q, keys.transpose(2, 3)) * scaling
            scores = scores.masked_fill(~mask, float("-inf"))
            return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype), values)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                              scale=scaling)

    def _final(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.text.norm(hidden)).float()

    # --- driving steps from the host ---------------------------------------------------------------------

    def _stage(self, token_ids: list[int], width: int) -> None:
        host = self._host_np
        host[0, :len(token_ids)] = token_ids
        host[0, len(token_ids):] = token_ids[0]  # pad id: any valid token; the first, as for a device-staged draft
        host[1, :] = np.arange(self.length, self.length + self.max_width)
        self.ids.copy_(self._host[0], non_blocking=True)
        self.pos.copy_(self._host[1], non_blocking=True)

    @torch.inference_mode()
    def step(self, token_ids: list[int], device_tail: torch.Tensor | None = None
             ) -> list[tuple[int, float, float, float, int]]:
        """Per token at positions ``length ..``: (greedy choice before bans, its logit, logsumexp of the row, the
        logit of the next staged token and that token's id; the last two meaningless on the last row); the full
        fp32 logits stay on the device for ``logits_row``. Commits nothing.
        device_tail: ids already on the device (a draft of the static block drafter) staged after ``token_ids``
        by a device copy, so the host never waits for them before the step: the rows name them."""
        n = len(token_ids) + (0 if device_tail is None else device_tail.numel())
        if not token_ids or n > self.max_width:
            raise ValueError(f"a step of {n} tokens; the runner allows 1..{self.max_width}")
        if self.length < self.prefix_len or not self.prefix_len:
            raise RuntimeError("prefill first")
        width = bucket(n, self.widths)
        self._stage(token_ids, width)
        if device_tail is not None:
            self.ids[len(token_ids):n].copy_(device_tail)  # ordered after the staging copy, before the step
        if self.graphs is not None:
            logits, summary, *features = self.graphs.replay(width, self.prefix_bucket)
        else:
            logits, summary, *features = self.body(width, self.prefix_bucket)
        self.features = features[0] if features else None  # a graph's static output: read before the next step
        self._logits, self._step_tokens = logits, n
        rows = summary[:n].tolist()  # the one host sync of a step
        return [(int(token), best, lse, drafted, int(following)) for token, best, lse, drafted, following in rows]

    def logits_row(self, i: int) -> torch.Tensor:
        """fp32 logits [vocab] after the i-th token of the last step (valid until the next step)."""
        if not 0 <= i < self._step_tokens:
            raise IndexError(i)
        return self._logits[i]

    def commit(self, n_tokens: int) -> None:
        if not 0 <= n_tokens <= self._step_tokens:
            raise ValueError(f"cannot commit {n_tokens} of a {self._step_tokens}-token step")
        self.length += n_tokens
        self._step_tokens = 0

    @torch.inference_mode()
    def capture_graphs(self) -> int:
        """Capture any missing graph of the current prefix bucket (all widths); returns how many were captured.
        Staged at the committed length with pad ids: only rejected positions are written (invariant 4)."""
        if self.graphs is None:
            return 0
        self.graphs.touch(self.prefix_bucket)
        missing = [w for w in self.widths if not self.graphs.has(w, self.prefix_bucket)]
        for width in missing:
            self._stage([0], width)
            self.graphs.capture(width, self.prefix_bucket)
        return len(missing)
