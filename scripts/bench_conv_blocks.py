"""Times every Conv1dBlock shape of Diffusion Policy's U-Nets: PyTorch (cuDNN conv + GroupNorm
+ Mish, TF32 off) vs our fused op, both replayed from CUDA graphs.

Each graph holds one call per copy of the weights, with enough copies that they overflow L2,
so every call streams its weights from HBM as it does inside the real U-Net. Prints a table
(median of CUDA-event timings) and writes JSON.

    python scripts/bench_conv_blocks.py [--batch 1 64] [--dtype float32] [--json out.json]
    python scripts/bench_conv_blocks.py --sweep-paths --batch 1 2 4 8 16 32 64
    python scripts/bench_conv_blocks.py --split-k --batch 1

--sweep-paths also times both CUDA routes of the op (the weight-streaming kernel and im2col
+ GEMM, the latter with contiguous and with taps-major weights, ops.taps_major) at every
size: where they cross sets KernelConfig.gemm_min_positions and gemm_min_work. --split-k also times the
streaming route's split-K GroupNorm kernel (kernel_config(clusters=False)) next to the
default, one thread-block cluster per group. --no-pdl launches without programmatic
dependent launch.
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F

from diffusion_policy_accelerated.kernels import ops
from diffusion_policy_accelerated.model.configs import UNETS, distinct_block_shapes
from diffusion_policy_accelerated.tools.profiling import copy_bandwidth_gbs, graph_time_ms, weight_copies
from diffusion_policy_accelerated.kernels.config import kernel_config

# The U-Nets' labels in the table, with their widths (LeRobot's has the image U-Net's).
WIDTHS = {f"{name} [{','.join(map(str, UNETS[name]['down_dims']))}]": UNETS[name]["down_dims"]
          for name in ("lowdim", "image")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--sweep-paths", action="store_true",
                        help="also time the streaming kernel and the GEMM route separately")
    parser.add_argument("--no-pdl", action="store_true",
                        help="launch without programmatic dependent launch (to measure what it buys)")
    parser.add_argument("--split-k", action="store_true",
                        help="also time the split-K kernel instead of one cluster per group")
    args = parser.parse_args()
    with kernel_config(pdl=not args.no_pdl):
        return table(args)


def table(args):
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  dtype {args.dtype}  "
          f"TF32 off  PDL {'off' if args.no_pdl else 'on'}  copy bandwidth {bandwidth:.0f} GB/s", flush=True)
    rows = []
    header = (f"{'U-Net':22} {'B':>3} {'C_in':>5} {'C_out':>5} {'L':>3} {'weights MB':>10} "
              f"{'torch us':>9} {'ours us':>8} {'speed-up':>8} {'ours GB/s':>9} {'% copy BW':>9}"
              + (f" {'stream us':>9} {'gemm us':>8} {'gemm taps-major us':>18}" if args.sweep_paths else "")
              + (f" {'split-K us':>10}" if args.split_k else ""))
    print(header)
    for unet, dims in WIDTHS.items():
        for cin, cout, length, k, groups in distinct_block_shapes(dims):
            for batch in args.batch:
                weight_bytes = cout * cin * k * dtype.itemsize
                copies = weight_copies(weight_bytes)
                ws = [torch.randn(cout, cin, k, device="cuda", dtype=dtype) * (cin * k) ** -0.5
                      for _ in range(copies)]
                x = torch.randn(batch, cin, length, device="cuda", dtype=dtype)
                b, gamma, beta = (torch.randn(cout, device="cuda", dtype=dtype) for _ in range(3))
                torch_us = 1e3 * graph_time_ms(lambda i: F.mish(F.group_norm(
                    F.conv1d(x, ws[i], b, padding=k // 2), groups, gamma, beta)), copies)
                # Counters owned by the caller, as ConditionalUnet1D passes them: no memset
                # between the calls, so consecutive kernels overlap as they do in the U-Net.
                counters = torch.zeros(cout, dtype=torch.int32, device="cuda")
                ours_us = 1e3 * graph_time_ms(lambda i: ops.conv1d_gn_mish(
                    x, ws[i], b, gamma, beta, groups, counters=counters), copies)
                gbs = weight_bytes / (ours_us * 1e-6) / 1e9
                paths = {}
                variants = []
                if args.sweep_paths:
                    taps_major = [ops.taps_major(w) for w in ws]
                    variants += [("stream", dict(gemm_min_positions=1 << 62, gemm_min_work=1 << 62), ws),
                                 ("gemm", dict(gemm_min_positions=1), ws),
                                 ("gemm_taps_major", dict(gemm_min_positions=1), taps_major)]
                if args.split_k:
                    variants.append(("split_k", dict(clusters=False), ws))
                for name, config, weights in variants:
                    with kernel_config(**config):
                        paths[f"{name}_us"] = 1e3 * graph_time_ms(lambda i: ops.conv1d_gn_mish(
                            x, weights[i], b, gamma, beta, groups, counters=counters), copies)
                row = dict(unet=unet, batch=batch, in_channels=cin, out_channels=cout, length=length,
                           kernel_size=k, groups=groups, weight_mb=weight_bytes / 1e6,
                           torch_us=torch_us, ours_us=ours_us, speedup=torch_us / ours_us,
                           ours_weight_gbs=gbs, copy_bandwidth_gbs=bandwidth, **paths)
                rows.append(row)
                print(f"{unet:22} {batch:3} {cin:5} {cout:5} {length:3} {row['weight_mb']:10.2f} "
                      f"{torch_us:9.1f} {ours_us:8.1f} {row['speedup']:7.2f}x {gbs:9.0f} "
                      f"{100 * gbs / bandwidth:8.0f}%"
                      + "".join(f" {v:9.1f}" for v in paths.values()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           dtype=args.dtype, rows=rows), f, indent=1)
    slower = [r for r in rows if r["batch"] == 1 and r["speedup"] <= 1]
    print(f"batch 1: ours faster on {sum(r['batch'] == 1 for r in rows) - len(slower)} of "
          f"{sum(r['batch'] == 1 for r in rows)} shapes", flush=True)


if __name__ == "__main__":
    sys.exit(main())
