"""Batch-invariant kernels for the decode step (Triton): a row's results never depend on the other rows of a step.

cuBLAS, PyTorch's reductions and fused attention pick their tiling and split the reductions by the shapes they
see, so in bf16 the same token computed in a batch of 64 or alone, or in a verify of width 9 or 1, rounds
differently, and greedy decoding follows a different path after a near-tie. These kernels fix the reduction order
of every row (after "Defeating nondeterminism in LLM inference"):
- ``linear``: tiles of ``BLOCK_M x BLOCK_N x BLOCK_K`` with no split-K, the kernel never specialised on the number
  of rows: an output element is the same k-loop of the same tensor-core products whatever the number of rows (a
  tile configuration other than the default is used only where it was seen to give the default's bits, below);
- ``rms_norm`` and the row ``logsumexp``: one program per row, a fixed block walk over the row;
- ``step_attention``: one program per (row, head, block of queries), walking that row's keys in fixed blocks from
  the first ring slot to the end of its own prefix with an online softmax; masked keys add exact zeros, so neither
  the batch, the step width, stale ring slots nor the other rows' prefix lengths change a bit;
- ``moe``: the router's fp32 logits through the same fixed-tile matmul (IEEE fp32 products), top-k experts sorted
  by id, each (token, expert) pair through a grouped matmul of fixed tiles, the k results added in that order.
Tiles: the default ones, or on CUDA in bf16/fp16 those `engine.kernels.tiles` measured fastest for each weight shape
and rows bucket among the configurations whose results are bitwise the default's (checked on the card, never assumed).
Prefills run per chunk at their own shapes, so they use the torch kernels (the same for a chunk alone or batched).
On the CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests check them.
"""

from __future__ import annotations

import os
import time

import torch
from loguru import logger

if not torch.cuda.is_available():  # read by triton.jit below: the kernels run interpreted (CPU tests)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from engine.kernels.tiles import DEFAULT, NARROW, TILES, Config  # noqa: E402

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
ROW_BLOCK = 1024
ATTN_BLOCK_Q, ATTN_BLOCK_K = 16, 64


