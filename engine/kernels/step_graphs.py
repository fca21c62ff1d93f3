"""CUDA graphs of static-shape bodies, one per key (e.g. rows x width x prefix bucket of a decode step); GPU only.

`StepGraphs(body)` captures ``body(key)`` on first need and replays it after. The body reads and writes only
tensors whose addresses never change (static inputs and buffers), so a replay recomputes it on whatever the host
staged; its outputs are the graph's static outputs, overwritten by each replay of that graph.

Graphs are grouped by ``key[-1]`` (the prefix or memory bucket): those of the ``max_groups`` most recently used
groups are kept, the others dropped. All graphs share one memory pool. That is safe here because replays run one
at a time on one stream and each graph's outputs stay referenced (so no later capture takes their memory);
intermediates of one graph may reuse another's, which is fine for strictly sequential replays.

Anything that fails during capture (a host sync such as ``.item()``/``nonzero`` in a kernel path, an unsupported op,
out of memory) raises `GraphCaptureError` with the key and the cause, and the caller runs the body eagerly from then
on. This module imports without CUDA; constructing `StepGraphs` needs it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import torch
from loguru import logger

WARMUP_RUNS = 2  # eager runs on the capture stream first (cuBLAS handles, lazy inits, autotuning)
MAX_GROUPS = 4


class GraphCaptureError(RuntimeError):
    pass


def cuda_graphs_available() -> tuple[bool, str]:
    """(available, why not)."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if not hasattr(torch.cuda, "CUDAGraph"):
        return False, f"torch {torch.__version__} has no torch.cuda.CUDAGraph"
    return True, ""


class StepGraphs:
    def __init__(self, body: Callable[[tuple], object], device: torch.device | str, max_groups: int = MAX_GROUPS):
        ok, why = cuda_graphs_available()
        if not ok:
            raise GraphCaptureError(f"CUDA graphs unavailable: {why}")
        self.body = body
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.max_groups = max_groups
        self._recent: list[Hashable] = []  # groups, least recently used first
        self.captured = 0  # captures so far (a caller can tell whether a call captured)
        self.capture_s = 0.0  # wall time spent capturing (warm-up runs, first kernel compilations included)

    def has(self, key: tuple) -> bool:
        return key in self.graphs

    def capture(self, key: tuple) -> None:
        t0 = time.perf_counter()
        self.touch(key[-1])
        try:
            current = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):
                for _ in range(WARMUP_RUNS):
                    self.body(key)
            current.wait_stream(self.stream)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                outputs = self.body(key)
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - any failure means: no graphs, run eagerly
            raise GraphCaptureError(f"capture of {key} failed: {type(exc).__name__}: "
                                    f"{' '.join(str(exc).split())[:400]}") from exc
        self.graphs[key] = (graph, outputs)
        self.captured += 1
        self.capture_s += time.perf_counter() - t0

    def capture_all(self, keys: list[tuple]) -> None:
        """Capture every key not captured yet (the widths of one batch and prefix bucket); logged at debug level."""
        before, count = self.capture_s, self.captured
        for key in keys:
            if key not in self.graphs:
                self.capture(key)
        logger.debug("captured {} step graphs (key {} ..) in {:.2f}s; {} graphs, {:.1f}s in all",
                     self.captured - count, keys[0], self.capture_s - before, self.captured, self.capture_s)

    def replay(self, key: tuple):
        if key not in self.graphs:
            self.capture(key)
        else:
            self.touch(key[-1])
        graph, outputs = self.graphs[key]
        graph.replay()
        return outputs

    def touch(self, group: Hashable) -> None:
        """Mark a group used; drop the graphs of the least recently used groups beyond the limit."""
        if self._recent and self._recent[-1] == group:
            return
        if group in self._recent:
            self._recent.remove(group)
        self._recent.append(group)
        while len(self._recent) > self.max_groups:
            old = self._recent.pop(0)
            for key in [k for k in self.graphs if k[-1] == old]:
                del self.graphs[key]

    def clear(self) -> None:
        self.graphs.clear()
        self._recent.clear()

    def __len__(self) -> int:
        return len(self.graphs)
