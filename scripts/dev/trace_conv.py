"""Where one launch of a fused Conv1dBlock (conv1d_gn_mish) spends its time, for both of its
streaming kernels: one thread-block cluster per GroupNorm group, and split-K blocks with a
finishing block (kernel_config(clusters=False)). A CUDA graph of back-to-back launches
(one weight copy each, as in bench_conv_blocks.py) is replayed with every block stamping the
global timer at points of its work (ops._C.start_launch_trace); for each launch but the
first this prints, in µs from the moment the previous launch's last block was done: when its
blocks started (median and last: negative where programmatic dependent launch let them
start, and request their first weights, before that launch ended), had waited for that
launch (median), had staged their input (median), had streamed
their weights (median and last); then, last block: cluster kernel, when its cluster's sums
were visible ("arrived"), added up ("summed"), its share's moments taken ("moments") and the
group's statistics known ("stats"); split-K kernel, when the partial sums were counted
("arrived"), finishing had started ("moments" column), the splits were added up and the
statistics known; and when the launch's last block was done ("done": the launch's time).
Medians over launches and replays.

--upsample C,L traces Diffusion Policy's Upsample1d instead (ConvTranspose1d(C, C, 4, 2, 1) at
input length L, one kernel: split-K blocks whose finishing block folds the taps into
positions).

    python scripts/dev/trace_conv.py [--shape 256,256,16 1024,1024,4] [--dtype float32] [--batch 1]
    python scripts/dev/trace_conv.py --upsample 256,8 512,4 [--dtype bfloat16]
"""
import argparse
import statistics

import torch

from diffusion_policy_accelerated.kernels import ops
from diffusion_policy_accelerated.kernels.config import kernel_config

START, WAITED, STAGED, COMPUTED, ARRIVED, FINISHING, SUMMED, NORMALIZED, FINISHED = range(9)
COLUMNS = ["started", "last in", "waited", "staged", "streamed", "last", "arrived", "summed", "moments",
           "stats", "done"]


def launch_rows(trace, blocks):
    """Per launch after the first: µs after the previous launch's last stamp."""
    rows, offset, previous = [], 0, None
    for n in blocks:
        t = trace[offset:offset + n].double()
        offset += n
        end = t[t > 0].max()
        if previous is not None:
            def rel(event, reduce):
                values = t[t[:, event] > 0, event] - previous
                if values.numel() == 0:
                    return float("nan")
                return float(values.median() if reduce == "median" else values.max()) / 1e3
            rows.append([rel(START, "median"), rel(START, "max"), rel(WAITED, "median"),
                         rel(STAGED, "median"), rel(COMPUTED, "median"),
                         rel(COMPUTED, "max"), rel(ARRIVED, "max"), rel(SUMMED, "max"), rel(FINISHING, "max"),
                         rel(NORMALIZED, "max"), float(end - previous) / 1e3])
        previous = end
    return rows


def trace_layer(cin, cout, length, batch, dtype, launches=8, replays=5, upsample=False):
    shape = (cin, cout, 4) if upsample else (cout, cin, 5)
    ws = [torch.randn(*shape, device="cuda", dtype=dtype) * (cin * 5) ** -0.5 for _ in range(launches)]
    x = torch.randn(batch, cin, length, device="cuda", dtype=dtype)
    b, gamma, beta = (torch.randn(cout, device="cuda", dtype=dtype) for _ in range(3))
    counters = torch.zeros(cout, dtype=torch.int32, device="cuda")
    buffer = torch.zeros(launches * 1024, 9, dtype=torch.int64, device="cuda")
    if upsample:
        call = lambda w: ops.conv1d(x, w, b, 2, 1, transposed=True, counters=counters)
    else:
        call = lambda w: ops.conv1d_gn_mish(x, w, b, gamma, beta, 8, counters=counters)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for w in ws:  # warm-up outside the graph: planning, attributes
            call(w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    ops._C.start_launch_trace(buffer)
    try:
        with torch.cuda.graph(graph, stream=stream):
            for w in ws:
                call(w)
    finally:
        blocks = ops._C.stop_launch_trace()
    rows = []
    for _ in range(replays):
        buffer.zero_()
        graph.replay()
        torch.cuda.synchronize()
        rows += launch_rows(buffer.cpu(), blocks)
    return blocks[0], [statistics.median(r[i] for r in rows) for i in range(len(COLUMNS))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", default=["256,256,16", "512,512,8", "512,512,4", "1024,1024,4"],
                        help="in_channels,out_channels,length (kernel size 5, 8 groups)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--upsample", nargs="+", default=[], help="channels,input length")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, batch {args.batch}: "
          "µs after the previous launch's last block, medians")
    print(f"{'layer':16} {'MB':>6} {'kernel':9} {'blocks':>6} " + " ".join(f"{c:>8}" for c in COLUMNS))
    for shape in args.upsample:
        channels, length = map(int, shape.split(","))
        blocks, values = trace_layer(channels, channels, length, args.batch, dtype, upsample=True)
        print(f"up {channels} L{length:<9} {channels * channels * 4 * dtype.itemsize / 1e6:6.2f} {'split-K':9} "
              f"{blocks:6} " + " ".join(f"{v:8.2f}" for v in values), flush=True)
    if args.upsample:
        return
    for shape in args.shape:
        cin, cout, length = map(int, shape.split(","))
        mb = cin * cout * 5 * dtype.itemsize / 1e6
        for clusters in (True, False):
            # Half precision without clusters would take the GEMM route from 8 positions
            # (KernelConfig.portable_half_gemm_min_positions): kept on the split-K kernel here.
            with kernel_config(clusters=clusters, portable_half_gemm_min_positions=2 ** 62):
                blocks, values = trace_layer(cin, cout, length, args.batch, dtype)
            print(f"{cin}->{cout} L{length:<6} {mb:6.2f} {'cluster' if clusters else 'split-K':9} {blocks:6} "
                  + " ".join(f"{v:8.2f}" for v in values), flush=True)


if __name__ == "__main__":
    main()
