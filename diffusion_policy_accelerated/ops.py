"""Python entry points of the fused ops (`torch.ops.dpa.*`) and their fake implementations.

The C++ side validates every argument and raises `ValueError` / `TypeError` /
`RuntimeError` with the argument's name; the wrappers here only translate
keyword-friendly Python arguments (strings, None) into the op schemas.
"""
from typing import Optional

import torch

from ._extension import load_extension

_C = load_extension()

SCHEDULER_KINDS = {"ddpm": 0, "ddim": 1}
PREDICTION_TYPES = {"epsilon": 0, "sample": 1, "v_prediction": 2}
# Columns of a denoise table row (see csrc/denoise_step.h, StepColumn).
TABLE_COLUMNS = ("sqrt_beta_prod", "sqrt_alpha_prod", "inv_sqrt_beta_prod",
                 "inv_sqrt_alpha_prod", "x0_coeff", "second_coeff", "noise_scale", "add_noise")


def built_with_cuda() -> bool:
    """True when the loaded extension contains the CUDA kernels."""
    return bool(_C.built_with_cuda())


def set_gemm_path_min_positions(positions: int) -> int:
    """Batch * length from which CUDA conv1d_gn_mish uses im2col + cuBLAS instead of its
    weight-streaming kernel (set from scripts/bench_conv_blocks.py --sweep-paths); returns
    the previous value. Process-wide; meant for benchmarking and tuning."""
    return _C.set_gemm_path_min_positions(int(positions))


def conv1d_gn_mish(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   gn_weight: Optional[torch.Tensor], gn_bias: Optional[torch.Tensor],
                   num_groups: int, eps: float = 1e-5) -> torch.Tensor:
    """Mish(GroupNorm(Conv1d(x))) in one op: what Diffusion Policy's `Conv1dBlock` computes.

    x: [B, C_in, L]; weight: [C_out, C_in, K] with K odd (padding K // 2, stride 1);
    bias, gn_weight, gn_bias: [C_out] or None. Accumulation and statistics are fp32
    whatever the (shared) dtype of the tensors, which may be fp32, fp16 or bf16.
    """
    return torch.ops.dpa.conv1d_gn_mish(x, weight, bias, gn_weight, gn_bias, int(num_groups), float(eps))


def _enum(value, table, what):
    if isinstance(value, int) and value in table.values():
        return value
    if value not in table:
        raise ValueError(f"{what} must be one of {sorted(table)}, got {value!r}")
    return table[value]


def denoise_step(model_output: torch.Tensor, sample: torch.Tensor, noise: Optional[torch.Tensor],
                 table: torch.Tensor, step: int, *, scheduler: str, prediction_type: str = "epsilon",
                 clip_sample_range: Optional[float] = None,
                 use_clipped_model_output: bool = False) -> torch.Tensor:
    """One DDPM/DDIM update `x_t -> x_{t-1}` with the per-step constants in row `step` of `table`.

    `table` ([num_steps, 8] float32, on the sample's device) comes from
    `diffusion_policy_accelerated.schedulers`; the step index is a plain int so a CUDA
    graph can bake one launch per step. `noise` (same shape/dtype as `sample`) is used
    only where the row says noise is added; None means no noise term.
    """
    return torch.ops.dpa.denoise_step(
        model_output, sample, noise, table, int(step),
        _enum(scheduler, SCHEDULER_KINDS, "scheduler"),
        _enum(prediction_type, PREDICTION_TYPES, "prediction_type"),
        None if clip_sample_range is None else float(clip_sample_range),
        bool(use_clipped_model_output))


@torch.library.register_fake("dpa::conv1d_gn_mish")
def _conv1d_gn_mish_fake(x, weight, bias, gn_weight, gn_bias, num_groups, eps):
    torch._check(x.dim() == 3, lambda: "conv1d_gn_mish: x must be [B, C_in, L]")
    torch._check(weight.dim() == 3, lambda: "conv1d_gn_mish: weight must be [C_out, C_in, K]")
    return x.new_empty((x.shape[0], weight.shape[0], x.shape[2]))


@torch.library.register_fake("dpa::denoise_step")
def _denoise_step_fake(model_output, sample, noise, table, step, scheduler, prediction_type,
                       clip_sample_range, use_clipped_model_output):
    torch._check(model_output.shape == sample.shape,
                 lambda: "denoise_step: model_output and sample must have the same shape")
    return torch.empty_like(sample, memory_format=torch.contiguous_format)
