"""`block` drafter (after DFlash): a small network that drafts a block of k tokens in one forward pass from
hidden states of several target layers over the recent context, and (``memory``) over the page images.

Shapes and positions. The output so far is o_0 .. o_t; the target has run every input up to o_{t-1} (o_t, the
last committed token, is the next verify round's first input). The drafter keeps the target's features of the
last ``context`` inputs it was fed (prompt positions from the prefill, then each round's committed inputs):
f = concat(hidden state after each of ``layers``) [context, len(layers) * H]. One forward over

    [fuse(f_{-C}) .. fuse(f_{-1}),  embed(o_t),  mask, mask, .. mask]      (C context rows + k block rows)

where block rows see every context row and every block row, and context rows see only context rows, gives at
block row j the draft of o_{t+1+j}. Only the block rows are read after the last layer, so that layer runs its
queries, MLP and the rest on the block rows alone (every row still gives keys and values): the same logits for
less work. ``embed`` and the output head are the target's
own ``embed_tokens`` and ``lm_head`` (frozen, through small projections), so the drafter's own weights stay small.

Page memory (``memory=True``). The recent context says where the target is reading, not what comes next: the
next words are only on the page. With memory, every row also cross-attends to the target's features of the
whole prompt (the page images' tokens after the target's layers, from the chunk's prefill), so the drafter can
read ahead instead of guessing from the text so far. Its keys and values are projected once per chunk
(`encode_memory`), not per draft.

This module holds the network, its configuration, its training loss and where a checkpoint keeps it. At decode
time `engine.drafters.block_rows.BlockRows` runs it for every row of a batch: its buffers only ever hold features
of committed inputs, so they need no rollback. Any draft is safe: the verify step keeps only what the target
itself produces.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

CONFIG_FILE = "drafter_config.json"
WEIGHTS_FILE = "drafter.safetensors"


@dataclass
class BlockDrafterConfig:
    target_hidden: int  # the target decoder's hidden size H
    layers: list[int]  # target decoder layers whose outputs are the features (0-based)
    block: int = 8  # k: tokens drafted per forward
    context: int = 32  # C: committed inputs whose features the drafter sees
    dim: int = 256  # the drafter's width
    num_layers: int = 2
    num_heads: int = 4
    loss_decay: float = 4.0  # training: block position j weighs exp(-j / loss_decay)
    memory: bool = False  # rows also attend to the prompt's features (the pages), see the module docstring
    meta: dict = field(default_factory=dict)  # what it was trained on (free-form, saved with it)

    @staticmethod
    def default_layers(num_target_layers: int) -> list[int]:
        """Three layers spread over the target: an early, a middle and the last one."""
        return sorted({1 if num_target_layers > 2 else 0, num_target_layers // 2, num_target_layers - 1})


@dataclass
class PageMemory:
    """The prompt's features projected to every drafter layer's keys and values, once per decode.
    kv[layer] = (k, v) [S, heads, M, head_dim]; allowed [S, 1, 1, M] (False = padding) or None;
    index [B] (which of the S memories each drafted example reads) or None (S == B)."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    allowed: torch.Tensor | None = None
    index: torch.Tensor | None = None


