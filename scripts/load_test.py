"""Load test of `dpa serve`: 1 to 64 concurrent robots on loopback, each calling in a closed loop.

    python scripts/load_test.py --dtype bfloat16                       # demo lowdim U-Net, DDPM-100
    python scripts/load_test.py --clients 1 8 64 --malformed-every 5   # every 5th request malformed
    python scripts/load_test.py --ray-replicas 2 --kill-replica        # through Ray Serve, one replica killed
    python -m scripts.load_test --image-cameras 1 3 --clients 1 4      # an image policy from camera frames
    python -m scripts.load_test --lerobot-cameras 1 --jpeg-quality 90  # LeRobot's, frames raw then as JPEG

Starts `dpa serve` (or `dpa serve --ray-replicas N`) as a process of its own on 127.0.0.1,
waits for its warm-up, then for each client count runs that many client processes (robots are
separate machines: threads of one process would queue on its interpreter lock), each sending
`--requests` requests one after another with fresh observations. The 1-client row is the
baseline: sequential batch-1 calls through the same server. Per row: action chunks per second
and its ratio to the baseline, client-side p50 / p99 latency (from sending an encoded request
to its decoded answer; the clients encode before the clock starts, as a robot would on its own
computer) and the p99's ratio to a lone request's p50, the mean batch the server formed and
the server's median compute time per batch, and the malformed requests mixed in (each must get
a 4xx, every other request an action). With `--kill-replica`, one Ray Serve replica is killed
in the middle of the largest row: its requests must still be answered (the client retries).
Every run is bounded (fixed request counts, timeouts); the server is stopped at the end.
Writes a JSON and, with `--plot`, a figure.

`--image-cameras 1 3` serves, instead, a Diffusion Policy image checkpoint (random weights:
the real-robot encoder configuration, a ResNet18 per camera, at `--image-size`, and Push-T's
image U-Net, 512/1024/2048, or with `--image-unet small` the tests' small one, which shows
what frames, the protocol and the encoders cost) with 1, then 3, cameras, each sent as uint8
frames [n_obs_steps, C, H, W]; `--lerobot-cameras 1 3` does the same for a LeRobot
DiffusionPolicy folder of LeRobot's Push-T configuration as 0.4 defaults it (96 x 96 frames,
crop 84 x 84, horizon 16, one ResNet18 for the cameras, U-Net 512/1024/2048), served through
LeRobot's processors (`dpa serve --lerobot`; needs LeRobot). Their rows add the bytes of one
request. `--jpeg-quality Q` measures every row a second time on the same server with the
cameras sent as JPEG of quality Q (the client encodes them). The frames are smooth random
images (a camera's frames are smoother than noise, which JPEG cannot compress). Those policies
are built with the tests' helpers (tests/support), so these options run from the repository's
root as a module (`python -m scripts.load_test`).
"""
import argparse
import concurrent.futures
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

from diffusion_policy_accelerated.serving import protocol
from diffusion_policy_accelerated.serving.client import PolicyClient

IMAGE_SIZE = (3, 96, 96)
MALFORMED = [b"not safetensors", {"nan": True}, {"float64": True}, {"extra": True}]


def malformed_body(spec, k):
    kind = MALFORMED[k % len(MALFORMED)]
    if isinstance(kind, bytes):
        return kind
    inputs = {name: np.zeros(s.shape, np.float64 if "float64" in kind else s.dtype) for name, s in spec.inputs.items()}
    if "nan" in kind:
        floats = [v for v in inputs.values() if v.dtype.kind == "f"]  # not frames (uint8)
        if floats:
            floats[0].flat[0] = np.nan
        else:
            inputs = {name: value.astype(np.float64) for name, value in inputs.items()}
    if "extra" in kind:
        inputs["extra"] = np.zeros(1, np.float32)
    return protocol.encode_tensors(inputs)


