"""CUDA graphs of the static decode step, one per (width bucket, prefix bucket); GPU only.

`StepGraphs(body)` captures ``body(width, prefix_bucket)`` (``StaticRswaRunner.step_body``) on first need
and replays it after. The body reads and writes only tensors whose addresses never change (the runner's
static inputs and buffers), so a replay recomputes it on whatever the host staged. The captured outputs
(logits, argmax) are the graph's static outputs, overwritten by each replay of that graph.

Graphs are kept for the ``max_prefix_buckets`` most recently used prefix buckets (``touch`` at each chunk). All graphs share one
memory pool. That is safe here because replays run one at a time on one stream and
each graph's outputs stay referenced (so no later capture takes their memory); intermediates of one graph
may reuse another's, which is fine for strictly sequential replays.

Anything that fails during capture (a host sync such as ``.item()``/``nonzero`` in a kernel path, an
unsupported op, out of memory) raises `GraphCaptureError` with the width, bucket and cause, and the caller
falls back to the eager engine. This module imports without CUDA; constructing `StepGraphs` needs it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

WARMUP_RUNS = 2  # eager runs on the capture stream first (cuBLAS handles, lazy inits, autotuning)
MAX_PREFIX_BUCKETS = 4  # graphs kept for this many prefix buckets (least recently used dropped): each bucket's
# graphs hold ~20 MB of outputs at full size (fp32 logits of up to k_max + 1 rows of a 129,280 vocabulary)


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
    def __init__(self, body: Callable[[int, int], tuple[torch.Tensor, ...]], device: torch.device | str,
                 max_prefix_buckets: int = MAX_PREFIX_BUCKETS):
        ok, why = cuda_graphs_available()
        if not ok:
            raise GraphCaptureError(f"CUDA graphs unavailable: {why}")
        self.body = body
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.max_prefix_buckets = max_prefix_buckets
        self._recent: list[int] = []  # prefix buckets, least recently used first

    def has(self, width: int, prefix_bucket: int) -> bool:
        return (width, prefix_bucket) in self.graphs

    def capture(self, width: int, prefix_bucket: int) -> None:
        self.touch(prefix_bucket)
        try:
            current = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):
                for _ in range(WARMUP_RUNS):
                    self.body(width, prefix_bucket)
            current.wait_stream(self.stream)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                outputs = self.body(width, prefix_bucket)
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - any failure means: no graphs, use the eager engine
            raise GraphCaptureError(f"capture of the {width}-token step over prefix bucket {prefix_bucket} "
                                    f"failed: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}") from exc
        self.graphs[width, prefix_bucket] = (graph, outputs)

    def replay(self, width: int, prefix_bucket: int) -> tuple[torch.Tensor, ...]:
        if not self.has(width, prefix_bucket):
            self.capture(width, prefix_bucket)
        graph, outputs = self.graphs[width, prefix_bucket]
        graph.replay()
        return outputs

    def touch(self, prefix_bucket: int) -> None:
        """Mark a bucket used; drop the graphs of the least recently used buckets beyond the limit."""
        if prefix_bucket in self._recent:
            self._recent.remove(prefix_bucket)
        self._recent.append(prefix_bucket)
        while len(self._recent) > self.max_prefix_buckets:
            old = self._recent.pop(0)
            for key in [k for k in self.graphs if k[1] == old]:
                del self.graphs[key]

    def clear(self) -> None:
        self.graphs.clear()
        self._recent.clear()

    def __len__(self) -> int:
        return len(self.graphs)
