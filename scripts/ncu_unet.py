"""Checks the profiler's byte formulas against the hardware: Nsight Compute's DRAM bytes and
duration for every streaming conv kernel of one fused U-Net forward, next to the bytes that
`diffusion_policy_accelerated.tools.profiling` counts for the same op.

    python scripts/ncu_unet.py [--unet lowdim|image] [--batch 1] [--csv FILE]

Runs itself under `ncu` (a warm-up forward, then the profiled one) and prints one row per
kernel: the op's shapes, formula MB, ncu DRAM MB (read + write), their ratio, ncu's
duration and the roofline fraction (bytes / duration over the copy bandwidth) from each
byte count. ncu flushes the caches before each kernel (its default), so every kernel reads
its weights from DRAM, as in the U-Net where they never fit L2 together.
"""
import argparse
import csv
import io
import os
import subprocess
import sys

import torch
from diffusion_policy_accelerated import ConditionalUnet1D
from diffusion_policy_accelerated.kernels import ops
from diffusion_policy_accelerated.model.configs import HORIZON, UNETS
from diffusion_policy_accelerated.tools.costs import conv1d_gn_mish_cost, conv1d_gn_mish_shortcut_cost, fused_conv1d_cost
from diffusion_policy_accelerated.tools.profiling import copy_bandwidth_gbs

METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum")


def forward_and_record(unet_name, batch):
    """Runs one fused forward (after a warm-up one) and returns, in launch order, each fused
    op's (description, formula bytes)."""
    torch.manual_seed(0)
    config = UNETS[unet_name]
    unet = ConditionalUnet1D(**config).cuda().eval()
    sample = torch.randn(batch, HORIZON, config["input_dim"], device="cuda")
    cond = torch.randn(batch, config["global_cond_dim"], device="cuda")
    calls = []
    fused, plain, paired = ops.conv1d_gn_mish, ops.conv1d, ops.conv1d_gn_mish_shortcut

    def recording_fused(x, weight, bias, gn_weight, gn_bias, num_groups, eps=1e-5, **kw):
        _, nbytes = conv1d_gn_mish_cost(tuple(x.shape), tuple(weight.shape), x.dtype, bias=bias is not None,
                                        affine=gn_weight is not None,
                                        film=None if kw.get("film") is None else tuple(kw["film"].shape),
                                        residual=kw.get("residual") is not None)
        calls.append((f"conv1d_gn_mish {x.shape[1]}->{weight.shape[0]} L{x.shape[2]}", nbytes))
        return fused(x, weight, bias, gn_weight, gn_bias, num_groups, eps, **kw)

    def recording_plain(x, weight, bias=None, stride=1, padding=0, **kw):
        transposed = kw.get("transposed", False)
        _, nbytes = fused_conv1d_cost(tuple(x.shape), tuple(weight.shape), x.dtype, bias=bias is not None,
                                      stride=stride, padding=padding, transposed=transposed,
                                      residual=kw.get("residual") is not None)
        kind = "conv_transpose1d" if transposed else "conv1d"
        out_channels = weight.shape[1] if transposed else weight.shape[0]
        calls.append((f"{kind} {x.shape[1]}->{out_channels} k{weight.shape[2]} L{x.shape[2]}", nbytes))
        return plain(x, weight, bias, stride, padding, **kw)

    def recording_paired(x, weight, bias, gn_weight, gn_bias, num_groups, eps, shortcut_weight,
                         shortcut_bias=None, **kw):
        _, nbytes = conv1d_gn_mish_shortcut_cost(
            tuple(x.shape), tuple(weight.shape), tuple(shortcut_weight.shape), x.dtype, bias=bias is not None,
            affine=gn_weight is not None, shortcut_bias=shortcut_bias is not None,
            film=None if kw.get("film") is None else tuple(kw["film"].shape))
        calls.append((f"conv1d_gn_mish_shortcut {x.shape[1]}->{weight.shape[0]} L{x.shape[2]}", nbytes))
        return paired(x, weight, bias, gn_weight, gn_bias, num_groups, eps, shortcut_weight, shortcut_bias, **kw)

    ops.conv1d_gn_mish, ops.conv1d, ops.conv1d_gn_mish_shortcut = recording_fused, recording_plain, recording_paired
    with torch.inference_mode():
        for _ in range(2):
            calls.clear()
            unet(sample, 0, global_cond=cond)
    torch.cuda.synchronize()
    ops.conv1d_gn_mish, ops.conv1d, ops.conv1d_gn_mish_shortcut = fused, plain, paired
    return calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unet", default="lowdim", choices=list(UNETS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--csv", default=None, help="also write the table here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    calls = forward_and_record(args.unet, args.batch)
    if args.child:
        return
    bandwidth = copy_bandwidth_gbs()
    command = ["ncu", "--csv", "--print-units", "base", "--metrics", ",".join(METRICS),
               "--kernel-name", "regex:stream_conv", "--launch-skip", str(len(calls)),
               "--launch-count", str(len(calls)), sys.executable, os.path.abspath(__file__),
               "--unet", args.unet, "--batch", str(args.batch), "--child"]
    print(f"{torch.cuda.get_device_name()}  {args.unet} U-Net, batch {args.batch}, fp32; "
          f"copy bandwidth {bandwidth:.0f} GB/s; profiling {len(calls)} kernels with ncu...", flush=True)
    result = subprocess.run(command, capture_output=True, text=True)
    table = result.stdout[result.stdout.find('"ID"'):] if '"ID"' in result.stdout else ""
    kernels = {}
    for row in csv.DictReader(io.StringIO(table)):
        kernels.setdefault(int(row["ID"]), {})[row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
    if len(kernels) != len(calls):
        sys.exit(f"ncu profiled {len(kernels)} kernels, expected {len(calls)}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    rows = []
    for (name, formula), (_, metrics) in zip(calls, sorted(kernels.items())):
        seconds = metrics["gpu__time_duration.sum"] * 1e-9
        measured = metrics["dram__bytes_read.sum"] + metrics["dram__bytes_write.sum"]
        rows.append(dict(op=name, formula_mb=formula / 1e6, ncu_dram_mb=measured / 1e6,
                         ratio=measured / formula, ncu_us=seconds * 1e6,
                         fraction_formula=formula / seconds / (bandwidth * 1e9),
                         fraction_ncu=measured / seconds / (bandwidth * 1e9)))
    header = f"{'op':42} {'formula MB':>10} {'ncu MB':>8} {'ncu/formula':>11} {'ncu us':>7} {'frac (formula)':>14} {'frac (ncu)':>10}"
    print(header)
    for r in rows:
        print(f"{r['op']:42} {r['formula_mb']:10.3f} {r['ncu_dram_mb']:8.3f} {r['ratio']:11.3f} {r['ncu_us']:7.1f} "
              f"{r['fraction_formula']:14.3f} {r['fraction_ncu']:10.3f}")
    big = [r for r in rows if r["formula_mb"] >= 1.0]
    worst = max(big, key=lambda r: abs(r["ratio"] - 1.0))
    total_formula, total_ncu = sum(r["formula_mb"] for r in rows), sum(r["ncu_dram_mb"] for r in rows)
    print(f"all kernels: formula {total_formula:.1f} MB, ncu {total_ncu:.1f} MB ({total_ncu / total_formula:.3f}); "
          f"kernels >= 1 MB: largest deviation {abs(worst['ratio'] - 1.0):.1%} ({worst['op']})")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
