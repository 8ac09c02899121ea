"""Where a U-Net forward's GPU time goes on the convs' im2col + cuBLAS route (batch x length
>= KernelConfig.gemm_min_positions), kernel by kernel, and the measurements behind two of
the route rules (csrc/conv1d/conv_route.h).

Default: the GPU time of one forward of the lowdim and image U-Nets per kernel name (torch
profiler, 5 forwards averaged, not graphed: FiLM's Linear and Mish kernels show here but are
hoisted out of GraphedSampler's loop). --by-shape adds the profiler's per-op table grouped
by input shapes. --side-stream instead times every residual block with a 1x1 shortcut
(ops.residual_block) and each U-Net's forward at batch 8 and 64, CUDA-graphed, with the
shortcut's GEMM on a side stream and without (kernel_config(side_stream=...)), interleaved
on, off, on. --taps-as-rows instead times every GroupNorm conv's GEMM at batch 8 and 64 as
im2col builds it against the GEMM of a taps-major weight (ops.taps_major) with x itself, in
both orientations, with results in x's dtype and in fp32. --splits instead times the GEMMs
of LeRobot's U-Net's GroupNorm convs at long horizons whole and cut into 2 to 32 slices of
the reduction (one strided-batched GEMM; the partial sums' addition is the epilogue's): in
fp32 beside the count gemm_splits takes (KernelConfig.fp32_gemm_max_splits); with --dtype
bfloat16 the taps-major GEMMs half precision takes, which the ops never cut. --narrow instead
times each fp32 GroupNorm conv of LeRobot's U-Net that narrow_gemm.cu takes at long horizons
(ops.conv1d_gn_mish: im2col, GEMM and epilogue, CUDA-graphed) with that GEMM and with
cuBLAS's (kernel_config(narrow_gemm=...)), interleaved narrow, cuBLAS, narrow.

    python scripts/dev/profile_gemm_route.py [--batch 64] [--dtype bfloat16] [--by-shape]
    python scripts/dev/profile_gemm_route.py --side-stream
    python scripts/dev/profile_gemm_route.py --taps-as-rows
    python scripts/dev/profile_gemm_route.py --splits [--dtype bfloat16]
    python scripts/dev/profile_gemm_route.py --narrow
"""
import argparse
from collections import defaultdict

import torch

from diffusion_policy_accelerated import ConditionalUnet1D
from diffusion_policy_accelerated.kernels import ops
from diffusion_policy_accelerated.model.configs import HORIZON, UNETS, distinct_block_shapes
from diffusion_policy_accelerated.model.unet import conv1d_block_shapes
from diffusion_policy_accelerated.tools.profiling import graph_time_ms, weight_copies
from diffusion_policy_accelerated.kernels.config import kernel_config
from diffusion_policy_accelerated.kernels.routing import conv_route

WIDTHS = {name: UNETS[name]["down_dims"] for name in ("lowdim", "image")}


