"""R-SWA key/value cache with speculation slack: a fixed prefix region plus a tagged output ring.

Layout, per decoder layer, one static buffer of ``prefix_len + ring_size`` slots:
- slots ``[0, L)`` hold the prefix (BOS + image tokens + prompt text, positions ``0..L-1``), written once;
- slots ``[L, L + C)`` are the output ring; position ``p >= L`` lives in slot ``L + p % C``, and
  ``tags[p % C] == p`` records which position a ring slot holds (``EMPTY`` until first written).

Attention rule (the model's R-SWA, ``engine.official.rswa_mask``): a query at position ``p`` sees every
prefix slot ``j <= p`` and every ring slot whose tag is in ``[p - W + 1, p]`` (W = sliding window, itself
included).

Invariants:
1. ``C = W + max_step_tokens - 1``. A step writes at most ``max_step_tokens`` consecutive positions
   ``c .. c+K-1`` starting at the committed length ``c``; its queries need tags down to ``c - W + 1``. The
   written and the needed positions span ``W + K - 1 <= C`` values, so a step never overwrites a slot that
   one of its own queries needs.
2. Positions ``< length`` are committed: their slots hold the states of the accepted tokens.
3. Rejected positions (written by a step, never committed) are invisible: their tags are ``>= length``,
   i.e. ahead of every query until a later step writes those very positions again (a query at ``p`` only
   sees tags ``<= p``, and every tag ``>= length`` that is ``<= p`` was rewritten by the step holding ``p``).
   Rollback after a rejection is therefore ``commit(accepted)`` only: no copy, no clearing.
4. Shapes never change after construction; memory is ``nbytes()`` whatever the output length.

The object plays the part of a transformers cache for the model's own attention modules: they call
``update(key_states, value_states, layer_idx)`` and attend over the buffers it returns, with the mask
from ``begin_step``.
"""

from __future__ import annotations

import torch

EMPTY = -(2**62)  # tag of a ring slot never written: outside every window


class RswaKVCache:
    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, prefix_len: int, window: int,
                 max_step_tokens: int, dtype: torch.dtype, device: torch.device | str):
        if prefix_len < 1 or window < 1 or max_step_tokens < 1:
            raise ValueError("prefix_len, window and max_step_tokens must be positive")
        self.prefix_len = prefix_len
        self.window = window
        self.max_step_tokens = max_step_tokens
        self.ring_size = window + max_step_tokens - 1
        shape = (1, num_kv_heads, prefix_len + self.ring_size, head_dim)
        # zeros, not empty: masked slots still enter the attention product, and garbage could be NaN
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.tags = torch.full((self.ring_size,), EMPTY, dtype=torch.long, device=device)
        self._prefix_slots = torch.arange(prefix_len, device=device)
        self.length = 0  # committed positions: [0, length)
        self._step_slots: torch.Tensor | None = None
        self._step_tokens = 0

    def begin_step(self, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Open a step over positions ``length .. length + n_tokens - 1`` (all in the prefix, or all
        outputs): tag their slots and return (position ids [1, n], bool mask [1, 1, n, L + C], True = attend)."""
        start = self.length
        positions = torch.arange(start, start + n_tokens, device=self.tags.device)
        if start < self.prefix_len:
            if start + n_tokens > self.prefix_len:
                raise ValueError(f"a step may not cross the end of the prefix ({self.prefix_len} tokens)")
            self._step_slots = positions
        else:
            if n_tokens > self.max_step_tokens:
                raise ValueError(f"a step of {n_tokens} output tokens; the ring allows {self.max_step_tokens}")
            ring_index = positions % self.ring_size
            self.tags.index_copy_(0, ring_index, positions)
            self._step_slots = self.prefix_len + ring_index
        self._step_tokens = n_tokens
        p = positions[:, None]
        sees_prefix = self._prefix_slots[None, :] <= p
        sees_ring = (self.tags[None, :] <= p) & (self.tags[None, :] > p - self.window)
        return positions[None], torch.cat([sees_prefix, sees_ring], dim=1)[None, None]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Called by the model's attention: write this step's states, return the whole layer buffer."""
        self.keys[layer_idx].index_copy_(2, self._step_slots, key_states)
        self.values[layer_idx].index_copy_(2, self._step_slots, value_states)
        return self.keys[layer_idx], self.values[layer_idx]

    def commit(self, n_tokens: int) -> None:
        """Accept the first ``n_tokens`` positions of the step just run; the rest are dropped (invariant 3)."""
        if not 0 <= n_tokens <= self._step_tokens:
            raise ValueError(f"cannot commit {n_tokens} of a {self._step_tokens}-token step")
        self.length += n_tokens
        self._step_tokens = 0

    def nbytes(self) -> int:
        """Bytes held by the cache (keys, values, tags); constant for its lifetime."""
        tensors = [*self.keys, *self.values, self.tags, self._prefix_slots]
        return sum(t.numel() * t.element_size() for t in tensors)
