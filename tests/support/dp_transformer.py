"""Diffusion Policy's transformer policies at inference, for the tests and
scripts/benchmark_policy.py.

`TransformerForDiffusion` is a compact rewrite of real-stanford/diffusion_policy's
diffusion_policy/model/diffusion/transformer_for_diffusion.py (and positional_embedding.py's
SinusoidalPosEmb) with the same attributes, registration order and forward: the diffusion
timestep as the first condition token, the observations as further condition tokens
(obs_as_cond), a condition encoder of n_cond_layers pre-norm transformer layers (or an MLP
where n_cond_layers is 0), a pre-norm transformer decoder over the trajectory with causal
self-attention and a causal memory mask (causal_attn), or, without condition tokens
(time_as_cond False), an encoder-only BERT whose first token is the timestep. Dropout and
weight initialisation (`_init_weights`) are left out: they do nothing at inference.

`TransformerLowdimPolicy` and `TransformerHybridImagePolicy` reproduce
DiffusionTransformerLowdimPolicy's and DiffusionTransformerHybridImagePolicy's
`conditional_sample` (diffusers' scheduler, `model(trajectory, t, cond)`) and
`predict_action` (observations as condition tokens or inpainted, pred_action_steps_only),
written independently: the diffusion_policy package is not a dependency.
"""
import math

import torch
import torch.nn as nn

from tests.support.dp_policies import Normalizer, UnetPolicy


class SinusoidalPosEmb(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        half_dim = self.dim // 2
        emb = math.log(10000) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim, device=x.device) * -emb)
        emb = x[:, None] * emb[None, :]
        return torch.cat((emb.sin(), emb.cos()), dim=-1)


def _layer(layer_class, n_emb, n_head, p_drop_attn):
    return layer_class(d_model=n_emb, nhead=n_head, dim_feedforward=4 * n_emb, dropout=p_drop_attn,
                       activation="gelu", batch_first=True, norm_first=True)


class TransformerForDiffusion(nn.Module):
    def __init__(self, input_dim, output_dim, horizon, n_obs_steps=None, cond_dim=0, n_layer=12, n_head=12,
                 n_emb=768, p_drop_emb=0.1, p_drop_attn=0.1, causal_attn=False, time_as_cond=True,
                 obs_as_cond=False, n_cond_layers=0):
        super().__init__()
        self._dummy_variable = nn.Parameter()  # ModuleAttrMixin
        if n_obs_steps is None:
            n_obs_steps = horizon
        T, T_cond = horizon, 1
        if not time_as_cond:
            T += 1
            T_cond -= 1
        obs_as_cond = cond_dim > 0  # DP derives it from cond_dim, whatever was passed
        if obs_as_cond:
            assert time_as_cond
            T_cond += n_obs_steps
        self.input_emb = nn.Linear(input_dim, n_emb)
        self.pos_emb = nn.Parameter(torch.zeros(1, T, n_emb))
        self.drop = nn.Dropout(p_drop_emb)
        self.time_emb = SinusoidalPosEmb(n_emb)
        self.cond_obs_emb = nn.Linear(cond_dim, n_emb) if obs_as_cond else None
        self.cond_pos_emb = None
        self.encoder = None
        self.decoder = None
        encoder_only = False
        if T_cond > 0:
            self.cond_pos_emb = nn.Parameter(torch.zeros(1, T_cond, n_emb))
            if n_cond_layers > 0:
                self.encoder = nn.TransformerEncoder(_layer(nn.TransformerEncoderLayer, n_emb, n_head, p_drop_attn),
                                                     num_layers=n_cond_layers)
            else:
                self.encoder = nn.Sequential(nn.Linear(n_emb, 4 * n_emb), nn.Mish(), nn.Linear(4 * n_emb, n_emb))
            self.decoder = nn.TransformerDecoder(_layer(nn.TransformerDecoderLayer, n_emb, n_head, p_drop_attn),
                                                 num_layers=n_layer)
        else:
            encoder_only = True
            self.encoder = nn.TransformerEncoder(_layer(nn.TransformerEncoderLayer, n_emb, n_head, p_drop_attn),
                                                 num_layers=n_layer)
        if causal_attn:
            # Additive masks: -inf above the diagonal (attend to the left only).
            mask = (torch.triu(torch.ones(T, T)) == 1).transpose(0, 1)
            mask = mask.float().masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, float(0.0))
            self.register_buffer("mask", mask)
            if time_as_cond and obs_as_cond:
                t, s = torch.meshgrid(torch.arange(T), torch.arange(T_cond), indexing="ij")
                mask = t >= (s - 1)  # the first condition token is the timestep
                mask = mask.float().masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, float(0.0))
                self.register_buffer("memory_mask", mask)
            else:
                self.memory_mask = None
        else:
            self.mask = None
            self.memory_mask = None
        self.ln_f = nn.LayerNorm(n_emb)
        self.head = nn.Linear(n_emb, output_dim)
        self.T, self.T_cond, self.horizon = T, T_cond, horizon
        self.time_as_cond, self.obs_as_cond, self.encoder_only = time_as_cond, obs_as_cond, encoder_only

    def forward(self, sample, timestep, cond=None, **kwargs):
        timesteps = timestep
        if not torch.is_tensor(timesteps):
            timesteps = torch.tensor([timesteps], dtype=torch.long, device=sample.device)
        elif torch.is_tensor(timesteps) and len(timesteps.shape) == 0:
            timesteps = timesteps[None].to(sample.device)
        timesteps = timesteps.expand(sample.shape[0])
        time_emb = self.time_emb(timesteps).unsqueeze(1)
        input_emb = self.input_emb(sample)
        if self.encoder_only:
            token_embeddings = torch.cat([time_emb, input_emb], dim=1)
            x = self.drop(token_embeddings + self.pos_emb[:, :token_embeddings.shape[1], :])
            x = self.encoder(src=x, mask=self.mask)
            x = x[:, 1:, :]
        else:
            cond_embeddings = time_emb
            if self.obs_as_cond:
                cond_embeddings = torch.cat([cond_embeddings, self.cond_obs_emb(cond)], dim=1)
            x = self.drop(cond_embeddings + self.cond_pos_emb[:, :cond_embeddings.shape[1], :])
            memory = self.encoder(x)
            x = self.drop(input_emb + self.pos_emb[:, :input_emb.shape[1], :])
            x = self.decoder(tgt=x, memory=memory, tgt_mask=self.mask, memory_mask=self.memory_mask)
        return self.head(self.ln_f(x))


