"""GPU kernels and graph capture: batch-invariant matmuls and reductions (invariant), the small-batch GEMV (gemv),
the static MoE experts (static_moe) and CUDA graphs per step shape (step_graphs).

Imports nothing else of engine/."""
