"""What the tools print: kernel tables a terminal can show (scripts/profile_action.py through
tools/profiling.py, whole names kept in its CSV), examples/robot_loop.py telling the user
when chunks keep arriving late, and scripts/load_test.py's camera-frame rows."""
import csv
import importlib.util
import json
import time
from pathlib import Path

import numpy as np
import pytest

from diffusion_policy_accelerated.tools.profiling import NAME_WIDTH, TOP_COLUMNS, format_table, short_name, write_csv

ROOT = Path(__file__).resolve().parents[2]
ELEMENTWISE = ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::"
               "CUDAFunctor_add<float> >(at::TensorIteratorBase&, at::native::CUDAFunctor_add<float> const&)::"
               "{lambda(int)#1}>(int, at::native::gpu_kernel_impl_nocast<at::native::CUDAFunctor_add<float> >("
               "at::TensorIteratorBase&, at::native::CUDAFunctor_add<float> const&)::{lambda(int)#1})")
STREAM_CONV = ("void dpa::(anonymous namespace)::stream_conv_kernel<float, 4, true, dpa::Epilogue<float, "
               "(dpa::EpilogueKind)2> >(dpa::StreamArgs<float>, int, int, int, int, int, int, int, int, int)")
CUBLAS = "sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_off_kernel"


@pytest.mark.parametrize("name,short", [
    ("aten::mish", "aten::mish"),                                            # fits: unchanged
    ("Memcpy DtoD (Device -> Device)", "Memcpy DtoD (Device -> Device)"),
    (ELEMENTWISE, "elementwise_kernel<...>"),                                # templates too long: collapsed
    (STREAM_CONV, "stream_conv_kernel<float, 4, true, Epilogue<float, (EpilogueKind)2> >"),  # they fit: kept
    (CUBLAS + "__5x_cublas", CUBLAS[:NAME_WIDTH - 3] + "..."),              # no structure: cut
])
def test_short_names(name, short):
    assert short_name(name) == short and len(short) <= NAME_WIDTH


def test_tables_shorten_names_and_the_csv_keeps_them(tmp_path):
    rows = [dict(name=n, total_us=10.0 * i, mean_us=1.0, share=0.25, calls=3, layers="down.0.res0.block0")
            for i, n in enumerate([ELEMENTWISE, STREAM_CONV, "aten::mish"])]
    table = format_table(rows, TOP_COLUMNS)
    assert max(len(line) for line in table.splitlines()) < NAME_WIDTH + 60
    assert "elementwise_kernel<...>" in table and "at::native" not in table
    write_csv(rows, tmp_path / "top.csv", TOP_COLUMNS)
    with open(tmp_path / "top.csv") as f:
        assert [row["name"] for row in csv.DictReader(f)] == [ELEMENTWISE, STREAM_CONV, "aten::mish"]


