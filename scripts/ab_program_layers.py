"""Per-layer A/B of the single-kernel program against one launch per conv: for each layer
shape, N copies of the layer (distinct weights, so they stream from HBM) run either as N
launches in a CUDA graph or as one program of N stages, and the time per layer is printed.
Separates what a program stage costs from what the U-Net's mix of stages costs.

    python scripts/ab_program_layers.py [--dtype float32] [--copies 8]
"""
import argparse
import statistics

import torch

from diffusion_policy_accelerated import ops

LAYERS = [(1024, 1024, 4), (2048, 512, 4), (512, 512, 8), (256, 256, 16), (2048, 2048, 4)]


def replay_ms(fn, replays=30):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--copies", type=int, default=8)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, args.dtype, flush=True)
    for cin, cout, length in LAYERS:
        torch.manual_seed(0)
        x = torch.randn(1, cin, length, device="cuda", dtype=dtype)
        weights = [(torch.randn(cout, cin, 5, device="cuda") / (5 * cin) ** 0.5).to(dtype)
                   for _ in range(args.copies)]
        vec = torch.randn(cout, device="cuda", dtype=dtype)

        def per_conv():
            return [ops.conv1d_gn_mish(x, w, vec, vec, vec, 8) for w in weights]

        program = ops._C.StreamProgram()
        program.add_input(x)
        program.begin()
        outs = per_conv()
        program.end()
        assert not program.failure, program.failure
        program.run()
        torch.cuda.synchronize()
        reference = per_conv()
        same = all(torch.equal(a, b) for a, b in zip(outs, reference))
        ms_launches = replay_ms(per_conv)
        ms_program = replay_ms(program.run)
        mb = weights[0].nbytes / 1e6
        n = args.copies
        print(f"{cin:5}->{cout:<5} L{length:<3} {mb:6.2f} MB  per-conv {1e3 * ms_launches / n:7.2f} us/layer"
              f"  program {1e3 * ms_program / n:7.2f} us/stage  {'same' if same else 'DIFFERENT'}", flush=True)


if __name__ == "__main__":
    main()
