"""FLOP and byte formulas of every op a Diffusion Policy action runs (the only place they are
written), applied by `profiling` to the input shapes a `torch.profiler` trace records.

Conventions: a multiply-add is 2 FLOPs and every other arithmetic op or transcendental 1; a
convolution's zero-padding taps count, since dense kernels compute them. Bytes are the least
traffic possible: every input read once and the output written once, so bytes / bandwidth is
a lower bound on an op's time, which is what a roofline needs.
"""
import ast
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

Shape = Tuple[int, ...]
Cost = Tuple[int, int]  # (FLOPs, bytes)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _nbytes(dtype: torch.dtype, *shapes: Optional[Shape]) -> int:
    return dtype.itemsize * sum(math.prod(shape) for shape in shapes if shape is not None)


def _check_conv_shapes(x: Shape, weight: Shape) -> None:
    # aten::convolution also serves 2-D and 3-D convolutions, which these formulas do not.
    if len(x) != 3 or len(weight) != 3:
        raise ValueError(f"1-D convolution shapes expected, got x {x}, weight {weight}")


def conv1d_cost(x: Shape, weight: Shape, dtype: torch.dtype, *, bias: bool = True, stride: int = 1,
                padding: int = 0, dilation: int = 1, groups: int = 1) -> Cost:
    """x [B, C_in, L], weight [C_out, C_in / groups, K]."""
    _check_conv_shapes(x, weight)
    batch, _, length = x
    c_out, c_in_per_group, k = weight
    l_out = (length + 2 * padding - dilation * (k - 1) - 1) // stride + 1
    outputs = batch * c_out * l_out
    flops = 2 * outputs * c_in_per_group * k + (outputs if bias else 0)
    return flops, _nbytes(dtype, x, weight, (c_out,) if bias else None, (batch, c_out, l_out))


def conv_transpose1d_cost(x: Shape, weight: Shape, dtype: torch.dtype, *, bias: bool = True,
                          stride: int = 1, padding: int = 0, output_padding: int = 0,
                          dilation: int = 1, groups: int = 1) -> Cost:
    """x [B, C_in, L], weight [C_in, C_out / groups, K]: each input element is scattered to
    C_out / groups * K outputs."""
    _check_conv_shapes(x, weight)
    batch, c_in, length = x
    _, c_out_per_group, k = weight
    c_out = c_out_per_group * groups
    l_out = (length - 1) * stride - 2 * padding + dilation * (k - 1) + output_padding + 1
    flops = 2 * batch * c_in * length * c_out_per_group * k + (batch * c_out * l_out if bias else 0)
    return flops, _nbytes(dtype, x, weight, (c_out,) if bias else None, (batch, c_out, l_out))


def group_norm_cost(x: Shape, dtype: torch.dtype, *, affine: bool = True) -> Cost:
    """Statistics (x * x and two sums: 3 per element), then (x - mean) * rstd * gamma + beta
    (4 per element); the per-group scalars are negligible."""
    channels = (x[1],) if affine else None
    return 7 * math.prod(x), _nbytes(dtype, x, channels, channels, x)


def mish_cost(x: Shape, dtype: torch.dtype) -> Cost:
    """x * tanh(log1p(exp(x))): 4 per element."""
    return 4 * math.prod(x), _nbytes(dtype, x, x)


def linear_cost(x: Shape, weight: Shape, dtype: torch.dtype, *, bias: bool = True) -> Cost:
    """x [..., in], weight [out, in]."""
    rows, (n_out, n_in) = math.prod(x[:-1]), weight
    out = (rows, n_out)
    flops = 2 * rows * n_in * n_out + (rows * n_out if bias else 0)
    return flops, _nbytes(dtype, x, weight, (n_out,) if bias else None, out)


def matmul_cost(a: Shape, b: Shape, dtype: torch.dtype, *, bias: Optional[Shape] = None) -> Cost:
    """mm (a [M, K] @ b [K, N]) and addmm (bias + a @ b, bias broadcast to [M, N])."""
    (m, k), (_, n) = a, b
    flops = 2 * m * k * n + (m * n if bias is not None else 0)
    return flops, _nbytes(dtype, a, b, bias, (m, n))


def elementwise_cost(shapes: Sequence[Shape], dtype: torch.dtype) -> Cost:
    """One op per output element (add, sub, mul, div); broadcast inputs are read once."""
    out = tuple(torch.broadcast_shapes(*shapes))
    return math.prod(out), _nbytes(dtype, *shapes, out)


