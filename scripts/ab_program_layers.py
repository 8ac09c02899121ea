"""Per-layer A/B of the single-kernel program against one launch per conv: for each layer
shape, N copies of the layer (distinct weights, so they stream from HBM) run either as N
launches in a CUDA graph or as one program of N stages, and the time per layer is printed.
Separates what a program stage costs from what the U-Net's mix of stages costs.

    python scripts/ab_program_layers.py [--dtype float32] [--copies 8]
"""
import argparse

import torch
from bench_conv_blocks import graph_time_ms

from diffusion_policy_accelerated import ops

LAYERS = [(1024, 1024, 4), (2048, 512, 4), (512, 512, 8), (256, 256, 16), (2048, 2048, 4)]


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

        def layer(i):
            return ops.conv1d_gn_mish(x, weights[i], vec, vec, vec, 8)

        program = ops._C.StreamProgram()
        program.add_input(x)
        program.begin()
        outs = [layer(i) for i in range(args.copies)]
        program.end()
        assert not program.failure, program.failure
        program.run()
        torch.cuda.synchronize()
        same = all(torch.equal(out, layer(i)) for i, out in enumerate(outs))
        # graph_time_ms: a graph of one call per weight copy, per call; the program is one call.
        ms_launch = graph_time_ms(layer, args.copies)
        ms_stage = graph_time_ms(lambda _: program.run(), 1) / args.copies
        mb = weights[0].nbytes / 1e6
        print(f"{cin:5}->{cout:<5} L{length:<3} {mb:6.2f} MB  per-conv {1e3 * ms_launch:7.2f} us/layer"
              f"  program {1e3 * ms_stage:7.2f} us/stage  {'same' if same else 'DIFFERENT'}", flush=True)


if __name__ == "__main__":
    main()
