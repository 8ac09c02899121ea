"""accelerate()'s whole-call graph (policy_graph.py): normalisation, the observation encoder and
the denoising loop of `predict_action` as one CUDA graph replay, on Diffusion Policy's image
policy with its real encoder architecture (torchvision's ResNet18 with GroupNorm, one per
camera), its real-robot configuration (Diffusion Policy's MultiImageObsEncoder with
torchvision's Resize and ImageNet Normalize, and a crop) and its hybrid policy's (robomimic's
ObservationEncoder); and what it refuses to capture."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
from diffusers import DDIMScheduler

from tests.support import DEVICES
from diffusion_policy_accelerated import accelerate
from diffusion_policy_accelerated.sampling.capturable import make_capturable
from diffusion_policy_accelerated.sampling.policy_graph import GraphedPolicyCall
from tests.support.dp_policies import ImagePolicy, ResNetObsEncoder, Sizes, real_robot_encoder
from tests.support.dp_reference import RefUnet, randomize_
from tests.adapters.test_accelerate import ACTION_TOLERANCE, SCHEDULER_CONFIG, UNET_SIZE, make_policy, max_abs_difference, predict
from tests.adapters.test_accelerate import make_obs as make_obs_for

SIZES = Sizes(horizon=16, n_obs_steps=2, n_action_steps=8, action_dim=2)
IMAGE, CROP, AGENT_POS_DIM = (3, 24, 24), 20, 2


def resnet_policy(cameras, device, encoder=None):
    """The image policy with one ResNet18-GN per camera (DDIM, 8 steps)."""
    torch.manual_seed(0)
    keys = [f"camera{i}" for i in range(cameras)]
    feature_dim = 512 * cameras + AGENT_POS_DIM
    unet = randomize_(RefUnet(**UNET_SIZE, input_dim=SIZES.action_dim, global_cond_dim=feature_dim * SIZES.n_obs_steps,
                              cond_predict_scale=True), seed=1)
    shapes = {**{key: IMAGE for key in keys}, "agent_pos": (AGENT_POS_DIM,)}
    policy = ImagePolicy(unet, DDIMScheduler(**SCHEDULER_CONFIG), "global", 8, SIZES,
                         encoder or ResNetObsEncoder(keys, CROP), feature_dim, shapes)
    return policy.to(device).eval()


def image_obs(policy, batch, seed):
    generator = torch.Generator().manual_seed(seed)
    obs = {key: torch.rand(batch, SIZES.n_obs_steps, *IMAGE, generator=generator)
           for key in policy.obs_encoder.cameras}
    obs["agent_pos"] = torch.randn(batch, SIZES.n_obs_steps, AGENT_POS_DIM, generator=generator)
    return {key: value.to(policy.device) for key, value in obs.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cameras", [1, 3])
def test_resnet_image_policy_actions_equal_the_policys_own(cameras, device):
    """New observations on every call, several batch sizes: fp32 actions within
    ACTION_TOLERANCE of the policy's own eager predict_action for the same seed; on CUDA one
    graph per batch size holds the whole call (the sampler captures none of its own)."""
    reference = resnet_policy(cameras, device)
    accelerated = accelerate(copy.deepcopy(reference))
    for call, batch in enumerate([1, 3, 1]):
        obs = image_obs(reference, batch, seed=call)
        expected = predict(reference, obs, seed=call)
        actual = predict(accelerated, obs, seed=call)
        assert max_abs_difference(actual, expected) <= ACTION_TOLERANCE
    if device == "cuda":
        whole = accelerated.predict_action
        assert whole.refused is None and len(whole._graphs) == 2
        assert accelerated.conditional_sample.sampler._graphs == {}


def real_robot_policy(cameras, device, **sizes):
    """Diffusion Policy's real-robot image configuration (train_diffusion_unet_real_image_workspace
    .yaml's encoder: imagenet_norm, resize_shape [240, 320], crop_shape [216, 288], a ResNet18-GN
    per camera; `sizes` changes them) with `cameras` cameras and a low-dim pose, DDIM-8."""
    torch.manual_seed(0)
    encoder, feature_dim, shapes = real_robot_encoder(cameras, **sizes)
    unet = randomize_(RefUnet(**UNET_SIZE, input_dim=SIZES.action_dim, global_cond_dim=feature_dim * SIZES.n_obs_steps,
                              cond_predict_scale=True), seed=1)
    policy = ImagePolicy(unet, DDIMScheduler(**SCHEDULER_CONFIG), "global", 8, SIZES, encoder, feature_dim, shapes)
    return policy.to(device).eval()


def real_robot_obs(policy, batch, seed):
    generator = torch.Generator().manual_seed(seed)
    shapes = policy.obs_encoder.key_shape_map
    obs = {key: torch.rand(batch, SIZES.n_obs_steps, *shapes[key], generator=generator)
           for key in policy.obs_encoder.rgb_keys}
    obs["robot_eef_pose"] = torch.randn(batch, SIZES.n_obs_steps, *shapes["robot_eef_pose"], generator=generator)
    return {key: value.to(policy.device) for key, value in obs.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("cameras,camera_shape", [(1, (3, 240, 320)), (2, (3, 120, 160)), (3, (3, 240, 320))])
def test_real_robot_configuration_runs_as_one_graph(cameras, camera_shape, channels_last):
    """The configuration whose capture failed in torchvision's Normalize: one graph per batch
    size, no warning, and actions equal to the policy's own (NCHW: the same kernels as eager;
    channels-last, accelerate's default, cuDNN's NHWC kernels). 120x160 cameras are resized."""
    reference = real_robot_policy(cameras, "cuda", camera_shape=camera_shape)
    accelerated = accelerate(copy.deepcopy(reference), encoder_channels_last=channels_last)
    tolerance = 1e-3 if channels_last else ACTION_TOLERANCE
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call, batch in enumerate([1, 2, 1]):
            obs = real_robot_obs(reference, batch, seed=call)
            assert max_abs_difference(predict(accelerated, obs, call), predict(reference, obs, call)) <= tolerance
    assert not [w for w in caught if "CUDA graph" in str(w.message)]
    whole = accelerated.predict_action
    assert whole.refused is None and len(whole._graphs) == 2
    assert accelerated.conditional_sample.sampler._graphs == {}


@pytest.mark.parametrize("cameras", [1, 3])
def test_real_robot_configuration_made_capturable_gives_the_policys_actions(cameras):
    """On the CPU, at a small size: the module swap a capture needs (torchvision's Normalize)
    leaves the accelerated policy's actions the policy's own."""
    sizes = dict(camera_shape=(3, 30, 40), resize_shape=(24, 32), crop_shape=(20, 28))
    reference = real_robot_policy(cameras, "cpu", **sizes)
    accelerated = accelerate(copy.deepcopy(reference))
    assert make_capturable(accelerated) == [f"obs_encoder.key_transform_map.camera_{i}.2" for i in range(cameras)]
    for call, batch in enumerate([1, 3]):
        obs = real_robot_obs(reference, batch, seed=call)
        assert max_abs_difference(predict(accelerated, obs, call), predict(reference, obs, call)) <= ACTION_TOLERANCE


def hybrid_policy(cameras, device):
    """Diffusion Policy's hybrid image policy (DiffusionUnetHybridImagePolicy) with robomimic's
    own ObservationEncoder (VisualCore: ResNet18Conv, SpatialSoftmax, a linear layer per camera)
    and DP's GroupNorm and fixed-crop swaps, `cameras` cameras and two low-dim keys, DDIM-8."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("robomimic.models.obs_nets")  # pip install --no-deps robomimic==0.3.0 termcolor
    from tests.support.dp_hybrid_checkpoint import hybrid_shape_meta, robomimic_encoder

    shape_meta = hybrid_shape_meta(cameras)
    encoder = robomimic_encoder(shape_meta)
    feature_dim = encoder.output_shape()[0]
    torch.manual_seed(0)
    unet = randomize_(RefUnet(**UNET_SIZE, input_dim=SIZES.action_dim, global_cond_dim=feature_dim * SIZES.n_obs_steps,
                              cond_predict_scale=True), seed=1)
    shapes = {key: tuple(value["shape"]) for key, value in shape_meta["obs"].items()}
    policy = ImagePolicy(unet, DDIMScheduler(**SCHEDULER_CONFIG), "global", 8, SIZES, encoder, feature_dim, shapes)
    return policy.to(device).eval(), shapes


@pytest.mark.parametrize("device,channels_last", [("cpu", False), pytest.param("cuda", False, marks=pytest.mark.gpu),
                                                  pytest.param("cuda", True, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("cameras", [1, 3])
def test_hybrid_configuration_runs_as_one_graph(cameras, device, channels_last):
    """robomimic's encoder as Diffusion Policy's hybrid policy holds it: actions equal to the
    policy's own for new observations and two batch sizes (NCHW: the same kernels, fp32
    ACTION_TOLERANCE; channels-last, cuDNN's NHWC kernels, 1e-3); on CUDA one graph per batch
    size holds the whole call, without a warning."""
    reference, shapes = hybrid_policy(cameras, device)
    accelerated = accelerate(copy.deepcopy(reference), encoder_channels_last=channels_last)
    tolerance = 1e-3 if channels_last else ACTION_TOLERANCE
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call, batch in enumerate([1, 2, 1]):
            generator = torch.Generator().manual_seed(call)
            obs = {key: (torch.rand if len(shape) == 3 else torch.randn)(batch, SIZES.n_obs_steps, *shape,
                                                                          generator=generator).to(device)
                   for key, shape in shapes.items()}
            assert max_abs_difference(predict(accelerated, obs, call), predict(reference, obs, call)) <= tolerance
    if device == "cuda":
        assert not [w for w in caught if "CUDA graph" in str(w.message)]
        whole = accelerated.predict_action
        assert whole.refused is None and len(whole._graphs) == 2
        assert accelerated.conditional_sample.sampler._graphs == {}


@pytest.mark.gpu
def test_unseeded_calls_draw_the_noise_the_eager_calls_draw():
    """Seeded once, then called again and again: each graphed call advances the generator as
    the eager call does (the first one included, whose capture draws too)."""
    reference = resnet_policy(1, "cuda")
    accelerated = accelerate(copy.deepcopy(reference))
    obs = image_obs(reference, 2, seed=0)
    actions = {}
    for name, policy in (("reference", reference), ("accelerated", accelerated)):
        torch.manual_seed(7)
        with torch.no_grad():
            actions[name] = [policy.predict_action(obs) for _ in range(3)]
    for actual, expected in zip(actions["accelerated"], actions["reference"]):
        assert max_abs_difference(actual, expected) <= ACTION_TOLERANCE
    assert not torch.allclose(actions["accelerated"][0]["action"], actions["accelerated"][1]["action"])


@pytest.mark.gpu
def test_whole_graph_off_keeps_the_encoder_eager():
    reference = resnet_policy(1, "cuda")
    accelerated = accelerate(copy.deepcopy(reference), whole_graph=False)
    # Only the non-finite guard (eager) stands in for predict_action.
    assert not isinstance(vars(accelerated).get("predict_action"), GraphedPolicyCall)
    obs = image_obs(reference, 2, seed=0)
    assert max_abs_difference(predict(accelerated, obs, 0), predict(reference, obs, 0)) <= ACTION_TOLERANCE
    assert len(accelerated.conditional_sample.sampler._graphs) == 1


class SynchronisingEncoder(nn.Module):
    """An encoder that reads a value back to the host (a NaN check): no graph can hold it."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder, self.cameras = encoder, encoder.cameras

    def forward(self, obs):
        features = self.encoder(obs)
        if torch.isnan(features).any():
            raise ValueError("NaN features")
        return features


class CountingEncoder(SynchronisingEncoder):
    """An encoder whose output depends on Python state that changes on every call."""

    calls = 0

    def forward(self, obs):
        self.calls += 1
        return self.encoder(obs) + self.calls


@pytest.mark.gpu
@pytest.mark.parametrize("wrapper,reason", [(SynchronisingEncoder, "capture failed"),
                                            (CountingEncoder, "first replay differs")])
def test_an_encoder_a_graph_cannot_hold_runs_eagerly_after_one_warning(wrapper, reason):
    reference = resnet_policy(1, "cuda", encoder=wrapper(ResNetObsEncoder(["camera0"], CROP)))
    accelerated = accelerate(copy.deepcopy(reference))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with pytest.warns(RuntimeWarning, match=f"predict_action cannot run as one CUDA graph.*{reason}"):
            predict(accelerated, image_obs(reference, 2, seed=0), 0)
        assert torch.cuda.current_stream() == stream  # a failed capture hands the caller's stream back
    torch.cuda.current_stream().wait_stream(stream)
    assert reason in accelerated.predict_action.refused
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for call in (1, 2):
            obs = image_obs(reference, 2, seed=call)
            reference.obs_encoder.calls = accelerated.obs_encoder.calls = 0
            assert max_abs_difference(predict(accelerated, obs, call), predict(reference, obs, call)) \
                <= ACTION_TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("whole_graph", [True, False])
def test_weights_loaded_moved_or_replaced_after_capture_are_followed(whole_graph):
    """Weights loaded in place are read by the graphs as they are; a move to the CPU and back
    (new storage) and a replaced tensor (a normaliser loaded anew, as Diffusion Policy's
    LinearNormalizer does) capture anew instead of replaying graphs over old tensors."""
    reference = resnet_policy(1, "cuda")
    accelerated = accelerate(copy.deepcopy(reference), whole_graph=whole_graph)
    obs = image_obs(reference, 2, seed=0)
    predict(accelerated, obs, 0)
    new_weights = randomize_(copy.deepcopy(reference.obs_encoder).cpu(), seed=5).state_dict()
    for policy in (reference, accelerated):
        policy.obs_encoder.load_state_dict(new_weights)
    assert max_abs_difference(predict(accelerated, obs, 1), predict(reference, obs, 1)) <= ACTION_TOLERANCE
    for policy in (reference, accelerated):
        policy.to("cpu").to("cuda")
    assert max_abs_difference(predict(accelerated, obs, 2), predict(reference, obs, 2)) <= ACTION_TOLERANCE
    for policy in (reference, accelerated):
        policy.normalizer.fields["action"].scale = torch.full((SIZES.action_dim,), 3.0, device="cuda")
    assert max_abs_difference(predict(accelerated, obs, 3), predict(reference, obs, 3)) <= ACTION_TOLERANCE


@pytest.mark.gpu
def test_a_callers_own_capture_holds_the_whole_call():
    """predict_action inside a CUDA graph the caller captures: the call and the loop join it."""
    reference = resnet_policy(1, "cuda")
    accelerated = accelerate(copy.deepcopy(reference))
    obs = image_obs(reference, 2, seed=0)
    predict(accelerated, obs, 0)  # the caller's warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        output = accelerated.predict_action(obs)
    fresh = image_obs(reference, 2, seed=1)
    for key, value in fresh.items():
        obs[key].copy_(value)
    torch.manual_seed(1)
    graph.replay()
    assert max_abs_difference(output, predict(reference, fresh, 1)) <= ACTION_TOLERANCE


# Measured on an H100 (DDIM-8, random ResNet18-GN weights, actions of size ~1): ... the bound
# leaves room for another seed.
ENCODER_TOLERANCES = {torch.float16: 0.05, torch.bfloat16: 0.1}


@pytest.mark.gpu
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("encoder_dtype", [None, torch.float16, torch.bfloat16])
def test_half_precision_and_channels_last_encoder(encoder_dtype, channels_last):
    reference = resnet_policy(1, "cuda")
    accelerated = accelerate(copy.deepcopy(reference), encoder_dtype=encoder_dtype,
                             encoder_channels_last=channels_last)
    obs = image_obs(reference, 3, seed=0)
    actual, expected = predict(accelerated, obs, 0), predict(reference, obs, 0)
    tolerance = ENCODER_TOLERANCES.get(encoder_dtype, 1e-3 if channels_last else ACTION_TOLERANCE)
    assert max_abs_difference(actual, expected) <= tolerance
    assert accelerated.predict_action.refused is None
    assert all(p.dtype == torch.float32 for p in accelerated.obs_encoder.parameters())


def test_the_encoder_goes_channels_last_unless_told_not_to():
    for option, expected in (({}, True), (dict(encoder_channels_last=False), False)):
        policy = accelerate(resnet_policy(1, "cpu"), **option)
        weight = policy.obs_encoder.backbones["camera0"].conv1.weight
        assert weight.is_contiguous(memory_format=torch.channels_last) == expected


@pytest.mark.parametrize("options,error,text", [
    (dict(encoder_dtype=torch.float32), TypeError, "encoder_dtype must be torch.float16, torch.bfloat16 or None"),
    (dict(encoder_dtype="float16"), TypeError, "encoder_dtype must be"),
    (dict(encoder_channels_last=1), TypeError, "encoder_channels_last must be a bool or None"),
    (dict(whole_graph="yes"), TypeError, "whole_graph must be a bool"),
])
def test_bad_options_are_refused_and_leave_the_policy_alone(options, error, text):
    policy = make_policy("image global cond")
    original = policy.model
    with pytest.raises(error, match=text):
        accelerate(policy, **options)
    assert policy.model is original and "predict_action" not in vars(policy)


def test_an_encoder_that_is_not_a_module_is_left_alone():
    """A plain function as the observation encoder: accelerate() works and leaves it; the
    encoder options refuse it."""
    for option in ({}, dict(encoder_dtype=torch.float16)):
        reference = make_policy("image global cond")
        vars(reference)["obs_encoder"] = (lambda encoder: lambda obs: encoder(obs))(reference.obs_encoder)
        if option:
            with pytest.raises(ValueError, match="encoder_dtype: the policy has no observation encoder"):
                accelerate(reference, **option)
            continue
        accelerated = accelerate(copy.deepcopy(reference))
        obs = make_obs_for(reference, 2, seed=0)
        assert max_abs_difference(predict(accelerated, obs, 0), predict(reference, obs, 0)) <= ACTION_TOLERANCE


@pytest.mark.parametrize("option", [dict(encoder_dtype=torch.float16), dict(encoder_channels_last=True)])
def test_encoder_options_need_an_encoder(option):
    policy = make_policy("lowdim global cond")
    with pytest.raises(ValueError, match=f"{next(iter(option))}: the policy has no observation encoder "
                                         r"\(policy.obs_encoder\)"):
        accelerate(policy, **option)
    assert "conditional_sample" not in vars(policy)
