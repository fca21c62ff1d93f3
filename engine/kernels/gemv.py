"""Small linears written as batched matrix-vector products, for decode steps on a GPU.

``batched_gemv(linear, x)`` equals ``linear(x)``: one GEMV per row of ``x``, batched (matmul of the weight
[1, out, in] with the rows [T, in, 1]). Why: in fp32 on CUDA cuBLAS may pick a GEMM kernel for a few rows
that costs several times the same rows as GEMVs; a batched GEMV costs about the same at every width. Each row is
computed as a single-token step computes it.

``with_gemv_linears(module)`` is a copy of a module tree whose ``nn.Linear`` children run ``batched_gemv``; it
shares every parameter with the original (nothing is copied but the module objects).
"""

from __future__ import annotations

import copy

import torch


def batched_gemv(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)`` for x [..., in] as one GEMV per row: [..., out]."""
    rows = x.reshape(-1, x.shape[-1], 1)
    out = torch.matmul(linear.weight[None], rows)[..., 0]
    if linear.bias is not None:
        out = out + linear.bias
    return out.view(*x.shape[:-1], -1)


class GemvLinear(torch.nn.Module):
    """An ``nn.Linear`` that runs as batched GEMVs (same parameters, not copied)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return batched_gemv(self.linear, x)


def with_gemv_linears(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of ``module`` whose every ``nn.Linear`` (itself included) is a `GemvLinear`."""
    if isinstance(module, torch.nn.Linear):
        return GemvLinear(module)
    clone = copy.copy(module)
    clone._modules = {name: None if child is None else with_gemv_linears(child)
                      for name, child in module._modules.items()}
    return clone