class TransformerPolicy(UnetPolicy):
    """What the transformer policies share with the U-Net ones (ModuleAttrMixin's device and
    dtype, the attributes accelerate() reads), with their own sampling loop: the condition
    tokens reach the model as `cond`."""

    def conditional_sample(self, condition_data, condition_mask, cond=None, generator=None, **kwargs):
        trajectory = torch.randn(size=condition_data.shape, dtype=condition_data.dtype,
                                 device=condition_data.device, generator=generator)
        self.noise_scheduler.set_timesteps(self.num_inference_steps)
        for t in self.noise_scheduler.timesteps:
            trajectory[condition_mask] = condition_data[condition_mask]
            model_output = self.model(trajectory, t, cond)
            trajectory = self.noise_scheduler.step(model_output, t, trajectory, generator=generator,
                                                   **kwargs).prev_sample
        trajectory[condition_mask] = condition_data[condition_mask]
        return trajectory

    def _slice_actions(self, nsample, start):
        action_pred = self.normalizer["action"].unnormalize(nsample[..., :self.action_dim])
        action = action_pred if self.pred_action_steps_only else action_pred[:, start:start + self.n_action_steps]
        return {"action": action, "action_pred": action_pred}


class TransformerLowdimPolicy(TransformerPolicy):
    """DiffusionTransformerLowdimPolicy at inference: observations as condition tokens
    (obs_as_cond, optionally pred_action_steps_only) or inpainted into the trajectory."""

    def __init__(self, model, noise_scheduler, horizon, obs_dim, action_dim, n_action_steps, n_obs_steps,
                 num_inference_steps=None, obs_as_cond=False, pred_action_steps_only=False, **kwargs):
        if pred_action_steps_only:
            assert obs_as_cond
        if num_inference_steps is None:
            num_inference_steps = noise_scheduler.config.num_train_timesteps
        super().__init__(model, noise_scheduler, num_inference_steps, kwargs)
        self.normalizer = Normalizer({"obs": [obs_dim], "action": [action_dim]})
        self.horizon, self.obs_dim, self.action_dim = horizon, obs_dim, action_dim
        self.n_action_steps, self.n_obs_steps = n_action_steps, n_obs_steps
        self.obs_as_cond, self.pred_action_steps_only = obs_as_cond, pred_action_steps_only

    def predict_action(self, obs_dict):
        assert "obs" in obs_dict
        assert "past_action" not in obs_dict
        nobs = self.normalizer["obs"].normalize(obs_dict["obs"])
        B, _, Do = nobs.shape
        To, T, Da = self.n_obs_steps, self.horizon, self.action_dim
        assert Do == self.obs_dim
        like = dict(device=self.device, dtype=self.dtype)
        cond = None
        if self.obs_as_cond:
            cond = nobs[:, :To]
            shape = (B, self.n_action_steps if self.pred_action_steps_only else T, Da)
            cond_data = torch.zeros(size=shape, **like)
            cond_mask = torch.zeros_like(cond_data, dtype=torch.bool)
        else:
            cond_data = torch.zeros(size=(B, T, Da + Do), **like)
            cond_mask = torch.zeros_like(cond_data, dtype=torch.bool)
            cond_data[:, :To, Da:] = nobs[:, :To]
            cond_mask[:, :To, Da:] = True
        nsample = self.conditional_sample(cond_data, cond_mask, cond=cond, **self.kwargs)
        result = self._slice_actions(nsample, start=To)
        if not self.obs_as_cond:
            obs_pred = self.normalizer["obs"].unnormalize(nsample[..., Da:])
            result["action_obs_pred"] = obs_pred[:, To:To + self.n_action_steps]
            result["obs_pred"] = obs_pred
        return result