def taps_as_rows_table():
    """A k-tap conv's GEMM as im2col builds it, [M, cin*k] x [cin*k, N], against the taps as
    rows of the weight, [k*M, cin] x [cin, N] (each output position then adds up its k taps'
    rows, shifted, in the epilogue), and that GEMM with the input channels-last, [N, cin] x
    [cin, k*M]; bf16 with bf16 and with fp32 results."""
    torch.backends.cuda.matmul.allow_tf32 = False
    for dtype in (torch.bfloat16, torch.float32):
        outs = (dtype,) if dtype == torch.float32 else (dtype, torch.float32)
        print(f"== {dtype}: us per GEMM: im2col [M,K*cin]x[K*cin,N] | taps as rows [K*M,cin]x[cin,N]"
              f" | channels-last [N,cin]x[cin,K*M]; " + " / ".join(f"{str(o)[6:]} out" for o in outs))
        for unet, dims in WIDTHS.items():
            for cin, cout, length, k, _ in distinct_block_shapes(dims):
                for batch in (8, 64):
                    M, N = cout, batch * length
                    copies = weight_copies(M * cin * k * dtype.itemsize)
                    ws = [torch.randn(M, cin * k, device="cuda", dtype=dtype) for _ in range(copies)]
                    cols = torch.randn(cin * k, N, device="cuda", dtype=dtype)
                    x = torch.randn(cin, N, device="cuda", dtype=dtype)
                    x_last = torch.randn(N, cin, device="cuda", dtype=dtype)
                    row = [graph_time_ms(lambda i: torch.mm(ws[i], cols), copies)]
                    for out in outs:
                        kw = {} if out == dtype else dict(out_dtype=out)
                        row.append(graph_time_ms(lambda i: torch.mm(ws[i].view(k * M, cin), x, **kw), copies))
                        row.append(graph_time_ms(lambda i: torch.mm(x_last, ws[i].view(k * M, cin).t(), **kw),
                                                 copies))
                    print(f"{unet[:8]:8} B{batch:<3} {cin:5}->{cout:<5} L{length:<3} {row[0] * 1e3:7.1f} | "
                          + " | ".join(f"{a * 1e3:7.1f} {b * 1e3:7.1f}" for a, b in zip(row[1::2], row[2::2])),
                          flush=True)


def lerobot_block_calls(horizon):
    """(in_channels, out_channels, length) of every Conv1dBlock call of LeRobot's default U-Net
    at this horizon, in call order."""
    with torch.device("meta"):
        model = ConditionalUnet1D(2, global_cond_dim=32, down_dims=UNETS["lerobot"]["down_dims"], kernel_size=5,
                                  cond_predict_scale=True)
    return [call[1:4] for call in conv1d_block_shapes(model, horizon)]


