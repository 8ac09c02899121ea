"""Diffusion Policy's `ConditionalUnet1D`, with its Conv1d -> GroupNorm -> Mish blocks fused.

The module tree, constructor arguments, forward semantics and `state_dict` keys are those of
`diffusion_policy.model.diffusion.conditional_unet1d.ConditionalUnet1D`, so checkpoints
trained with Diffusion Policy load here with `load_state_dict(strict=True)` and give the
same actions. Nothing here depends on einops or on the Diffusion Policy repository.

At inference time (nothing needs autograd) every convolution runs a fused op: each
`Conv1dBlock` one `dpa::conv1d_gn_mish` (which also applies its residual block's FiLM or
residual add), or, for a residual block's first Conv1dBlock and its 1x1 shortcut conv, one
`dpa::conv1d_gn_mish_shortcut` for both; the down/upsampling and final convs run
`dpa::conv1d`. Where the convs run as im2col + cuBLAS on CUDA (larger batches), a residual
block is one `dpa::residual_block`, which passes data between its convs without launches of
their own; `routing` decides which route each conv takes. Training, autograd, float64 and
devices without kernels take the plain
PyTorch path, which computes the same function (`use_fused_ops = False` selects it for
comparison).
"""
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from ..kernels import routing

__all__ = [
    "conv1d_block_shapes",
    "unet_config_from_state_dict",
    "SinusoidalPosEmb",
    "Downsample1d",
    "Upsample1d",
    "Conv1dBlock",
    "ConditionalResidualBlock1D",
    "ConditionalUnet1D",
]

# dtypes the fused kernels are instantiated for; anything else (float64 above all, used to
# check numerics) must take the PyTorch path.
_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# The ops module is imported on first fused call rather than at import time, because
# importing it loads (or, without a prebuilt binary, JIT-compiles) the C++ extension;
# users who only want the module tree, e.g. to convert a checkpoint, should not pay that.
_OPS = None
_OPS_HAS_CUDA = None


def _ops():
    global _OPS, _OPS_HAS_CUDA
    if _OPS is None:
        from ..kernels import ops
        _OPS_HAS_CUDA = bool(ops.built_with_cuda())
        _OPS = ops
    return _OPS


def _fused_device_ok(device: torch.device) -> bool:
    # A CPU-only build has no CUDA kernel registered: the op would raise, so fall back.
    if device.type == "cpu":
        _ops()
        return True
    if device.type == "cuda":
        _ops()
        return bool(_OPS_HAS_CUDA)
    return False


def _fusable(enabled: bool, x: torch.Tensor, *tensors: Optional[torch.Tensor]) -> bool:
    """Whether a fused op may replace PyTorch's on x with these weights and extra inputs:
    a dtype the kernels have, shared by all, nothing that needs autograd, a device with
    kernels, no autocast."""
    if not enabled or x.dtype not in _FUSED_DTYPES:
        return False
    tensors = [t for t in tensors if t is not None]
    if any(t.dtype != x.dtype for t in tensors):
        # Mixed dtypes only arise under autocast or a half-converted model; PyTorch
        # defines what those mean, the kernels would only reject them.
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in [x] + tensors):
        # The fused ops have no backward: keep training (and input-gradient guidance)
        # on the differentiable path.
        return False
    # The device first: autocast cannot even be queried for some (meta, say).
    return _fused_device_ok(x.device) and not torch.is_autocast_enabled(x.device.type)


def _conv_fusable(conv: nn.Module) -> bool:
    """Whether dpa::conv1d computes exactly this Conv1d / ConvTranspose1d (it has no
    dilation, groups, output padding or non-zero padding modes)."""
    if not isinstance(conv, (nn.Conv1d, nn.ConvTranspose1d)) or not isinstance(conv.padding, tuple):
        return False
    if conv.dilation != (1,) or conv.groups != 1 or conv.padding_mode != "zeros":
        return False
    return not isinstance(conv, nn.ConvTranspose1d) or conv.output_padding == (0,)


