"""Routed-expert (MoE) computation with static shapes and no host sync, for CUDA-graph decode steps.

All three take the model's own ``UnlimitedOcrTextExperts`` module (weights ``gate_up_proj`` [E, 2I, H],
``down_proj`` [E, H, I], ``act_fn``), the tokens ``x`` [T, H] and the router's ``top_k_index`` /
``top_k_weights`` [T, k] (fp32), and return [T, H] in ``x``'s dtype: sum over the k routed experts of
weight * down(act(gate(x)) * up(x)). Shapes depend on T only, never on the routing.

- ``grouped`` (default): transformers' ``grouped_mm_experts_forward``, the model's own default experts
  implementation, so the same arithmetic as the official path. Sorts the T*k (token, expert) pairs by
  expert and runs one grouped GEMM per projection over offsets computed on the device (histc, no
  bincount): each routed expert's weights are read once, no copies. Needs ``torch.nn.functional.grouped_mm``
  or ``torch._grouped_mm`` (documented for bf16 on CUDA sm80+; the CPU kernel takes fp32 too).
- ``gather``: index the weights of the T*k routed experts (a copy of T*k expert matrices), then batched
  matrix-vector products. Bytes ~3x the routed weights: cheap for T = 1-2, ruinous for T = 16 (~100 pairs).
- ``auto``: ``grouped`` on the CPU and on CUDA in bf16, ``gather`` otherwise (fp32 on CUDA).
- ``mixed``: ``gather`` for steps of at most ``MIXED_GATHER_MAX_TOKENS`` tokens (single-token decode, where
  copying a few experts' weights is cheapest), and for wider verify steps ``grouped`` where its kernel exists (CPU;
  CUDA in bf16), else ``dense`` (fp32 on CUDA). The choice depends on the step's static width, device and
  dtype only, so each captured graph holds one implementation.
- ``dense``: every expert on every token, weights zero for experts not routed. Reads all E experts'
  weights whatever T is (~440 MB per layer at full size): flat cost, plausible for wide verify steps.
"""

from __future__ import annotations

import torch

MOE_IMPLS = ("auto", "grouped", "gather", "dense", "mixed")
MIXED_GATHER_MAX_TOKENS = 2  # `mixed`: gather up to this many tokens per step, grouped above


def resolve(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto``: ``grouped`` where its kernel exists (CPU; CUDA in bf16), else ``gather`` (any dtype)."""
    if name not in MOE_IMPLS:
        raise ValueError(f"moe must be one of {MOE_IMPLS}, not {name!r}")
    if name != "auto":
        return name
    return "grouped" if device.type == "cpu" or dtype == torch.bfloat16 else "gather"


def make_official_experts_runnable(model) -> str | None:
    """On CUDA, transformers' default ``grouped_mm`` experts need bf16 (torch documents grouped_mm for bf16 on
    sm80+); in fp32 the official generate() would fail. Switch the model to the ``eager`` experts (the
    reference loop) there; returns the implementation set, or None when nothing changed."""
    param = model.lm_head.weight
    config = model.config.get_text_config()
    if param.device.type == "cuda" and param.dtype != torch.bfloat16 and \
            getattr(config, "_experts_implementation", None) == "grouped_mm":
        model.set_experts_implementation("eager")
        return "eager"
    return None


def grouped(experts, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    from transformers.integrations.moe import grouped_mm_experts_forward

    return grouped_mm_experts_forward(experts, x, top_k_index, top_k_weights)


def gather(experts, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    tokens, top_k = top_k_index.shape
    ids = top_k_index.reshape(-1)
    xs = x.repeat_interleave(top_k, dim=0)  # [T*k, H], pair j = (token j // k, its (j % k)-th expert)
    gate_up = torch.bmm(experts.gate_up_proj[ids], xs[:, :, None])[..., 0]  # [T*k, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.bmm(experts.down_proj[ids], (experts.act_fn(gate) * up)[:, :, None])[..., 0]  # [T*k, H]
    out = out * top_k_weights.reshape(-1, 1)
    return out.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)


def dense(experts, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    n_experts = experts.gate_up_proj.shape[0]
    gate_up = torch.matmul(x, experts.gate_up_proj.transpose(1, 2))  # [E, T, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.matmul(experts.act_fn(gate) * up, experts.down_proj.transpose(1, 2))  # [E, T, H]
    weights = torch.zeros(x.shape[0], n_experts, dtype=top_k_weights.dtype, device=x.device)
    weights.scatter_(1, top_k_index, top_k_weights)  # [T, E], zero where not routed
    return (out * weights.T[:, :, None]).sum(dim=0).to(x.dtype)


def mixed(experts, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    if x.shape[0] <= MIXED_GATHER_MAX_TOKENS:
        impl = gather
    elif x.device.type == "cpu" or x.dtype == torch.bfloat16:
        impl = grouped
    else:
        impl = dense
    return impl(experts, x, top_k_index, top_k_weights)


def experts_forward(name: str):
    if name not in MOE_IMPLS or name == "auto":
        raise ValueError(f"moe must be one of {MOE_IMPLS[1:]} here (resolve 'auto' first), not {name!r}")
    return {"grouped": grouped, "gather": gather, "dense": dense, "mixed": mixed}[name]
