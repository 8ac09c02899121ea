"""A/B of conv1d_gn_mish_shortcut (a residual block's first conv and its 1x1 shortcut in one
launch) against the two ops launched one after the other, batch 1, on a CUDA GPU:

  1. per shape, each variant alone in a CUDA graph of calls on rotating weight copies (so the
     weights stream from HBM): paired, block + shortcut, block alone, shortcut alone (µs);
  2. the whole 100-step DDPM loop (GraphedSampler) with the U-Net switched between pairing
     and separate launches in one process, two replays each (ms per action).

The second decides: (1) runs the same kernel back to back, warm, which the loop never does.

    python scripts/ab_shortcut.py
"""
import torch
from bench_conv_blocks import graph_time_ms, weight_copies
from benchmark import SCHEDULER_CONFIG, UNETS, median_ms
from diffusers import DDPMScheduler

from diffusion_policy_accelerated import ConditionalUnet1D, DenoiseSchedule, ops
from diffusion_policy_accelerated.model import Conv1dBlock
from diffusion_policy_accelerated.sampler import GraphedSampler

# (C_in, C_out, L) of the residual blocks that change width: lowdim, then image U-Net.
SHAPES = [(2, 256, 16), (256, 512, 8), (512, 1024, 4), (2048, 512, 4), (1024, 256, 8),
          (10, 512, 16), (512, 1024, 8), (1024, 2048, 4), (4096, 1024, 4), (2048, 512, 8)]
DTYPES = (torch.float32, torch.bfloat16)


def per_shape():
    print("C_in C_out L dtype | paired us | block + shortcut us | block alone | shortcut alone", flush=True)
    for dtype in DTYPES:
        for cin, cout, length in SHAPES:
            copies = weight_copies(cout * cin * 6 * dtype.itemsize)
            rand = lambda *s, scale=0.05: (torch.randn(*s, device="cuda") * scale).to(dtype)
            ws = [rand(cout, cin, 5) for _ in range(copies)]
            shortcuts = [rand(cout, cin, 1) for _ in range(copies)]
            x, b, g, film = rand(1, cin, length, scale=1), rand(cout), rand(cout), rand(1, 2 * cout)
            counters = torch.zeros(2 * cout, dtype=torch.int32, device="cuda")
            shortcut_counters = torch.zeros(cout, dtype=torch.int32, device="cuda")
            block = lambda i: ops.conv1d_gn_mish(x, ws[i], b, g, b, 8, film=film, counters=counters)
            shortcut = lambda i: ops.conv1d(x, shortcuts[i], b, counters=shortcut_counters)
            times = [1e3 * graph_time_ms(fn, copies) for fn in (
                lambda i: ops.conv1d_gn_mish_shortcut(x, ws[i], b, g, b, 8, 1e-5, shortcuts[i], b,
                                                      film=film, counters=counters),
                lambda i: (block(i), shortcut(i)), block, shortcut)]
            print(f"{cin} {cout} {length} {str(dtype)[6:]} | " + " | ".join(f"{t:.1f}" for t in times), flush=True)


def whole_loop():
    pairing = Conv1dBlock._can_fuse_shortcut
    schedule = DenoiseSchedule.from_diffusers(DDPMScheduler(**SCHEDULER_CONFIG), 100).to("cuda")
    try:
        for name in ("lowdim", "image"):
            torch.manual_seed(0)
            unet = ConditionalUnet1D(**UNETS[name]).cuda().eval()
            for dtype in DTYPES:
                unet = unet.to(dtype)
                data = torch.randn(1, 16, 2, device="cuda", dtype=dtype)
                mask = torch.zeros_like(data, dtype=torch.bool)
                cond = torch.randn(1, UNETS[name]["global_cond_dim"], device="cuda", dtype=dtype)
                results = {True: [], False: []}
                for _ in range(2):
                    for paired in (True, False):
                        Conv1dBlock._can_fuse_shortcut = pairing if paired else (lambda *args: False)
                        sampler = GraphedSampler(unet, schedule)
                        sampler(data, mask, global_cond=cond)
                        results[paired].append(median_ms(lambda: sampler(data, mask, global_cond=cond)))
                print(f"{name} {str(dtype)[6:]} DDPM-100 ms/action: paired "
                      f"{' / '.join(f'{v:.2f}' for v in results[True])}, separate "
                      f"{' / '.join(f'{v:.2f}' for v in results[False])}", flush=True)
    finally:
        Conv1dBlock._can_fuse_shortcut = pairing


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    per_shape()
    whole_loop()