def _counters_for(owner: nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
    """The owner's zeroed counters buffer for the CUDA kernels (see ops.conv1d)."""
    counters = owner.op_counters
    return counters if x.is_cuda and counters.device == x.device else None


def _run_conv(owner: nn.Module, conv: nn.Module, x: torch.Tensor,
              residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """conv(x) (+ residual), through dpa::conv1d when `owner` (which holds the use_fused_ops
    switch and the counters) allows it."""
    if _conv_fusable(conv) and _fusable(owner.use_fused_ops, x, conv.weight, conv.bias, residual):
        return _ops().conv1d(x, conv.weight, conv.bias, conv.stride[0], conv.padding[0],
                             transposed=isinstance(conv, nn.ConvTranspose1d), residual=residual,
                             counters=_counters_for(owner, x))
    out = conv(x)
    return out if residual is None else out + residual


def _gemm_route_weight(owner: nn.Module, conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """A Conv1dBlock's conv weight as the ops read it fastest for x: taps-major
    (ops.taps_major) where that pays (routing.taps_major_pays), else the weight itself.

    The copy is made once and kept on `owner` until the weight changes: another tensor, or
    an in-place update, which bumps its version (weights made under torch.inference_mode
    have none: update those by replacing them). It holds on to the weight it copied, so that
    a new weight cannot reuse its address. The cost is a second copy of these weights in
    memory, made only by models run in half precision at batches above 1 or, at batch 1, at
    long horizons."""
    weight = conv.weight
    if not routing.taps_major_pays(conv, x):
        return weight
    version = None if weight.is_inference() else weight._version
    cached = owner.__dict__.get("_taps_major_weight")
    if (cached is None or cached[0].data_ptr() != weight.data_ptr() or cached[0].dtype != weight.dtype
            or cached[1] != version):
        source = weight.detach()
        cached = (source, version, _ops().taps_major(source))
        owner._taps_major_weight = cached
    return cached[2]


def _register_counters(module: nn.Module, channels: int) -> None:
    # Not persistent: checkpoints keep Diffusion Policy's keys exactly.
    module.register_buffer("op_counters", torch.zeros(channels, dtype=torch.int32), persistent=False)
    module.use_fused_ops = True


class SinusoidalPosEmb(nn.Module):
    """Transformer-style timestep embedding, as Diffusion Policy computes it.

    Computed in float32 (float64 for float64 input): Diffusion Policy passes integer
    timesteps and gets float32, and timesteps in the hundreds would lose the phase
    entirely if the product were formed in a half type.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        half_dim = self.dim // 2
        scale = math.log(10000) / (half_dim - 1)
        freqs = torch.exp(torch.arange(half_dim, device=x.device, dtype=dtype) * -scale)
        emb = x.to(dtype)[:, None] * freqs[None, :]
        return torch.cat((emb.sin(), emb.cos()), dim=-1)


class Downsample1d(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, 3, 2, 1)
        _register_counters(self, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run_conv(self, self.conv, x)


class Upsample1d(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(dim, dim, 4, 2, 1)
        _register_counters(self, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run_conv(self, self.conv, x)


class _AppendDim(nn.Module):
    """Stands in for einops' `Rearrange('batch t -> batch t 1')`.

    It has no parameters, but it must occupy index 2 of `cond_encoder` so that the
    Sequential's layout (and any code indexing into it) matches Diffusion Policy.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(-1)


def _apply_film(out: torch.Tensor, film: torch.Tensor) -> torch.Tensor:
    """Diffusion Policy's FiLM: film [B, 2C] is a per-channel scale then bias (its
    cond_predict_scale layout), film [B, C] a bias."""
    channels = out.shape[1]
    if film.shape[1] == 2 * channels:
        return film[:, :channels, None] * out + film[:, channels:, None]
    return out + film[:, :, None]


class Conv1dBlock(nn.Module):
    """Conv1d -> GroupNorm -> Mish, fused into one op when nothing needs autograd.

    The parameters stay in `self.block` (an `nn.Sequential`) so checkpoint keys are
    `block.0.*` / `block.1.*` exactly as in Diffusion Policy. `forward` optionally applies
    what the enclosing residual block does next (FiLM, a residual add), fused into the op,
    and can run the residual block's 1x1 shortcut conv of the same input in the same launch.
    """

    def __init__(self, inp_channels: int, out_channels: int, kernel_size: int, n_groups: int = 8):
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv1d(inp_channels, out_channels, kernel_size, padding=kernel_size // 2),
            nn.GroupNorm(n_groups, out_channels),
            nn.Mish(),
        )
        # Room for a shortcut's tiles after this conv's (conv1d_gn_mish_shortcut).
        _register_counters(self, 2 * out_channels)

    def _can_fuse(self, x: torch.Tensor, film: Optional[torch.Tensor],
                  residual: Optional[torch.Tensor]) -> bool:
        conv, norm = self.block[0], self.block[1]
        # The kernel implements exactly the convolution this class builds; refuse anything
        # a user may have swapped in after construction (even kernels, strides, ...).
        if (not _conv_fusable(conv) or conv.kernel_size[0] % 2 != 1 or conv.stride != (1,)
                or conv.padding != (conv.kernel_size[0] // 2,)
                or not isinstance(self.block[2], nn.Mish)):
            return False
        return _fusable(self.use_fused_ops, x, conv.weight, conv.bias, norm.weight, norm.bias,
                        film, residual)

    def _can_fuse_shortcut(self, x: torch.Tensor, film: Optional[torch.Tensor],
                           shortcut: nn.Module, skip: Optional[torch.Tensor]) -> bool:
        """Whether dpa::conv1d_gn_mish_shortcut computes this block and `shortcut` exactly."""
        if not (isinstance(shortcut, nn.Conv1d) and _conv_fusable(shortcut)
                and shortcut.kernel_size == (1,) and shortcut.stride == (1,) and shortcut.padding == (0,)
                and shortcut.out_channels == self.block[0].out_channels):
            return False
        return self._can_fuse(x, film, None) and _fusable(self.use_fused_ops, x, shortcut.weight,
                                                          shortcut.bias, skip)

    def forward(self, x: torch.Tensor, film: Optional[torch.Tensor] = None,
                residual: Optional[torch.Tensor] = None, shortcut: Optional[nn.Module] = None,
                skip: Optional[torch.Tensor] = None
                ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """x: [B, C_in, T] -> Mish(GroupNorm(Conv1d(x))), then FiLM with `film` ([B, 2 C_out]:
        scale, bias; or [B, C_out]: bias) and `+ residual` ([B, C_out, T]) when given.

        With `shortcut` (the residual block's 1x1 conv of the same x) returns (that output,
        shortcut(x)), from one dpa::conv1d_gn_mish_shortcut where it applies. With `skip`
        ([B, C2, T]) the input is torch.cat((x, skip), dim=1), which that op reads in place."""
        if shortcut is not None and residual is None and self._can_fuse_shortcut(x, film, shortcut, skip):
            conv, norm = self.block[0], self.block[1]
            return _ops().conv1d_gn_mish_shortcut(
                x, conv.weight, conv.bias, norm.weight, norm.bias, norm.num_groups, norm.eps,
                shortcut.weight, shortcut.bias, film=film, counters=_counters_for(self, x), skip=skip)
        if skip is not None:
            x = torch.cat((x, skip), dim=1)
        if shortcut is not None:
            return self._block(x, film, residual), _run_conv(self, shortcut, x)
        return self._block(x, film, residual)

    def _block(self, x: torch.Tensor, film: Optional[torch.Tensor],
               residual: Optional[torch.Tensor]) -> torch.Tensor:
        if self._can_fuse(x, film, residual):
            conv, norm = self.block[0], self.block[1]
            return _ops().conv1d_gn_mish(x, _gemm_route_weight(self, conv, x), conv.bias, norm.weight,
                                         norm.bias, norm.num_groups, norm.eps, film=film,
                                         residual=residual, counters=_counters_for(self, x))
        out = self.block(x)
        if film is not None:
            out = _apply_film(out, film)
        return out if residual is None else out + residual


class ConditionalResidualBlock1D(nn.Module):
    """Two Conv1dBlocks with FiLM conditioning in between and a residual connection."""

    def __init__(self, in_channels: int, out_channels: int, cond_dim: int, kernel_size: int = 3,
                 n_groups: int = 8, cond_predict_scale: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList([
            Conv1dBlock(in_channels, out_channels, kernel_size, n_groups=n_groups),
            Conv1dBlock(out_channels, out_channels, kernel_size, n_groups=n_groups),
        ])
        # FiLM (https://arxiv.org/abs/1709.07871): with cond_predict_scale the encoder
        # predicts a per-channel scale as well as a bias.
        cond_channels = out_channels * 2 if cond_predict_scale else out_channels
        self.cond_predict_scale = cond_predict_scale
        self.out_channels = out_channels
        self.cond_encoder = nn.Sequential(
            nn.Mish(),
            nn.Linear(cond_dim, cond_channels),
            _AppendDim(),
        )
        self.residual_conv = (nn.Conv1d(in_channels, out_channels, 1)
                              if in_channels != out_channels else nn.Identity())
        _register_counters(self, out_channels)

    def forward(self, x: torch.Tensor, cond: Optional[torch.Tensor],
                film: Optional[torch.Tensor] = None, skip: Optional[torch.Tensor] = None,
                channels_last: bool = False) -> torch.Tensor:
        """x: [B, in_channels, T], cond: [B, cond_dim] -> [B, out_channels, T]. `film`, if
        given, is `cond_encoder(cond)` computed elsewhere ([B, cond_channels, 1] or
        [B, cond_channels]); the sampler precomputes it, since it depends only on the
        timestep and the observation. With `skip` the block's input is
        torch.cat((x, skip), dim=1) (the U-Net's up path), read in place where the fused
        ops apply. `channels_last`: where the block runs as one op, store its output
        channels-last (see ops.residual_block), for a next block that reads it so
        (`reads_channels_last`)."""
        embed = self.cond_encoder(cond) if film is None else film
        # [B, 2C]: scale first, then bias (the channel layout of Diffusion Policy's
        # checkpoints); [B, C]: a bias. The first block applies it to its output.
        film = embed.reshape(embed.shape[0], -1)
        if self._takes_block_op(x, film, skip):
            first, second = self.blocks
            conv, norm, conv2, norm2 = first.block[0], first.block[1], second.block[0], second.block[1]
            shortcut = None if isinstance(self.residual_conv, nn.Identity) else self.residual_conv
            return _ops().residual_block(
                x, _gemm_route_weight(first, conv, x), conv.bias, norm.weight, norm.bias,
                _gemm_route_weight(second, conv2, x), conv2.bias,
                norm2.weight, norm2.bias, norm.num_groups, norm.eps,
                None if shortcut is None else shortcut.weight, None if shortcut is None else shortcut.bias,
                film=film, counters=_counters_for(first, x), skip=skip, channels_last=channels_last)
        if isinstance(self.residual_conv, nn.Identity):
            if skip is not None:
                x = torch.cat((x, skip), dim=1)
            out, residual = self.blocks[0](x, film=film), x
        else:
            out, residual = self.blocks[0](x, film=film, shortcut=self.residual_conv, skip=skip)
        return self.blocks[1](out, residual=residual)

    def _takes_block_op(self, x: torch.Tensor, film: torch.Tensor, skip: Optional[torch.Tensor]) -> bool:
        """Whether dpa::residual_block computes this block and pays (routing.block_op_pays)."""
        # The route first: it is false at batch 1, where the per-conv checks then run only once.
        first, second = self.blocks
        if not (routing.block_op_pays(first.block[0], first.block[1].num_groups, x) and _fused_device_ok(x.device)):
            return False
        norm, norm2 = first.block[1], second.block[1]
        if norm.num_groups != norm2.num_groups or norm.eps != norm2.eps:
            return False
        if isinstance(self.residual_conv, nn.Identity):
            fusable = first._can_fuse(x, film, None) and _fusable(first.use_fused_ops, x, skip)
        else:
            fusable = first._can_fuse_shortcut(x, film, self.residual_conv, skip)
        # The second conv reads the first's output, which has x's dtype and device.
        return fusable and second._can_fuse(x, None, None)

    def reads_channels_last(self, x: torch.Tensor) -> bool:
        """Whether this block, given an input like x (its batch, length, dtype and device;
        no skip), reads it in place when x is stored channels-last, where otherwise it would
        transpose it: as one op whose first conv's taps are GEMM rows (a taps-major weight),
        at batch 2+. At batch 1, x's [C][L] is that GEMM's operand as it is."""
        return (x.shape[0] > 1 and self._takes_block_op(x, None, None)
                and routing.taps_major_pays(self.blocks[0].block[0], x))


class ConditionalUnet1D(nn.Module):
    """Diffusion Policy's 1-D temporal U-Net noise predictor, checkpoint-compatible.

    forward(sample [B, T, input_dim], timestep, local_cond [B, T, local_cond_dim] or None,
    global_cond [B, global_cond_dim] or None) -> [B, T, input_dim].

    `use_fused_ops` (default True) switches every convolution between the fused ops and
    plain PyTorch, so the two can be compared on the same weights.
    """

    def __init__(self, input_dim: int, local_cond_dim: Optional[int] = None,
                 global_cond_dim: Optional[int] = None, diffusion_step_embed_dim: int = 256,
                 down_dims: Sequence[int] = [256, 512, 1024], kernel_size: int = 3,
                 n_groups: int = 8, cond_predict_scale: bool = False):
        super().__init__()
        # down_dims keeps Diffusion Policy's list default (so the signature is identical);
        # it is only ever read.
        all_dims = [input_dim] + list(down_dims)
        start_dim = down_dims[0]

        dsed = diffusion_step_embed_dim
        diffusion_step_encoder = nn.Sequential(
            SinusoidalPosEmb(dsed),
            nn.Linear(dsed, dsed * 4),
            nn.Mish(),
            nn.Linear(dsed * 4, dsed),
        )
        cond_dim = dsed + (global_cond_dim if global_cond_dim is not None else 0)

        def res_block(dim_in, dim_out):
            return ConditionalResidualBlock1D(dim_in, dim_out, cond_dim=cond_dim,
                                              kernel_size=kernel_size, n_groups=n_groups,
                                              cond_predict_scale=cond_predict_scale)

        in_out = list(zip(all_dims[:-1], all_dims[1:]))

        local_cond_encoder = None
        if local_cond_dim is not None:
            # [0] feeds the first down block, [1] was meant for the last up block.
            local_cond_encoder = nn.ModuleList([
                res_block(local_cond_dim, in_out[0][1]),
                res_block(local_cond_dim, in_out[0][1]),
            ])

        # Registration order below follows Diffusion Policy so that state_dict() lists
        # the keys in the same order, not only the same set.
        mid_dim = all_dims[-1]
        self.mid_modules = nn.ModuleList([res_block(mid_dim, mid_dim), res_block(mid_dim, mid_dim)])

        down_modules = nn.ModuleList([])
        for ind, (dim_in, dim_out) in enumerate(in_out):
            is_last = ind >= len(in_out) - 1
            down_modules.append(nn.ModuleList([
                res_block(dim_in, dim_out),
                res_block(dim_out, dim_out),
                Downsample1d(dim_out) if not is_last else nn.Identity(),
            ]))

        up_modules = nn.ModuleList([])
        for ind, (dim_in, dim_out) in enumerate(reversed(in_out[1:])):
            # Diffusion Policy compares against len(in_out) although this loop has one
            # element fewer, so the test is never true and every up level upsamples. That
            # is what makes the output length equal the input length again; keep it.
            is_last = ind >= len(in_out) - 1
            up_modules.append(nn.ModuleList([
                res_block(dim_out * 2, dim_in),
                res_block(dim_in, dim_in),
                Upsample1d(dim_in) if not is_last else nn.Identity(),
            ]))

        final_conv = nn.Sequential(
            # Deliberately the default n_groups=8, not the n_groups argument: that is what
            # Diffusion Policy builds, and with n_groups != 8 its GroupNorm differs.
            Conv1dBlock(start_dim, start_dim, kernel_size=kernel_size),
            nn.Conv1d(start_dim, input_dim, 1),
        )

        # What forward's inputs must be (check_inputs).
        self.input_dim, self.local_cond_dim, self.global_cond_dim = input_dim, local_cond_dim, global_cond_dim
        self.down_dims = list(down_dims)
        self.diffusion_step_encoder = diffusion_step_encoder
        self.local_cond_encoder = local_cond_encoder
        self.up_modules = up_modules
        self.down_modules = down_modules
        self.final_conv = final_conv

        _register_counters(self, input_dim)

    @property
    def use_fused_ops(self) -> bool:
        return self._use_fused_ops

    @use_fused_ops.setter
    def use_fused_ops(self, enabled: bool) -> None:
        self.set_fused_ops(enabled)

    def set_fused_ops(self, enabled: bool = True) -> "ConditionalUnet1D":
        """Select the fused ops (True) or plain PyTorch (False) for every convolution."""
        enabled = bool(enabled)
        object.__setattr__(self, "_use_fused_ops", enabled)
        for module in self.modules():
            if module is not self and hasattr(module, "op_counters"):
                module.use_fused_ops = enabled
        return self

    def _encode_timestep(self, timesteps: torch.Tensor) -> torch.Tensor:
        encoder = self.diffusion_step_encoder
        dtype = encoder[1].weight.dtype
        if dtype == torch.float64:
            # Keep a float64 model float64 end to end (it serves as the numerical reference).
            timesteps = timesteps.to(torch.float64)
        # The sinusoid is formed in float32 at least (see SinusoidalPosEmb); only then is it
        # rounded to the model's dtype, so half-precision models still work.
        emb = encoder[0](timesteps).to(dtype)
        return encoder[3](encoder[2](encoder[1](emb)))

    def film_embedding_tables(self, timesteps: torch.Tensor) -> Tuple[
            Dict[nn.Module, torch.Tensor], Dict[nn.Module, torch.Tensor]]:
        """Splits every block's FiLM encoder, `Linear(mish(cat(t_emb, global_cond)))`, into
        a per-timestep part and a per-observation part, since they are independent:
        returns ({block: [len(timesteps), C] = W_t mish(t_emb(t)) + b},
        {block: W_g [C, global_cond_dim]}). A sampler tabulates the first once per
        schedule and multiplies mish(global_cond) by the second once per call, taking the
        timestep MLP and the FiLM weights (about a quarter of the lowdim U-Net) out of the
        per-step path. The split sum differs from the fused one only by fp rounding."""
        dsed = self.diffusion_step_encoder[1].in_features
        timesteps = timesteps.to(self.diffusion_step_encoder[1].weight.device)
        step_features = nn.functional.mish(self._encode_timestep(timesteps))
        per_step, per_observation = {}, {}
        for module in self.modules():
            if isinstance(module, ConditionalResidualBlock1D):
                linear = module.cond_encoder[1]
                per_step[module] = nn.functional.linear(step_features, linear.weight[:, :dsed], linear.bias)
                per_observation[module] = linear.weight[:, dsed:]
        return per_step, per_observation

    @property
    def horizon_multiple(self) -> int:
        """Horizons must be multiples of this: each of the len(down_dims) - 1 downsamplings
        halves the length, and the up path concatenates each level's skip connection again."""
        return 2 ** (len(self.down_dims) - 1)

    def check_inputs(self, sample: Union[torch.Tensor, Sequence[int]], local_cond: Optional[torch.Tensor] = None,
                     global_cond: Optional[torch.Tensor] = None, *, with_global_cond: bool = True,
                     sample_name: str = "sample") -> None:
        """Raises, naming the argument and what this U-Net expects, where forward's inputs do
        not fit it (ValueError for shapes and devices, TypeError for types and dtypes):
        sample [B, T, input_dim] with T a multiple of horizon_multiple, global_cond
        [B, global_cond_dim] exactly when built with global_cond_dim (unless
        `with_global_cond` is False: FiLM computed by the caller), local_cond
        [B, T, local_cond_dim] exactly when built with local_cond_dim. Given the sample itself
        (not its shape), the sample and the conditions must also be on the U-Net's device and
        of its dtype (a float64 U-Net takes float64; under autocast any floating dtype), as
        PyTorch's own layers require. `sample_name`: what the caller calls the sample, for the
        messages."""
        tensors = [(sample_name, sample)] if isinstance(sample, torch.Tensor) else []
        if not tensors and not (isinstance(sample, (tuple, list, torch.Size))
                                and all(isinstance(n, int) for n in sample)):
            raise TypeError(f"{sample_name} must be a torch.Tensor, got {type(sample).__name__}")
        for name, value in (("local_cond", local_cond), ("global_cond", global_cond)):
            if value is not None and not isinstance(value, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor or None, got {type(value).__name__}")
        shape = tuple(sample.shape) if tensors else tuple(sample)
        if len(shape) != 3 or shape[2] != self.input_dim or shape[0] < 1:
            raise ValueError(f"{sample_name} must be [batch, horizon, input_dim={self.input_dim}], got {list(shape)}")
        batch, horizon = shape[0], shape[1]
        if horizon < 1 or horizon % self.horizon_multiple:
            raise ValueError(f"the horizon ({sample_name}.shape[1]) must be a positive multiple of "
                             f"{self.horizon_multiple} for this U-Net ({len(self.down_dims)} levels, "
                             f"down_dims {self.down_dims}: each downsampling halves it), got {horizon}")
        checks = [("local_cond", local_cond, self.local_cond_dim, (batch, horizon))]
        if with_global_cond:
            checks.append(("global_cond", global_cond, self.global_cond_dim, (batch,)))
        for name, value, width, want in checks:
            if width is None and value is not None:
                raise ValueError(f"{name} was given, but this U-Net was built without {name}_dim")
            if width is not None:
                expected = list(want) + [width]
                if value is None:
                    raise ValueError(f"{name} is required: this U-Net was built with {name}_dim={width}; "
                                     f"pass a tensor of shape {expected}")
                if list(value.shape) != expected:
                    raise ValueError(f"{name} must be {expected} ({name}_dim={width}) for {sample_name} "
                                     f"{list(shape)}, got {list(value.shape)}")
                tensors.append((name, value))
        if not isinstance(sample, torch.Tensor):
            return
        parameter = next(self.parameters())
        device, dtype = parameter.device, parameter.dtype
        autocast = device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type)
        wanted = str(dtype).removeprefix("torch.")
        for name, value in tensors:
            if value.device != device:
                raise ValueError(f"{name} is a meta tensor (a shape without data); the U-Net on {device} needs "
                                 f"values there" if value.is_meta else f"{name} is on {value.device}, the U-Net "
                                 f"on {device}: pass {name}.to({str(device)!r})")
            got = str(value.dtype).removeprefix("torch.")
            if not value.is_floating_point():
                raise TypeError(f"{name} must be a floating-point tensor ({wanted}, the U-Net's dtype), got {got}")
            if value.dtype != dtype and not autocast:
                raise TypeError(f"{name} must be {wanted}, the U-Net's dtype, got {got}: convert it "
                                f"({name}.to({dtype})) or the U-Net (unet.to({value.dtype}))")

    def forward(self, sample: torch.Tensor, timestep: Union[torch.Tensor, float, int],
                local_cond: Optional[torch.Tensor] = None,
                global_cond: Optional[torch.Tensor] = None, *,
                film_embeddings: Optional[Dict[nn.Module, torch.Tensor]] = None,
                **kwargs) -> torch.Tensor:
        """sample: [B, T, input_dim]; timestep: int/float, 0-dim or [B] tensor.

        A Python-number timestep is turned into a long tensor like Diffusion Policy does
        (so a float is truncated); prefer tensors, which avoid a host-to-device copy.
        `film_embeddings` maps every `ConditionalResidualBlock1D` to its `cond_encoder`
        output for this timestep and `global_cond`, computed by the caller (see
        `film_embedding_tables`); `timestep` and `global_cond` are then unused.
        Inputs that do not fit the U-Net (shapes, device, dtype) raise ValueError or TypeError
        (check_inputs) before anything runs.
        """
        self.check_inputs(sample, local_cond, global_cond, with_global_cond=film_embeddings is None)
        sample = sample.transpose(1, 2)  # [B, input_dim, T]

        global_feature = None
        if film_embeddings is None:
            timesteps = timestep
            if not torch.is_tensor(timesteps):
                timesteps = torch.tensor([timesteps], dtype=torch.long, device=sample.device)
            elif timesteps.dim() == 0:
                timesteps = timesteps[None]
            timesteps = timesteps.to(sample.device).expand(sample.shape[0])
            global_feature = self._encode_timestep(timesteps)
            if global_cond is not None:
                global_feature = torch.cat([global_feature, global_cond], dim=-1)

        def block(module, x, skip=None, feeds=None):
            """module's output for x; stored channels-last where `feeds`, the block that
            reads it next (and alone), reads it so in place."""
            film = None if film_embeddings is None else film_embeddings[module]
            channels_last = feeds is not None and feeds.reads_channels_last(x)
            return module(x, global_feature, film, skip=skip, channels_last=channels_last)

        h_local = []
        if local_cond is not None:
            local_cond = local_cond.transpose(1, 2)
            resnet, resnet2 = self.local_cond_encoder
            h_local.append(block(resnet, local_cond))
            h_local.append(block(resnet2, local_cond))

        x = sample
        h = []
        for idx, (resnet, resnet2, downsample) in enumerate(self.down_modules):
            x = block(resnet, x, feeds=None if idx == 0 and len(h_local) > 0 else resnet2)
            if idx == 0 and len(h_local) > 0:
                x = x + h_local[0]
            x = block(resnet2, x)
            h.append(x)
            x = downsample(x)

        mid_modules = list(self.mid_modules)
        for mid_module, next_module in zip(mid_modules, mid_modules[1:] + [None]):
            x = block(mid_module, x, feeds=next_module)

        for idx, (resnet, resnet2, upsample) in enumerate(self.up_modules):
            x = block(resnet, x, skip=h.pop(), feeds=resnet2)
            # Never true (idx stops at len - 1), so h_local[1] is computed but unused.
            # Diffusion Policy keeps this condition on purpose: its published checkpoints
            # were trained with it, and "fixing" it would change their outputs.
            if idx == len(self.up_modules) and len(h_local) > 0:
                x = x + h_local[1]
            x = block(resnet2, x)
            x = upsample(x)

        x = _run_conv(self, self.final_conv[1], self.final_conv[0](x))
        return x.transpose(1, 2)


def conv1d_block_shapes(unet: ConditionalUnet1D, horizon: int, batch: int = 1) -> List[Tuple[int, ...]]:
    """(batch, in_channels, out_channels, length, kernel_size, groups) of every Conv1dBlock
    call of one forward pass, in call order: the shapes the fused op serves for this U-Net
    and horizon. Found by running the model, so any configuration works; a model built under
    `torch.device("meta")` answers instantly."""
    parameter = next(unet.parameters())
    like = dict(device=parameter.device, dtype=parameter.dtype)
    calls = []
    # A block given a shortcut returns (its output, the shortcut's).
    # The up path's blocks get their skip connection as a keyword (see Conv1dBlock.forward).
    hooks = [block.register_forward_hook(lambda m, args, kwargs, out: calls.append(
        (args[0].shape[0], args[0].shape[1] + (kwargs["skip"].shape[1] if kwargs.get("skip") is not None else 0),
         m.block[0].out_channels, args[0].shape[2], m.block[0].kernel_size[0], m.block[1].num_groups)),
        with_kwargs=True)
        for block in unet.modules() if isinstance(block, Conv1dBlock)]
    input_dim = unet.final_conv[1].out_channels
    global_dim = unet.mid_modules[0].cond_encoder[1].in_features - unet.diffusion_step_encoder[1].in_features
    local_dim = None if unet.local_cond_encoder is None else \
        unet.local_cond_encoder[0].blocks[0].block[0].in_channels
    # On the plain path every Conv1dBlock runs as a module (the fused path calls some of them
    # inside their residual block's op), so every hook fires.
    fused = unet.use_fused_ops
    unet.use_fused_ops = False
    try:
        with torch.no_grad():
            unet(torch.zeros(batch, horizon, input_dim, **like), 0,
                 local_cond=None if local_dim is None else torch.zeros(batch, horizon, local_dim, **like),
                 global_cond=torch.zeros(batch, global_dim, **like) if global_dim else None)
    finally:
        unet.use_fused_ops = fused
        for hook in hooks:
            hook.remove()
    return [tuple(int(v) for v in call) for call in calls]


def unet_config_from_state_dict(state_dict: Mapping, n_groups: int = 8) -> Dict[str, Any]:
    """The constructor arguments of Diffusion Policy's `ConditionalUnet1D` whose state_dict
    (keys without the policy's `model.` prefix) is `state_dict`, read off the weight shapes.

    GroupNorm's group count leaves no trace in the weights, so `n_groups` must come from the
    config (Diffusion Policy's default is 8). Raises ValueError for a state_dict without the
    U-Net's layout.
    """
    def shape(key):
        if key not in state_dict:
            raise ValueError(f"state_dict has no {key!r}: not Diffusion Policy's ConditionalUnet1D")
        return tuple(state_dict[key].shape)

    # diffusion_step_encoder = [SinusoidalPosEmb, Linear(dsed, 4 dsed), Mish, Linear(4 dsed, dsed)]
    step_embed_dim = shape("diffusion_step_encoder.1.weight")[1]
    down_dims: List[int] = []
    while f"down_modules.{len(down_dims)}.0.blocks.0.block.0.weight" in state_dict:
        down_dims.append(shape(f"down_modules.{len(down_dims)}.0.blocks.0.block.0.weight")[0])
    # Conv1d weight: [out_channels, in_channels, kernel_size].
    first_conv = shape("down_modules.0.0.blocks.0.block.0.weight")
    # The FiLM encoder Linear reads cat(timestep embedding, global_cond) and writes a bias (or
    # a scale and a bias) per channel.
    film = shape("down_modules.0.0.cond_encoder.1.weight")
    local_key = "local_cond_encoder.0.blocks.0.block.0.weight"
    global_cond_dim = film[1] - step_embed_dim
    if film[0] not in (first_conv[0], 2 * first_conv[0]) or global_cond_dim < 0:
        raise ValueError(f"inconsistent U-Net weights: FiLM encoder {list(film)} for "
                         f"{first_conv[0]} channels and a {step_embed_dim}-dim step embedding")
    final = shape("final_conv.1.weight")
    if final[0] != first_conv[1]:
        raise ValueError(f"inconsistent U-Net weights: input_dim {first_conv[1]} in, "
                         f"{final[0]} out")
    return dict(
        input_dim=first_conv[1],
        local_cond_dim=shape(local_key)[1] if local_key in state_dict else None,
        global_cond_dim=global_cond_dim or None,
        diffusion_step_embed_dim=step_embed_dim,
        down_dims=down_dims,
        kernel_size=first_conv[2],
        n_groups=int(n_groups),
        cond_predict_scale=film[0] == 2 * first_conv[0],
    )
