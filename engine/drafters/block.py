"""`block` drafter (after DFlash): a small network that drafts a block of k tokens in one forward pass from
hidden states of several target layers over the recent context.

Shapes and positions. The output so far is o_0 .. o_t; the target has run every input up to o_{t-1} (o_t, the
last committed token, is the next verify round's first input). The drafter keeps the target's features of the
last ``context`` inputs it was fed (prompt positions from the prefill, then each round's committed inputs):
f = concat(hidden state after each of ``layers``) [context, len(layers) * H]. One forward over

    [fuse(f_{-C}) .. fuse(f_{-1}),  embed(o_t),  mask, mask, .. mask]      (C context rows + k block rows)

where block rows see every context row and every block row, and context rows see only context rows, gives at
block row j the draft of o_{t+1+j}. ``embed`` and the output head are the target's own ``embed_tokens`` and
``lm_head`` (frozen, through small projections), so the drafter's own weights stay small.

Its cache needs no rollback: it only ever holds features of committed inputs (``feed``). Any draft is safe:
the verify round keeps only what the target itself produces.
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
    meta: dict = field(default_factory=dict)  # what it was trained on (free-form, saved with it)

    @staticmethod
    def default_layers(num_target_layers: int) -> list[int]:
        """Three layers spread over the target: an early, a middle and the last one."""
        return sorted({1 if num_target_layers > 2 else 0, num_target_layers // 2, num_target_layers - 1})


class BlockDrafterNet(torch.nn.Module):
    def __init__(self, config: BlockDrafterConfig):
        super().__init__()
        c = config
        self.config = c
        self.fuse = torch.nn.Linear(len(c.layers) * c.target_hidden, c.dim)
        self.embed_in = torch.nn.Linear(c.target_hidden, c.dim)
        self.mask_token = torch.nn.Parameter(torch.zeros(c.dim))
        self.positions = torch.nn.Embedding(c.context + c.block, c.dim)
        layer = torch.nn.TransformerEncoderLayer(c.dim, c.num_heads, 4 * c.dim, dropout=0.0, activation="gelu",
                                                 batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, c.num_layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(c.dim)
        self.head_in = torch.nn.Linear(c.dim, c.target_hidden)
        n = c.context + c.block
        allowed = torch.ones(n, n, dtype=torch.bool)
        allowed[: c.context, c.context :] = False  # context rows never see the block
        self.register_buffer("attn_mask", ~allowed, persistent=False)  # True = masked (PyTorch convention)
        torch.nn.init.normal_(self.mask_token, std=0.02)

    def forward(self, features: torch.Tensor, last_embedding: torch.Tensor, lm_head) -> torch.Tensor:
        """features [B, C, L*H], last_embedding [B, H] (target's embedding of o_t) -> logits [B, k, vocab]."""
        c = self.config
        B = features.shape[0]
        ctx = self.fuse(features)
        first = self.embed_in(last_embedding)[:, None]
        masks = self.mask_token.expand(B, c.block - 1, -1)
        x = torch.cat([ctx, first, masks], dim=1) + self.positions.weight[None]
        h = self.blocks(x, mask=self.attn_mask)
        return lm_head(self.head_in(self.norm(h[:, c.context :])))

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


class BlockDrafter:
    """The runtime drafter (``engine.drafters.Drafter``) of one decode. The engine calls ``feed`` with the
    target's features of every input it commits (the prompt after the prefill, then each round's), in order."""

    name = "block"

    def __init__(self, net: BlockDrafterNet, embed_tokens, lm_head):
        self.net, self.embed_tokens, self.lm_head = net, embed_tokens, lm_head
        self._buffer: torch.Tensor | None = None  # [<= C, L*H], the latest fed features
        self.fed = 0  # inputs fed so far (prompt + committed outputs)
        self.prompt_len: int | None = None

    def feed(self, features: torch.Tensor) -> None:
        """features [n, L*H] of the next n committed inputs."""
        if self.prompt_len is None:
            self.prompt_len = features.shape[0]
        buf = features if self._buffer is None else torch.cat([self._buffer, features])
        self._buffer = buf[-self.net.config.context :]
        self.fed += features.shape[0]

    @torch.inference_mode()
    def propose(self, committed_ids: list[int], k: int) -> list[int]:
        c = self.net.config
        if k < 1 or self._buffer is None or self._buffer.shape[0] < c.context:
            return []
        if self.fed != self.prompt_len + len(committed_ids) - 1:
            raise RuntimeError(f"block drafter fed {self.fed} inputs, expected prompt {self.prompt_len} + "
                               f"{len(committed_ids) - 1} committed outputs")
        p = next(self.net.parameters())
        last = torch.tensor([committed_ids[-1]], device=p.device)
        logits = self.net(self._buffer[None].to(p.dtype), self.embed_tokens(last).to(p.dtype), self.lm_head)
        return logits[0, : min(k, c.block)].argmax(-1).tolist()
