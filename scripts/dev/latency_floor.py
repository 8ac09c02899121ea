"""What one launch costs in the denoising loop's chain when it has almost no weights to
stream: a CUDA graph of N back-to-back dependent launches of one op on a tiny layer, replayed;
prints µs per launch (median over replays of CUDA-event timings). Our ops' tiny layers give the
fixed cost of one launch per layer (programmatic dependent launch, staging the input, the
split-K or cluster exchange, GroupNorm, the store); a PyTorch elementwise kernel gives a plain
kernel boundary for comparison. A step of the lowdim U-Net is ~30 such launches in a chain, so
30 x this cost bounds what one launch per layer can reach, whatever the weights' bytes.

    python scripts/dev/latency_floor.py [--launches 30] [--replays 50]
"""
import argparse
import statistics

import torch

from diffusion_policy_accelerated.kernels import ops


def time_chain(step, x, launches, replays):
    """µs per launch of `launches` dependent calls x = step(x), graphed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            y = x
            for _ in range(launches):
                y = step(y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(launches):
            y = step(y)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / launches)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=30)
    parser.add_argument("--replays", type=int, default=50)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for channels, length in ((32, 16), (256, 16), (256, 4)):
            x = torch.randn(1, channels, length, device="cuda", dtype=dtype)
            w = torch.randn(channels, channels, 5, device="cuda", dtype=dtype) * (5 * channels) ** -0.5
            ws = torch.randn(channels, channels, 1, device="cuda", dtype=dtype) * channels ** -0.5
            b, gamma = torch.zeros(channels, device="cuda", dtype=dtype), torch.ones(channels, device="cuda", dtype=dtype)
            film = torch.randn(1, 2 * channels, device="cuda", dtype=dtype)
            counters = torch.zeros(2 * channels, dtype=torch.int32, device="cuda")
            kb = w.numel() * w.element_size() / 1024
            cases = {
                "conv1d_gn_mish + FiLM": lambda y: ops.conv1d_gn_mish(
                    y, w, b, gamma, b, 8, 1e-5, film=film, counters=counters),
                "conv1d_gn_mish_shortcut": lambda y: ops.conv1d_gn_mish_shortcut(
                    y, w, b, gamma, b, 8, 1e-5, ws, b, film=film, counters=counters)[0],
                "conv1d 1x1": lambda y: ops.conv1d(y, ws, b, counters=counters),
                "torch add (PyTorch kernel)": lambda y: y + 1,
            }
            for name, step in cases.items():
                us = time_chain(step, x, args.launches, args.replays)
                rows.append((str(dtype).replace("torch.", ""), f"{channels}x{length}", f"{kb:.0f}", name, us))
                print(f"  {rows[-1][0]:9} {rows[-1][1]:7} {name:28} {us:6.2f} µs per launch", flush=True)
    print(f"\n{args.launches} dependent launches in one CUDA graph, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}")
    print("| dtype | channels x length | k=5 weights KB | op | µs per launch |")
    print("|---|---|---|---|---|")
    for dtype, shape, kb, name, us in rows:
        print(f"| {dtype} | {shape} | {kb} | {name} | {us:.2f} |")


if __name__ == "__main__":
    main()