def robot(url, requests, malformed_every, seed, start_at, jpeg_quality=None):
    """One client's closed loop, from time.time() == start_at, its cameras sent as JPEG of
    `jpeg_quality` where given: (latencies of its actions in s, batch rows, server compute ms,
    malformed sent, malformed rejected with 4xx, retries)."""
    rng = np.random.default_rng(seed)
    latencies, rows, compute, sent_bad, rejected = [], [], [], 0, 0
    with PolicyClient(url, timeout=30, deadline=120) as client:
        spec = client.spec
        if jpeg_quality:
            import torch

            # The clients share the server's machine: one thread each for their encoding, and
            # torch imported before the row starts.
            torch.set_num_threads(1)
            client.request_body(observation(spec, rng), None, jpeg_quality)
        time.sleep(max(0.0, start_at - time.time()))
        for k in range(requests):
            if malformed_every and k % malformed_every == malformed_every - 1:
                sent_bad += 1
                status, _ = client._call("POST", "/v1/act", malformed_body(spec, k), retry=False)
                rejected += 400 <= status < 500
                continue
            # Encoded before the clock starts: a robot encodes on its own computer, these on the server's.
            body = client.request_body(observation(spec, rng), None, jpeg_quality)
            start = time.perf_counter()
            client.act_body(body)
            latencies.append(time.perf_counter() - start)
            rows.append(client.last_timings.get("batch_rows", 1))
            compute.append(client.last_timings.get("compute_ms", float("nan")))
        return latencies, rows, compute, sent_bad, rejected, client.retries, time.time()


def is_camera(input_spec):
    """A camera input: uint8 frames [n_obs_steps, C, H, W] (what the client may send as JPEG)."""
    return input_spec.dtype == "uint8" and len(input_spec.shape) == 4


def observation(spec, rng):
    """Fresh inputs of the spec: smooth frames for camera inputs, uniform bytes for other uint8
    inputs, normal floats otherwise."""
    return {name: smooth_frames(s.shape, rng) if is_camera(s)
            else rng.integers(0, 256, s.shape, dtype=np.uint8) if s.dtype == "uint8"
            else rng.standard_normal(s.shape).astype(np.float32) for name, s in spec.inputs.items()}


def smooth_frames(shape, rng):
    """uint8 frames of `shape` [..., C, H, W]: a random 8 x 8 grid per channel, bilinearly
    stretched to H x W, with a little noise (+-4)."""
    *lead, h, w = shape
    grid = rng.uniform(0, 255, (*lead, 8, 8))
    ys, xs = np.linspace(0, 7, h), np.linspace(0, 7, w)
    y0, x0 = np.minimum(ys.astype(int), 6), np.minimum(xs.astype(int), 6)
    fy, fx = (ys - y0)[:, None], (xs - x0)[None, :]
    top = grid[..., y0, :][..., x0] * (1 - fx) + grid[..., y0, :][..., x0 + 1] * fx
    bottom = grid[..., y0 + 1, :][..., x0] * (1 - fx) + grid[..., y0 + 1, :][..., x0 + 1] * fx
    image = top * (1 - fy) + bottom * fy + rng.uniform(-4, 4, (*lead, h, w))
    return np.clip(image, 0, 255).round().astype(np.uint8)


def run_row(url, clients, requests, malformed_every, kill=None, jpeg_quality=None):
    # fork: this process has not initialised CUDA (the server is another process); the clients
    # use numpy and safetensors, and torch's CPU ops for JPEG.
    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(clients, mp_context=context) as pool:
        start_at = time.time() + 1.0 + 0.02 * clients  # every process started and connected by then
        futures = [pool.submit(robot, url, requests, malformed_every, 1000 * clients + i, start_at, jpeg_quality)
                   for i in range(clients)]
        if kill is not None:
            time.sleep(max(0.0, start_at - time.time()))
            kill()
        results = [f.result(timeout=600) for f in futures]
    wall = max(r[6] for r in results) - start_at
    latencies = np.array([x for r in results for x in r[0]])
    return {"clients": clients, "actions": len(latencies), "wall_s": wall, "chunks_per_s": len(latencies) / wall,
            "p50_ms": 1e3 * float(np.percentile(latencies, 50)), "p99_ms": 1e3 * float(np.percentile(latencies, 99)),
            "mean_batch": statistics.mean(x for r in results for x in r[1]),
            "compute_ms": statistics.median(x for r in results for x in r[2]),
            "malformed": sum(r[3] for r in results), "rejected": sum(r[4] for r in results),
            "retries": sum(r[5] for r in results)}


