"""The `dpa` command (also `python -m diffusion_policy_accelerated`): `dpa serve` (a policy over
HTTP, see serving/server.py), `dpa demo` (plain PyTorch against this package) and `dpa routes`
(which route each conv of a U-Net forward takes, and why)."""
import argparse
import asyncio
import os
import sys

# `dpa serve`'s exit status when its drain timeout cut off requests (they were answered 503);
# 0: every request it took was answered, 1: it failed, 2: a usage error.
EXIT_CUT_OFF = 3


def _source_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--checkpoint", metavar="CKPT", help="a Diffusion Policy workspace checkpoint (.ckpt; a "
                      "pickle, so only one you trust): lowdim policies take raw observations, image policies "
                      "their encoder's features")
    what.add_argument("--lerobot", metavar="FOLDER", help="a LeRobot DiffusionPolicy folder (config.json, "
                      "model.safetensors): LeRobot's normalised global condition in, normalised actions out; a "
                      "folder with cameras (and its processors): camera frames and state in, unnormalised actions "
                      "out, with LeRobot installed")
    parser.add_argument("--lerobot-global-cond", action="store_true", help="serve a --lerobot folder with cameras "
                        "from LeRobot's normalised global condition (the client runs LeRobot's encoder and "
                        "preprocessor) instead of camera frames; normalised actions out")
    parser.add_argument("--device", help="default: cuda where there is one, else cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                        help="the U-Net's weights (inputs and actions stay float32)")
    parser.add_argument("--steps", type=int, help="denoising steps (default: the policy's; the demo's 100 "
                        "DDPM / 16 DDIM)")
    parser.add_argument("--scheduler", default="ddpm", choices=["ddpm", "ddim"], help="the demo model's")
    parser.add_argument("--max-batch", type=int, default=64, help="observations per sampler call; graphs "
                        "are captured for powers of two up to it")
    parser.add_argument("--parallel-window", type=int, metavar="STEPS", help="sample by Picard iteration over "
                        "this many steps at once (fewer dependent steps where the GPU has room: half precision at "
                        "small batches; default: the sequential loop)")
    parser.add_argument("--parallel-tolerance", type=float, default=0.1, help="the parallel sampler's tolerance, "
                        "in units of each step's noise standard deviation (default 0.1)")
    parser.add_argument("--no-check-finite", dest="check_finite", action="store_false", help="turn off the "
                        "non-finite guard, which answers 422 where a request's inputs or its actions hold NaN or Inf "
                        "(and does not send such actions); it costs no device synchronisation, only a look at the "
                        "inputs and at the actions' host copy")


def source_from_args(args):
    from .serving.policies import PolicySource

    kind, path = (("checkpoint", args.checkpoint) if args.checkpoint else
                  ("lerobot", args.lerobot) if args.lerobot else ("demo", None))
    return PolicySource(kind=kind, path=path, device=args.device, dtype=args.dtype, steps=args.steps,
                        scheduler=args.scheduler, parallel_window=args.parallel_window,
                        parallel_tolerance=args.parallel_tolerance, check_finite=args.check_finite,
                        lerobot_global_cond=args.lerobot_global_cond)


def _serve_defaults() -> dict:
    """The defaults of the options only `dpa serve` itself has (not Ray Serve), by argument."""
    from .serving.batcher import DRAIN_TIMEOUT_S
    from .serving.connections import IDLE_TIMEOUT_S, MAX_CONNECTIONS, READ_TIMEOUT_S

    return dict(drain_timeout=DRAIN_TIMEOUT_S, read_timeout=READ_TIMEOUT_S, idle_timeout=IDLE_TIMEOUT_S,
                max_connections=MAX_CONNECTIONS)


def serve_main(argv) -> int:
    parser = argparse.ArgumentParser(
        prog="dpa serve", description="Serve a policy over HTTP, batching concurrent requests (default: the "
        "demo's lowdim U-Net with random weights). Protocol: POST /v1/act with a safetensors body; "
        "GET /v1/spec, /health, /metrics.")
    _source_arguments(parser)
    defaults = _serve_defaults()
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to accept other machines (default: "
                        "this one only)")
    parser.add_argument("--port", type=int, default=8700)
    parser.add_argument("--max-wait-ms", type=float, default=2.0, help="how long an idle server waits for "
                        "more requests to share a batch")
    parser.add_argument("--max-queue", type=int, help="observations (on Ray Serve: requests) that may "
                        "wait before requests get 503 (default 4 batches; on Ray Serve unbounded)")
    parser.add_argument("--instances", type=int, metavar="N", help="N copies of the policy on the device, each "
                        "with its own graphs and stream, so that a batch can start while another runs (shorter "
                        "waits for requests that miss a batch; N times the memory; default 2 on CUDA, 1 on CPU)")
    parser.add_argument("--ray-replicas", type=int, metavar="N", help="serve through Ray Serve with N replicas "
                        "(one GPU each where the cluster has GPUs) on the Ray cluster of RAY_ADDRESS, or a local one")
    parser.add_argument("--drain-timeout", type=float, metavar="SECONDS", help="on SIGTERM/SIGINT, how long queued "
                        "and running requests are answered before the rest get 503 (default "
                        f"{defaults['drain_timeout']:g}); the exit status is 0 when all were answered, "
                        f"{EXIT_CUT_OFF} when some were cut off (stderr says how many)")
    parser.add_argument("--read-timeout", type=float, metavar="SECONDS", help="a request (headers and body) must "
                        "arrive within this long of its first byte, else 408 and its connection is closed (default "
                        f"{defaults['read_timeout']:g})")
    parser.add_argument("--idle-timeout", type=float, metavar="SECONDS", help="a connection with no request for "
                        f"this long is closed (default {defaults['idle_timeout']:g})")
    parser.add_argument("--max-connections", type=int, metavar="N", help="open connections at most; one more is "
                        f"answered 503 with Retry-After and closed (default {defaults['max_connections']})")
    args = parser.parse_args(argv)
    if args.ray_replicas is not None and args.ray_replicas < 1:
        parser.error(f"--ray-replicas must be a positive integer, got {args.ray_replicas}")
    if args.max_queue is not None and args.max_queue < 1:
        parser.error(f"--max-queue must be a positive integer, got {args.max_queue}")
    if args.instances is not None and args.instances < 1:
        parser.error(f"--instances must be a positive integer, got {args.instances}")
    if args.instances is not None and args.ray_replicas:
        parser.error("--instances is for dpa serve itself; on Ray Serve, add replicas (--ray-replicas)")
    for name in defaults:
        value, flag = getattr(args, name), "--" + name.replace("_", "-")
        if value is not None and args.ray_replicas:
            parser.error(f"{flag} is for dpa serve itself, not Ray Serve (--ray-replicas)")
        if value is not None and not (value >= 0 if name == "drain_timeout" else value > 0):
            parser.error(f"{flag} must be {'>= 0' if name == 'drain_timeout' else 'positive'}, got {value:g}")
    try:
        source_from_args(args)  # its settings checked before anything loads
    except ValueError as error:
        parser.error(str(error))
    if args.ray_replicas:
        return _serve_on_ray(args)
    from .serving.policies import load_policy, policy_device
    from .serving.lerobot_policy import LeRobotMissing
    from .serving.server import PolicyServer, serve

    source = source_from_args(args)
    # Two on CUDA: with 64 closed-loop clients (H100, bf16 demo, DDPM-100) p99 went from 4.60x
    # a lone request's p50 to 2.50x and throughput from 25.6x to 30.4x sequential calls, a
    # lone client alike; a CPU's cores are busy with one batch already.
    count = args.instances or (2 if policy_device(source).type == "cuda" else 1)
    # Each instance draws its own noise for rows without a seed.
    try:
        instances = [load_policy(source, max_rows=args.max_batch, seed=i) for i in range(count)]
    except LeRobotMissing as error:
        print(f"dpa serve: {error}", file=sys.stderr, flush=True)
        return 1
    options = {name: default if getattr(args, name) is None else getattr(args, name)
               for name, default in defaults.items()}
    server = PolicyServer(instances, host=args.host, port=args.port, max_wait_ms=args.max_wait_ms,
                          max_queue_rows=args.max_queue, **options)
    asyncio.run(serve(server))
    if not server.batcher.drained:
        print(f"dpa serve: the drain timeout ({server.drain_timeout:g} s) cut off {server.batcher.cut_off} "
              f"queued or running requests (answered 503); exit status {EXIT_CUT_OFF}", file=sys.stderr, flush=True)
        # A batch may still run on the device; its thread would keep the interpreter from exiting.
        os._exit(EXIT_CUT_OFF)
    return 0


def _serve_on_ray(args) -> int:
    import signal
    import threading

    import ray
    from ray import serve

    from .serving.ray_serve import build_app

    ray.init(address=os.environ.get("RAY_ADDRESS"))
    gpus = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
    serve.start(http_options={"host": args.host, "port": args.port})
    print(f"dpa serve: deploying {args.ray_replicas} replicas ({gpus} GPU each) on Ray Serve; each warms up "
          f"before it takes traffic...", file=sys.stderr, flush=True)
    serve.run(build_app(source_from_args(args), num_replicas=args.ray_replicas, num_gpus=gpus,
                        max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
                        max_queued_requests=args.max_queue or -1), name="dpa", route_prefix="/")
    print(f"dpa serve: ready on http://{args.host}:{args.port} through Ray Serve", file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    return 0


def routes_main(argv) -> int:
    import torch

    from .model.configs import HORIZON, UNETS
    from .model.routes import explain
    from .model.unet import ConditionalUnet1D

    parser = argparse.ArgumentParser(prog="dpa routes", description="Which route each conv of a U-Net "
                                     "forward takes, and why (csrc/conv1d/conv_route.h's rules).")
    parser.add_argument("--unet", default="lowdim", choices=sorted(UNETS))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--horizon", type=int, default=HORIZON)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda where there is a GPU, else cpu; "
                        "cuda without a GPU answers for an H100 (the GPU the defaults were measured on)")
    args = parser.parse_args(argv)
    if any(b < 1 for b in args.batch) or args.horizon < 1:
        parser.error("--batch and --horizon must be positive")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    where = f"{device} ({torch.cuda.get_device_name()})" if device == "cuda" and torch.cuda.is_available() else (
        "cuda (no GPU here: an H100's limits assumed)" if device == "cuda" else "cpu")
    with torch.device("meta"):
        unet = ConditionalUnet1D(**UNETS[args.unet])
    for batch in args.batch:
        print(f"{args.unet} U-Net, batch {batch}, horizon {args.horizon}, {args.dtype} on {where}:")
        for r in explain(unet, batch, args.horizon, getattr(torch, args.dtype), device):
            print(f"  {r.module:34s} {r.shape:42s} {r.route:30s} {r.why}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        return serve_main(argv[1:])
    if argv[:1] == ["demo"]:
        from .tools.demo import main as demo_main

        demo_main(argv[1:])
        return 0
    if argv[:1] == ["routes"]:
        return routes_main(argv[1:])
    print("usage: dpa {serve,demo,routes} [options]   (dpa serve --help, ...)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
