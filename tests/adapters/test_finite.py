"""The non-finite guard (sampling/finite.py) of accelerate() and load_checkpoint(): NaN or Inf in
an observation, or produced inside the policy (poisoned weights, an overflow), raises
dpa.NonFiniteError naming which, instead of returning actions; check_finite=False returns them.
On CUDA the whole predict_action is one graph replay, whose flags are computed inside it."""
import copy

import numpy as np
import pytest
import torch

import diffusion_policy_accelerated as dpa
from diffusion_policy_accelerated.sampling.finite import FiniteGuard, named_arrays
from tests.adapters.test_accelerate import make_obs, make_policy, predict
from tests.support import DEVICES

BAD_VALUES = [float("nan"), float("inf"), float("-inf")]


def poison_weight(policy):
    """One weight of the U-Net's last conv set to NaN, in place (which accelerate() follows)."""
    with torch.no_grad():
        policy.model.final_conv[1].weight[0, 0, 0] = float("nan")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", BAD_VALUES, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("whole_graph", [True, False], ids=["whole graph", "loop graph"])
def test_non_finite_observation_is_named(value, whole_graph, device):
    policy = dpa.accelerate(make_policy("lowdim global cond", device), whole_graph=whole_graph)
    obs = make_obs(policy, 3, seed=0)
    predict(policy, obs, seed=0)  # a good call first: on CUDA the graph is captured and then replayed
    obs["obs"][2, 1, 4] = value
    with pytest.raises(dpa.NonFiniteError, match=r"observations: obs_dict\['obs'\] \(rows \[2\] of 3\)") as caught:
        predict(policy, obs, seed=0)
    assert caught.value.where == "observations" and caught.value.names == ("obs_dict['obs']",)
    # The next good call is answered as before.
    obs["obs"][2, 1, 4] = 0.0
    assert torch.isfinite(predict(policy, obs, seed=0)["action"]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_camera_image_is_named(device):
    policy = dpa.accelerate(make_policy("image global cond", device))
    obs = make_obs(policy, 2, seed=0)
    obs["image"][1, 0, 0, 3, 3] = float("nan")
    with pytest.raises(dpa.NonFiniteError) as caught:
        predict(policy, obs, seed=0)
    assert caught.value.names == ("obs_dict['image']",) and "(rows [1] of 2)" in str(caught.value)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("whole_graph", [True, False], ids=["whole graph", "loop graph"])
def test_poisoned_weights_name_the_weight(whole_graph, device):
    """A NaN weight inside the U-Net: every action is NaN; the error names the actions, all
    rows, and the weight."""
    policy = dpa.accelerate(make_policy("lowdim global cond", device), whole_graph=whole_graph)
    obs = make_obs(policy, 2, seed=0)
    predict(policy, obs, seed=0)
    poison_weight(policy)
    with pytest.raises(dpa.NonFiniteError, match=r"from finite observations: result\['action'\] \(rows \[0, 1\] "
                                                 r"of 2\).*not finite: model\.final_conv\.1\.weight") as caught:
        predict(policy, obs, seed=0)
    assert caught.value.where == "actions"
    assert caught.value.names == ("result['action']", "result['action_pred']")


@pytest.mark.parametrize("device", DEVICES)
def test_overflow_from_finite_observations_and_weights(device):
    """Observations near float32's largest value overflow in the policy's arithmetic (one row
    only): the actions are refused, and the message says that the weights are finite."""
    policy = dpa.accelerate(make_policy("lowdim global cond", device))
    obs = make_obs(policy, 3, seed=0)
    obs["obs"][1] = 3e38
    with pytest.raises(dpa.NonFiniteError, match=r"result\['action'\] \(rows \[1\] of 3\).*weights are finite, so "
                                                 r"its arithmetic overflowed") as caught:
        predict(policy, obs, seed=0)
    assert caught.value.where == "actions"


@pytest.mark.parametrize("device", DEVICES)
def test_check_finite_false_returns_what_was_computed(device):
    reference = make_policy("lowdim global cond", device)
    policy = dpa.accelerate(copy.deepcopy(reference), check_finite=False)
    obs = make_obs(policy, 2, seed=0)
    obs["obs"][0, 0, 0] = float("nan")
    actions = predict(policy, obs, seed=0)["action"]
    # Row 0 is NaN, as the policy's own predict_action has it; row 1 is untouched.
    assert torch.isnan(actions[0]).all() and torch.isfinite(actions[1]).all()
    assert torch.isnan(predict(reference, obs, seed=0)["action"][0]).all()


def test_bad_check_finite_option():
    with pytest.raises(TypeError, match="check_finite must be a bool"):
        dpa.accelerate(make_policy("lowdim global cond"), check_finite=1)


@pytest.mark.gpu
def test_flags_are_computed_inside_the_graph():
    """On CUDA the replay computes the flags: the captured call holds them, the sampler has no
    graph of its own, and a replay with a NaN observation is refused without a new capture."""
    policy = dpa.accelerate(make_policy("lowdim global cond", "cuda"))
    obs = make_obs(policy, 2, seed=0)
    predict(policy, obs, seed=0)
    call = policy.predict_action
    (captured,) = call._graphs.values()
    assert captured.flags is not None and captured.flags.stacked[0].shape == (3,)  # obs, action, action_pred
    obs["obs"][1, 0, 0] = float("nan")
    with pytest.raises(dpa.NonFiniteError, match="observations"):
        predict(policy, obs, seed=0)
    assert len(call._graphs) == 1 and call.refused is None
    assert policy.conditional_sample.sampler._graphs == {}


@pytest.mark.gpu
def test_a_first_call_with_nan_keeps_its_graph():
    """The first call of a shape captures the graph on its own observations: a NaN among them
    is refused as usual, and the graph (checked against the eager call, NaN and all) serves the
    next calls."""
    policy = dpa.accelerate(make_policy("lowdim global cond", "cuda"))
    obs = make_obs(policy, 2, seed=0)
    good = obs["obs"].clone()
    obs["obs"][0, 0, 0] = float("nan")
    with pytest.raises(dpa.NonFiniteError, match="observations"):
        predict(policy, obs, seed=0)
    call = policy.predict_action
    assert call.refused is None and len(call._graphs) == 1
    assert torch.isfinite(predict(policy, {"obs": good}, seed=0)["action"]).all()
    assert len(call._graphs) == 1


@pytest.mark.gpu
def test_a_callers_own_capture_gets_the_call_unchecked():
    """Inside a graph the caller captures, nothing can be read: the call joins the capture
    unchecked, and the caller's replays produce the NaN it gave them."""
    policy = dpa.accelerate(make_policy("lowdim global cond", "cuda"))
    obs = make_obs(policy, 1, seed=0)
    predict(policy, obs, seed=0)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = policy.predict_action(obs)["action"]
    obs["obs"].fill_(float("nan"))
    graph.replay()
    assert torch.isnan(out).all()


# --------------------------------------------------------------------------------------
# load_checkpoint's predict_action and predict_action_from_features.
# --------------------------------------------------------------------------------------

def test_checkpoint_guard(tmp_path):
    from tests.adapters.test_checkpoint import OBS_DIM, make_checkpoint

    path, *_ = make_checkpoint(tmp_path, scheduler="ddim", steps=3)
    ck = dpa.load_checkpoint(path, device="cpu")
    obs = np.random.default_rng(0).standard_normal((2, 2, OBS_DIM)).astype(np.float32)
    assert np.isfinite(ck.predict_action({"obs": obs})["action"].numpy()).all()
    obs[1, 1, 1] = np.inf  # a numpy array, as a robot's driver gives it
    with pytest.raises(dpa.NonFiniteError, match=r"predict_action: NaN or Inf in the observations: "
                                                 r"obs_dict\['obs'\] \(rows \[1\] of 2\)"):
        ck.predict_action({"obs": obs})
    global_cond = torch.randn(2, ck.unet_config["global_cond_dim"])
    with pytest.raises(dpa.NonFiniteError, match=r"predict_action_from_features: .* observations: noise"):
        ck.predict_action_from_features(global_cond, noise=torch.full((4, 2, 16, 2), float("nan")))
    # A zero normaliser scale divides the actions by zero: finite weights, infinite actions.
    ck.normalizer_params["action"]["scale"][0] = 0.0
    with pytest.raises(dpa.NonFiniteError, match="weights are finite, so its arithmetic overflowed or divided by zero"):
        ck.predict_action_from_features(global_cond)
    ck.normalizer_params["action"]["scale"][0] = float("nan")
    with pytest.raises(dpa.NonFiniteError, match=r"not finite: normalizer\.action\.scale"):
        ck.predict_action_from_features(global_cond)
    ck.check_finite = False
    assert torch.isnan(ck.predict_action_from_features(global_cond)[..., 0]).all()


def test_checkpoint_poisoned_unet_is_named(tmp_path):
    from tests.adapters.test_checkpoint import make_checkpoint

    path, *_ = make_checkpoint(tmp_path, obs_mode="inpaint", scheduler="ddim", steps=3)
    ck = dpa.load_checkpoint(path, device="cpu")
    with torch.no_grad():
        ck.unet.final_conv[1].bias.fill_(float("nan"))
    with pytest.raises(dpa.NonFiniteError, match=r"from finite observations: result \(rows \[0\] of 1\); these weights "
                                                 r"of the policy are not finite: unet\.final_conv\.1\.bias") as caught:
        ck.predict_action_from_features(obs_features=torch.zeros(1, 2, ck.obs_feature_dim))
    assert caught.value.where == "actions"
    assert not dpa.load_checkpoint(path, device="cpu", check_finite=False).check_finite
    with pytest.raises(TypeError, match="check_finite must be a bool"):
        dpa.load_checkpoint(path, device="cpu", check_finite="yes")


# --------------------------------------------------------------------------------------
# The guard itself.
# --------------------------------------------------------------------------------------

def test_named_arrays_walks_trees_in_order():
    tree = {"a": torch.zeros(2), "b": [torch.zeros(1, dtype=torch.int64), (np.zeros(3), torch.ones(1))],
            "c": "text", "d": np.zeros(2, np.int32)}
    assert [name for name, _ in named_arrays(tree, "x")] == ["x['a']", "x['b'][1][0]", "x['b'][1][1]"]


def test_guard_names_arguments_as_the_method_does():
    def method(batch, noise=None, *, scale=1.0):
        return {"actions": batch["state"] * scale + (0 if noise is None else noise)}

    guard = FiniteGuard(method, "method", torch.nn.Linear(1, 1))
    good = {"state": torch.ones(2, 3)}
    torch.testing.assert_close(guard(good, scale=2.0)["actions"], torch.full((2, 3), 2.0))
    with pytest.raises(dpa.NonFiniteError, match=r"observations: noise \(rows \[0\] of 2\)"):
        guard(good, torch.tensor([[float("nan")] * 3, [0.0] * 3]))
    with pytest.raises(dpa.NonFiniteError, match=r"actions, from finite observations: result\['actions'\]"):
        guard(good, scale=float("inf"))
