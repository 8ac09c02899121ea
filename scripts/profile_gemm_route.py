"""Where a U-Net forward's GPU time goes on the convs' im2col + cuBLAS route (batch x length
>= 32), kernel by kernel, and whether splitting its GEMMs over K by hand would pay.

Default: the GPU time of one forward of the lowdim and image U-Nets per kernel name (torch
profiler, 5 forwards averaged, not graphed: FiLM's Linear and Mish kernels show here but are
hoisted out of GraphedSampler's loop). --by-shape adds the profiler's per-op table grouped
by input shapes. --split-k instead times every GroupNorm conv's GEMM at batch 8 and 64 in
one cuBLAS call against a strided batched GEMM over S slices of K with fp32 partials (S =
2..16), each in a CUDA graph of enough weight copies to overflow L2. --side-stream instead
times every residual block with a 1x1 shortcut (ops.residual_block) and each U-Net's forward
at batch 8 and 64, CUDA-graphed, with the shortcut's GEMM on a side stream and without
(ops.set_side_stream), interleaved on, off, on. --libraries instead times every GroupNorm
conv's GEMM of the lowdim U-Net at batch 64 in bf16 through cuBLAS (what the ops call),
cuBLASLt and torch.compile's max-autotune (Triton templates and ATen, the fastest kept;
autotuning takes ~10-40 s a shape). --taps-as-rows instead times every GroupNorm conv's GEMM
at batch 8 and 64 as im2col builds it against the GEMM of a taps-major weight
(ops.taps_major) with x itself, in both orientations, with results in x's dtype and in
fp32.

    python scripts/profile_gemm_route.py [--batch 64] [--dtype bfloat16] [--by-shape]
    python scripts/profile_gemm_route.py --split-k
    python scripts/profile_gemm_route.py --side-stream
    python scripts/profile_gemm_route.py --libraries
    python scripts/profile_gemm_route.py --taps-as-rows
"""
import argparse
from collections import defaultdict

import torch
from bench_conv_blocks import UNETS as WIDTHS, distinct_block_shapes, graph_time_ms, weight_copies
from benchmark import HORIZON, UNETS

from diffusion_policy_accelerated import ConditionalUnet1D, ops

SPLITS = (2, 4, 8, 16)


