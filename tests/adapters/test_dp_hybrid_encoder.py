"""DiffusionUnetHybridImagePolicy checkpoints from camera frames: the rebuilt robomimic encoder
(adapters/dp_hybrid_encoder.py) against robomimic's own ObservationEncoder / VisualCore with DP's
GroupNorm and CropRandomizer replacements (tests/support/dp_hybrid_checkpoint.py), and
load_checkpoint(...).predict_action against Diffusion Policy's predict_action on those modules."""
import warnings

import pytest
import torch

pytest.importorskip("omegaconf")
pytest.importorskip("torchvision")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("robomimic.models.obs_nets")  # pip install --no-deps robomimic==0.3.0 termcolor

from diffusion_policy_accelerated.adapters.checkpoint import load_checkpoint  # noqa: E402
from diffusion_policy_accelerated.adapters.dp_hybrid_encoder import build_hybrid_obs_encoder  # noqa: E402
from tests.support.dp_hybrid_checkpoint import (  # noqa: E402
    CROP_SHAPE, hybrid_frames, hybrid_shape_meta, make_hybrid_checkpoint, robomimic_encoder)
from tests.support.dp_image_checkpoint import as_float_obs, dp_predict_action  # noqa: E402

TOLERANCE = dict(atol=1e-4, rtol=1e-4)

ENCODER_CASES = {
    "DP's settings: crop, group norm, fixed eval crop, 1 camera": dict(cameras=1),
    "3 cameras": dict(cameras=3),
    "BatchNorm (no obs_encoder_group_norm)": dict(cameras=2, obs_encoder_group_norm=False),
    "no crop": dict(cameras=1, crop_shape=None),
}


def _policy_cfg(shape_meta, crop_shape=CROP_SHAPE, obs_encoder_group_norm=True, eval_fixed_crop=True):
    return dict(shape_meta=shape_meta, crop_shape=None if crop_shape is None else list(crop_shape),
                obs_encoder_group_norm=obs_encoder_group_norm, eval_fixed_crop=eval_fixed_crop)


@pytest.mark.parametrize("case", ENCODER_CASES)
def test_rebuilt_encoder_equals_robomimics(case):
    options = dict(ENCODER_CASES[case])
    shape_meta = hybrid_shape_meta(options.pop("cameras"))
    reference = robomimic_encoder(shape_meta, **{"crop_shape": CROP_SHAPE, **options})
    rebuilt = build_hybrid_obs_encoder(_policy_cfg(shape_meta, **options), reference.state_dict())
    assert sorted(rebuilt.state_dict()) == sorted(reference.state_dict())  # loaded strictly
    g = torch.Generator().manual_seed(1)
    obs = {k: torch.rand((4,) + tuple(v["shape"]), generator=g) * 2 - 1 for k, v in shape_meta["obs"].items()}
    with torch.no_grad():
        want = reference(obs)
        torch.testing.assert_close(rebuilt(obs), want, **TOLERANCE)
    assert rebuilt.feature_dim == want.shape[-1] == reference.output_shape()[0]
    assert rebuilt.keys == list(shape_meta["obs"])  # robomimic's order, not sorted


@pytest.mark.parametrize("cameras,obs_mode", [(1, "global"), (2, "global"), (1, "inpaint")])
def test_predict_action_from_frames_equals_diffusion_policy(cameras, obs_mode, tmp_path):
    path, cfg, encoder, ref, state = make_hybrid_checkpoint(tmp_path, cameras, obs_mode=obs_mode)
    ck = load_checkpoint(path, device="cpu")
    obs = as_float_obs(hybrid_frames(cfg["shape_meta"], batch=3, steps=3))
    result = ck.predict_action(obs, generator=torch.Generator().manual_seed(9))
    expected = dp_predict_action(ck, cfg, encoder, ref, state, obs, seed=9)
    assert result["action"].shape == (3, 8, 2)
    torch.testing.assert_close(result["action"], expected, **TOLERANCE)


def test_without_eval_fixed_crop_the_centre_is_cropped_with_a_warning(tmp_path):
    path, cfg, *_ = make_hybrid_checkpoint(tmp_path, 1, eval_fixed_crop=False)
    fixed, *_ = make_hybrid_checkpoint(tmp_path, 1, name="fixed.ckpt")
    obs = as_float_obs(hybrid_frames(cfg["shape_meta"], batch=2))
    ck = load_checkpoint(path, device="cpu")
    with pytest.warns(UserWarning, match="crops its camera frames at random"):
        got = ck.predict_action(obs, generator=torch.Generator().manual_seed(2))["action"]
    want = load_checkpoint(fixed, device="cpu").predict_action(obs, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(got, want["action"], **TOLERANCE)


def test_encoder_that_does_not_fit_is_refused(tmp_path):
    path, cfg, encoder, ref, state = make_hybrid_checkpoint(tmp_path, 1)
    weights = {k[len("obs_encoder."):]: v for k, v in state.items() if k.startswith("obs_encoder.")}
    for change, text in [
        ({"obs_encoder_group_norm": False}, "missing [obs_nets.view_1_image.backbone.nets.1.running_mean"),
        ({"crop_shape": [48, 20]}, "must be smaller than camera 'view_1_image''s [40, 48] frames"),
        ({"crop_shape": [20, 20]}, "size mismatch for obs_nets.view_1_image.pool.pos_x"),
    ]:
        with pytest.raises(ValueError) as caught:
            build_hybrid_obs_encoder({**_policy_cfg(cfg["shape_meta"]), **change}, weights)
        assert text in str(caught.value), str(caught.value)

