"""load_checkpoint on synthetic Diffusion Policy workspace checkpoints.

The checkpoints are shaped like `BaseWorkspace.save_checkpoint`'s: `torch.save({'cfg':
DictConfig, 'state_dicts': {'model', 'ema_model', 'optimizer'}, 'pickles': {...}},
pickle_module=dill)`, with policy state_dicts made of `dp_reference.RefUnet` (Diffusion
Policy's module tree) under 'model.' and LinearNormalizer params under
'normalizer.params_dict.<field>.'; cfg.policy follows Diffusion Policy's train_*.yaml. The
expected results are Diffusion Policy's conditional_sample / predict_action steps, written
here with the reference U-Net and diffusers' schedulers.
"""
import pickle
import re
import sys
import warnings

import pytest
import torch
from diffusers import DDIMScheduler, DDPMScheduler

pytest.importorskip("omegaconf")
from omegaconf import OmegaConf  # noqa: E402

from diffusion_policy_accelerated.adapters.checkpoint import (  # noqa: E402
    DiffusionPolicyCheckpoint, load_checkpoint, unet_config_from_state_dict)
from diffusion_policy_accelerated.sampling.picard import Picard  # noqa: E402
from tests.support.dp_reference import RefUnet, randomize_  # noqa: E402

try:
    import dill
except ImportError:  # pragma: no cover
    dill = None

SCHEDULER_TARGETS = {"ddim": "diffusers.schedulers.scheduling_ddim.DDIMScheduler",
                     "ddpm": "diffusers.schedulers.scheduling_ddpm.DDPMScheduler"}
SCHEDULER_CLASSES = {"ddim": DDIMScheduler, "ddpm": DDPMScheduler}
SMALL_UNET = dict(diffusion_step_embed_dim=16, down_dims=[16, 32], kernel_size=5, n_groups=8,
                  cond_predict_scale=True)
