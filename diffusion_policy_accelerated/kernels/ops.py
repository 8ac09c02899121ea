"""Python entry points of the fused ops (`torch.ops.dpa.*`) and their fake implementations.

The C++ side validates every argument and raises `ValueError` / `TypeError` /
`RuntimeError` with the argument's name; the wrappers here only translate
keyword-friendly Python arguments (strings, None) into the op schemas.
"""
from typing import Optional, Tuple

import torch

from .config import library

# The compiled extension, its kernel configuration set: the ops read it at every launch.
_C = library()

SCHEDULER_KINDS = {"ddpm": 0, "ddim": 1}
PREDICTION_TYPES = {"epsilon": 0, "sample": 1, "v_prediction": 2}
# Columns of a denoise table row (see csrc/denoise_step/denoise_step.h, StepColumn).
TABLE_COLUMNS = ("sqrt_beta_prod", "sqrt_alpha_prod", "inv_sqrt_beta_prod",
                 "inv_sqrt_alpha_prod", "x0_coeff", "second_coeff", "noise_scale", "add_noise")


def built_with_cuda() -> bool:
    """True when the loaded extension contains the CUDA kernels."""
    return bool(_C.built_with_cuda())


def taps_major(weight: torch.Tensor) -> torch.Tensor:
    """A copy of a Conv1d weight [C_out, C_in, K] stored taps-major: the same shape and
    values, [C_out][K][C_in] in memory (strides (C_in * K, 1, C_in)).

    The conv ops take weights of any strides. On CUDA this layout selects their im2col +
    cuBLAS route at any batch x length (not only from KernelConfig.gemm_min_positions on), and
    there the weight's rows (output channel, tap) multiply the input itself, where a
    contiguous weight needs the input's K times larger im2col columns; on an H100 cuBLAS runs
    that GEMM shape faster too. Pass the contiguous weight where the weight-streaming kernels
    are faster (batch 1, small layers). ConditionalUnet1D makes, keeps and passes such copies
    itself where they pay (routing.taps_major_pays).
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        raise ValueError(f"taps_major: weight must be a Conv1d weight [C_out, C_in, K], got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    return weight.transpose(1, 2).contiguous().transpose(1, 2)


def conv1d_gn_mish(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   gn_weight: Optional[torch.Tensor], gn_bias: Optional[torch.Tensor],
                   num_groups: int, eps: float = 1e-5, *, film: Optional[torch.Tensor] = None,
                   residual: Optional[torch.Tensor] = None,
                   counters: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mish(GroupNorm(Conv1d(x))) in one op: what Diffusion Policy's `Conv1dBlock` computes,
    then optionally what its `ConditionalResidualBlock1D` does to that output.

    x: [B, C_in, L] (any strides); weight: [C_out, C_in, K] with K odd (padding K // 2,
    stride 1); bias, gn_weight, gn_bias: [C_out] or None. `film`: [B, C_out] (y + film) or
    [B, 2 * C_out] (y * film[:, :C_out] + film[:, C_out:]: a FiLM scale, then a bias);
    `residual`: [B, C_out, L], added last. Accumulation and statistics are fp32 whatever the
    (shared) dtype, fp32, fp16 or bf16; on CUDA each output is rounded once, on the CPU the
    conv's result is rounded to the dtype as ATen's conv returns it. `counters`: see `conv1d`.
    """
    return torch.ops.dpa.conv1d_gn_mish(x, weight, bias, gn_weight, gn_bias, int(num_groups),
                                        float(eps), film=film, residual=residual, counters=counters)


def conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           stride: int = 1, padding: int = 0, *, transposed: bool = False,
           residual: Optional[torch.Tensor] = None,
           counters: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.conv1d(x, weight, bias, stride, padding)` or, with `transposed`,
    `F.conv_transpose1d(...)` (weight [C_in, C_out, K]), plus `residual` if given: the
    U-Net's down/upsampling, 1x1 residual and final convs. Dilation 1, groups 1, no output
    padding. fp32 accumulation whatever the dtype.

    `counters` (CUDA; optional): an int32 tensor of at least C_out zeros on x's device that
    the kernels use to elect the block finishing each output tile, and leave all zero again;
    passing one saves a memset per call. It must not serve two calls running concurrently.
    """
    return torch.ops.dpa.conv1d(x, weight, bias, int(stride), int(padding), bool(transposed),
                                residual=residual, counters=counters)


def conv1d_gn_mish_shortcut(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                            gn_weight: Optional[torch.Tensor], gn_bias: Optional[torch.Tensor],
                            num_groups: int, eps: float, shortcut_weight: torch.Tensor,
                            shortcut_bias: Optional[torch.Tensor] = None, *,
                            film: Optional[torch.Tensor] = None,
                            counters: Optional[torch.Tensor] = None,
                            skip: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """`(conv1d_gn_mish(x, weight, ..., film=film), conv1d(x, shortcut_weight, shortcut_bias))`
    in one op: the first Conv1dBlock of a residual block whose channel count changes and the
    block's 1x1 shortcut conv, which read the same x. On the CUDA streaming path (batch x
    length < 32) both weights stream in one launch, saving the shortcut's launch, input
    round trip and finishing pass.

    shortcut_weight: [C_s, C_in, 1]; shortcut_bias: [C_s] or None. `counters` (CUDA;
    optional): int32 zeros, at least C_out + C_s of them (see `conv1d`). `skip` ([B, C2, L],
    any strides): the input is `torch.cat((x, skip), dim=1)` (C_in = x's channels + C2),
    read in place, as the U-Net's up path concatenates its skip connections.
    """
    return torch.ops.dpa.conv1d_gn_mish_shortcut(x, weight, bias, gn_weight, gn_bias, int(num_groups),
                                                 float(eps), shortcut_weight, shortcut_bias, film=film,
                                                 counters=counters, skip=skip)


def residual_block(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   gn_weight: Optional[torch.Tensor], gn_bias: Optional[torch.Tensor],
                   weight2: torch.Tensor, bias2: Optional[torch.Tensor],
                   gn_weight2: Optional[torch.Tensor], gn_bias2: Optional[torch.Tensor],
                   num_groups: int, eps: float = 1e-5,
                   shortcut_weight: Optional[torch.Tensor] = None,
                   shortcut_bias: Optional[torch.Tensor] = None, *,
                   film: Optional[torch.Tensor] = None, counters: Optional[torch.Tensor] = None,
                   skip: Optional[torch.Tensor] = None, channels_last: bool = False) -> torch.Tensor:
    """Diffusion Policy's `ConditionalResidualBlock1D` given its FiLM embedding, in one op:

        h = conv1d_gn_mish(x, weight, bias, gn_weight, gn_bias, num_groups, eps, film=film)
        residual = conv1d(x, shortcut_weight, shortcut_bias) if shortcut_weight is given, else x
        out = conv1d_gn_mish(h, weight2, bias2, gn_weight2, gn_bias2, num_groups, eps,
                             residual=residual)

    with x = torch.cat((x, skip), dim=1) when `skip` is given (read in place). Both
    GroupNorms have `num_groups` groups and `eps`. Where the convs run as im2col + cuBLAS
    (CUDA, by csrc/conv1d/conv_route.h's rules: from KernelConfig.gemm_min_positions, or by their work), the
    first conv's epilogue writes the second conv's GEMM operand (its im2col columns, or with a
    taps-major `weight2`, see `taps_major`, its output channels-last) and the second's epilogue adds the
    shortcut's GEMM result, saving one launch per block, two with a shortcut; elsewhere the
    op runs the separate ops. `counters`: int32 zeros, at least out_channels of them,
    twice that with a shortcut (see `conv1d`).

    `channels_last`: return the output stored channels-last, [B][L][C_out] in memory
    (strides (L * C_out, 1, C_out)); the values are the same. Where the op is fused on the
    GEMM route (above) its epilogue writes that layout, and there a block whose first
    weight is taps-major reads such an x in place, where it would otherwise transpose it in
    a launch of its own. Elsewhere the output is copied into that layout.
    """
    return torch.ops.dpa.residual_block(x, weight, bias, gn_weight, gn_bias, weight2, bias2,
                                        gn_weight2, gn_bias2, int(num_groups), float(eps),
                                        shortcut_weight, shortcut_bias, film=film,
                                        counters=counters, skip=skip, channels_last=bool(channels_last))


def _enum(value, table, what):
    if isinstance(value, int) and value in table.values():
        return value
    if value not in table:
        raise ValueError(f"{what} must be one of {sorted(table)}, got {value!r}")
    return table[value]


def denoise_step(model_output: torch.Tensor, sample: torch.Tensor, noise: Optional[torch.Tensor],
                 table: torch.Tensor, step: int, *, scheduler: str, prediction_type: str = "epsilon",
                 clip_sample_range: Optional[float] = None,
                 use_clipped_model_output: bool = False,
                 condition_data: Optional[torch.Tensor] = None,
                 condition_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One DDPM/DDIM update `x_t -> x_{t-1}` with the per-step constants in row `step` of `table`.

    `table` ([num_steps, 8] float32, on the sample's device) comes from
    `diffusion_policy_accelerated.model.schedulers`; the step index is a plain int so a CUDA
    graph can bake one launch per step. `noise` (same shape/dtype as `sample`) is used
    only where the row says noise is added; None means no noise term. With
    `condition_data` and `condition_mask` (bool), both shaped like `sample`, returns
    `torch.where(condition_mask, condition_data, x_{t-1})`: Diffusion Policy's inpainting,
    done in the same pass. `model_output` may be strided (the U-Net's transposed output).
    """
    return torch.ops.dpa.denoise_step(
        model_output, sample, noise, table, int(step),
        _enum(scheduler, SCHEDULER_KINDS, "scheduler"),
        _enum(prediction_type, PREDICTION_TYPES, "prediction_type"),
        None if clip_sample_range is None else float(clip_sample_range),
        bool(use_clipped_model_output), condition_data=condition_data,
        condition_mask=condition_mask)


def picard_window(trajectory: torch.Tensor, start: torch.Tensor, window: int, film_table: torch.Tensor,
                  film_observation: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The inputs of one Picard iteration's batched U-Net evaluation (csrc/picard/picard.h):
    for window row r of batch row b (row r * batch + b), the state trajectory[i, b] and the
    FiLM row film_table[i] + film_observation[b], i = min(start[b] + r, steps - 1).

    trajectory: [steps + 1, batch, ...] contiguous; start: int32 [batch], each window's first
    step; film_table: [steps, width] (every residual block's timestep FiLM part, side by side);
    film_observation: [batch, width] (the observation part) or None. Returns
    ([window * batch, ...], [window * batch, width])."""
    return torch.ops.dpa.picard_window(trajectory, start, int(window), film_table, film_observation)


def picard_update(trajectory: torch.Tensor, start: torch.Tensor, state: torch.Tensor, model_output: torch.Tensor,
                  noise: Optional[torch.Tensor], table: torch.Tensor, thresholds: torch.Tensor, *, scheduler: str,
                  prediction_type: str = "epsilon", clip_sample_range: Optional[float] = None,
                  use_clipped_model_output: bool = False, condition_data: Optional[torch.Tensor] = None,
                  condition_mask: Optional[torch.Tensor] = None, conditional_handle: int = 0) -> None:
    """One Picard iteration's update, in place (csrc/picard/picard.h): each window step's
    denoise step (as `denoise_step`, row start[b] + r of `table`, noise[i] where the step adds
    noise, inpainting with condition_data/condition_mask) applied to model_output (the U-Net
    on picard_window's states), the window rebuilt by a cumulative sum into `trajectory`,
    `start` moved past the states whose mean squared change is within `thresholds[i]` (float32
    [steps]) and the one after them, `state[0]` (int32 [3], the rest scratch left zero)
    counting the iteration. `conditional_handle` (begin_graph_loop's): set the graph loop's
    condition, some row short of the last state."""
    torch.ops.dpa.picard_update(
        trajectory, start, state, model_output, noise, table, thresholds,
        _enum(scheduler, SCHEDULER_KINDS, "scheduler"), _enum(prediction_type, PREDICTION_TYPES, "prediction_type"),
        None if clip_sample_range is None else float(clip_sample_range), bool(use_clipped_model_output),
        condition_data=condition_data, condition_mask=condition_mask, conditional_handle=int(conditional_handle))


@torch.library.register_fake("dpa::conv1d_gn_mish")
def _conv1d_gn_mish_fake(x, weight, bias, gn_weight, gn_bias, num_groups, eps, *, film=None,
                         residual=None, counters=None):
    torch._check(x.dim() == 3, lambda: "conv1d_gn_mish: x must be [B, C_in, L]")
    torch._check(weight.dim() == 3, lambda: "conv1d_gn_mish: weight must be [C_out, C_in, K]")
    return x.new_empty((x.shape[0], weight.shape[0], x.shape[2]))


@torch.library.register_fake("dpa::conv1d")
def _conv1d_fake(x, weight, bias, stride, padding, transposed, *, residual=None, counters=None):
    torch._check(x.dim() == 3, lambda: "conv1d: x must be [B, C_in, L]")
    torch._check(weight.dim() == 3, lambda: "conv1d: weight must be 3-D")
    k = weight.shape[2]
    if transposed:
        out_channels, length = weight.shape[1], (x.shape[2] - 1) * stride - 2 * padding + k
    else:
        out_channels, length = weight.shape[0], (x.shape[2] + 2 * padding - k) // stride + 1
    return x.new_empty((x.shape[0], out_channels, length))


@torch.library.register_fake("dpa::conv1d_gn_mish_shortcut")
def _conv1d_gn_mish_shortcut_fake(x, weight, bias, gn_weight, gn_bias, num_groups, eps, shortcut_weight,
                                  shortcut_bias, *, film=None, counters=None, skip=None):
    if skip is not None:
        torch._check(skip.dim() == 3 and x.dim() == 3,
                     lambda: "conv1d_gn_mish_shortcut: x and skip must be [B, C, L]")
        torch._check(skip.shape[0] == x.shape[0] and skip.shape[2] == x.shape[2],
                     lambda: "conv1d_gn_mish_shortcut: skip must match x's batch and length")
    out = _conv1d_gn_mish_fake(x, weight, bias, gn_weight, gn_bias, num_groups, eps, film=film)
    torch._check(shortcut_weight.dim() == 3,
                 lambda: "conv1d_gn_mish_shortcut: shortcut_weight must be [C_s, C_in, 1]")
    return out, x.new_empty((x.shape[0], shortcut_weight.shape[0], x.shape[2]))


@torch.library.register_fake("dpa::residual_block")
def _residual_block_fake(x, weight, bias, gn_weight, gn_bias, weight2, bias2, gn_weight2, gn_bias2,
                         num_groups, eps, shortcut_weight, shortcut_bias, *, film=None,
                         counters=None, skip=None, channels_last=False):
    torch._check(x.dim() == 3, lambda: "residual_block: x must be [B, C_in, L]")
    torch._check(weight.dim() == 3 and weight2.dim() == 3,
                 lambda: "residual_block: weight and weight2 must be [C_out, C, K]")
    if skip is not None:
        torch._check(skip.dim() == 3 and skip.shape[0] == x.shape[0] and skip.shape[2] == x.shape[2],
                     lambda: "residual_block: skip must be [B, C2, L] like x")
    if channels_last:
        return x.new_empty((x.shape[0], x.shape[2], weight.shape[0])).transpose(1, 2)
    return x.new_empty((x.shape[0], weight.shape[0], x.shape[2]))


@torch.library.register_fake("dpa::denoise_step")
def _denoise_step_fake(model_output, sample, noise, table, step, scheduler, prediction_type,
                       clip_sample_range, use_clipped_model_output, *, condition_data=None,
                       condition_mask=None):
    torch._check(model_output.shape == sample.shape,
                 lambda: "denoise_step: model_output and sample must have the same shape")
    return torch.empty_like(sample, memory_format=torch.contiguous_format)


@torch.library.register_fake("dpa::picard_window")
def _picard_window_fake(trajectory, start, window, film_table, film_observation=None):
    torch._check(trajectory.dim() >= 3, lambda: "picard_window: trajectory must be [steps + 1, batch, ...]")
    rows = window * trajectory.shape[1]
    return (trajectory.new_empty((rows, *trajectory.shape[2:])), film_table.new_empty((rows, film_table.shape[1])))


@torch.library.register_fake("dpa::picard_update")
def _picard_update_fake(trajectory, start, state, model_output, noise, table, thresholds, scheduler,
                        prediction_type, clip_sample_range, use_clipped_model_output, *, condition_data=None,
                        condition_mask=None, conditional_handle=0):
    torch._check(model_output.shape[0] % trajectory.shape[1] == 0,
                 lambda: "picard_update: model_output must be [window * batch, ...]")