def start_server(args, port):
    command = [sys.executable, "-m", "diffusion_policy_accelerated.cli", "serve", "--port", str(port),
               "--dtype", args.dtype, "--scheduler", args.scheduler, "--max-batch", str(args.max_batch)]
    command += ["--steps", str(args.steps)] if args.steps else []
    command += ["--device", args.device] if args.device else []
    command += ["--checkpoint", args.checkpoint] if args.checkpoint else []
    command += ["--lerobot", args.lerobot] if args.lerobot else []
    command += ["--ray-replicas", str(args.ray_replicas)] if args.ray_replicas else []
    command += ["--instances", str(args.instances)] if args.instances else []
    print("starting:", " ".join(command[2:]), flush=True)
    # The server's warm-up progress goes to this terminal (its stderr).
    return subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def kill_a_replica():
    import ray

    ray.init(address="auto", log_to_driver=False)
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA::dpa#")]

    def kill():
        def later():
            time.sleep(2.0)
            ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
            print(f"  killed replica {names[0]}", flush=True)
        threading.Thread(target=later, daemon=True).start()
    return kill


def measure(args, label):
    """Start the server of `args`, run a row per client count (and, with args.jpeg_quality,
    each once more with the cameras sent as JPEG), stop it: [(spec, rows)], one per encoding."""
    server = start_server(args, args.port)
    url = f"http://127.0.0.1:{args.port}"
    runs = []
    try:
        with PolicyClient(url) as client:
            client.wait_ready(timeout=900)
            spec = client.spec
            cameras = any(is_camera(s) for s in spec.inputs.values())
            if args.jpeg_quality and not cameras:
                print("the policy takes no camera frames: --jpeg-quality has nothing to encode", flush=True)
            encodings = [None] + ([args.jpeg_quality] if args.jpeg_quality and cameras else [])
            sizes = [len(client.request_body(observation(spec, np.random.default_rng(0)), None, q)) for q in encodings]
        print(f"serving {spec.info.get('policy')} ({spec.info.get('scheduler', '').upper()}-{spec.info.get('steps')}, "
              f"{spec.info.get('dtype')} on {spec.info.get('device_name')}, torch {spec.info.get('torch')})",
              flush=True)
        for quality, request_bytes in zip(encodings, sizes):
            name = ", ".join(x for x in (label, quality and f"JPEG {quality}") if x)
            print(f"{name + ': ' if name else ''}{request_bytes} bytes per request (one observation)", flush=True)
            header = (f"{'clients':>7} {'actions':>7} {'chunks/s':>9} {'x seq':>6} {'p50 ms':>8} {'p99 ms':>8} "
                      f"{'p99/lone':>8} {'batch':>6} {'run ms':>7} {'bad 4xx':>8} {'retries':>7}")
            print(header, flush=True)
            rows = []
            for clients in args.clients:
                kill = kill_a_replica() if args.kill_replica and clients == max(args.clients) else None
                row = run_row(url, clients, args.requests, args.malformed_every, kill, quality)
                row.update(label=name, request_bytes=request_bytes, jpeg_quality=quality)
                base = rows[0] if rows else row
                row["x_sequential"] = row["chunks_per_s"] / base["chunks_per_s"]
                row["p99_over_lone"] = row["p99_ms"] / base["p50_ms"]
                rows.append(row)
                print(f"{clients:>7} {row['actions']:>7} {row['chunks_per_s']:>9.1f} {row['x_sequential']:>6.1f} "
                      f"{row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f} {row['p99_over_lone']:>8.2f} "
                      f"{row['mean_batch']:>6.1f} {row['compute_ms']:>7.2f} "
                      f"{row['rejected']:>4}/{row['malformed']:<3} {row['retries']:>7}", flush=True)
                if row["rejected"] != row["malformed"]:
                    raise SystemExit(f"{row['malformed'] - row['rejected']} malformed requests were not answered "
                                     f"with 4xx")
            runs.append((spec, rows))
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    return runs