OBS_DIM, ACTION_DIM, IMAGE_FEATURES = 5, 2, 6
TOLERANCE = dict(atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------------------
# Synthetic workspace checkpoints.
# --------------------------------------------------------------------------------------

def scheduler_cfg(kind):
    cfg = dict(_target_=SCHEDULER_TARGETS[kind], num_train_timesteps=100, beta_start=0.0001,
               beta_end=0.02, beta_schedule="squaredcos_cap_v2", clip_sample=True,
               prediction_type="epsilon")
    if kind == "ddpm":
        cfg["variance_type"] = "fixed_small"
    else:
        cfg.update(set_alpha_to_one=True, steps_offset=0)
    return cfg


def workspace_cfg(policy="lowdim", obs_mode="global", scheduler="ddim", steps=4, unet=None,
                  oa_step_convention=True, pred_action_steps_only=False, **policy_extra):
    """(cfg as train_diffusion_unet_*_workspace.yaml composes it, unresolved; the U-Net
    constructor arguments that cfg implies)."""
    unet = {**SMALL_UNET, **(unet or {})}
    glob, local = obs_mode == "global", obs_mode == "local"
    top = dict(name="train_diffusion_unet", horizon=16, n_obs_steps=2, n_action_steps=8,
               n_latency_steps=0, obs_as_global_cond=glob,
               training=dict(seed=42, use_ema=True),
               # Hydra's ${now:} is not registered outside Hydra: the loader must cope.
               logging=dict(name="${now:%Y.%m.%d}_${name}"))
    common = dict(noise_scheduler=scheduler_cfg(scheduler), horizon="${horizon}",
                  n_action_steps="${eval:'${n_action_steps}+${n_latency_steps}'}",
                  n_obs_steps="${n_obs_steps}", num_inference_steps=steps,
                  obs_as_global_cond="${obs_as_global_cond}")
    if policy == "lowdim":
        top.update(_target_="diffusion_policy.workspace.train_diffusion_unet_lowdim_workspace."
                            "TrainDiffusionUnetLowdimWorkspace",
                   obs_dim=OBS_DIM, action_dim=ACTION_DIM, obs_as_local_cond=local,
                   pred_action_steps_only=pred_action_steps_only)
        unet_kwargs = dict(input_dim=ACTION_DIM if (glob or local) else ACTION_DIM + OBS_DIM,
                           local_cond_dim=OBS_DIM if local else None,
                           global_cond_dim=OBS_DIM * 2 if glob else None, **unet)
        policy_cfg = dict(
            _target_="diffusion_policy.policy.diffusion_unet_lowdim_policy.DiffusionUnetLowdimPolicy",
            model=dict(_target_="diffusion_policy.model.diffusion.conditional_unet1d.ConditionalUnet1D",
                       **unet_kwargs),
            **common, obs_dim="${obs_dim}", action_dim="${action_dim}",
            obs_as_local_cond="${obs_as_local_cond}",
            pred_action_steps_only="${pred_action_steps_only}",
            oa_step_convention=oa_step_convention)
    else:
        assert obs_mode in ("global", "inpaint")
        shape_meta = dict(obs=dict(image=dict(shape=[3, 8, 8], type="rgb"),
                                   agent_pos=dict(shape=[2], type="low_dim")),
                          action=dict(shape=[ACTION_DIM]))
        top.update(_target_="diffusion_policy.workspace.train_diffusion_unet_hybrid_workspace."
                            "TrainDiffusionUnetHybridWorkspace", shape_meta=shape_meta)
        unet_kwargs = dict(input_dim=ACTION_DIM if glob else ACTION_DIM + IMAGE_FEATURES,
                           local_cond_dim=None, global_cond_dim=IMAGE_FEATURES * 2 if glob else None, **unet)
        policy_cfg = dict(
            _target_=f"diffusion_policy.policy.diffusion_unet_{policy}_policy."
                     + {"hybrid_image": "DiffusionUnetHybridImagePolicy",
                        "image": "DiffusionUnetImagePolicy"}[policy],
            shape_meta="${shape_meta}", **common, **unet)
        if policy == "image":
            policy_cfg["obs_encoder"] = dict(
                _target_="diffusion_policy.model.vision.multi_image_obs_encoder.MultiImageObsEncoder",
                shape_meta="${shape_meta}", crop_shape=[76, 76])
        else:
            policy_cfg.update(crop_shape=[76, 76], obs_encoder_group_norm=True, eval_fixed_crop=True)
    policy_cfg.update(policy_extra)
    top["policy"] = policy_cfg
    return top, unet_kwargs


NORMALIZER_FIELDS = {"lowdim": {"obs": OBS_DIM, "action": ACTION_DIM},
                     "image": {"image": 1, "agent_pos": 2, "action": ACTION_DIM}}


def policy_state(unet_kwargs, seed, policy="lowdim"):
    """(reference U-Net, a DP policy state_dict around it)."""
    torch.manual_seed(seed)
    ref = randomize_(RefUnet(**unet_kwargs), seed).eval()
    state = {"_dummy_variable": torch.empty(0)}  # ModuleAttrMixin's
    state.update({"model." + k: v.clone() for k, v in ref.state_dict().items()})
    g = torch.Generator().manual_seed(seed + 100)
    fields = NORMALIZER_FIELDS["lowdim" if policy == "lowdim" else "image"]
    for field, dim in fields.items():
        prefix = f"normalizer.params_dict.{field}."
        state[prefix + "scale"] = 0.5 + torch.rand(dim, generator=g)
        state[prefix + "offset"] = torch.randn(dim, generator=g)
        for stat in ("min", "max", "mean", "std"):
            state[prefix + "input_stats." + stat] = torch.randn(dim, generator=g)
    if policy != "lowdim":
        state["obs_encoder.fc.weight"] = torch.randn(IMAGE_FEATURES, 4, generator=g)
    return ref, state


def save_workspace(path, cfg, state_dicts, pickle_module=None):
    payload = {"cfg": OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg,
               "state_dicts": state_dicts,
               "pickles": {"global_step": pickle.dumps(123), "epoch": pickle.dumps(4)}}
    torch.save(payload, path, pickle_module=pickle_module or dill or pickle)
    return path


def make_checkpoint(tmp_path, name="latest.ckpt", ema=True, **cfg_kwargs):
    """(path, cfg, unet kwargs, reference U-Net of the weights the loader should pick)."""
    cfg, unet_kwargs = workspace_cfg(**cfg_kwargs)
    policy = cfg_kwargs.get("policy", "lowdim")
    model_ref, model_state = policy_state(unet_kwargs, seed=1, policy=policy)
    state_dicts = {"model": model_state,
                   "optimizer": torch.optim.AdamW(model_ref.parameters()).state_dict()}
    ref = model_ref
    if ema:
        ref, state_dicts["ema_model"] = policy_state(unet_kwargs, seed=2, policy=policy)
    return save_workspace(tmp_path / name, cfg, state_dicts), cfg, unet_kwargs, ref


# --------------------------------------------------------------------------------------
# Diffusion Policy's inference, with the reference U-Net and diffusers.
# --------------------------------------------------------------------------------------

def dp_scheduler(cfg):
    ns = dict(cfg["policy"]["noise_scheduler"])
    kind = "ddim" if ns.pop("_target_").endswith("DDIMScheduler") else "ddpm"
    return SCHEDULER_CLASSES[kind](**ns)


@torch.no_grad()
def dp_conditional_sample(ref, scheduler, steps, condition_data, condition_mask, local_cond=None,
                          global_cond=None, generator=None):
    trajectory = torch.randn(size=condition_data.shape, dtype=condition_data.dtype,
                             generator=generator)
    scheduler.set_timesteps(steps)
    for t in scheduler.timesteps:
        trajectory[condition_mask] = condition_data[condition_mask]
        model_output = ref(trajectory, t, local_cond=local_cond, global_cond=global_cond)
        trajectory = scheduler.step(model_output, t, trajectory, generator=generator).prev_sample
    trajectory[condition_mask] = condition_data[condition_mask]
    return trajectory


def dp_unnormalize(state, field, x):
    scale = state[f"normalizer.params_dict.{field}.scale"]
    offset = state[f"normalizer.params_dict.{field}.offset"]
    return ((x.reshape(-1, scale.shape[0]) - offset) / scale).reshape(x.shape)


def dp_normalize(state, field, x):
    scale = state[f"normalizer.params_dict.{field}.scale"]
    offset = state[f"normalizer.params_dict.{field}.offset"]
    return (x.reshape(-1, scale.shape[0]) * scale + offset).reshape(x.shape)


def gen(seed):
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------
# Tests.
# --------------------------------------------------------------------------------------

UNET_CASES = {
    "lowdim global, film scale, k5, g8": dict(obs_mode="global"),
    "lowdim global, no film scale, k3, g4": dict(
        obs_mode="global", unet=dict(cond_predict_scale=False, kernel_size=3, n_groups=4)),
    "lowdim local cond, g4": dict(obs_mode="local", unet=dict(n_groups=4, kernel_size=3)),
    "lowdim inpainting (no global cond), 3 levels": dict(
        obs_mode="inpaint", unet=dict(down_dims=[16, 32, 64], diffusion_step_embed_dim=32)),
    "hybrid image global": dict(policy="hybrid_image", obs_mode="global"),
    "image inpainting, no film scale": dict(policy="image", obs_mode="inpaint",
                                            unet=dict(cond_predict_scale=False)),
}


@pytest.mark.parametrize("case", UNET_CASES)
def test_infers_unet_constructor_args_and_weights(case, tmp_path):
    path, cfg, unet_kwargs, ref = make_checkpoint(tmp_path, **UNET_CASES[case])
    ck = load_checkpoint(path, device="cpu")
    assert isinstance(ck, DiffusionPolicyCheckpoint)
    assert ck.unet_config == unet_kwargs
    stripped = {k[len("model."):]: v for k, v in ck._policy_state.items() if k.startswith("model.")}
    assert unet_config_from_state_dict(stripped, n_groups=unet_kwargs["n_groups"]) == unet_kwargs
    # The weights are the EMA copy's, and the U-Net computes what DP's does.
    g = gen(0)
    x = torch.randn(3, 16, unet_kwargs["input_dim"], generator=g)
    lc = (torch.randn(3, 16, unet_kwargs["local_cond_dim"], generator=g)
          if unet_kwargs["local_cond_dim"] else None)
    gc = (torch.randn(3, unet_kwargs["global_cond_dim"], generator=g)
          if unet_kwargs["global_cond_dim"] else None)
    with torch.no_grad():
        torch.testing.assert_close(ck.unet(x, 7, local_cond=lc, global_cond=gc),
                                   ref(x, 7, local_cond=lc, global_cond=gc), **TOLERANCE)
    assert ck.horizon == 16 and ck.n_obs_steps == 2 and ck.n_action_steps == 8
    assert ck.action_dim == ACTION_DIM and ck.num_inference_steps == 4
    assert ck.obs_as_global_cond == (UNET_CASES[case]["obs_mode"] == "global")
    assert ck.obs_as_local_cond == (UNET_CASES[case]["obs_mode"] == "local")
    assert ck.cfg["policy"]["horizon"] == 16 and isinstance(ck.cfg, dict)
    assert ck.unet.training is False and next(ck.unet.parameters()).device.type == "cpu"


def test_prefers_ema_weights(tmp_path):
    path, cfg, unet_kwargs, ema_ref = make_checkpoint(tmp_path)
    payload = torch.load(path, weights_only=False)
    key = "model.final_conv.1.weight"
    ck = load_checkpoint(path, device="cpu")
    assert ck.weights == "ema_model"
    torch.testing.assert_close(ck.unet.state_dict()["final_conv.1.weight"],
                               payload["state_dicts"]["ema_model"][key])
    ck = load_checkpoint(path, device="cpu", use_ema=False)
    assert ck.weights == "model"
    torch.testing.assert_close(ck.unet.state_dict()["final_conv.1.weight"],
                               payload["state_dicts"]["model"][key])
    assert not torch.equal(payload["state_dicts"]["model"][key],
                           payload["state_dicts"]["ema_model"][key])
    # Without EMA (training.use_ema=False) the checkpoint has no ema_model.
    path, _, _, model_ref = make_checkpoint(tmp_path, name="noema.ckpt", ema=False)
    assert load_checkpoint(path, device="cpu").weights == "model"


@pytest.mark.parametrize("obs_mode", ["global", "local", "inpaint"])
def test_ddim_sample_equals_diffusion_policy(obs_mode, tmp_path):
    path, cfg, unet_kwargs, ref = make_checkpoint(tmp_path, obs_mode=obs_mode, steps=5)
    ck = load_checkpoint(path, device="cpu")
    g = gen(3)
    B, T, D = 2, 16, unet_kwargs["input_dim"]
    gc = torch.randn(B, unet_kwargs["global_cond_dim"], generator=g) if obs_mode == "global" else None
    lc = torch.randn(B, T, OBS_DIM, generator=g) if obs_mode == "local" else None
    data = torch.randn(B, T, D, generator=g)
    mask = torch.zeros(B, T, D, dtype=torch.bool)
    if obs_mode == "inpaint":
        mask[:, :2, ACTION_DIM:] = True
    expected = dp_conditional_sample(ref, dp_scheduler(cfg), 5, data, mask, local_cond=lc,
                                     global_cond=gc, generator=gen(11))
    actual = ck.sample(global_cond=gc, local_cond=lc, condition_data=data, condition_mask=mask,
                       generator=gen(11))
    assert actual.shape == (B, T, D)
    torch.testing.assert_close(actual, expected, **TOLERANCE)
    if obs_mode != "inpaint":  # default condition: zeros, nothing known
        expected = dp_conditional_sample(ref, dp_scheduler(cfg), 5, torch.zeros(B, T, D),
                                         torch.zeros(B, T, D, dtype=torch.bool), local_cond=lc,
                                         global_cond=gc, generator=gen(12))
        torch.testing.assert_close(ck.sample(global_cond=gc, local_cond=lc, generator=gen(12)),
                                   expected, **TOLERANCE)


def test_ddpm_sample_equals_diffusion_policy_with_its_noise(tmp_path):
    """DDPM draws per-step noise; with diffusers' draws passed as `noise` the loop is DP's."""
    path, cfg, unet_kwargs, ref = make_checkpoint(tmp_path, scheduler="ddpm", steps=6)
    ck = load_checkpoint(path, device="cpu")
    assert ck.schedule.kind == "ddpm"
    B, shape = 2, (2, 16, ACTION_DIM)
    gc = torch.randn(B, unet_kwargs["global_cond_dim"], generator=gen(0))
    expected = dp_conditional_sample(ref, dp_scheduler(cfg), 6, torch.zeros(shape),
                                     torch.zeros(shape, dtype=torch.bool), global_cond=gc,
                                     generator=gen(5))
    # DP's draws in DP's order: the initial trajectory, then one per step with t > 0.
    g = gen(5)
    noise = [torch.randn(shape, generator=g)]
    noise += [torch.randn(shape, generator=g) if t > 0 else torch.zeros(shape)
              for t in ck.schedule.timesteps]
    actual = ck.sample(global_cond=gc, noise=torch.stack(noise))
    torch.testing.assert_close(actual, expected, **TOLERANCE)


def test_num_inference_steps_override_and_default(tmp_path):
    path, *_ = make_checkpoint(tmp_path, scheduler="ddpm", steps=None)
    assert load_checkpoint(path, device="cpu").num_inference_steps == 100  # num_train_timesteps
    assert load_checkpoint(path, device="cpu", num_inference_steps=7).num_inference_steps == 7
    assert len(load_checkpoint(path, device="cpu", num_inference_steps=7).schedule.timesteps) == 7
    with pytest.raises(ValueError, match="positive integer"):
        load_checkpoint(path, device="cpu", num_inference_steps=0)


def test_normalize_unnormalize(tmp_path):
    path, cfg, unet_kwargs, _ = make_checkpoint(tmp_path, policy="hybrid_image")
    ck = load_checkpoint(path, device="cpu")
    state = ck._policy_state
    assert sorted(ck.fields) == ["action", "agent_pos", "image"]
    g = gen(0)
    for field, x in [("action", torch.randn(3, 16, ACTION_DIM, generator=g)),
                     ("agent_pos", torch.randn(3, 2, 2, generator=g).double()),
                     ("image", torch.rand(3, 2, 3, 8, 8, generator=g))]:
        n = ck.normalize(field, x)
        assert n.dtype == torch.float32 and n.shape == x.shape
        torch.testing.assert_close(n, dp_normalize(state, field, x.float()))
        torch.testing.assert_close(ck.unnormalize(field, n), x.float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ck.unnormalize(field, x), dp_unnormalize(state, field, x.float()))
    # numpy in, like DP
    torch.testing.assert_close(ck.normalize("action", torch.ones(1, 2).numpy()),
                               dp_normalize(state, "action", torch.ones(1, 2)))
    assert ck.normalizer_params["action"]["input_stats"]["mean"].shape == (ACTION_DIM,)
    with pytest.raises(KeyError, match="no field 'obs'"):
        ck.normalize("obs", torch.zeros(1, 5))


def dp_expected_actions(ck, ref, cfg, state, *, global_cond=None, nobs=None, seed):
    """DP's predict_action after normalisation/encoding, written out as DP writes it."""
    To, T, Da = ck.n_obs_steps, ck.horizon, ck.action_dim
    policy, lowdim = cfg["policy"], "Lowdim" in cfg["policy"]["_target_"]
    local_cond = None
    if global_cond is not None:
        B = global_cond.shape[0]
        shape = (B, ck.n_action_steps if policy.get("pred_action_steps_only") else T, Da)
        data = torch.zeros(shape)
        mask = torch.zeros_like(data, dtype=torch.bool)
    elif policy.get("obs_as_local_cond"):
        B, _, Do = nobs.shape
        local_cond = torch.zeros(B, T, Do)
        local_cond[:, :To] = nobs[:, :To]
        data = torch.zeros(B, T, Da)
        mask = torch.zeros_like(data, dtype=torch.bool)
    else:
        B, _, Do = nobs.shape
        data = torch.zeros(B, T, Da + Do)
        mask = torch.zeros_like(data, dtype=torch.bool)
        data[:, :To, Da:] = nobs[:, :To]
        mask[:, :To, Da:] = True
    nsample = dp_conditional_sample(ref, dp_scheduler(cfg), ck.num_inference_steps, data, mask,
                                    local_cond=local_cond, global_cond=global_cond,
                                    generator=gen(seed))
    action_pred = dp_unnormalize(state, "action", nsample[..., :Da])
    if policy.get("pred_action_steps_only"):
        return action_pred
    start = (To - 1 if policy.get("oa_step_convention") else To) if lowdim else To - 1
    return action_pred[:, start:start + ck.n_action_steps]


SLICE_CASES = {
    "lowdim global, oa_step_convention": dict(obs_mode="global"),
    "lowdim global, no oa_step_convention": dict(obs_mode="global", oa_step_convention=False),
    "lowdim global, pred_action_steps_only": dict(obs_mode="global", pred_action_steps_only=True),
    "lowdim local cond": dict(obs_mode="local"),
    "lowdim inpainting": dict(obs_mode="inpaint"),
    "image global": dict(policy="image", obs_mode="global"),
    "hybrid image inpainting": dict(policy="hybrid_image", obs_mode="inpaint"),
}


@pytest.mark.parametrize("case", SLICE_CASES)
def test_predict_action_from_features_slices_as_diffusion_policy(case, tmp_path):
    path, cfg, unet_kwargs, ref = make_checkpoint(tmp_path, **SLICE_CASES[case])
    cfg = OmegaConf.to_container(OmegaConf.create(cfg))
    ck = load_checkpoint(path, device="cpu")
    cfg["policy"]["pred_action_steps_only"] = ck.pred_action_steps_only
    cfg["policy"]["obs_as_local_cond"] = ck.obs_as_local_cond
    state = ck._policy_state
    B = 3
    if ck.obs_as_global_cond:
        features = {"global_cond": torch.randn(B, unet_kwargs["global_cond_dim"], generator=gen(1))}
        expected = dp_expected_actions(ck, ref, cfg, state, **features, seed=9)
    else:
        features = {"obs_features": torch.randn(B, 3, ck.obs_feature_dim, generator=gen(1))}
        expected = dp_expected_actions(ck, ref, cfg, state, nobs=features["obs_features"], seed=9)
    action = ck.predict_action_from_features(generator=gen(9), **features)
    assert action.shape == (B, ck.n_action_steps, ACTION_DIM)
    torch.testing.assert_close(action, expected, **TOLERANCE)
    # The wrong kind of features is refused with what to pass instead.
    wrong = ({"obs_features": torch.zeros(B, 2, 3)} if ck.obs_as_global_cond
             else {"global_cond": torch.zeros(B, 4)})
    with pytest.raises(ValueError, match="pass (global_cond|obs_features)"):
        ck.predict_action_from_features(**wrong)


@pytest.mark.parametrize("obs_mode", ["global", "local", "inpaint"])
def test_lowdim_predict_action_from_raw_observations(obs_mode, tmp_path):
    path, cfg, unet_kwargs, ref = make_checkpoint(tmp_path, obs_mode=obs_mode)
    ck = load_checkpoint(path, device="cpu")
    obs = torch.randn(2, 3, OBS_DIM, generator=gen(4)) * 3
    nobs = dp_normalize(ck._policy_state, "obs", obs)
    features = ({"global_cond": nobs[:, :2].reshape(2, -1)} if obs_mode == "global"
                else {"obs_features": nobs})
    result = ck.predict_action({"obs": obs}, generator=gen(6))
    torch.testing.assert_close(result["action"],
                               ck.predict_action_from_features(generator=gen(6), **features),
                               atol=1e-6, rtol=1e-6)
    assert result["action_pred"].shape == (2, 16, ACTION_DIM)
    assert ("obs_pred" in result) == (obs_mode == "inpaint")
    with pytest.raises(ValueError, match="obs must be"):
        ck.predict_action({"obs": torch.zeros(2, 1, OBS_DIM)})


def test_parallel_sampling_reaches_the_checkpoints_sampler(tmp_path):
    """load_checkpoint(parallel=...) samples by Picard iteration: with tolerance 0 the sequential
    sampler's actions for the same noise."""
    path, *_ = make_checkpoint(tmp_path, obs_mode="global")
    sequential = load_checkpoint(path, device="cpu")
    parallel = load_checkpoint(path, device="cpu", parallel=Picard(window=4, tolerance=0))
    assert parallel.sampler.parallel == Picard(window=4, tolerance=0) and sequential.sampler.parallel is None
    obs = torch.randn(2, 3, OBS_DIM, generator=gen(4))
    torch.testing.assert_close(parallel.predict_action({"obs": obs}, generator=gen(6))["action"],
                               sequential.predict_action({"obs": obs}, generator=gen(6))["action"], atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="parallel must be None, a bool, a Picard"):
        load_checkpoint(path, device="cpu", parallel="yes")


def test_image_policy_with_a_foreign_encoder_is_refused(tmp_path):
    """This file's image checkpoints hold a stand-in encoder (one 'fc.weight', no rgb_model):
    predict_action says it cannot rebuild it; tests/adapters/test_dp_encoder.py has real ones."""
    path, *_ = make_checkpoint(tmp_path, policy="image")
    ck = load_checkpoint(path, device="cpu")
    with pytest.raises(ValueError, match="cfg.policy.obs_encoder has no rgb_model"):
        ck.predict_action({"image": torch.zeros(1, 2, 3, 8, 8)})
    assert list(ck.obs_encoder_state_dict()) == ["fc.weight"]
    assert "DiffusionUnetImagePolicy" in repr(ck)


def test_cfg_interpolations_resolved_and_eval_resolver_not_left_behind(tmp_path):
    path, *_ = make_checkpoint(tmp_path)
    assert not OmegaConf.has_resolver("eval")
    ck = load_checkpoint(path, device="cpu")
    assert not OmegaConf.has_resolver("eval")
    assert ck.cfg["policy"]["n_action_steps"] == 8 and ck.cfg["policy"]["horizon"] == 16
    assert ck.cfg["logging"]["name"] == "${now:%Y.%m.%d}_${name}"  # unresolvable here: verbatim


def test_resolved_cfg_and_plain_pickle(tmp_path, monkeypatch):
    """As train.py saves it (cfg resolved first), and loadable without dill."""
    cfg, unet_kwargs = workspace_cfg()
    del cfg["logging"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated name in omegaconf 2.4, the only one before
        OmegaConf.register_new_resolver("eval", eval)
    try:
        cfg = OmegaConf.create(cfg)
        OmegaConf.resolve(cfg)
    finally:
        OmegaConf.clear_resolver("eval")
    _, state = policy_state(unet_kwargs, seed=1)
    path = save_workspace(tmp_path / "plain.ckpt", cfg, {"model": state}, pickle_module=pickle)
    monkeypatch.setitem(sys.modules, "dill", None)
    ck = load_checkpoint(path, device="cpu")
    assert ck.n_action_steps == 8 and ck.weights == "model"


def test_dtype_option(tmp_path):
    path, *_ = make_checkpoint(tmp_path)
    ck32 = load_checkpoint(path, device="cpu")
    ck = load_checkpoint(path, device="cpu", dtype=torch.bfloat16)
    assert next(ck.unet.parameters()).dtype == torch.bfloat16
    gc = torch.randn(1, 2 * OBS_DIM, generator=gen(0))
    out = ck.predict_action_from_features(gc, generator=gen(1))
    assert out.dtype == torch.float32  # inputs and actions stay float32, as in DP
    torch.testing.assert_close(out, ck32.predict_action_from_features(gc, generator=gen(1)),
                               atol=0.1, rtol=0.1)
    for bad in (torch.int32, torch.float64):
        with pytest.raises(TypeError, match="dtype must be one of"):
            load_checkpoint(path, dtype=bad)


# ---------------------------------------------------------------- errors

def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint file"):
        load_checkpoint(tmp_path / "nope.ckpt")


def test_missing_omegaconf_says_how_to_install(tmp_path, monkeypatch):
    path, *_ = make_checkpoint(tmp_path)
    monkeypatch.setitem(sys.modules, "omegaconf", None)
    with pytest.raises(ImportError, match="pip install omegaconf"):
        load_checkpoint(path, device="cpu")


def test_not_a_workspace_checkpoint(tmp_path):
    torch.save({"cfg": OmegaConf.create({"policy": {}}), "weights": {}}, tmp_path / "a.ckpt",
               pickle_module=dill or pickle)
    with pytest.raises(ValueError, match="'state_dicts'"):
        load_checkpoint(tmp_path / "a.ckpt")
    torch.save({"x": torch.zeros(1)}, tmp_path / "b.ckpt")
    with pytest.raises(ValueError, match="not a Diffusion Policy workspace checkpoint"):
        load_checkpoint(tmp_path / "b.ckpt")


@pytest.mark.parametrize("damage", ["truncated", "garbage", "a legacy pickle cut short", "empty"])
def test_corrupt_checkpoint_file(tmp_path, damage):
    """A file that is not a whole checkpoint raises one ValueError naming it, not the
    unpickler's or zip reader's own error."""
    path, *_ = make_checkpoint(tmp_path)
    data = path.read_bytes()
    bad = tmp_path / "bad.ckpt"
    if damage == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        bad.write_bytes(bytes(range(256)) * 64)
    elif damage == "a legacy pickle cut short":
        bad.write_bytes(pickle.dumps({"cfg": 1, "state_dicts": {}})[:-5])
    else:
        bad.write_bytes(b"")
    with pytest.raises(ValueError, match=f"path: {re.escape(str(bad))} is not a readable Diffusion Policy "
                                         "checkpoint"):
        load_checkpoint(bad, device="cpu")


def test_transformer_policy_is_refused(tmp_path):
    cfg, _ = workspace_cfg()
    cfg["policy"]["_target_"] = ("diffusion_policy.policy.diffusion_transformer_lowdim_policy."
                                 "DiffusionTransformerLowdimPolicy")
    state = {"model.pos_emb": torch.zeros(1, 16, 8), "model.head.weight": torch.zeros(2, 8),
             "normalizer.params_dict.action.scale": torch.ones(2)}
    path = save_workspace(tmp_path / "t.ckpt", cfg, {"model": state})
    with pytest.raises(ValueError, match="transformer policies"):
        load_checkpoint(path, device="cpu")


def test_unsupported_scheduler_is_refused(tmp_path):
    path, *_ = make_checkpoint(tmp_path, noise_scheduler=dict(
        _target_="diffusers.schedulers.scheduling_dpmsolver_multistep.DPMSolverMultistepScheduler",
        num_train_timesteps=100))
    with pytest.raises(ValueError, match="DPMSolverMultistepScheduler.*is not supported"):
        load_checkpoint(path, device="cpu")


@pytest.mark.parametrize("change,error,text", [
    (dict(_target_="diffusion_policy.policy.diffusion_unet_video_policy.DiffusionUnetVideoPolicy"),
     ValueError, "is not supported"),
    (dict(obs_as_global_cond=False), ValueError, "obs_as_global_cond=False but the U-Net"),
    (dict(action_dim=3), ValueError, r"input_dim 2, .* does not fit cfg.policy's action_dim 3"),
    (dict(obs_dim=4), ValueError, "does not fit cfg.policy's action_dim 2, obs_dim 4"),
    (dict(n_obs_steps=3), ValueError, "does not fit .* n_obs_steps 3"),
    (dict(horizon=None), ValueError, "horizon must be a positive integer, got None"),
    ({"_delete": "horizon"}, ValueError, r"cfg.policy \(DiffusionUnetLowdimPolicy\) has no \['horizon'\]"),
    (dict(temperature=0.5), ValueError, r"keys \['temperature'\] .* scheduler.step"),
    (dict(eta=0.5), ValueError, "DDIM options"),  # DDPM takes no eta
])
def test_bad_policy_config_is_refused(change, error, text, tmp_path):
    cfg, unet_kwargs = workspace_cfg(scheduler="ddpm")
    if "_delete" in change:
        del cfg["policy"][change["_delete"]]
    else:
        cfg["policy"].update(change)
    _, state = policy_state(unet_kwargs, seed=1)
    path = save_workspace(tmp_path / "bad.ckpt", cfg, {"model": state})
    with pytest.raises(error, match=text):
        load_checkpoint(path, device="cpu")


def test_ddim_eta_from_config_is_used(tmp_path):
    path, *_ = make_checkpoint(tmp_path, eta=0.5)
    ck = load_checkpoint(path, device="cpu")
    assert ck.step_options == dict(eta=0.5, use_clipped_model_output=False)
    assert ck.schedule.eta == 0.5


def test_use_ema_false_without_model_weights(tmp_path):
    cfg, unet_kwargs = workspace_cfg()
    _, state = policy_state(unet_kwargs, seed=1)
    path = save_workspace(tmp_path / "e.ckpt", cfg, {"ema_model": state})
    assert load_checkpoint(path, device="cpu").weights == "ema_model"
    with pytest.raises(ValueError, match="no 'model'"):
        load_checkpoint(path, device="cpu", use_ema=False)


def test_sample_argument_errors(tmp_path):
    path, *_ = make_checkpoint(tmp_path)
    ck = load_checkpoint(path, device="cpu")
    with pytest.raises(ValueError, match="condition_mask without condition_data"):
        ck.sample(global_cond=torch.zeros(1, 2 * OBS_DIM),
                  condition_mask=torch.zeros(1, 16, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="global_cond is required: this U-Net was built with global_cond_dim="):
        ck.sample()
