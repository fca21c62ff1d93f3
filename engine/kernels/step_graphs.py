"""CUDA graphs of static-shape bodies, one per key (e.g. rows x width x prefix bucket of a decode step); GPU only.

`StepGraphs(body)` captures ``body(key)`` lazily and replays it after: ``ready(key)`` counts a use of the key and
says whether to replay it (capturing it first when needed) or to run the body eagerly. A key is captured at its
``capture_after``-th use, one key at a time: a shape used once (a batch filling up, the last rows of a run) never
costs a capture, and no step waits for the captures of shapes it does not use, so start-up is not a wall of
captures before the first token. The body reads and writes only tensors whose addresses never change (static
inputs and buffers), so a replay recomputes it on whatever the host staged; its outputs are the graph's static
outputs, overwritten by each replay of that graph.

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
CAPTURE_AFTER = 2  # a key's graph is captured at this use of the key (the uses before run eagerly)


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
    def __init__(self, body: Callable[[tuple], object], device: torch.device | str, max_groups: int = MAX_GROUPS,
                 capture_after: int = CAPTURE_AFTER):
        ok, why = cuda_graphs_available()
        if not ok:
            raise GraphCaptureError(f"CUDA graphs unavailable: {why}")
        self.body = body
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.max_groups, self.capture_after = max_groups, max(1, capture_after)
        self.uses: dict[tuple, int] = {}
        self._recent: list[Hashable] = []  # groups, least recently used first
        self.captured = 0  # captures so far (a caller can tell whether a call captured)
        self.capture_s = 0.0  # wall time spent capturing (warm-up runs, first kernel compilations included)

    def has(self, key: tuple) -> bool:
        return key in self.graphs

    def ready(self, key: tuple) -> bool:
        """Count a use of ``key``: True to ``replay`` it (captured already, or to be captured now), False to run the
        body eagerly this time."""
        uses = self.uses[key] = self.uses.get(key, 0) + 1
        return key in self.graphs or uses >= self.capture_after

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
        logger.debug("captured step graph {} in {:.2f}s; {} graphs, {:.1f}s in all", key, time.perf_counter() - t0,
                     self.captured, self.capture_s)

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

    def close(self) -> None:
        """Drop every graph and the memory pool they share (the caller is done with them)."""
        self.clear()
        self.uses.clear()
        self.pool = None

    def __len__(self) -> int:
        return len(self.graphs)