def cat_cost(shapes: Sequence[Shape], dtype: torch.dtype) -> Cost:
    """Pure data movement: every input read, the same bytes written."""
    return 0, 2 * _nbytes(dtype, *shapes)


def _epilogue_cost(out: Shape, dtype: torch.dtype, film: Optional[Shape],
                   residual: bool) -> Cost:
    """A fused FiLM (film [B, 2C]: scale * y + bias, 2 per element; [B, C]: + bias, 1) and
    residual add (1 per element): their FLOPs and the bytes of their extra inputs."""
    elements = math.prod(out)
    flops = (0 if film is None else (2 if film[1] == 2 * out[1] else 1) * elements) \
        + (elements if residual else 0)
    return flops, _nbytes(dtype, film, out if residual else None)


def conv1d_gn_mish_cost(x: Shape, weight: Shape, dtype: torch.dtype, *, bias: bool = True,
                        affine: bool = True, film: Optional[Shape] = None,
                        residual: bool = False) -> Cost:
    """dpa::conv1d_gn_mish: the conv (stride 1, padding K // 2), GroupNorm and Mish FLOPs of
    its output, and its FiLM / residual epilogue; fused, so the only traffic is x, the
    parameters, the epilogue's inputs and the output."""
    conv_flops, _ = conv1d_cost(x, weight, dtype, bias=bias, padding=weight[2] // 2)
    out = (x[0], weight[0], x[2])
    channels = (weight[0],)
    extra_flops, extra_bytes = _epilogue_cost(out, dtype, film, residual)
    flops = conv_flops + group_norm_cost(out, dtype)[0] + mish_cost(out, dtype)[0] + extra_flops
    return flops, extra_bytes + _nbytes(dtype, x, weight, channels if bias else None,
                                        channels if affine else None, channels if affine else None, out)


def fused_conv1d_cost(x: Shape, weight: Shape, dtype: torch.dtype, *, bias: bool = True,
                      stride: int = 1, padding: int = 0, transposed: bool = False,
                      residual: bool = False) -> Cost:
    """dpa::conv1d: a Conv1d or ConvTranspose1d plus an optional residual, in one pass."""
    cost = conv_transpose1d_cost if transposed else conv1d_cost
    flops, nbytes = cost(x, weight, dtype, bias=bias, stride=stride, padding=padding)
    out_channels = weight[1] if transposed else weight[0]
    length = ((x[2] - 1) * stride - 2 * padding + weight[2] if transposed
              else (x[2] + 2 * padding - weight[2]) // stride + 1)
    extra_flops, extra_bytes = _epilogue_cost((x[0], out_channels, length), dtype, None, residual)
    return flops + extra_flops, nbytes + extra_bytes


def conv1d_gn_mish_shortcut_cost(x: Shape, weight: Shape, shortcut_weight: Shape, dtype: torch.dtype, *,
                                 bias: bool = True, affine: bool = True, shortcut_bias: bool = True,
                                 film: Optional[Shape] = None) -> Cost:
    """dpa::conv1d_gn_mish_shortcut: conv1d_gn_mish and a 1x1 conv of the same x, which is
    read once."""
    flops, nbytes = conv1d_gn_mish_cost(x, weight, dtype, bias=bias, affine=affine, film=film)
    shortcut_flops, shortcut_bytes = fused_conv1d_cost(x, shortcut_weight, dtype, bias=shortcut_bias)
    return flops + shortcut_flops, nbytes + shortcut_bytes - _nbytes(dtype, x)


def residual_block_cost(x: Shape, weight: Shape, weight2: Shape, dtype: torch.dtype, *,
                        shortcut_weight: Optional[Shape] = None, bias: bool = True,
                        affine: bool = True, bias2: bool = True, affine2: bool = True,
                        shortcut_bias: bool = True, film: Optional[Shape] = None) -> Cost:
    """dpa::residual_block: its first conv (with the shortcut, if any) and its second, with
    the residual; the first's output and the shortcut's are passed on inside the op, so only
    x, the parameters, the FiLM and the output count as traffic."""
    if shortcut_weight is None:
        flops, nbytes = conv1d_gn_mish_cost(x, weight, dtype, bias=bias, affine=affine, film=film)
    else:
        flops, nbytes = conv1d_gn_mish_shortcut_cost(x, weight, shortcut_weight, dtype, bias=bias,
                                                     affine=affine, shortcut_bias=shortcut_bias, film=film)
    out = (x[0], weight[0], x[2])
    flops2, nbytes2 = conv1d_gn_mish_cost(out, weight2, dtype, bias=bias2, affine=affine2, residual=True)
    # Not traffic: the first output's write and read, and the residual's read (x, read already)
    # or the shortcut output's write and read: 3 or 4 output-sized tensors.
    passed_on = (3 if shortcut_weight is None else 4) * _nbytes(dtype, out)
    return flops + flops2, nbytes + nbytes2 - passed_on


def denoise_step_cost(sample: Shape, dtype: torch.dtype, *, scheduler: str, prediction_type: str,
                      clip: bool, use_clipped_model_output: bool = False,
                      noise: bool = False) -> Cost:
    """dpa::denoise_step, counted op by op from `denoise_element` (csrc/denoise_step/denoise_step.h); the
    noise term counts wherever noise is passed (the table row may still switch it off)."""
    x0 = 0 if prediction_type == "sample" else 3  # (s - c m) / c'  or  c s - c' m
    epsilon_derived = scheduler == "ddim" and (use_clipped_model_output or prediction_type != "epsilon")
    per_element = (x0 + (3 if epsilon_derived else 0) + (2 if clip else 0)
                   + 3  # x0 coefficient * x0 + second coefficient * (sample or epsilon)
                   + (2 if noise else 0))
    table_row = 8 * torch.float32.itemsize
    inputs = 3 if noise else 2
    return per_element * math.prod(sample), (inputs + 1) * _nbytes(dtype, sample) + table_row


# The profiler's type names of tensor arguments (record_shapes=True).
_TRACE_DTYPES = {"float": torch.float32, "double": torch.float64, "c10::Half": torch.float16,
                 "c10::BFloat16": torch.bfloat16, "long int": torch.int64, "int": torch.int32,
                 "short int": torch.int16, "signed char": torch.int8, "unsigned char": torch.uint8,
                 "bool": torch.bool}


class OpInputs:
    """An op's arguments as the profiler recorded them: per argument its dims, its type name
    ('' for None) and, for scalars, its value as text."""

    def __init__(self, dims: list, types: list, concrete: list, default_dtype: torch.dtype):
        self.dims, self.types, self.concrete = dims, types, concrete
        # Tensor lists (cat's input) are recorded without a dtype.
        self.dtype = next((_TRACE_DTYPES[t] for t in types if t in _TRACE_DTYPES), default_dtype)

    def tensor(self, i: int) -> Optional[Shape]:
        return tuple(self.dims[i]) if i < len(self.types) and self.types[i] in _TRACE_DTYPES else None

    def tensors(self) -> List[Shape]:
        return [tuple(d) for d, t in zip(self.dims, self.types) if t in _TRACE_DTYPES]

    def tensor_list(self, i: int) -> List[Shape]:
        return [tuple(d) for d in self.dims[i]]

    def given(self, i: int) -> bool:
        return self.types[i] != ""

    def scalar(self, i: int):
        value = ast.literal_eval(self.concrete[i])
        # 1-D convolutions record stride, padding, ... as one-element lists.
        return value[0] if isinstance(value, list) else value

    def shapes_text(self) -> str:
        def text(dims, kind):
            if kind == "TensorList":
                return "[" + ", ".join("x".join(map(str, d)) for d in dims) + "]"
            return "x".join(map(str, dims)) or "scalar"
        return ", ".join(text(d, t) for d, t in zip(self.dims, self.types)
                         if t in _TRACE_DTYPES or t == "TensorList")


def _convolution(c: OpInputs) -> Cost:
    # aten::convolution(input, weight, bias, stride, padding, dilation, transposed,
    # output_padding, groups): under conv1d and conv_transpose1d, and the level where a
    # padding given as a string ("same") has become numbers.
    common = dict(bias=c.given(2), stride=c.scalar(3), padding=c.scalar(4), dilation=c.scalar(5),
                  groups=c.scalar(8))
    if c.scalar(6):
        return conv_transpose1d_cost(c.tensor(0), c.tensor(1), c.dtype, output_padding=c.scalar(7), **common)
    return conv1d_cost(c.tensor(0), c.tensor(1), c.dtype, **common)


def _denoise_step(c: OpInputs) -> Cost:
    from ..kernels import ops  # already loaded: the trace holds a dpa op

    def name(table, value):
        return next(key for key, number in table.items() if number == value)

    return denoise_step_cost(c.tensor(1), c.dtype, scheduler=name(ops.SCHEDULER_KINDS, c.scalar(5)),
                             prediction_type=name(ops.PREDICTION_TYPES, c.scalar(6)),
                             clip=c.given(7), use_clipped_model_output=c.scalar(8),
                             noise=c.given(2))


def _conv1d_gn_mish_shortcut(c: OpInputs) -> Cost:
    x, skip = c.tensor(0), c.tensor(11)
    if skip is not None:  # the input is cat((x, skip), dim=1), read in place
        x = (x[0], x[1] + skip[1], x[2])
    return conv1d_gn_mish_shortcut_cost(x, c.tensor(1), c.tensor(7), c.dtype, bias=c.given(2),
                                        affine=c.given(3), shortcut_bias=c.given(8), film=c.tensor(9))


def _residual_block(c: OpInputs) -> Cost:
    x, skip = c.tensor(0), c.tensor(15)
    if skip is not None:  # the input is cat((x, skip), dim=1), read in place
        x = (x[0], x[1] + skip[1], x[2])
    return residual_block_cost(x, c.tensor(1), c.tensor(5), c.dtype, shortcut_weight=c.tensor(11),
                               bias=c.given(2), affine=c.given(3), bias2=c.given(6), affine2=c.given(7),
                               shortcut_bias=c.given(12), film=c.tensor(13))


def _elementwise(c: OpInputs) -> Cost:
    return elementwise_cost(c.tensors(), c.dtype)


# Profiler op name -> cost from the recorded arguments (in each op's schema order).
OP_COSTS: Dict[str, Callable[[OpInputs], Cost]] = {
    "aten::conv1d": lambda c: conv1d_cost(
        c.tensor(0), c.tensor(1), c.dtype, bias=c.given(2), stride=c.scalar(3),
        padding=c.scalar(4), dilation=c.scalar(5), groups=c.scalar(6)),
    "aten::conv_transpose1d": lambda c: conv_transpose1d_cost(
        c.tensor(0), c.tensor(1), c.dtype, bias=c.given(2), stride=c.scalar(3),
        padding=c.scalar(4), output_padding=c.scalar(5), groups=c.scalar(6), dilation=c.scalar(7)),
    "aten::convolution": _convolution,
    "aten::group_norm": lambda c: group_norm_cost(c.tensor(0), c.dtype, affine=c.given(2)),
    "aten::mish": lambda c: mish_cost(c.tensor(0), c.dtype),
    "aten::linear": lambda c: linear_cost(c.tensor(0), c.tensor(1), c.dtype, bias=c.given(2)),
    "aten::addmm": lambda c: matmul_cost(c.tensor(1), c.tensor(2), c.dtype, bias=c.tensor(0)),
    "aten::mm": lambda c: matmul_cost(c.tensor(0), c.tensor(1), c.dtype),
    "aten::add": _elementwise,
    "aten::sub": _elementwise,
    "aten::mul": _elementwise,
    "aten::div": _elementwise,
    "aten::cat": lambda c: cat_cost(c.tensor_list(0), c.dtype),
    # Keyword-only arguments are recorded in schema order after the positional ones.
    "dpa::conv1d_gn_mish": lambda c: conv1d_gn_mish_cost(
        c.tensor(0), c.tensor(1), c.dtype, bias=c.given(2), affine=c.given(3),
        film=c.tensor(7), residual=c.tensor(8) is not None),
    "dpa::conv1d": lambda c: fused_conv1d_cost(
        c.tensor(0), c.tensor(1), c.dtype, bias=c.given(2), stride=c.scalar(3),
        padding=c.scalar(4), transposed=c.scalar(5), residual=c.tensor(6) is not None),
    "dpa::conv1d_gn_mish_shortcut": _conv1d_gn_mish_shortcut,
    "dpa::residual_block": _residual_block,
    "dpa::denoise_step": _denoise_step,
}


def op_cost(name: str, inputs: OpInputs) -> Optional[Cost]:
    """(FLOPs, bytes) of one recorded call, or None where no formula applies."""
    formula = OP_COSTS.get(name)
    if formula is None:
        return None
    try:
        return formula(inputs)
    except (ValueError, TypeError, IndexError, SyntaxError):
        # A call the trace describes only partly (a string padding, an unrecorded scalar,
        # a 2-D conv) is left to an enclosing or enclosed op with a formula, not guessed.
        return None
