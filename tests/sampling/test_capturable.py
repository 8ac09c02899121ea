"""capturable.py: the modules whose ordinary code breaks a CUDA graph capture, made capturable
without changing a result (checked bit for bit on the CPU, and as a capture on CUDA), and the
description of a capture that still fails (the module and the line)."""
import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.modules.transformer as transformer
import torchvision

from diffusion_policy_accelerated.sampling.capturable import (CaptureError, HostRandomnessError, capture_failure,
                                                              end_generator_capture, make_capturable)
from tests.support.dp_policies import real_robot_encoder
from tests.support.dp_reference import randomize_
from tests.support.dp_transformer import TransformerForDiffusion

IMAGENET = dict(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])


def small_real_robot_encoder(cameras):
    """The real-robot configuration's encoder (imagenet_norm, resize, crop) at a size the CPU
    runs quickly: 3x30x40 frames resized to 24x32 and cropped to 20x28."""
    torch.manual_seed(0)
    encoder, _, shapes = real_robot_encoder(cameras, camera_shape=(3, 30, 40), resize_shape=(24, 32),
                                            crop_shape=(20, 28))
    return randomize_(encoder, seed=1).eval(), shapes


def frames(shapes, batch, seed):
    generator = torch.Generator().manual_seed(seed)
    return {key: torch.rand(batch, *shape, generator=generator) for key, shape in shapes.items()}


@pytest.mark.parametrize("cameras", [1, 3])
def test_real_robot_encoder_gives_the_same_features_after_the_swap(cameras):
    reference, shapes = small_real_robot_encoder(cameras)
    swapped = copy.deepcopy(reference)
    changed = make_capturable(swapped)
    assert changed == [f"key_transform_map.camera_{i}.2" for i in range(cameras)]
    for batch in (1, 4):
        obs = frames(shapes, batch, seed=batch)
        with torch.no_grad():
            assert torch.equal(swapped(obs), reference(obs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("inplace", [False, True])
def test_normalize_computes_what_torchvision_computes_and_builds_its_constants_once(dtype, inplace, monkeypatch):
    reference = torchvision.transforms.Normalize(**IMAGENET, inplace=inplace)
    swapped = copy.deepcopy(reference)
    make_capturable(swapped)
    image = torch.rand(2, 3, 5, 6, dtype=dtype)
    expected = reference(image.clone())
    given = image.clone()
    assert torch.equal(swapped(given), expected)
    assert torch.equal(given, expected if inplace else image)  # in place only where asked
    # A capture cannot copy host values to the device: later calls build no tensor from them.
    monkeypatch.setattr(torch, "as_tensor", lambda *args, **kwargs: pytest.fail("built a tensor on a later call"))
    assert torch.equal(swapped(image.clone()), expected)


def test_normalize_follows_new_values_and_keeps_torchvisions_errors():
    normalize = torchvision.transforms.Normalize(**IMAGENET)
    make_capturable(normalize)
    image = torch.rand(1, 3, 4, 4)
    normalize(image)
    normalize.mean = [0.0, 0.0, 0.0]
    assert torch.equal(normalize(image), torchvision.transforms.Normalize([0.0] * 3, IMAGENET["std"])(image))
    normalize.mean = torch.zeros(3)  # a tensor: torchvision's own forward
    assert torch.equal(normalize(image), torchvision.transforms.Normalize([0.0] * 3, IMAGENET["std"])(image))
    normalize.std = [0.2, 0.0, 0.2]
    with pytest.raises(ValueError, match="std evaluated to zero"):
        normalize(image)
    normalize.std = IMAGENET["std"]
    with pytest.raises(TypeError, match="Input tensor should be a float tensor"):
        normalize(torch.zeros(1, 3, 4, 4, dtype=torch.uint8))


def transformer_denoiser(causal_attn=True, time_as_cond=True, n_cond_layers=0):
    torch.manual_seed(0)
    model = TransformerForDiffusion(input_dim=2 if time_as_cond else 7, output_dim=2 if time_as_cond else 7,
                                    horizon=6, n_obs_steps=2, cond_dim=5 if time_as_cond else 0, n_layer=2, n_head=2,
                                    n_emb=16, causal_attn=causal_attn, time_as_cond=time_as_cond,
                                    n_cond_layers=n_cond_layers)
    return randomize_(model, seed=1).eval()


# (causal_attn, time_as_cond, n_cond_layers): the PyTorch transformer modules the model has
@pytest.mark.parametrize("causal_attn,time_as_cond,n_cond_layers,modules", [
    (True, True, 0, ["decoder"]),  # an MLP condition encoder
    (True, True, 2, ["encoder", "decoder"]),
    (True, False, 0, ["encoder"]),  # encoder-only (BERT)
    (False, True, 2, ["encoder", "decoder"])])
def test_transformer_modules_test_their_mask_once(causal_attn, time_as_cond, n_cond_layers, modules, monkeypatch):
    reference = transformer_denoiser(causal_attn, time_as_cond, n_cond_layers)
    swapped = copy.deepcopy(reference)
    assert make_capturable(swapped) == modules
    sample, cond = torch.randn(3, 6, swapped.head.out_features), torch.randn(3, 2, 5)
    args = (sample, torch.tensor(7), cond if time_as_cond else None)
    with torch.no_grad():
        expected = reference(*args)
        assert torch.equal(swapped(*args), expected)
        # PyTorch tests the mask (a read back, which a capture cannot hold) only where no hint is given.
        detect = transformer._detect_is_causal_mask

        def no_test_without_a_hint(mask, is_causal=None, size=None):
            assert mask is None or is_causal is not None, "tested the mask again"
            return detect(mask, is_causal, size)
        monkeypatch.setattr(transformer, "_detect_is_causal_mask", no_test_without_a_hint)
        assert torch.equal(swapped(*args), expected)


def test_a_mask_changed_in_place_or_replaced_is_tested_again():
    """The causal answer belongs to the mask as it was: a mask made non-causal in place (its
    version) or replaced gives the results a fresh module gives."""
    reference = transformer_denoiser()
    swapped = copy.deepcopy(reference)
    make_capturable(swapped)
    args = (torch.randn(2, 6, 2), torch.tensor(3), torch.randn(2, 2, 5))
    with torch.no_grad():
        swapped(*args)
        for model in (reference, swapped):
            model.mask.zero_()  # attend everywhere
        assert torch.equal(swapped(*args), reference(*args))
        for model in (reference, swapped):
            model.mask = torch.triu(torch.full((6, 6), float("-inf")), diagonal=1)
        assert torch.equal(swapped(*args), reference(*args))


def test_make_capturable_is_idempotent_and_survives_deepcopy_and_pickle():
    model = nn.Sequential(torchvision.transforms.Normalize(**IMAGENET), nn.Identity())
    assert make_capturable(model) == ["0"]
    assert make_capturable(model) == []
    image = torch.rand(1, 3, 4, 4)
    expected = model(image)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert copied[0].forward.module is copied[0]
        assert torch.equal(copied(image), expected)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=False)(image), expected)
    assert list(model.state_dict()) == []


