"""Profiles one Diffusion Policy action chunk (the whole denoising loop) and says where its time goes.

  --mode eager   plain PyTorch U-Net + diffusers' step math (DenoiseSchedule.reference_step),
                 step by step: what Diffusion Policy does
  --mode graph   the same loop captured whole as one CUDA graph (CUDA only)
  --mode ours    GraphedSampler: fused ops, hoisted FiLM, the loop as one CUDA graph (on a
                 CPU, or with --no-graph, the same hoisted loop run eagerly)

Prints, and writes to --out as {mode}_report.txt: the measured peaks; the coarse breakdown of
one action (U-Net, scheduler steps, everything else; synchronised wall time; a CUDA graph is
one row); the top ops (CPU) or kernels (CUDA) with the layers that ran them; on CUDA the GPU
time split (compute / memcpy+memset / idle); the per-op roofline table; the autograd
profiler's per-op table; a cProfile of one U-Net forward. Long kernel names are shortened in
the tables (tools/profiling.py, short_name). Also writes {mode}_trace.json (chrome://tracing
or ui.perfetto.dev; every module call is a range named like down.0.res0.block0),
{mode}_top.csv (the top table, whole names), {mode}_roofline.csv and .png, {mode}_forward.prof, and
{mode}_forward.png where gprof2dot and Graphviz are installed.

    python scripts/profile_action.py --mode {eager,graph,ours} [--device cuda|cpu] [--unet lowdim|image]
                              [--batch N] [--horizon N] [--dtype float32|float16|bfloat16] [--steps N] [--out DIR] [--no-graph]
"""
import argparse
from pathlib import Path

import torch
from benchmark import graphed_pytorch_loop

from diffusion_policy_accelerated import ConditionalUnet1D, DenoiseSchedule
from diffusion_policy_accelerated.model.configs import HORIZON, SCHEDULER_CONFIG, UNETS
from diffusion_policy_accelerated.tools.profiling import (
    BREAKDOWN_COLUMNS, TOP_COLUMNS, Phases, analyse, call_graph_png, cprofile_call, format_gpu_split,
    format_table, measure_peaks, plot_roofline, record_trace, time_breakdown, write_csv)
from diffusion_policy_accelerated.sampling.sampler import GraphedSampler

ROWS_SHOWN = 25