class TransformerHybridImagePolicy(TransformerPolicy):
    """DiffusionTransformerHybridImagePolicy at inference, with any observation encoder (a dict
    of frames [N, ...] to features [N, obs_feature_dim]; robomimic's in Diffusion Policy)."""

    def __init__(self, model, noise_scheduler, obs_encoder, obs_feature_dim, obs_shapes, horizon, action_dim,
                 n_action_steps, n_obs_steps, num_inference_steps=None, obs_as_cond=True,
                 pred_action_steps_only=False, **kwargs):
        if num_inference_steps is None:
            num_inference_steps = noise_scheduler.config.num_train_timesteps
        super().__init__(model, noise_scheduler, num_inference_steps, kwargs)
        self.obs_encoder = obs_encoder
        fields = {key: [shape[0], 1, 1] if len(shape) == 3 else list(shape) for key, shape in obs_shapes.items()}
        self.normalizer = Normalizer({**fields, "action": [action_dim]})
        self.horizon, self.action_dim, self.obs_feature_dim = horizon, action_dim, obs_feature_dim
        self.n_action_steps, self.n_obs_steps = n_action_steps, n_obs_steps
        self.obs_as_cond, self.pred_action_steps_only = obs_as_cond, pred_action_steps_only

    def predict_action(self, obs_dict):
        assert "past_action" not in obs_dict
        nobs = self.normalizer.normalize(obs_dict)
        B = next(iter(nobs.values())).shape[0]
        To, T, Da, Do = self.n_obs_steps, self.horizon, self.action_dim, self.obs_feature_dim
        like = dict(device=self.device, dtype=self.dtype)
        this_nobs = {key: value[:, :To, ...].reshape(-1, *value.shape[2:]) for key, value in nobs.items()}
        nobs_features = self.obs_encoder(this_nobs).reshape(B, To, -1)
        cond = None
        if self.obs_as_cond:
            cond = nobs_features
            shape = (B, self.n_action_steps if self.pred_action_steps_only else T, Da)
            cond_data = torch.zeros(size=shape, **like)
            cond_mask = torch.zeros_like(cond_data, dtype=torch.bool)
        else:
            cond_data = torch.zeros(size=(B, T, Da + Do), **like)
            cond_mask = torch.zeros_like(cond_data, dtype=torch.bool)
            cond_data[:, :To, Da:] = nobs_features
            cond_mask[:, :To, Da:] = True
        nsample = self.conditional_sample(cond_data, cond_mask, cond=cond, **self.kwargs)
        return self._slice_actions(nsample, start=To - 1)
