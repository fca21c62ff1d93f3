"""Tile configurations of the invariant kernels (`engine.kernels.invariant`): chosen by measurement on the card, per
weight shape and number of rows, and only among configurations whose results are bitwise those of the default.

Why this keeps every token: a configuration (``BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages``) decides how the
output is cut into tiles and how loads are pipelined, and an output element is still the same chain of tensor-core
products over K in the same order, as long as ``BLOCK_K`` and the instruction family stay. That is an argument, not a
guarantee (a compiler may pick another instruction for another tile), so it is checked, never assumed: `TileTable.tune`
runs each candidate on random inputs at each rows bucket and keeps it for a shape only if every output bit equals the
default's at every bucket. Then a step of any rows, a verify of any width and a prefill of any length give each row
the bits it would get alone, whichever configuration each of them ran: batch invariance holds across configurations.

Without `tune` (off CUDA, or a caller that does not ask) every kernel runs the default tiles, as before.

- ``linear``: the dense matmul, keyed by (N, K) of the weight; ``grouped``: the routed experts' grouped matmul, keyed
  by (N, K) of one expert's weight, whose slot layout follows the configuration's ``BLOCK_M``.
- rows buckets: a configuration per bucket of rows (tokens) in a call, ``ROW_BUCKETS``; each is tuned at its largest
  count (the cost at the bucket's upper end, where the choice matters most).
- tuning runs once per process and device for each shape (a worker's engines share it), ``WARMUP + REPEAT`` calls of
  each candidate a bucket, timed with CUDA events.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

Config = tuple[int, int, int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages
DEFAULT: Config = (64, 64, 64, 4, 3)
NARROW: Config = (64, 16, 64, 4, 3)  # weights of at most 64 outputs (the router): 4x the programs, never tuned
# BLOCK_K stays 64 in every candidate (the K chain's cut); tiles of 64 rows and more keep Hopper's wgmma family
CANDIDATES: tuple[Config, ...] = (DEFAULT, (64, 128, 64, 4, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 3),
                                  (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (64, 256, 64, 8, 3),
                                  (128, 256, 64, 8, 3))
ROW_BUCKETS = (16, 64, 256, 1024, 4096)  # the last one also serves every larger call
WARMUP, REPEAT = 2, 5


def rows_bucket(m: int) -> int:
    return next((b for b in ROW_BUCKETS if m <= b), ROW_BUCKETS[-1])


@dataclass
class TileTable:
    choice: dict[tuple[str, int, int, int], Config] = field(default_factory=dict)  # (kind, N, K, bucket) -> config
    rejected: dict[tuple[str, int, int], list[Config]] = field(default_factory=dict)  # not bitwise the default
    tuned: set[tuple[str, int, int, str]] = field(default_factory=set)  # (kind, N, K, device name)
    timings: dict[tuple[str, int, int, int], dict[Config, float]] = field(default_factory=dict)  # ms, for records

    def pick(self, kind: str, n: int, k: int, m: int) -> Config:
        """The configuration a call of ``m`` rows against an (n, k) weight runs."""
        if n <= 64 and kind == "linear":
            return NARROW
        return self.choice.get((kind, n, k, rows_bucket(m)), DEFAULT)

    def tune(self, kind: str, weight: torch.Tensor, run, candidates: tuple[Config, ...] = CANDIDATES,
             buckets: tuple[int, ...] = ROW_BUCKETS, timer=None) -> None:
        """Measure ``candidates`` for one weight shape (``weight`` [N, K], or [E, N, K] for ``grouped``) and keep the
        fastest bitwise-equal one per rows bucket. ``run(config, m, inputs) -> output`` launches the kernel on the
        random ``inputs`` of ``m`` rows (made here, the same for every candidate); ``timer(fn) -> ms`` (default:
        `time_ms`)."""
        n, k = weight.shape[-2], weight.shape[-1]
        key = (kind, n, k, _device_name(weight.device))
        if key in self.tuned or (n <= 64 and kind == "linear"):
            return
        timer = timer or time_ms
        gen = torch.Generator(device=weight.device).manual_seed(n * 131 + k)
        bad: list[Config] = []
        times: dict[int, dict[Config, float]] = {}
        for m in buckets:
            inputs = torch.randn(m, k, generator=gen, device=weight.device).to(weight.dtype)
            reference = run(DEFAULT, m, inputs)
            times[m] = {}
            for config in candidates:
                if config in bad:
                    continue
                try:
                    out = run(config, m, inputs)
                except torch.OutOfMemoryError:
                    raise  # the card's memory, not the candidate: the caller decides
                except Exception:  # noqa: BLE001 - e.g. more shared memory than the card has: not a candidate
                    bad.append(config)
                    continue
                if not torch.equal(out, reference):
                    bad.append(config)
                    continue
                times[m][config] = timer(lambda c=config, m=m, inputs=inputs: run(c, m, inputs))
        for m, measured in times.items():
            usable = {c: t for c, t in measured.items() if c not in bad}
            self.timings[kind, n, k, m] = measured
            if usable:
                self.choice[kind, n, k, m] = min(usable, key=usable.get)
        self.rejected[kind, n, k] = bad
        self.tuned.add(key)

    def summary(self) -> dict:
        """What was chosen, for records: {kind NxK: {bucket: config as text}} and the rejected candidates."""
        out: dict = {}
        for (kind, n, k, m), config in sorted(self.choice.items()):
            out.setdefault(f"{kind} {n}x{k}", {})[str(m)] = "-".join(map(str, config))
        for (kind, n, k), bad in self.rejected.items():
            if bad:
                out.setdefault(f"{kind} {n}x{k}", {})["not_bitwise"] = ["-".join(map(str, c)) for c in bad]
        return out


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def time_ms(fn, repeat: int = REPEAT, warmup: int = WARMUP) -> float:
    """Milliseconds a call of ``fn``: ``repeat`` calls after ``warmup`` untimed ones, with CUDA events where CUDA is
    (the device's time, launches queued back to back), else the wall clock."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - t0) * 1000 / repeat
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


TILES = TileTable()  # the process's table: every engine of the process runs and tunes this one
