"""The R-SWA key/value cache of B decode slots: per slot a prefix region and a tagged output ring, in static buffers.

Layout, per decoder layer, keys and values ``[B, C + P, kv_heads, head_dim]``:
- slots ``[0, C)`` of a row are its output ring, slots ``[C, C + L_b)`` its prefix (BOS + image tokens + prompt,
  positions ``0 .. L_b - 1``), written once at admission (``P`` is the prefix capacity, grown on demand);
- ``tags[b, r]`` is the absolute position ring slot ``r`` of row ``b`` holds (``EMPTY`` until written); position
  ``p >= L_b`` lives in ring slot ``p % C``;
- ``prefix_len[b]`` is ``L_b`` (1 for a free row, so that its queries see one zero slot and stay finite).

Attention rule (the model's R-SWA): a query of row ``b`` at position ``p`` sees its prefix slots ``j < L_b`` and
its ring slots whose tag is in ``[p - W + 1, p]`` (W = sliding window, itself included). Rows never see each other.

Invariants (a step of row b writes positions ``len_b .. len_b + w - 1``, w <= ``max_width``; drafts and padding
alike, only the first accepted ones are committed):
1. ``C >= W + max_width - 1``: a step never overwrites a ring slot one of its own queries needs, and a committed
   position a later query needs is never overwritten by a rejected or padded write.
2. Positions ``< len_b`` are committed. Rejected positions have tags ``>= len_b``; the step that next holds such a
   position rewrites it before any query reads it (every layer writes before it attends). Rollback after a
   rejection is moving ``len_b``: no copy, no clearing.
3. A row's results depend only on its own inputs and buffers (no reduction crosses rows), so a chunk's tokens do
   not depend on the other rows of the batch: exactly in fp32, bitwise in bf16 with batch-invariant kernels.
4. Shapes never change while rows are in flight, except when a longer prefix than ``P`` is admitted: then every
   buffer grows (rows copied) and captured graphs are dropped. Memory is constant in output length.

Memory: the key/value buffers hold ``rows <= max_batch`` rows. They are made, grown and cut buffer by buffer (a
layer's keys, then its values, ...: a new buffer, the kept contents copied, the old one freed), so a change of shape
costs one buffer's worth of memory beyond the cache, never a second cache. When ``rows`` rows of a capacity do not fit
(out of memory at construction or when the prefix region grows), ``rows`` steps down by ``STEP_DOWN`` (about 10%)
until they do (one row at least, else the error stands); ``keep_rows`` gives back the memory of the rows above a
count (the batch shrinks after an out-of-memory error elsewhere); ``release`` gives all of it back (the engine is
done). The caller keeps its rows below ``rows`` (the rows above lose their cache).
"""

from __future__ import annotations

import math

import torch

STEP_DOWN = 0.9  # rows kept when a capacity's buffers do not fit
EMPTY = -(2**62)  # tag of a ring slot never written by the row's current chunk: outside every window
ALIGN = 16
# prefix lengths a step graph is kept for: attention reads only the slots up to the bucket
PREFIX_BUCKETS = [*range(128, 2048, 128), *range(2048, 8192, 512), *range(8192, 65536 + 1, 1024)]


def bucket(value: int, buckets: list[int]) -> int:
    """The smallest bucket >= ``value``."""
    for b in buckets:
        if b >= value:
            return b
    raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")


def pow2_buckets(largest: int) -> list[int]:
    """1, 2, 4 .. below ``largest``, and ``largest``: the batch sizes and step widths a graph is kept for."""
    if largest < 1:
        raise ValueError("largest must be >= 1")
    return sorted({2**e for e in range(largest.bit_length()) if 2**e < largest} | {largest})