def make_action(mode, unet, schedule, data, mask, global_cond, noise, use_graph=True):
    """(action(phases) running one action chunk with its parts named, a note on the parts)."""
    if mode == "eager":
        def action(phases):
            trajectory = noise[0]
            for i, t in enumerate(schedule.timesteps):
                trajectory = torch.where(mask, data, trajectory)
                with phases("U-Net"):
                    model_output = unet(trajectory, t, global_cond=global_cond)
                with phases("scheduler step"):
                    trajectory = schedule.reference_step(
                        model_output, i, trajectory, noise[i + 1] if schedule.needs_noise(i) else None)
            return torch.where(mask, data, trajectory)
        return action, "everything else: inpainting, indexing the noise, the Python loop"
    graph_note = ("a CUDA graph replays the whole loop (every U-Net and scheduler step) in one "
                  "launch: its parts cannot be timed apart")
    if mode == "graph":
        replay = graphed_pytorch_loop(unet, schedule, data, mask, global_cond, noise)

        def action(phases):
            with phases("graph replay"):
                replay()
        return action, graph_note
    sampler = GraphedSampler(unet, schedule, use_cuda_graph=None if use_graph else False)

    def action(phases):
        with phases("sampler call"):
            return sampler(data, mask, global_cond=global_cond, noise=noise)
    if sampler.use_cuda_graph:
        return action, graph_note + "; the sampler call also copies the inputs in and the output out"
    return action, "without a CUDA graph the sampler runs its hoisted loop eagerly: one row, not split"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", required=True, choices=["eager", "graph", "ours"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--unet", default="lowdim", choices=list(UNETS))
    parser.add_argument("--down-dims", type=int, nargs="+",
                        help="override the U-Net's widths (a narrower model for quick looks)")
    parser.add_argument("--no-graph", action="store_true",
                        help="ours: run the sampler's loop without a CUDA graph, so that the trace "
                             "has the ops that launch its kernels (per-op roofline of the fused ops)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--horizon", type=int, default=HORIZON)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                        help="the U-Net's and the data's dtype")
    parser.add_argument("--steps", type=int, help="DDPM steps (default 100 on CUDA, 10 on a CPU)")
    parser.add_argument("--reps", type=int, default=3, help="actions averaged in the breakdown")
    parser.add_argument("--out", default="profile_out", help="folder for the files")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.mode == "graph" and device.type != "cuda":
        parser.error("--mode graph captures a CUDA graph: it needs --device cuda")
    if args.no_graph and args.mode != "ours":
        parser.error("--no-graph applies to --mode ours")
    # The roofline's fp32 ceiling is measured without TF32, so the ops must run without it.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    steps = args.steps or (100 if device.type == "cuda" else 10)
    config = dict(UNETS[args.unet], **({"down_dims": args.down_dims} if args.down_dims else {}))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    prefix = args.mode + ("_nograph" if args.no_graph else "")

    def output(kind):
        return out / f"{prefix}_{kind}"

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    unet = ConditionalUnet1D(**config).to(device, dtype).eval()
    unet.use_fused_ops = args.mode == "ours"
    schedule = DenoiseSchedule.from_diffusers(SCHEDULER_CONFIG, steps, kind="ddpm").to(device)
    generator = torch.Generator(device).manual_seed(0)
    data = torch.randn(args.batch, args.horizon, config["input_dim"], device=device, generator=generator).to(dtype)
    mask = torch.zeros_like(data, dtype=torch.bool)
    global_cond = torch.randn(args.batch, config["global_cond_dim"], device=device, generator=generator).to(dtype)
    noise = torch.randn((steps + 1,) + tuple(data.shape), device=device, generator=generator).to(dtype)

    report = []

    def emit(text):
        print(text, flush=True)
        report.append(text)

    peaks = measure_peaks(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    emit(f"{name}  torch {torch.__version__}  mode {args.mode}  U-Net {args.unet} "
         f"{config['down_dims']}  batch {args.batch}  DDPM-{steps}  {args.dtype}, TF32 off\n"
         f"peaks (measured now): {peaks.describe()}")
    with torch.inference_mode():
        action, note = make_action(args.mode, unet, schedule, data, mask, global_cond, noise,
                                   use_graph=not args.no_graph)
        action(Phases(device, timed=False))  # warm-up; graph modes capture here
        breakdown = time_breakdown(action, device, reps=args.reps)
        emit(f"\none action, mean of {args.reps} (synchronised around every part)\n"
             + format_table(breakdown, BREAKDOWN_COLUMNS) + f"\n({note})")

        trace, prof = record_trace(lambda: action(Phases(device, timed=False)), unet, device,
                                   output("trace.json"))
        analysis = analyse(trace, peaks)
        timed = "kernels and copies" if analysis.on_gpu else "CPU ops"
        write_csv(analysis.top, output("top.csv"), TOP_COLUMNS)
        emit(f"\ntop {timed} of one action (trace: {output('trace.json')}; all rows, whole names: "
             f"{output('top.csv')})" + ("" if analysis.on_gpu else "; outermost ops, each with the ops it calls")
             + "\n" + format_table(analysis.top, TOP_COLUMNS, limit=ROWS_SHOWN))
        if analysis.gpu_split is not None:
            emit(format_gpu_split(analysis.gpu_split))
        write_csv(analysis.roofline, output("roofline.csv"))
        plot_roofline(analysis.roofline, peaks, output("roofline.png"),
                      f"{args.mode}, {args.unet} U-Net, batch {args.batch}, {name}")
        emit(f"\nper-op roofline: {analysis.roofline_share:.1%} of the {timed}' time is in ops with a "
             f"formula (all rows: {output('roofline.csv')}, plot: {output('roofline.png')})\n"
             + format_table(analysis.roofline, limit=ROWS_SHOWN))
        if analysis.on_gpu and not analysis.roofline:
            emit("(no rows: a CUDA graph replay launches kernels without the ops that queued them, "
                 "so there are no shapes; see --mode eager, or --mode ours --no-graph)")
        sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        emit(f"\nautograd profiler, per op (sorted by {sort_by})\n"
             + prof.key_averages().table(sort_by=sort_by, row_limit=ROWS_SHOWN))

        forward_cprofile = cprofile_call(
            lambda: unet(data, schedule.timesteps[0], global_cond=global_cond), output("forward.prof"))
        emit(f"\ncProfile of one U-Net forward ({output('forward.prof')}), top 20 cumulative\n"
             f"{forward_cprofile}" + call_graph_png(output("forward.prof"), output("forward.png")))
    output("report.txt").write_text("\n".join(report) + "\n")
    return analysis


if __name__ == "__main__":
    main()
