"""Diffusion Policy's `ConditionalUnet1D` module tree in plain PyTorch, the tests' reference.

Diffusion Policy itself (and einops) is not a dependency, so compatibility is proven against
`RefUnet`: a compact rewrite of real-stanford/diffusion_policy's
diffusion_policy/model/diffusion/conditional_unet1d.py, conv1d_components.py and
positional_embedding.py with the same attribute names, Sequential indices and registration
order, written independently of the package under test.
"""
import functools
import math

import torch
import torch.nn as nn


class RefConv1dBlock(nn.Module):
    def __init__(self, cin, cout, k, n_groups=8):
        super().__init__()
        self.block = nn.Sequential(nn.Conv1d(cin, cout, k, padding=k // 2),
                                   nn.GroupNorm(n_groups, cout), nn.Mish())

    def forward(self, x):
        return self.block(x)


class RefRearrange(nn.Module):  # einops Rearrange('batch t -> batch t 1')
    def forward(self, x):
        return x[:, :, None]


class RefResBlock(nn.Module):
    def __init__(self, cin, cout, cond_dim, kernel_size, n_groups, cond_predict_scale):
        super().__init__()
        self.blocks = nn.ModuleList([RefConv1dBlock(cin, cout, kernel_size, n_groups),
                                     RefConv1dBlock(cout, cout, kernel_size, n_groups)])
        self.cond_predict_scale = cond_predict_scale
        self.out_channels = cout
        self.cond_encoder = nn.Sequential(
            nn.Mish(), nn.Linear(cond_dim, cout * (2 if cond_predict_scale else 1)), RefRearrange())
        self.residual_conv = nn.Conv1d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, cond):
        out = self.blocks[0](x)
        e = self.cond_encoder(cond)
        if self.cond_predict_scale:
            e = e.reshape(e.shape[0], 2, self.out_channels, 1)
            out = e[:, 0] * out + e[:, 1]
        else:
            out = out + e
        return self.blocks[1](out) + self.residual_conv(x)


class RefDownsample1d(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.conv = nn.Conv1d(d, d, 3, 2, 1)

    def forward(self, x):
        return self.conv(x)


class RefUpsample1d(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.conv = nn.ConvTranspose1d(d, d, 4, 2, 1)

    def forward(self, x):
        return self.conv(x)


class RefPosEmb(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, t):  # always float64: this is the numerical ground truth
        half = self.dim // 2
        freqs = torch.exp(torch.arange(half, dtype=torch.float64, device=t.device)
                          * -(math.log(10000) / (half - 1)))
        arg = t.to(torch.float64)[:, None] * freqs[None]
        return torch.cat([arg.sin(), arg.cos()], dim=-1)


class RefUnet(nn.Module):
    def __init__(self, input_dim, local_cond_dim=None, global_cond_dim=None,
                 diffusion_step_embed_dim=256, down_dims=(256, 512, 1024), kernel_size=3,
                 n_groups=8, cond_predict_scale=False):
        super().__init__()
        dims = [input_dim] + list(down_dims)
        in_out = list(zip(dims[:-1], dims[1:]))
        dsed = diffusion_step_embed_dim
        cond_dim = dsed + (global_cond_dim or 0)
        R = functools.partial(RefResBlock, cond_dim=cond_dim, kernel_size=kernel_size,
                              n_groups=n_groups, cond_predict_scale=cond_predict_scale)
        # Same registration order as Diffusion Policy's __init__.
        self.mid_modules = nn.ModuleList([R(dims[-1], dims[-1]), R(dims[-1], dims[-1])])
        self.diffusion_step_encoder = nn.Sequential(
            RefPosEmb(dsed), nn.Linear(dsed, 4 * dsed), nn.Mish(), nn.Linear(4 * dsed, dsed))
        self.local_cond_encoder = (
            nn.ModuleList([R(local_cond_dim, dims[1]), R(local_cond_dim, dims[1])])
            if local_cond_dim is not None else None)
        # In DP every up level ends with an Upsample1d (its is_last test never fires).
        self.up_modules = nn.ModuleList(
            nn.ModuleList([R(2 * dout, din), R(din, din), RefUpsample1d(din)])
            for din, dout in reversed(in_out[1:]))
        self.down_modules = nn.ModuleList(
            nn.ModuleList([R(din, dout), R(dout, dout),
                           RefDownsample1d(dout) if i < len(in_out) - 1 else nn.Identity()])
            for i, (din, dout) in enumerate(in_out))
        # DP's final block uses the default 8 groups whatever n_groups is.
        self.final_conv = nn.Sequential(RefConv1dBlock(dims[1], dims[1], kernel_size),
                                        nn.Conv1d(dims[1], input_dim, 1))

    def forward(self, sample, timesteps, local_cond=None, global_cond=None):
        # DP accepts a number, a 0-dim tensor (what its sampling loop passes) or one per row.
        if not torch.is_tensor(timesteps):
            timesteps = torch.tensor([timesteps], dtype=torch.long, device=sample.device)
        elif timesteps.dim() == 0:
            timesteps = timesteps[None].to(sample.device)
        timesteps = timesteps.expand(sample.shape[0])
        enc = self.diffusion_step_encoder
        g = enc[1:](enc[0](timesteps).to(enc[1].weight.dtype))
        if global_cond is not None:
            g = torch.cat([g, global_cond], -1)
        x = sample.transpose(1, 2)
        h_local = []
        if local_cond is not None:
            lc = local_cond.transpose(1, 2)
            h_local = [m(lc, g) for m in self.local_cond_encoder]
        skips = []
        for i, (r1, r2, down) in enumerate(self.down_modules):
            x = r1(x, g)
            if i == 0 and h_local:
                x = x + h_local[0]
            x = r2(x, g)
            skips.append(x)
            x = down(x)
        for m in self.mid_modules:
            x = m(x, g)
        for r1, r2, up in self.up_modules:
            # DP computes h_local[1] but never adds it (checkpoint-compatibility quirk).
            x = up(r2(r1(torch.cat([x, skips.pop()], 1), g), g))
        return self.final_conv(x).transpose(1, 2)


def randomize_(module, seed):
    """Perturb every parameter so GroupNorm affines, biases etc. all matter in comparisons."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            scale = p.std().item() if p.numel() > 1 and p.std().item() > 0 else 0.3
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale * 0.5)
    return module