def splits_table(dtype, horizons=(32, 64, 128), batches=(1, 8), counts=(2, 4, 8, 16, 32)):
    """Each GroupNorm conv shape of LeRobot's U-Net, its GEMM whole against [S, ...] x [S, ...]
    over S slices of the reduction: in fp32 [M, cin*k] x [cin*k, N] and the S the ops take
    for it; in half precision the taps-major form the ops take, [k*M, cin] x x[cin, N] with
    fp32 results (the ops cut those never). Also the sum over one forward's convs."""
    torch.backends.cuda.matmul.allow_tf32 = False
    fp32 = dtype == torch.float32
    kw = {} if fp32 else dict(out_dtype=torch.float32)
    print(f"== {str(dtype)[6:]} us per GEMM: whole | " + " ".join(f"{s:>6}" for s in counts) + " slices"
          + (" | the ops' count" if fp32 else ""))
    for horizon in horizons:
        calls = lerobot_block_calls(horizon)
        for batch in batches:
            total = [0.0] * (1 + len(counts))
            for cin, cout, length, k, _ in distinct_block_shapes(UNETS["lerobot"]["down_dims"], horizon):
                (M, red), N = ((cout, cin * k) if fp32 else (cout * k, cin)), batch * length
                copies = weight_copies(M * red * dtype.itemsize)
                ws = [torch.randn(M, red, device="cuda", dtype=dtype) for _ in range(copies)]
                cols = torch.randn(red, N, device="cuda", dtype=dtype)
                row = [graph_time_ms(lambda i: torch.mm(ws[i], cols, **kw), copies)]
                for s in counts:
                    d = red // s
                    row.append(graph_time_ms(lambda i: torch.bmm(ws[i].unflatten(1, (s, d)).transpose(0, 1),
                                                                 cols.unflatten(0, (s, d)), **kw), copies)
                               if red % s == 0 and d >= 64 else float("nan"))
                n = calls.count((cin, cout, length))
                for j, v in enumerate(row):
                    total[j] += n * (v if v == v else row[0])
                with kernel_config(gemm_min_positions=1, narrow_gemm=False):
                    taken = conv_route(torch.nn.Conv1d(cin, cout, k, padding=k // 2, device="meta"), batch, length,
                                       dtype, "cuda").cublas_splits
                taken = f" | {taken}" if fp32 else ""
                print(f"T{horizon:<4} B{batch:<2} {cin:5}->{cout:<5} L{length:<4} x{n} {row[0] * 1e3:7.1f} | "
                      + " ".join(f"{v * 1e3:6.1f}" for v in row[1:]) + taken, flush=True)
            print(f"T{horizon:<4} B{batch:<2} one forward's GroupNorm convs (whole where a count cannot cut): "
                  + " | ".join(f"{v * 1e3:.1f}" for v in total), flush=True)


def narrow_table(horizons=(32, 64, 128), batches=(1, 2, 4)):
    """µs per fp32 GroupNorm conv op of LeRobot's U-Net, narrow GEMM / cuBLAS / narrow GEMM,
    where the narrow GEMM takes it; and the sums over one forward's such convs."""
    torch.backends.cuda.matmul.allow_tf32 = False
    print("== float32 us per conv1d_gn_mish (im2col + GEMM + epilogue): narrow / cuBLAS / narrow | slices")
    for horizon in horizons:
        calls = lerobot_block_calls(horizon)
        for batch in batches:
            total = [0.0, 0.0, 0.0]
            for cin, cout, length, k, groups in distinct_block_shapes(UNETS["lerobot"]["down_dims"], horizon):
                route = conv_route(torch.nn.Conv1d(cin, cout, k, padding=k // 2, device="meta"), batch, length,
                                   torch.float32, "cuda")
                splits = route.narrow_splits
                if not splits:  # not on the GEMM route by its size, or not the narrow GEMM's
                    continue
                copies = weight_copies(cout * cin * k * 4)
                ws = [torch.randn(cout, cin, k, device="cuda") * (cin * k) ** -0.5 for _ in range(copies)]
                x = torch.randn(batch, cin, length, device="cuda")
                b, gamma, beta = (torch.randn(cout, device="cuda") for _ in range(3))
                counters = torch.zeros(cout, dtype=torch.int32, device="cuda")
                row = []
                for narrow in (True, False, True):
                    with kernel_config(narrow_gemm=narrow):
                        row.append(graph_time_ms(lambda i: ops.conv1d_gn_mish(x, ws[i], b, gamma, beta, groups,
                                                                              counters=counters), copies))
                n = calls.count((cin, cout, length))
                total = [t + n * v for t, v in zip(total, row)]
                print(f"T{horizon:<4} B{batch:<2} {cin:5}->{cout:<5} L{length:<4} x{n} "
                      + " / ".join(f"{v * 1e3:6.1f}" for v in row) + f" | {splits}", flush=True)
            if total[0]:
                print(f"T{horizon:<4} B{batch:<2} one forward's such convs: "
                      + " / ".join(f"{v * 1e3:.1f}" for v in total), flush=True)


def residual_block_args(cin, cout, k, groups, dtype):
    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=dtype) * scale

    return dict(weight=randn(cout, cin, k, scale=(cin * k) ** -0.5), bias=randn(cout), gn_weight=randn(cout),
                gn_bias=randn(cout), weight2=randn(cout, cout, k, scale=(cout * k) ** -0.5), bias2=randn(cout),
                gn_weight2=randn(cout), gn_bias2=randn(cout), num_groups=groups, eps=1e-5,
                shortcut_weight=randn(cout, cin, 1, scale=cin ** -0.5), shortcut_bias=randn(cout))


def side_stream_table():
    """us per call with the shortcut's GEMM on a side stream and on the caller's stream."""
    torch.backends.cuda.matmul.allow_tf32 = False
    for dtype in (torch.bfloat16, torch.float32):
        print(f"== {dtype}: us per call, side stream on / off / on")
        for unet, dims in WIDTHS.items():
            for cin, cout, length, k, groups in distinct_block_shapes(dims):
                if cin == cout:
                    continue
                weight_bytes = (cin * cout * (k + 1) + cout * cout * k) * dtype.itemsize
                copies = weight_copies(weight_bytes)
                blocks = [residual_block_args(cin, cout, k, groups, dtype) for _ in range(copies)]
                for batch in (8, 64):
                    x = torch.randn(batch, cin, length, device="cuda", dtype=dtype)
                    row = []
                    for enabled in (True, False, True):
                        with kernel_config(side_stream=enabled):
                            row.append(graph_time_ms(lambda i: ops.residual_block(x, **blocks[i]), copies))
                    print(f"{unet[:8]:8} B{batch:<3} {cin:5}->{cout:<5} L{length:<3}"
                          + " / ".join(f"{1e3 * t:7.1f}" for t in row), flush=True)
            for batch in (8, 64):
                model = ConditionalUnet1D(**UNETS[unet]).cuda().eval().to(dtype)
                sample = torch.randn(batch, HORIZON, 2, device="cuda", dtype=dtype)
                cond = torch.randn(batch, UNETS[unet]["global_cond_dim"], device="cuda", dtype=dtype)
                timestep = torch.full((batch,), 10, device="cuda")
                row = []
                with torch.inference_mode():
                    for enabled in (True, False, True):
                        with kernel_config(side_stream=enabled):
                            row.append(graph_time_ms(lambda i: model(sample, timestep, global_cond=cond), 1,
                                                     replays=100))
                print(f"{unet[:8]:8} B{batch:<3} whole forward   "
                      + " / ".join(f"{1e3 * t:7.1f}" for t in row), flush=True)


def kernel_breakdown(batch, dtype, by_shape, forwards=5):
    for name in ("lowdim", "image"):
        unet = ConditionalUnet1D(**UNETS[name]).cuda().eval().to(dtype)
        sample = torch.randn(batch, HORIZON, 2, device="cuda", dtype=dtype)
        cond = torch.randn(batch, UNETS[name]["global_cond_dim"], device="cuda", dtype=dtype)
        timestep = torch.full((batch,), 10, device="cuda")
        activities = [torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
        with torch.inference_mode():
            for _ in range(3):
                unet(sample, timestep, global_cond=cond)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=activities, record_shapes=by_shape) as prof:
                for _ in range(forwards):
                    unet(sample, timestep, global_cond=cond)
                torch.cuda.synchronize()
        by_kernel = defaultdict(lambda: [0.0, 0])
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                by_kernel[event.name[:90]][0] += event.device_time_total / forwards
                by_kernel[event.name[:90]][1] += 1
        total = sum(us for us, _ in by_kernel.values())
        print(f"== {name} {str(dtype)[6:]} B{batch} forward: {total:.1f} us of kernels")
        for kernel, (us, calls) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:14]:
            print(f"{us:8.1f} us {calls // forwards:4d}x  {kernel}")
        if by_shape:
            print(prof.key_averages(group_by_input_shape=True).table(
                sort_by="device_time_total", row_limit=22, max_name_column_width=30,
                max_shapes_column_width=70))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                        help="default: bfloat16, and float32 with --splits")
    parser.add_argument("--by-shape", action="store_true", help="also the per-op table by input shapes")
    parser.add_argument("--side-stream", action="store_true",
                        help="time the shortcut blocks and forwards with and without the side stream instead")
    parser.add_argument("--taps-as-rows", action="store_true",
                        help="time the GroupNorm convs' GEMMs with the taps as weight rows instead")
    parser.add_argument("--splits", action="store_true",
                        help="time LeRobot's fp32 GEMMs whole and cut into slices of the reduction instead")
    parser.add_argument("--narrow", action="store_true",
                        help="time LeRobot's fp32 GroupNorm convs with the narrow GEMM and cuBLAS's instead")
    args = parser.parse_args()
    if args.narrow:
        narrow_table()
    elif args.splits:
        splits_table(getattr(torch, args.dtype or "float32"))
    elif args.taps_as_rows:
        taps_as_rows_table()
    elif args.side_stream:
        side_stream_table()
    else:
        kernel_breakdown(args.batch, getattr(torch, args.dtype or "bfloat16"), args.by_shape)


if __name__ == "__main__":
    main()