def _robot_loop():
    spec = importlib.util.spec_from_file_location("dpa_robot_loop", ROOT / "examples" / "robot_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _SlowClient:
    """PolicyClient's part robot_loop uses, answering each act after `seconds`."""
    spec = type("Spec", (), {"inputs": {"global_cond": type("T", (), {"shape": (4,)})()}})()
    last_timings = {"server_ms": 1.0, "batch_rows": 1}

    def __init__(self, seconds):
        self.seconds = seconds

    def __call__(self, *args, **kwargs):
        return self

    def wait_ready(self, timeout):
        pass

    def act(self, observation):
        time.sleep(self.seconds)
        return np.zeros((16, 2), np.float32)

    def close(self):
        pass


@pytest.mark.parametrize("seconds,warned", [(0.06, True), (0.0, False)])
def test_robot_loop_says_once_what_to_lower(monkeypatch, capsys, seconds, warned):
    """Chunks that take 60 ms against a 20 ms deadline (2 actions at 100 Hz): after three late
    ones the loop names the measured time, the deadline and the flags, once; on time, nothing."""
    robot_loop = _robot_loop()
    monkeypatch.setattr(robot_loop, "PolicyClient", _SlowClient(seconds))
    robot_loop.main(["--hz", "100", "--steps-per-chunk", "2", "--chunks", "7"])
    err = capsys.readouterr().err
    assert err.count("chunks arrived late") == (1 if warned else 0), err
    if warned:
        assert "robot_loop: 3 chunks arrived late" in err and "must come within 20 ms" in err
        assert "dpa serve --steps 10" in err and "--scheduler ddim" in err and "--steps-per-chunk" in err
        measured = float(err.split("a chunk took ")[1].split(" ms")[0])
        assert 50 <= measured < 1000


def test_load_test_sends_frames_raw_and_as_jpeg(tmp_path, capsys):
    """scripts/load_test.py's image rows against a real `dpa serve` process: an image checkpoint
    (the small U-Net, DDPM-2), 1 and 2 clients, the frames raw and then as JPEG on the same
    server. Every request is answered; the JPEG request is the smaller one by far (the frames
    are smooth, as a camera's are)."""
    pytest.importorskip("aiohttp")
    pytest.importorskip("torchvision")
    from scripts import load_test
    from tests.support.serve_process import free_port

    out = tmp_path / "load_test.json"
    load_test.main(["--image-cameras", "1", "--image-unet", "small", "--clients", "1", "2", "--requests", "2",
                    "--steps", "2", "--dtype", "float32", "--max-batch", "2", "--jpeg-quality", "90",
                    "--port", str(free_port()), "--json", str(out)])
    raw, jpeg = (run["rows"] for run in json.loads(out.read_text())["runs"])
    assert [row["clients"] for row in raw + jpeg] == [1, 2, 1, 2]
    assert all(row["actions"] == 2 * row["clients"] and row["retries"] == 0 for row in raw + jpeg)
    assert raw[0]["jpeg_quality"] is None and jpeg[0]["jpeg_quality"] == 90
    assert raw[0]["request_bytes"] > 2 * 3 * 96 * 96 > 4 * jpeg[0]["request_bytes"]
    assert "1 camera, JPEG 90" in capsys.readouterr().out


def test_load_test_frames_are_smooth_uint8():
    from scripts.load_test import smooth_frames

    frames = smooth_frames((2, 3, 40, 56), np.random.default_rng(0))
    assert frames.shape == (2, 3, 40, 56) and frames.dtype == np.uint8 and frames.std() > 20
    # Neighbouring pixels differ by little (noise, which JPEG cannot compress, would by ~85).
    assert np.abs(np.diff(frames.astype(int), axis=-1)).mean() < 12


def test_load_test_serves_a_lerobot_folder_from_frames(tmp_path):
    """--lerobot-cameras: a LeRobot folder of Push-T's configuration (its full-size U-Net, one
    DDPM step here) served from camera frames by a real `dpa serve --lerobot` process; the
    summary rows are the raw frames' (the JPEG run comes after them)."""
    pytest.importorskip("aiohttp")
    pytest.importorskip("lerobot.policies.diffusion.modeling_diffusion")
    from scripts import load_test
    from tests.support.serve_process import free_port

    out = tmp_path / "load_test.json"
    load_test.main(["--lerobot-cameras", "1", "--clients", "1", "--requests", "1", "--steps", "1", "--dtype",
                    "float32", "--max-batch", "1", "--jpeg-quality", "80", "--port", str(free_port()),
                    "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["server"]["policy"].startswith("LeRobot")
    assert [run["rows"][0]["jpeg_quality"] for run in result["runs"]] == [None, 80]
    assert result["rows"][0]["jpeg_quality"] is None and result["rows"][0]["actions"] == 1


@pytest.mark.parametrize("budget", [0, -3, 2.5, True])
def test_sm_budgets_must_be_positive_integers(budget):
    from diffusion_policy_accelerated.tools.sm_budget import confine_to_sms

    with pytest.raises(ValueError, match="budget must be a positive number of SMs"):
        confine_to_sms(budget)


def test_an_sm_budget_without_a_gpu_says_so():
    import torch

    from diffusion_policy_accelerated.tools.sm_budget import confine_to_sms

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        confine_to_sms(16)


@pytest.mark.parametrize("argv,text", [
    (["--jpeg-quality", "0"], "--jpeg-quality must be 1-100, got 0"),
    (["--jpeg-quality", "101"], "--jpeg-quality must be 1-100, got 101"),
    (["--image-unet", "small"], "--image-size and --image-unet are for --image-cameras"),
    (["--lerobot-cameras", "1", "--image-size", "3", "64", "64"], "--image-size and --image-unet are for"),
    (["--image-cameras", "0"], "--image-cameras takes positive counts"),
    (["--image-cameras", "1", "--lerobot-cameras", "1"], "not allowed with argument"),
    (["--kill-replica"], "--kill-replica needs --ray-replicas"),
])
def test_load_test_refuses_bad_options(argv, text, capsys):
    from scripts import load_test

    with pytest.raises(SystemExit) as exit_:
        load_test.main(argv)
    assert exit_.value.code == 2 and text in capsys.readouterr().err


@pytest.mark.parametrize("argv,text", [
    (["--sms", "16", "--device", "cpu"], "--sms needs a GPU (--device cuda)"),
    (["--quality-only", "--speed-only"], "--quality-only and --speed-only leave nothing to run"),
])
def test_benchmark_parallel_refuses_bad_options(argv, text):
    import os
    import subprocess
    import sys

    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark_parallel.py"), *argv],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 2 and text in done.stderr