class KVSlots:
    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, window: int, max_batch: int,
                 max_width: int, prefix_capacity: int, dtype: torch.dtype, device: torch.device | str):
        if min(num_layers, window, max_batch, max_width, prefix_capacity) < 1:
            raise ValueError("layers, window, max_batch, max_width and prefix_capacity must be positive")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.window, self.max_batch, self.max_width = window, max_batch, max_width
        self.ring_size = math.ceil((window + max_width - 1) / ALIGN) * ALIGN
        self.dtype, self.device = dtype, torch.device(device)
        with torch.inference_mode():
            self.tags = torch.full((max_batch, self.ring_size), EMPTY, dtype=torch.long, device=self.device)
            self.prefix_len = torch.ones(max_batch, dtype=torch.long, device=self.device)
            # step inputs (ids, positions), staged by the host in one copy a step and read by the step graph
            self._staged = torch.zeros(2, max_batch, max_width, dtype=torch.long, device=self.device)
            self.ids, self.pos = self._staged[0], self._staged[1]
        pinned = self.device.type == "cuda"
        self._host = torch.zeros(2, max_batch, max_width, dtype=torch.long, pin_memory=pinned)
        self.host_ids, self.host_pos = self._host.numpy()[0], self._host.numpy()[1]
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.capacity, self.rows = 0, max_batch
        self._allocate(prefix_capacity)

    def _allocate(self, capacity: int) -> None:
        """Buffers of ``capacity`` prefix slots, the rows' contents kept; as many rows as fit (see the module
        docstring)."""
        while True:
            try:
                self._reshape(capacity)
                break
            except torch.OutOfMemoryError:
                if self.rows == 1:
                    raise
            # outside the handler, whose traceback holds the buffer that failed
            self.keep_rows(max(1, min(self.rows - 1, int(self.rows * STEP_DOWN))))
        with torch.inference_mode():
            self.prefix_index = torch.arange(capacity, device=self.device)
        self.capacity = capacity

    def _reshape(self, capacity: int) -> None:
        """Every buffer at ``rows`` x ``ring_size + capacity`` slots, one at a time (those already so are left)."""
        shape = (self.rows, self.ring_size + capacity, self.num_kv_heads, self.head_dim)
        with torch.inference_mode():
            for group in (self.keys, self.values):
                while len(group) < self.num_layers:
                    group.append(self.zeros(shape))
                for i, old in enumerate(group):
                    if tuple(old.shape) == shape:
                        continue
                    # zeros, not empty: masked slots still enter the attention products, and garbage could be NaN
                    new = self.zeros(shape)
                    rows, slots = min(shape[0], old.shape[0]), min(shape[1], old.shape[1])
                    new[:rows, :slots].copy_(old[:rows, :slots])
                    group[i] = new
                    del old
                    self._free_cached()

    def _free_cached(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def release(self) -> None:
        """Give every buffer's memory back (the engine is done with this cache)."""
        self.keys, self.values, self.capacity = [], [], 0
        self._free_cached()

    def keep_rows(self, rows: int) -> bool:
        """Hold the first ``rows`` rows only, freeing the others' memory (their contents are dropped); True when the
        buffers moved. Buffer by buffer: a smaller copy, then the old one goes, so the copy costs one buffer's worth
        of memory at most; a copy that does not fit keeps a view of the old buffer (right shape, memory freed on the
        next call)."""
        rows = max(1, rows)
        whole = all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in [*self.keys, *self.values])
        if rows >= self.rows and whole:
            return False  # nothing to free (no view of a larger buffer left from a copy that did not fit)
        rows = min(rows, self.rows)
        with torch.inference_mode():
            for group in (self.keys, self.values):
                for i, old in enumerate(group):
                    group[i] = old[:rows]  # a view; ``old`` is the old buffer's last other holder
                    try:
                        group[i] = self.zeros(tuple(group[i].shape)).copy_(old[:rows])
                    except torch.OutOfMemoryError:
                        pass  # the view stays: right shape, the memory given back by the next call
                    del old
                    self._free_cached()
        self.rows = rows
        return True

    def zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        """One key or value buffer (a test can make it run out of memory)."""
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def ensure_capacity(self, prefix_len: int) -> bool:
        """Grow the prefix region to hold ``prefix_len`` tokens (rows kept); True when the buffers moved."""
        if prefix_len <= self.capacity:
            return False
        self._allocate(bucket(prefix_len, PREFIX_BUCKETS))
        return True

    def nbytes(self) -> int:
        """Bytes of the cache buffers and static inputs; constant whatever the output lengths."""
        tensors = [*self.keys, *self.values, self.tags, self.prefix_len, self._staged]
        return sum(t.numel() * t.element_size() for t in tensors)

    def bytes_per_row(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in [*self.keys, *self.values])

    # --- rows -------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def open_row(self, row: int, prefix_len: int) -> None:
        """A new chunk takes ``row``: its ring forgets the previous chunk, its prefix is ``prefix_len`` long."""
        if prefix_len > self.capacity:
            raise ValueError(f"prefix of {prefix_len} tokens; capacity {self.capacity}")
        self.tags[row].fill_(EMPTY)
        self.prefix_len[row] = prefix_len

    @torch.inference_mode()
    def close_row(self, row: int) -> None:
        self.tags[row].fill_(EMPTY)
        self.prefix_len[row] = 1

    def write_prefix(self, layer: int, row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values [L, kv_heads, head_dim] of the prefix positions 0 .. L-1."""
        c = self.ring_size
        self.keys[layer][row, c : c + keys.shape[0]].copy_(keys)
        self.values[layer][row, c : c + keys.shape[0]].copy_(values)

    def prefix_view(self, layer: int, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.ring_size
        return self.keys[layer][row, c : c + length], self.values[layer][row, c : c + length]

    # --- steps ----------------------------------------------------------------------------------------------

    def stage(self) -> None:
        """Copy the host-staged ids and positions to the device: one asynchronous copy of the whole (small) buffer
        from pinned memory. The host writes the buffer again only after the step's results came back."""
        self._staged.copy_(self._host, non_blocking=True)

    def tag_step(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tag the ring slots of the step's positions ``pos`` [n, w] (rows 0..n-1); returns (row index, ring index)
        [n, w] of each position, what ``write_step`` takes."""
        ring = pos % self.ring_size
        self.tags[: pos.shape[0]].scatter_(1, ring, pos)
        rows = torch.arange(pos.shape[0], device=pos.device)[:, None].expand_as(ring)
        return rows, ring

    def step_mask(self, pos: torch.Tensor, prefix_bucket: int) -> torch.Tensor:
        """bool [n, 1, w, C + prefix_bucket] (True = attend) of the step's queries at ``pos`` [n, w]."""
        n = pos.shape[0]
        tags = self.tags[:n, None, :]
        p = pos[:, :, None]
        sees_ring = (tags <= p) & (tags > p - self.window)
        sees_prefix = self.prefix_index[None, None, :prefix_bucket] < self.prefix_len[:n, None, None]
        return torch.cat([sees_ring, sees_prefix.expand(-1, pos.shape[1], -1)], dim=2)[:, None]

    def write_step(self, layer: int, where: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor,
                   values: torch.Tensor) -> None:
        """keys/values [n, w, kv_heads, head_dim] of the step's positions into the slots ``where`` (``tag_step``)."""
        self.keys[layer].index_put_(where, keys)
        self.values[layer].index_put_(where, values)