def tests_helper(module):
    """A module of tests/support, which builds the image and LeRobot policies."""
    import importlib

    try:
        return importlib.import_module(f"tests.support.{module}")
    except ModuleNotFoundError as error:
        if not error.name.startswith("tests"):
            raise
        sys.exit("--image-cameras and --lerobot-cameras build their policies with the tests' helpers: run this from "
                 "the repository's root as a module, python -m scripts.load_test ...")


def image_checkpoint(folder, cameras, args):
    """A DiffusionUnetImagePolicy checkpoint with `cameras` cameras of args.image_size frames and
    random weights (the tests' helper), its path."""
    import pathlib

    from diffusion_policy_accelerated.model.configs import UNETS

    make_image_checkpoint = tests_helper("dp_image_checkpoint").make_image_checkpoint
    c, h, w = args.image_size or IMAGE_SIZE
    crop = (h - h // 8, w - w // 8)  # DP's real-robot ratio (216 x 288 of 240 x 320)
    unet = None if args.image_unet == "small" else {
        k: v for k, v in UNETS["image"].items() if k not in ("input_dim", "global_cond_dim")}
    path, *_ = make_image_checkpoint(pathlib.Path(folder), cameras, name=f"image_{cameras}.ckpt",
                                     scheduler=args.scheduler, steps=args.steps or 100, camera_shape=(c, h, w),
                                     resize_shape=None, crop_shape=crop, unet=unet)
    return str(path)


def lerobot_folder(folder, cameras):
    """A LeRobot DiffusionPolicy folder of Push-T's configuration with `cameras` cameras and
    random weights (the tests' helper), its path."""
    import pathlib

    try:
        import lerobot.policies.diffusion.modeling_diffusion  # noqa: F401
    except ImportError as error:
        sys.exit(f"--lerobot-cameras needs LeRobot ({error}): pip install lerobot")
    path = pathlib.Path(folder) / f"lerobot_{cameras}"
    return str(tests_helper("lerobot_folder").make_folder(path, cameras, small=False))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--requests", type=int, default=20, help="requests per client per row")
    parser.add_argument("--malformed-every", type=int, default=0, help="make every k-th request malformed")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--scheduler", default="ddpm", choices=["ddpm", "ddim"])
    parser.add_argument("--steps", type=int)
    parser.add_argument("--device")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--checkpoint", help="serve this Diffusion Policy checkpoint instead of the demo")
    what.add_argument("--lerobot", metavar="FOLDER", help="serve this LeRobot DiffusionPolicy folder instead")
    what.add_argument("--image-cameras", type=int, nargs="+", help="serve a random image checkpoint with this many "
                      "cameras (each count a run of its own), sent as uint8 frames")
    what.add_argument("--lerobot-cameras", type=int, nargs="+", help="serve a random LeRobot folder (Push-T's "
                      "configuration) with this many cameras (each count a run of its own)")
    parser.add_argument("--image-size", type=int, nargs=3, metavar=("C", "H", "W"),
                        help="--image-cameras: the checkpoint's frames (default 3 96 96)")
    parser.add_argument("--image-unet", choices=["pusht", "small"],
                        help="--image-cameras: the checkpoint's U-Net, Push-T's (default) or the tests' small one")
    parser.add_argument("--jpeg-quality", type=int, help="measure each row again with the cameras sent as JPEG of "
                        "this quality (1-100)")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--port", type=int, default=8790)
    parser.add_argument("--instances", type=int, help="dpa serve --instances: policy copies whose batches "
                        "run side by side (default: dpa serve's)")
    parser.add_argument("--ray-replicas", type=int, help="through Ray Serve with this many replicas")
    parser.add_argument("--kill-replica", action="store_true", help="kill one Ray Serve replica in the largest row")
    parser.add_argument("--json", default="load_test.json")
    parser.add_argument("--plot", help="write a figure of throughput and p99 against clients here")
    args = parser.parse_args(argv)
    if args.kill_replica and not args.ray_replicas:
        parser.error("--kill-replica needs --ray-replicas")
    for option in ("image_cameras", "lerobot_cameras"):
        if getattr(args, option) and min(getattr(args, option)) < 1:
            parser.error(f"--{option.replace('_', '-')} takes positive counts")
    if (args.image_size or args.image_unet) and not args.image_cameras:
        parser.error("--image-size and --image-unet are for --image-cameras")
    if args.jpeg_quality is not None and not 1 <= args.jpeg_quality <= 100:
        parser.error(f"--jpeg-quality must be 1-100, got {args.jpeg_quality}")

    runs = []
    if args.image_cameras or args.lerobot_cameras:
        import tempfile

        folder = tempfile.mkdtemp(prefix="dpa_load_test_")
        try:
            for cameras in args.image_cameras or args.lerobot_cameras:
                if args.image_cameras:
                    args.checkpoint = image_checkpoint(folder, cameras, args)
                else:
                    args.lerobot = lerobot_folder(folder, cameras)
                runs += measure(args, f"{cameras} camera{'s' if cameras > 1 else ''}")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        c, h, w = (args.image_size or IMAGE_SIZE) if args.image_cameras else (3, 96, 96)
        what = ("Diffusion Policy image policy (a ResNet18 per camera)" if args.image_cameras
                else "LeRobot DiffusionPolicy (one ResNet18 for the cameras)")
        print(f"\n{what} from uint8 frames ({c} x {h} x {w}), "
              f"{runs[0][0].info.get('device_name')}:")
        print(f"{'cameras':>18} {'bytes/req':>10} {'clients':>7} {'chunks/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
        for _, run_rows in runs:
            for row in run_rows:
                print(f"{row['label']:>18} {row['request_bytes']:>10} {row['clients']:>7} "
                      f"{row['chunks_per_s']:>9.1f} {row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f}")
    else:
        runs += measure(args, None)
    # The summary row set and the plot: the last run with raw frames.
    spec, rows = next(run for run in reversed(runs) if run[1][0]["jpeg_quality"] is None)
    with open(args.json, "w") as f:
        json.dump({"server": spec.to_json(), "ray_replicas": args.ray_replicas, "instances": args.instances,
                   "rows": rows, "runs": [{"server": sp.to_json(), "rows": rw} for sp, rw in runs]}, f, indent=1)
    print(f"wrote {args.json}")
    if args.plot:
        plot(rows, spec, args.plot)


def plot(rows, spec, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clients = [r["clients"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(clients, [r["chunks_per_s"] for r in rows], "o-", label="dpa serve")
    left.plot(clients, [rows[0]["chunks_per_s"]] * len(rows), "--", label="sequential batch-1 calls")
    left.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="action chunks / s")
    left.legend()
    right.plot(clients, [r["p50_ms"] for r in rows], "o-", label="p50")
    right.plot(clients, [r["p99_ms"] for r in rows], "s-", label="p99")
    right.axhline(3 * rows[0]["p50_ms"], linestyle="--", color="gray", label="3x a lone request")
    right.set(xscale="log", xlabel="concurrent clients", ylabel="latency per request (ms)")
    right.legend()
    info = spec.info
    fig.suptitle(f"dpa serve, {info.get('scheduler', '').upper()}-{info.get('steps')} {info.get('dtype')} on "
                 f"{info.get('device_name')} (torch {info.get('torch')}): {info.get('policy')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