# --- linear -----------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                   stride_cn, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + kk[:, None] * stride_bk + rn[None, :] * stride_bn,
                    mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None, config: Config | None = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T (+ bias)`` in ``x``'s dtype (fp32 accumulation; fp32 inputs: IEEE products), with
    the tiles ``config`` or those `engine.kernels.tiles.TILES` picks (fp32: always the default tiles)."""
    M, K = x.shape
    N = weight.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if config is None:
        config = TILES.pick("linear", N, K, M) if x.dtype != torch.float32 else (NARROW if N <= 64 else DEFAULT)
    bm, bn, bk, warps, stages = config
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    _matmul_kernel[grid](x, weight, out, bias if bias is not None else x, M, N, K, x.stride(0), x.stride(1),
                         weight.stride(1), weight.stride(0), out.stride(0), out.stride(1), HAS_BIAS=bias is not None,
                         IEEE=x.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                         num_stages=stages)
    return out


# --- grouped matmul (MoE experts) -----------------------------------------------------------------------------

@triton.jit
def _grouped_kernel(a_ptr, w_ptr, c_ptr, rows_ptr, block_expert_ptr, N, K, stride_am, stride_we, stride_wn,
                    stride_wk, stride_cm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """c[slot] = a[rows[slot]] @ w[expert of the slot's block]^T for the BLOCK_M slots of this block; slots whose
    row is -1 (padding) are skipped."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # a block past the last expert's slots: nothing to do
        return
    slot = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row = tl.load(rows_ptr + slot)
    valid = row >= 0
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_ptr + row[:, None] * stride_am + kk[None, :], mask=valid[:, None] & (kk[None, :] < K),
                    other=0.0)
        b = tl.load(w_ptr + expert * stride_we + kk[:, None] * stride_wk + rn[None, :] * stride_wn,
                    mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(a, b)
    tl.store(c_ptr + slot[:, None] * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & (rn[None, :] < N))


def grouped_matmul(x: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, block_expert: torch.Tensor,
                   out_rows: int, config: Config = DEFAULT) -> torch.Tensor:
    """For each slot s (``rows`` [S], -1 = padding; S a multiple of the config's BLOCK_M; ``block_expert``
    [S / BLOCK_M], laid out by `expert_blocks` with that BLOCK_M): ``x[rows[s]] @ weights[e]^T`` -> [out_rows, N] at
    row s (rows of padding slots left zero)."""
    E, N, K = weights.shape
    bm, bn, bk, warps, stages = config
    out = torch.zeros(out_rows, N, dtype=x.dtype, device=x.device)
    grid = (block_expert.shape[0], triton.cdiv(N, bn))
    _grouped_kernel[grid](x, weights, out, rows, block_expert, N, K, x.stride(0), weights.stride(0),
                          weights.stride(1), weights.stride(2), out.stride(0), BLOCK_M=bm, BLOCK_N=bn,
                          BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return out


def expert_blocks(expert_ids: torch.Tensor, num_experts: int,
                  block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay the (pair -> expert) assignment ``expert_ids`` [P] out in blocks of ``block_m`` slots, each block one
    expert's: (rows [S] pair index or -1, block_expert [S / block_m] or -1, slot of each pair [P]). Static shapes
    (S = P + E * block_m rounded up), device ops only: CUDA-graph safe."""
    BLOCK_M = block_m  # noqa: N806
    P = expert_ids.shape[0]
    device = expert_ids.device
    S = triton.cdiv(P + num_experts * BLOCK_M, BLOCK_M) * BLOCK_M
    order = torch.sort(expert_ids, stable=True).indices  # pairs grouped by expert, in pair order within
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(
        0, expert_ids, torch.ones_like(expert_ids))
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = torch.cumsum(padded, 0) - padded  # first slot of each expert
    first_sorted = torch.cumsum(counts, 0) - counts  # first position of each expert in `order`
    sorted_experts = expert_ids[order]
    rank = torch.arange(P, device=device) - first_sorted[sorted_experts]
    slot_of_sorted = start[sorted_experts] + rank
    rows = torch.full((S,), -1, dtype=torch.long, device=device)
    rows.scatter_(0, slot_of_sorted, order)
    slot = torch.empty_like(order).scatter_(0, order, slot_of_sorted)
    block_first = torch.arange(S // BLOCK_M, device=device) * BLOCK_M
    ends = torch.cumsum(padded, 0)
    block_expert = torch.searchsorted(ends, block_first, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, torch.full_like(block_expert, -1))
    return rows, block_expert, slot


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK):
        cols = h0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * H + cols, mask=cols < H, other=0.0).to(tl.float32)
        total += x * x
    scale = 1.0 / tl.sqrt(tl.sum(total, axis=0) / H + eps)
    for h0 in range(0, H, BLOCK):
        cols = h0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * H + cols, mask=cols < H, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < H, other=0.0)
        y = (x * scale).to(y_ptr.dtype.element_ty) * w
        tl.store(y_ptr + row * H + cols, y.to(y_ptr.dtype.element_ty), mask=cols < H)


@triton.jit
def _logsumexp_kernel(x_ptr, y_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    m = tl.full((BLOCK,), -float("inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * V + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - safe) + tl.exp(x - safe)
        m = m_new
    top = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp(m - top), axis=0)
    tl.store(y_ptr + row, top + tl.log(total))


def logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """fp32 logsumexp of each row of ``x`` [R, V] (contiguous)."""
    R, V = x.shape
    y = torch.empty(R, dtype=torch.float32, device=x.device)
    _logsumexp_kernel[(R,)](x, y, V, BLOCK=ROW_BLOCK)
    return y


# --- step attention ---------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["W"])
def _step_attention_kernel(q_ptr, k_ptr, v_ptr, tags_ptr, prefix_ptr, pos_ptr, rows_ptr, o_ptr, W, C, window,
                           scaling, stride_qb, stride_qh, stride_qw, stride_kb, stride_ks, stride_kh, stride_tb,
                           stride_pb, stride_ob, stride_oh, stride_ow, GROUPS: tl.constexpr, D: tl.constexpr,
                           BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    """Queries of q's row i (cache row rows[i]) at positions pos[i]; prefix key j is seen when j < the row's prefix
    length and j <= the query's position (a prefill is causal; a step's queries are past the whole prefix)."""
    i, h, qb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b = tl.load(rows_ptr + i)
    kv_h = h // GROUPS
    qi = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)
    qmask = qi < W
    d = tl.arange(0, D)
    q = tl.load(q_ptr + i * stride_qb + h * stride_qh + qi[:, None] * stride_qw + d[None, :], mask=qmask[:, None],
                other=0.0)
    p = tl.load(pos_ptr + i * stride_pb + qi, mask=qmask, other=0)
    prefix = tl.load(prefix_ptr + b)
    end = C + prefix
    m_i = tl.full((BLOCK_Q,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_Q, D), dtype=tl.float32)
    for s0 in range(0, end, BLOCK_K):
        s = s0 + tl.arange(0, BLOCK_K)
        inside = s < end
        tag = tl.load(tags_ptr + b * stride_tb + s, mask=s < C, other=0)
        in_ring = s < C
        seen_ring = in_ring[None, :] & (tag[None, :] <= p[:, None]) & (tag[None, :] > p[:, None] - window)
        seen_prefix = ((~in_ring) & inside)[None, :] & ((s - C)[None, :] <= p[:, None])
        seen = (seen_ring | seen_prefix) & qmask[:, None]
        kv = b * stride_kb + s[:, None] * stride_ks + kv_h * stride_kh + d[None, :]
        k = tl.load(k_ptr + kv, mask=inside[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scaling
        scores = tl.where(seen, scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        prob = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, axis=1)
        v = tl.load(v_ptr + kv, mask=inside[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v).to(tl.float32)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + i * stride_ob + h * stride_oh + qi[:, None] * stride_ow + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=qmask[:, None])


def routed_experts(experts, x: torch.Tensor, index: torch.Tensor, config: Config = DEFAULT) -> torch.Tensor:
    """[T * k, hidden]: each (token, expert) pair of ``index`` [T, k] (expert ids) through its expert's two grouped
    projections (tiles ``config``, one slot layout for both), in pair order."""
    top_k = index.shape[1]
    rows, block_expert, slot = expert_blocks(index.reshape(-1), experts.num_experts, config[0])
    token_of_slot = torch.where(rows >= 0, rows // top_k, rows)
    gate_up = grouped_matmul(x, experts.gate_up_proj, token_of_slot, block_expert, rows.shape[0], config)
    g, u = gate_up.chunk(2, dim=-1)
    hidden = experts.act_fn(g) * u
    slots = torch.arange(rows.shape[0], device=x.device)
    down = grouped_matmul(hidden, experts.down_proj, torch.where(rows >= 0, slots, rows), block_expert,
                          rows.shape[0], config)
    return down[slot]


class InvariantKernels:
    """The step's primitives for `engine.model.forward.BatchForward` (``kernels="invariant"``), with the tiles of
    `engine.kernels.tiles.TILES` (`tune_tiles` fills it)."""

    def __init__(self, model):
        config = model.model.language_model.config
        self.groups = config.num_attention_heads // config.num_key_value_heads

    @staticmethod
    def _grouped_config(experts, tokens: int) -> Config:
        n, k = experts.gate_up_proj.shape[1:]
        return TILES.pick("grouped", n, k, tokens) if experts.gate_up_proj.dtype != torch.float32 else DEFAULT

    def linear(self, module: torch.nn.Linear, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        y = matmul(flat, module.weight, module.bias, out=out)
        return y if out is not None else y.view(*x.shape[:-1], -1)

    def rms_norm(self, module, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        y = torch.empty_like(flat)
        _rms_norm_kernel[(flat.shape[0],)](flat, module.weight, y, flat.shape[1], module.variance_epsilon,
                                           BLOCK=ROW_BLOCK)
        return y.view_as(x)

    def step_attention(self, q, keys, values, tags, prefix_len, pos, rows, ring_size: int, window: int,
                       scaling: float):
        """q [n, heads, w, dim] of cache rows ``rows`` [n]; keys/values [B, C + P, kv_heads, dim]; tags [B, C];
        prefix_len [B]; pos [n, w] (stride 1 along w)."""
        n, heads, w, dim = q.shape
        q = q.contiguous()
        out = torch.empty_like(q)
        grid = (n, heads, triton.cdiv(w, ATTN_BLOCK_Q))
        _step_attention_kernel[grid](q, keys, values, tags, prefix_len, pos, rows, out, w, ring_size, window, scaling,
                                     q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1),
                                     keys.stride(2), tags.stride(0), pos.stride(0), out.stride(0), out.stride(1),
                                     out.stride(2), GROUPS=self.groups, D=dim, BLOCK_Q=ATTN_BLOCK_Q,
                                     BLOCK_K=ATTN_BLOCK_K)
        return out

    def logsumexp(self, logits: torch.Tensor) -> torch.Tensor:
        """[R, V] (contiguous) -> [R] fp32."""
        return logsumexp_rows(logits)

    def moe(self, mlp, x: torch.Tensor) -> torch.Tensor:
        """Routed experts of ``UnlimitedOcrTextMoe`` for x [T, hidden] (the shared experts are the caller's)."""
        gate, experts = mlp.gate, mlp.experts
        logits = matmul(x.float(), gate.weight.float())
        scores = logits.softmax(dim=-1)
        if gate.topk_method != "greedy":
            raise NotImplementedError(f"router top-k method {gate.topk_method!r} in the invariant kernels")
        weights, index = torch.topk(scores, k=gate.top_k, dim=-1, sorted=True)
        index, order = torch.sort(index, dim=-1)
        weights = weights.gather(1, order) * gate.routed_scaling_factor
        T, top_k = index.shape
        down = routed_experts(experts, x, index, self._grouped_config(experts, T))
        y = down.view(T, top_k, -1) * weights.view(T, top_k, 1).to(x.dtype)
        out = y[:, 0]
        for j in range(1, top_k):
            out = out + y[:, j]
        return out



def tunable(model) -> bool:
    """Whether `tune_tiles` measures anything for this model: on CUDA in bf16/fp16 (fp32 keeps the default tiles)."""
    weight = model.lm_head.weight
    return weight.device.type == "cuda" and weight.dtype != torch.float32


def measure_tiles(model) -> None:
    """`tune_tiles` where it measures anything (`tunable`), once a process; out of memory keeps the default tiles."""
    if not tunable(model):
        return
    try:
        t0, tuned = time.perf_counter(), len(TILES.tuned)
        tune_tiles(model)
        if len(TILES.tuned) > tuned:
            logger.info("invariant kernel tiles measured in {:.1f}s: {}", time.perf_counter() - t0, TILES.summary())
    except torch.OutOfMemoryError:
        logger.warning("out of memory while measuring the kernels' tiles: the default tiles stay")
    finally:
        torch.cuda.empty_cache()


def tune_tiles(model, table=TILES, **options) -> None:
    """`engine.kernels.tiles.TileTable.tune` for each distinct linear weight shape of the decoder and the lm_head, and
    for the routed experts (both projections under one configuration: they share the slot layout; rows = tokens, each
    with a fixed random routing). ``options`` go to ``tune`` (tests: candidates, buckets, timer). Shapes tuned before
    in this process are skipped."""
    text = model.model.language_model
    weights = {tuple(m.weight.shape): m.weight for m in text.modules() if isinstance(m, torch.nn.Linear)}
    weights[tuple(model.lm_head.weight.shape)] = model.lm_head.weight
    for weight in weights.values():
        def run(config, m, inputs, weight=weight):
            return matmul(inputs, weight, config=config)
        table.tune("linear", weight, run, **options)
    experts = next((layer.mlp.experts for layer in text.layers if hasattr(layer.mlp, "experts")), None)
    if experts is None:
        return
    top_k = text.config.num_experts_per_tok
    routes: dict[int, torch.Tensor] = {}

    def run_experts(config, m, inputs):
        if m not in routes:
            gen = torch.Generator(device=inputs.device).manual_seed(m)
            scores = torch.rand(m, experts.num_experts, generator=gen, device=inputs.device)
            routes[m] = torch.sort(scores.topk(top_k, dim=-1).indices, dim=-1).values
        return routed_experts(experts, inputs, routes[m], config)

    table.tune("grouped", experts.gate_up_proj, run_experts, **options)