def test_a_module_with_a_forward_of_its_own_is_left_alone():
    normalize = torchvision.transforms.Normalize(**IMAGENET)
    normalize.forward = lambda image: image
    assert make_capturable(normalize) == []


def test_host_random_transforms_refuse_a_capture_and_run_eagerly_otherwise(monkeypatch):
    crop = torchvision.transforms.RandomCrop(4)
    model = nn.Sequential(nn.Identity(), crop, torchvision.transforms.ColorJitter(0.1))
    assert make_capturable(model) == ["1", "2"]
    assert make_capturable(model) == []
    assert crop(torch.rand(1, 3, 6, 6)).shape == (1, 3, 4, 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(HostRandomnessError, match="RandomCrop draws its random parameters on the host"):
        crop(torch.rand(1, 3, 6, 6))


class ReadsBack(nn.Module):
    def forward(self, x):
        if x.sum().item() > 1e9:  # the line a capture cannot hold
            return x
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failure_names_the_module_and_the_line():
    root = nn.Sequential(nn.Identity(), nn.Sequential(nn.ReLU(), ReadsBack()))
    try:
        try:
            root(torch.zeros(2))
        except RuntimeError:
            # torch.cuda.graph's own error at the capture's end, which hides the one that broke it
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    except RuntimeError as error:
        failure = error
    text = capture_failure(failure, root)
    assert text.startswith("capture failed: RuntimeError: operation not permitted when stream is capturing; "
                           f"in module 1.1 ({__name__}.ReadsBack), at {__file__}:")
    assert text.endswith(": `raise RuntimeError(\"operation not permitted when stream is capturing\")`")
    assert f"in a {__name__}.ReadsBack" in capture_failure(failure)  # no root to name it in
    assert issubclass(CaptureError, RuntimeError)


@pytest.mark.gpu
def test_the_real_robot_encoder_captures_after_the_swap_and_not_before():
    """The issue's failure, and its fix: torchvision's Normalize cannot be captured as it is;
    after make_capturable the whole encoder replays what it computes eagerly."""
    encoder, shapes = small_real_robot_encoder(cameras=2)
    encoder = encoder.cuda()
    obs = {key: value.cuda() for key, value in frames(shapes, 2, seed=0).items()}
    with torch.no_grad():
        expected = encoder(obs)
        caller = torch.cuda.current_stream()
        with pytest.raises(RuntimeError):
            with torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="thread_local"):
                encoder(obs)
        # What a failed capture leaves behind: its stream current, the generator capturing.
        torch.cuda.set_stream(caller)
        end_generator_capture(caller.device)
        make_capturable(encoder)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            encoder(obs)  # warm-up: the constants are built here
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            output = encoder(obs)
        fresh = {key: value.cuda() for key, value in frames(shapes, 2, seed=1).items()}
        for key in obs:
            obs[key].copy_(fresh[key])
        graph.replay()
        assert torch.equal(output, encoder(fresh))
        assert not torch.equal(output, expected)


@pytest.mark.gpu
def test_a_causal_transformer_captures_after_the_swap():
    model = transformer_denoiser().cuda()
    args = (torch.randn(2, 6, 2, device="cuda"), torch.tensor(5, device="cuda"), torch.randn(2, 2, 5, device="cuda"))
    with torch.no_grad():
        expected = model(*args)
        make_capturable(model)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            output = model(*args)
        graph.replay()
        assert torch.equal(output, expected)
