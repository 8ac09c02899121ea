"""The U-Nets' resampling convs, ConvTranspose1d (C -> C, k4, stride 2, pad 1: upsampling) and
Conv1d (C -> C, k3, stride 2, pad 1: downsampling), on the streaming route against the GEMM
route, each forced, over batch x positions (upsampling: input length; downsampling: output
length); µs per call, from CUDA graphs of enough weight copies to overflow L2 (as
bench_conv_blocks.py). KernelConfig.transposed_gemm_min_work comes from this table.

    python scripts/dev/resample_routes.py
"""
import torch

from diffusion_policy_accelerated.kernels import ops
from diffusion_policy_accelerated.tools.profiling import graph_time_ms, weight_copies
from diffusion_policy_accelerated.kernels.config import kernel_config

print(torch.cuda.get_device_name(), torch.__version__)
print(f"{'kind':5} {'dtype':9} {'C':>5} {'B':>3} {'L':>4} {'pos':>4} {'stream':>8} {'gemm':>8}")
for kind in ("up", "down"):
    k = 4 if kind == "up" else 3
    for dtype in (torch.float32, torch.bfloat16):
        for c in (256, 512, 1024, 2048):
            for batch, length in ((1, 4), (1, 8), (1, 16), (1, 32), (2, 8), (4, 4), (2, 16), (4, 8), (8, 4)):
                copies = weight_copies(c * c * k * dtype.itemsize)
                ws = [torch.randn(c, c, k, device="cuda", dtype=dtype) * (c * k) ** -0.5 for _ in range(copies)]
                b = torch.randn(c, device="cuda", dtype=dtype)
                x = torch.randn(batch, c, length if kind == "up" else 2 * length, device="cuda", dtype=dtype)
                counters = torch.zeros(c, dtype=torch.int32, device="cuda")
                times = []
                for config in (dict(gemm_min_positions=1 << 62, gemm_min_work=1 << 62), dict(gemm_min_positions=1)):
                    with kernel_config(**config):
                        times.append(1e3 * graph_time_ms(lambda i: ops.conv1d(
                            x, ws[i], b, 2, 1, transposed=kind == "up", counters=counters), copies))
                print(f"{kind:5} {str(dtype)[6:]:9} {c:5} {batch:3} {length:4} {batch * length:4} "
                      f"{times[0]:8.1f} {times[1]:8.1f}", flush=True)