class DraftLayer(torch.nn.Module):
    """Pre-norm transformer layer: masked self-attention over the rows, cross-attention to the page memory when
    there is one, MLP."""

    def __init__(self, dim: int, heads: int, memory: bool):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        if memory:
            self.norm_q = torch.nn.LayerNorm(dim)
            self.q_mem = torch.nn.Linear(dim, dim)
            self.kv_mem = torch.nn.Linear(dim, 2 * dim)
            self.proj_mem = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def _split(self, x: torch.Tensor) -> torch.Tensor:  # [B, N, dim] -> [B, heads, N, head_dim]
        B, N, D = x.shape
        return x.view(B, N, self.heads, D // self.heads).transpose(1, 2)

    def memory_kv(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.kv_mem(memory).chunk(2, dim=-1)
        return self._split(k), self._split(v)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor, memory: PageMemory | None, layer: int,
                first_row: int = 0) -> torch.Tensor:
        """x [B, N, dim] -> rows ``first_row``.. of the layer's output (every row still serves as key and value:
        the last layer computes only the block rows, the only ones read after it)."""
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x, q, allowed = x[:, first_row:], q[:, first_row:], allowed[first_row:]
        B, N, D = x.shape
        a = F.scaled_dot_product_attention(self._split(q), self._split(k), self._split(v), attn_mask=allowed)
        x = x + self.proj(a.transpose(1, 2).reshape(B, N, D))
        if memory is not None:
            mk, mv = memory.kv[layer]
            mask = memory.allowed
            if memory.index is not None:
                mk, mv = mk[memory.index], mv[memory.index]
                mask = mask[memory.index] if mask is not None else None
            a = F.scaled_dot_product_attention(self._split(self.q_mem(self.norm_q(x))), mk, mv, attn_mask=mask)
            x = x + self.proj_mem(a.transpose(1, 2).reshape(B, N, D))
        return x + self.mlp(self.norm2(x))


class BlockDrafterNet(torch.nn.Module):
    def __init__(self, config: BlockDrafterConfig):
        super().__init__()
        c = config
        self.config = c
        self.fuse = torch.nn.Linear(len(c.layers) * c.target_hidden, c.dim)
        self.embed_in = torch.nn.Linear(c.target_hidden, c.dim)
        self.mask_token = torch.nn.Parameter(torch.zeros(c.dim))
        self.positions = torch.nn.Embedding(c.context + c.block, c.dim)
        if c.memory:
            self.memory_in = torch.nn.Sequential(torch.nn.Linear(len(c.layers) * c.target_hidden, c.dim),
                                                 torch.nn.LayerNorm(c.dim))
        self.blocks = torch.nn.ModuleList(DraftLayer(c.dim, c.num_heads, c.memory) for _ in range(c.num_layers))
        self.norm = torch.nn.LayerNorm(c.dim)
        self.head_in = torch.nn.Linear(c.dim, c.target_hidden)
        n = c.context + c.block
        allowed = torch.ones(n, n, dtype=torch.bool)
        allowed[: c.context, c.context :] = False  # context rows never see the block
        self.register_buffer("allowed", allowed, persistent=False)  # True = may attend (SDPA convention)
        torch.nn.init.normal_(self.mask_token, std=0.02)

    def encode_memory(self, features: torch.Tensor, lengths: list[int] | None = None,
                      index: torch.Tensor | None = None) -> PageMemory | None:
        """features [S, M, L*H] (the prompt's features; right-padded when `lengths` says so) -> PageMemory for
        the forwards that follow; None when this drafter has no memory."""
        if not self.config.memory:
            return None
        mem = self.memory_in(features.to(self.fuse.weight.dtype))
        allowed = None
        if lengths is not None and min(lengths) < features.shape[1]:
            allowed = (torch.arange(features.shape[1], device=features.device)[None]
                       < torch.tensor(lengths, device=features.device)[:, None])[:, None, None]
        return PageMemory([layer.memory_kv(mem) for layer in self.blocks], allowed, index)

    def forward(self, features: torch.Tensor, last_embedding: torch.Tensor, lm_head,
                memory: PageMemory | None = None) -> torch.Tensor:
        """features [B, C, L*H], last_embedding [B, H] (target's embedding of o_t) -> logits [B, k, vocab]."""
        c = self.config
        if c.memory and memory is None:
            raise ValueError("this block drafter reads the page memory: pass encode_memory(prompt features)")
        B = features.shape[0]
        ctx = self.fuse(features)
        first = self.embed_in(last_embedding)[:, None]
        masks = self.mask_token.expand(B, c.block - 1, -1)
        x = torch.cat([ctx, first, masks], dim=1) + self.positions.weight[None]
        last = len(self.blocks) - 1
        for i, layer in enumerate(self.blocks):
            x = layer(x, self.allowed, memory, i, first_row=c.context if i == last else 0)
        return lm_head(self.head_in(self.norm(x)))

    def save(self, folder: str | Path) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=1))
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(folder / WEIGHTS_FILE))

    @classmethod
    def load(cls, folder: str | Path, device="cpu", dtype=torch.float32) -> "BlockDrafterNet":
        from safetensors.torch import load_file

        folder = Path(folder)
        net = cls(BlockDrafterConfig(**json.loads((folder / CONFIG_FILE).read_text())))
        net.load_state_dict(load_file(str(folder / WEIGHTS_FILE)))
        return net.to(device=device, dtype=dtype).eval().requires_grad_(False)


def block_loss(logits: torch.Tensor, targets: torch.Tensor, decay: float) -> torch.Tensor:
    """Cross-entropy per block position weighted by exp(-j / decay) (early positions matter most: a draft is
    accepted only up to its first miss); targets -100 are ignored."""
    B, k, V = logits.shape
    ce = F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1), ignore_index=-100,
                         reduction="none").view(B, k)
    weights = torch.exp(-torch.arange(k, device=logits.device, dtype=torch.float32) / decay)
    valid = (targets != -100).float()
    return (ce * valid * weights).sum() / (valid * weights).sum().clamp(min=1e-6)


def drafter_folder(model_path: str | Path) -> Path:
    """Where a checkpoint's own drafter lives: ``<model folder>/drafter``."""
    return Path(model_path) / "drafter"