def split_k_table():
    torch.backends.cuda.matmul.allow_tf32 = False
    for dtype in (torch.bfloat16, torch.float32):
        print(f"== {dtype}: GEMM [M, K] x [K, N] us, whole and split S ways; "
              f"sum8 = adding up 8 fp32 partials; err = S=4 against float64")
        print(f"{'unet':8} {'B':>3} {'M':>5} {'N':>5} {'K':>6} {'mm':>7}"
              + "".join(f" {'S=' + str(s):>7}" for s in SPLITS) + f" {'sum8':>7}")
        for unet, dims in WIDTHS.items():
            for cin, cout, length, k, _ in distinct_block_shapes(dims):
                for batch in (8, 64):
                    M, K, N = cout, cin * k, batch * length
                    copies = weight_copies(M * K * dtype.itemsize)
                    ws = [torch.randn(M, K, device="cuda", dtype=dtype) for _ in range(copies)]
                    cols = torch.randn(K, N, device="cuda", dtype=dtype)
                    fp32_out = {} if dtype == torch.float32 else dict(out_dtype=torch.float32)

                    def split_gemm(w, s):
                        return torch.bmm(w.as_strided((s, M, K // s), (K // s, K, 1)),
                                         cols.view(s, K // s, N), **fp32_out)

                    row = [graph_time_ms(lambda i: torch.mm(ws[i], cols), copies)]
                    row += [graph_time_ms(lambda i: split_gemm(ws[i], s), copies) if K % (8 * s) == 0
                            else float("nan") for s in SPLITS]
                    partials = torch.randn(8, M, N, device="cuda")
                    row.append(graph_time_ms(lambda i: partials.sum(0), 4))
                    err = ""
                    if K % 32 == 0:
                        ref = torch.mm(ws[0].double(), cols.double())
                        got = split_gemm(ws[0], 4).sum(0).double()
                        err = f"  err {((got - ref).abs().max() / ref.abs().max()).item():.1e}"
                    print(f"{unet[:8]:8} {batch:3} {M:5} {N:5} {K:6}"
                          + "".join(f" {1e3 * t:7.1f}" for t in row) + err, flush=True)


def gemm_libraries_table(batch=64, dtype=torch.bfloat16):
    import torch._dynamo
    import torch._inductor.config

    torch.backends.cuda.matmul.allow_tf32 = False
    torch._inductor.config.max_autotune_gemm_backends = "TRITON,ATEN"
    print(f"== {dtype}, batch {batch}: GEMM [M, K] x [K, N] us: cuBLAS / cuBLASLt / max-autotune")
    library = torch.backends.cuda.preferred_blas_library()
    try:
        for cin, cout, length, k, _ in distinct_block_shapes(WIDTHS["lowdim [256,512,1024]"]):
            M, K, N = cout, cin * k, batch * length
            copies = weight_copies(M * K * dtype.itemsize)
            ws = [torch.randn(M, K, device="cuda", dtype=dtype) for _ in range(copies)]
            cols = torch.randn(K, N, device="cuda", dtype=dtype)
            row = []
            for blas in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(blas)
                row.append(graph_time_ms(lambda i: torch.mm(ws[i], cols), copies))
            torch.backends.cuda.preferred_blas_library(library)
            torch._dynamo.reset()  # one compiled GEMM per shape, never a recompilation
            tuned = torch.compile(lambda w, c: torch.mm(w, c), mode="max-autotune-no-cudagraphs", dynamic=False)
            tuned(ws[0], cols)
            row.append(graph_time_ms(lambda i: tuned(ws[i], cols), copies))
            print(f"{M:5} {N:5} {K:6}  " + " / ".join(f"{1e3 * t:6.1f}" for t in row), flush=True)
    finally:
        torch.backends.cuda.preferred_blas_library(library)


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
    previous = ops.set_side_stream(True)
    try:
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
                            ops.set_side_stream(enabled)
                            row.append(graph_time_ms(lambda i: ops.residual_block(x, **blocks[i]), copies))
                        print(f"{unet[:8]:8} B{batch:<3} {cin:5}->{cout:<5} L{length:<3}"
                              + " / ".join(f"{1e3 * t:7.1f}" for t in row), flush=True)
                for batch in (8, 64):
                    model = ConditionalUnet1D(**UNETS[unet.split()[0]]).cuda().eval().to(dtype)
                    sample = torch.randn(batch, HORIZON, 2, device="cuda", dtype=dtype)
                    cond = torch.randn(batch, UNETS[unet.split()[0]]["global_cond_dim"], device="cuda", dtype=dtype)
                    timestep = torch.full((batch,), 10, device="cuda")
                    row = []
                    with torch.inference_mode():
                        for enabled in (True, False, True):
                            ops.set_side_stream(enabled)
                            row.append(graph_time_ms(lambda i: model(sample, timestep, global_cond=cond), 1,
                                                     replays=100))
                    print(f"{unet[:8]:8} B{batch:<3} whole forward   "
                          + " / ".join(f"{1e3 * t:7.1f}" for t in row), flush=True)
    finally:
        ops.set_side_stream(previous)


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
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--by-shape", action="store_true", help="also the per-op table by input shapes")
    parser.add_argument("--split-k", action="store_true", help="time the GEMMs split over K instead")
    parser.add_argument("--side-stream", action="store_true",
                        help="time the shortcut blocks and forwards with and without the side stream instead")
    parser.add_argument("--libraries", action="store_true",
                        help="time the lowdim GEMMs through cuBLAS, cuBLASLt and max-autotune instead")
    parser.add_argument("--taps-as-rows", action="store_true",
                        help="time the GroupNorm convs' GEMMs with the taps as weight rows instead")
    args = parser.parse_args()
    if args.taps_as_rows:
        taps_as_rows_table()
    elif args.libraries:
        gemm_libraries_table()
    elif args.side_stream:
        side_stream_table()
    elif args.split_k:
        split_k_table()
    else:
        kernel_breakdown(args.batch, getattr(torch, args.dtype), args.by_shape)


if __name__ == "__main__":
    main()
