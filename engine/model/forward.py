"""The decoder forward of Unlimited-OCR over `engine.model.kv_slots.KVSlots`: a chunk's prefill, and one step of B rows.

Same computation as ``UnlimitedOcrForConditionalGeneration.forward`` under ``generate()`` (the model's own norms,
projections, RoPE, router, experts and lm_head, in the same order); only the cache, the mask and, where asked, the
kernels that compute them are ours:
- ``prefill(row, embeds)``: one forward over a chunk's prefix (causal inside it), keys/values into its row;
- ``step_body(n, w, prefix_bucket)``: rows ``0 .. n-1`` each run ``w`` tokens (the staged ids at the staged
  positions: the last committed token, its drafts, padding) under the R-SWA rule. Only device work on static
  tensors, no host sync, shapes fixed by (n, w, prefix_bucket): what a CUDA graph captures and replays.

A step returns ``summary`` [n, w, 5] fp32: per token the greedy choice before any ban (argmax, first index on
ties, as ``generate``), its logit, the logsumexp of the row, the logit of the next staged token (the draft that
row judges: fast mode's relaxed rule needs its probability) and that token's id (the host learns drafts written on
the device from the step's one copy). The logits themselves stay in ``logits`` (a buffer shared by every step,
valid until the next) for the rare row whose argmax the no-repeat rule bans; with ``capture_layers`` the outputs of
those decoder layers go to ``features`` (the block drafter's input).

``kernels``: ``torch`` runs the model's own modules; ``invariant`` runs `engine.kernels.invariant`, whose
reductions never change order with the number of rows, the step width or the prefix bucket (bitwise the same
tokens for a chunk alone or in any batch, in bf16). ``moe``, ``attn`` and ``linear`` pick among the torch
implementations (`engine.kernels.static_moe`, SDPA or matmul attention, batched GEMVs for fp32 on CUDA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.unlimited_ocr.modeling_unlimited_ocr import apply_rotary_pos_emb

from engine.kernels.gemv import batched_gemv
from engine.kernels.static_moe import experts_forward, resolve
from engine.model.kv_slots import KVSlots

RSWA_LAYER = "reference_sliding_attention"
KERNELS = ("torch", "invariant")
ATTN_IMPLS = ("auto", "sdpa", "matmul")  # auto: SDPA for 1-token steps in bf16/fp16, matmul otherwise
LINEAR_IMPLS = ("auto", "torch", "bmv")  # auto: bmv for fp32 on CUDA (cuBLAS picks slow kernels there)


class BatchForward:
    def __init__(self, model, slots: KVSlots, *, kernels: str = "torch", moe: str = "auto", attn: str = "auto",
                 linear: str = "auto", capture_layers: tuple[int, ...] = (), step_tokens: int | None = None):
        self.model = model
        self.text = text = model.model.language_model
        config = text.config
        if any(kind != RSWA_LAYER for kind in config.layer_types):
            raise ValueError(f"every decoder layer must be {RSWA_LAYER!r}, got {sorted(set(config.layer_types))}")
        if kernels not in KERNELS or attn not in ATTN_IMPLS or linear not in LINEAR_IMPLS:
            raise ValueError(f"kernels {kernels!r}, attn {attn!r}, linear {linear!r}: choose among {KERNELS}, "
                             f"{ATTN_IMPLS}, {LINEAR_IMPLS}")
        self.slots = slots
        self.window = config.sliding_window
        self.head_dim = slots.head_dim
        self.groups = config.num_attention_heads // config.num_key_value_heads
        self.sparse = [kind == "sparse" for kind in config.mlp_layer_types]
        weight = text.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.vocab = model.lm_head.weight.shape[0]
        self.kernels = kernels
        self.moe = resolve(moe, weight.device, weight.dtype)
        self._experts = experts_forward(self.moe)
        self.attn = attn
        self.linear = ("bmv" if weight.device.type == "cuda" and weight.dtype == torch.float32 else "torch") \
            if linear == "auto" else linear
        self.capture_layers = tuple(capture_layers)
        self.invariant = None
        if kernels == "invariant":
            from engine.kernels.invariant import InvariantKernels

            self.invariant = InvariantKernels(model)
        rows = step_tokens or slots.max_batch * slots.max_width  # the most tokens a step runs
        with torch.inference_mode():
            self._rows = torch.arange(slots.max_batch, device=self.device)
            # shared by every step (graphs write into it): the logits of the last step, and the features it kept
            self.logits = torch.zeros(rows * self.vocab, dtype=self.dtype, device=self.device)
            width = len(self.capture_layers) * config.hidden_size
            self.features = torch.zeros(rows * max(width, 1), dtype=self.dtype, device=self.device)
            self.feature_width = width

    # --- prefill (eager) -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, rows: list[int], embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Write the prefixes ``embeds`` [g, L, hidden] (g chunks of one prefix length) into ``rows`` and return the
        fp32 logits [g, vocab] of their last positions and the captured features [g, L, F] (None without capture
        layers). Causal inside each prefix; the chunks never see each other. Torch kernels: the model's own
        modules, as ``generate()`` runs the prompt. Invariant kernels: the same kernels as the steps, so a chunk's
        prefix does not depend on the chunks prefilled beside it either."""
        g, length = embeds.shape[:2]
        for row in rows:
            self.slots.open_row(row, length)
        positions = torch.arange(length, device=self.device)[None].expand(g, length)
        row_index = torch.as_tensor(rows, device=self.device)
        where = (row_index[:, None].expand(g, length), self.slots.ring_size + positions)
        cos, sin = self.text.rotary_emb(embeds, position_ids=positions)
        hidden, kept = embeds, []
        for i, layer in enumerate(self.text.layers):
            attn = layer.self_attn
            x = self._prefill_op(layer.input_layernorm, hidden)
            q = self._prefill_op(attn.q_proj, x).view(g, length, -1, self.head_dim).transpose(1, 2)
            k = self._prefill_op(attn.k_proj, x).view(g, length, -1, self.head_dim).transpose(1, 2)
            v = self._prefill_op(attn.v_proj, x).view(g, length, -1, self.head_dim)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            self.slots.write_step(i, where, k.transpose(1, 2), v)
            if self.invariant is not None:
                out = self._attend_step(i, q, positions.contiguous(), None, 0, attn.scaling, row_index)
            else:
                keys, values = k, v.transpose(1, 2)  # [g, kv_heads, L, dim]
                if self.groups > 1:
                    keys = keys.repeat_interleave(self.groups, dim=1)
                    values = values.repeat_interleave(self.groups, dim=1)
                out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=attn.scaling)
            hidden = hidden + self._prefill_op(attn.o_proj, out.transpose(1, 2).reshape(g, length, -1))
            x = self._prefill_op(layer.post_attention_layernorm, hidden)
            hidden = hidden + (layer.mlp(x) if self.invariant is None else self._mlp(i, layer.mlp, x))
            if i in self.capture_layers:
                kept.append(hidden)
        last = self._prefill_op(self.text.norm, hidden[:, -1:])
        logits = self._prefill_op(self.model.lm_head, last.reshape(g, -1)).float()
        return logits, (torch.cat(kept, dim=-1) if kept else None)

    def _prefill_op(self, module, x):
        """A norm or projection of the prefill: the module itself (torch kernels) or its invariant kernel."""
        if self.invariant is None:
            return module(x)
        return self.invariant.linear(module, x) if isinstance(module, torch.nn.Linear) else \
            self.invariant.rms_norm(module, x)

    # --- one step (the graph body) --------------------------------------------------------------------------

    def step_body(self, n: int, w: int, prefix_bucket: int) -> torch.Tensor:
        """See the module docstring. Reads the staged ``slots.ids/pos``, writes ``logits`` and ``features``."""
        slots = self.slots
        ids, pos = slots.ids[:n, :w], slots.pos[:n, :w]
        where = slots.tag_step(pos)
        mask = slots.step_mask(pos, prefix_bucket) if self.invariant is None else None
        end = slots.ring_size + prefix_bucket
        embeds = self.text.embed_tokens(ids)  # [n, w, hidden]
        cos, sin = self.text.rotary_emb(embeds, position_ids=pos)
        hidden, kept = embeds, []
        for i, layer in enumerate(self.text.layers):
            attn = layer.self_attn
            x = self._norm(layer.input_layernorm, hidden)
            q = self._linear(attn.q_proj, x).view(n, w, -1, self.head_dim).transpose(1, 2)
            k = self._linear(attn.k_proj, x).view(n, w, -1, self.head_dim).transpose(1, 2)
            v = self._linear(attn.v_proj, x).view(n, w, -1, self.head_dim)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            slots.write_step(i, where, k.transpose(1, 2), v)
            out = self._attend_step(i, q, pos, mask, end, attn.scaling)  # [n, heads, w, dim]
            hidden = hidden + self._linear(attn.o_proj, out.transpose(1, 2).reshape(n, w, -1))
            x = self._norm(layer.post_attention_layernorm, hidden)
            hidden = hidden + self._mlp(i, layer.mlp, x)
            if i in self.capture_layers:
                kept.append(hidden)
        if kept:
            self.features[: n * w * self.feature_width].view(n, w, -1).copy_(torch.cat(kept, dim=-1))
        logits = self.logits[: n * w * self.vocab].view(n * w, self.vocab)
        self._lm_head(self._norm(self.text.norm, hidden).reshape(n * w, -1), out=logits)
        lse = None if self.invariant is None else self.invariant.logsumexp(logits).view(n, w)
        return summarize(logits.view(n, w, self.vocab), ids, lse)

    def step_key(self, key: tuple[int, int, int]) -> torch.Tensor:
        """``step_body`` of a (rows, width, prefix bucket) key: the body `engine.kernels.step_graphs` captures."""
        return self.step_body(*key)

    def release(self) -> None:
        """Give the step buffers' memory back (the engine is done)."""
        self.logits = self.features = None

    def step_logits(self, n: int, w: int) -> torch.Tensor:
        """[n, w, vocab] view of the last step's logits (model dtype)."""
        return self.logits[: n * w * self.vocab].view(n, w, self.vocab)

    def step_features(self, n: int, w: int) -> torch.Tensor:
        return self.features[: n * w * self.feature_width].view(n, w, self.feature_width)

    def _attend_step(self, layer: int, q, pos, mask, end: int, scaling, rows: torch.Tensor | None = None):
        """Attention of the queries ``q`` [n, heads, w, dim] at ``pos`` [n, w] of cache rows ``rows`` (default
        ``0 .. n-1``) under the R-SWA rule."""
        slots = self.slots
        if self.invariant is not None:
            rows = self._rows[: q.shape[0]] if rows is None else rows
            return self.invariant.step_attention(q, slots.keys[layer], slots.values[layer], slots.tags,
                                                 slots.prefix_len, pos, rows, slots.ring_size, self.window, scaling)
        n = q.shape[0]
        keys = slots.keys[layer][:n, :end].transpose(1, 2)  # [n, kv_heads, slots, dim] views
        values = slots.values[layer][:n, :end].transpose(1, 2)
        if self.groups > 1:
            keys = keys.repeat_interleave(self.groups, dim=1)
            values = values.repeat_interleave(self.groups, dim=1)
        single = q.shape[2] == 1 and self.dtype != torch.float32
        if self.attn == "sdpa" or (self.attn == "auto" and single):
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
        # as transformers' eager attention: scores in the model dtype, softmax in fp32
        scores = torch.matmul(q, keys.transpose(2, 3)) * scaling
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype), values)

    # --- shared pieces ---------------------------------------------------------------------------------------

    def _norm(self, module, x):
        return module(x) if self.invariant is None else self.invariant.rms_norm(module, x)

    def _linear(self, module: torch.nn.Linear, x):
        if self.invariant is not None:
            return self.invariant.linear(module, x)
        return batched_gemv(module, x) if self.linear == "bmv" else module(x)

    def _lm_head(self, x, out: torch.Tensor | None = None):
        head = self.model.lm_head
        if self.invariant is not None:
            return self.invariant.linear(head, x, out=out)
        if out is None:
            return head(x)
        return torch.matmul(x, head.weight.t(), out=out)

    def _dense(self, mlp, x):
        """``UnlimitedOcrTextMLP.forward``: down(act(gate(x)) * up(x))."""
        return self._linear(mlp.down_proj, mlp.act_fn(self._linear(mlp.gate_proj, x)) * self._linear(mlp.up_proj, x))

    def _mlp(self, i: int, mlp, x):
        if not self.sparse[i]:
            return self._dense(mlp, x)
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if self.invariant is not None:
            routed = self.invariant.moe(mlp, flat)
        else:
            _, top_k_weights, top_k_index = mlp.gate(flat)
            routed = self._experts(mlp.experts, flat, top_k_index, top_k_weights)
        return routed.view(shape) + self._dense(mlp.shared_experts, x)


def summarize(logits: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """[n, w, 5] fp32 per token: argmax, max logit, logsumexp (``lse`` when given, else over fp32 logits), logit of the
    next staged id, that id (the last column's two entries are meaningless). Read from the logits in their own dtype
    (a max, an index and a lookup are exact in any dtype): no fp32 copy of the step's logits unless ``lse`` is
    computed here."""
    argmax = logits.argmax(dim=-1)
    following = torch.roll(ids, -1, dims=1)
    drafted = logits.gather(2, following[..., None])[..., 0].float()
    lse = torch.logsumexp(logits.float(), dim=-1) if lse is None else lse
    return torch.stack([argmax.float(), logits.amax(dim=-1).float(), lse, drafted, following.float()], dim=-1)
