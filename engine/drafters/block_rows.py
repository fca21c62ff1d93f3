"""The block drafter for every row of a batch: one forward drafts a block for rows ``0 .. n-1`` at once.

`engine.drafters.block.BlockDrafterNet` reads, per row, the target's features of the last C committed inputs and,
with ``memory``, the features of the row's whole prompt (its pages). Here both live in static device buffers:
- ``ctx`` [B, C, F]: a ring per row of the features of its committed inputs (``feed`` writes each step's
  committed rows at ``fed % C`` in one scatter); a draft gathers it in input order;
- the page memory's keys and values per drafter layer [B, heads, M, head_dim] (M a multiple of
  ``memory_bucket`` >= every row's prompt), projected once per chunk by ``start``, padding masked by ``allowed``;
- ``last`` [B]: each row's last committed token; ``out`` [B, block]: the drafted ids, which stay on the device:
  the verify step reads them there (`engine.batch.engine`), so the host never waits for a draft.

Invariants: ``start(row)`` begins a chunk; ``feed`` gets every committed input of every row in order, exactly
once (``ready`` checks the count against the output); a draft reads only these buffers, so one CUDA graph per
(row bucket, memory bucket) replays it. Any draft is safe: the verify step keeps only the target's own tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.drafters.block import BlockDrafterNet, PageMemory
from engine.kernels.step_graphs import StepGraphs

MEMORY_BUCKET = 256


class BlockRows:
    name = "block"

    def __init__(self, net: BlockDrafterNet, embed_tokens, lm_head, max_batch: int, graphs: bool = False,
                 memory_bucket: int = MEMORY_BUCKET):
        c = net.config
        p = next(net.parameters())
        self.net, self.embed_tokens, self.lm_head = net, embed_tokens, lm_head
        self.block, self.context = c.block, c.context
        self.device, self.dtype = p.device, p.dtype
        self.memory_bucket = memory_bucket
        width = len(c.layers) * c.target_hidden
        with torch.inference_mode():
            self.ctx = torch.zeros(max_batch, c.context, width, device=p.device, dtype=p.dtype)
            self.order = torch.zeros(max_batch, c.context, dtype=torch.long, device=p.device)
            self.last = torch.zeros(max_batch, dtype=torch.long, device=p.device)
            self.out = torch.zeros(max_batch, c.block, dtype=torch.long, device=p.device)
        self.fed = np.zeros(max_batch, dtype=np.int64)  # inputs fed per row (prompt + committed outputs)
        self.prompt_len = np.zeros(max_batch, dtype=np.int64)
        self.mem_capacity = 0
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.allowed: torch.Tensor | None = None
        self.graphs = StepGraphs(self._body, p.device) if graphs else None

    # --- rows --------------------------------------------------------------------------------------------

    def _grow_memory(self, length: int) -> None:
        c, B = self.net.config, self.ctx.shape[0]
        capacity = self.memory_bucket * -(-length // self.memory_bucket)
        head_dim = c.dim // c.num_heads
        old, old_cap = self.kv, self.mem_capacity
        with torch.inference_mode():
            self.kv = [tuple(torch.zeros(B, c.num_heads, capacity, head_dim, device=self.device, dtype=self.dtype)
                             for _ in range(2)) for _ in range(c.num_layers)]
            for (k, v), (ok, ov) in zip(self.kv, old):
                k[:, :, :old_cap].copy_(ok)
                v[:, :, :old_cap].copy_(ov)
            allowed = torch.zeros(B, 1, 1, capacity, dtype=torch.bool, device=self.device)
            if self.allowed is not None:
                allowed[..., :old_cap].copy_(self.allowed)
            self.allowed = allowed
        self.mem_capacity = capacity
        if self.graphs is not None:
            self.graphs.clear()

    @torch.inference_mode()
    def start(self, row: int, prompt_features: torch.Tensor) -> None:
        """A new chunk in ``row``: its prompt's features [L, F] (from its prefill)."""
        length, C = prompt_features.shape[0], self.context
        if self.net.config.memory:
            if length > self.mem_capacity:
                self._grow_memory(length)
            fresh = self.net.encode_memory(prompt_features[None].to(self.dtype))
            for (k, v), (fk, fv) in zip(self.kv, fresh.kv):
                k[row].zero_()
                v[row].zero_()
                k[row, :, :length].copy_(fk[0])
                v[row, :, :length].copy_(fv[0])
            self.allowed[row].zero_()
            self.allowed[row, ..., :length] = True
        self.ctx[row].zero_()
        tail = prompt_features[-C:].to(self.dtype)
        ring = (np.arange(length - tail.shape[0], length)) % C
        self.ctx[row, torch.as_tensor(ring, device=self.device)] = tail
        self.fed[row] = self.prompt_len[row] = length

    def ready(self, row: int, committed_ids: list[int]) -> bool:
        """The row was fed every input up to o_{t-1} (prompt, then the committed outputs but the last) and holds a
        full context: it can draft."""
        fed = int(self.fed[row])
        expected = int(self.prompt_len[row]) + len(committed_ids) - 1
        if fed != expected:
            raise RuntimeError(f"block drafter row {row} fed {fed} inputs, expected {expected}")
        return fed >= self.context

    @torch.inference_mode()
    def feed(self, counts: dict[int, int], features: torch.Tensor) -> None:
        """features [n, w, F] of the step just run; ``counts[row]`` = its committed inputs (the first ones)."""
        if not counts:
            return
        src_rows, src_cols, dst_pos = [], [], []
        for row, count in counts.items():
            src_rows += [row] * count
            src_cols += range(count)
            dst_pos += [(int(self.fed[row]) + j) % self.context for j in range(count)]
            self.fed[row] += count
        index = torch.as_tensor(np.array([src_rows, src_cols, dst_pos]), device=self.device)
        self.ctx.index_put_((index[0], index[2]), features[index[0], index[1]].to(self.dtype))

    # --- drafting -----------------------------------------------------------------------------------------

    @torch.inference_mode()
    def draft(self, n: int, last_ids: np.ndarray) -> torch.Tensor:
        """Draft a block for rows ``0 .. n-1`` (``last_ids`` [n]: their last committed tokens); returns ``out[:n]``
        [n, block] on the device (valid until the next draft). Rows that do not use it are ignored by the caller."""
        order = (self.fed[:n, None] + np.arange(self.context)[None]) % self.context
        self.order[:n].copy_(torch.as_tensor(order), non_blocking=True)
        self.last[:n].copy_(torch.as_tensor(last_ids), non_blocking=True)
        if self.graphs is not None:
            return self.graphs.replay((n, self.mem_capacity))
        return self._body((n, self.mem_capacity))

    def close(self) -> None:
        """Give the device buffers and graphs back (the engine is done)."""
        if self.graphs is not None:
            self.graphs.close()
        self.graphs, self.kv, self.allowed = None, [], None
        self.ctx = self.order = self.last = self.out = None

    def _body(self, key: tuple[int, int]) -> torch.Tensor:
        n = key[0]
        feats = self.ctx[:n].gather(1, self.order[:n, :, None].expand(-1, -1, self.ctx.shape[2]))
        memory = None
        if self.net.config.memory:
            memory = PageMemory([(k[:n], v[:n]) for k, v in self.kv], self.allowed[:n])
        last = self.embed_tokens(self.last[:n]).to(self.dtype)
        logits = self.net(feats, last, self.lm_head, memory)
        self.out[:n].copy_(logits.argmax(-1))
        return self.out[:n]


class BlockRowDrafter:
    """A row's view of `BlockRows` for its `engine.drafters.policy.DraftPolicy` (``on_device``: the engine drafts)."""

    name = "block"
    on_device = True

    def __init__(self, rows: BlockRows, row: int, sits_out: bool = True, keeps_k: bool = False):
        self.rows, self.row = rows, row
        self.max_draft = rows.block
        self.sits_out, self.keeps_k = sits_out, keeps_k

    def ready(self, committed_ids: list[int]) -> bool:
        return self.rows.ready(self.row, committed_ids)
