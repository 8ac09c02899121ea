"""A small workload for `compute-sanitizer --tool memcheck`: a small U-Net forward through the
fused ops (fp32 and bf16) plus the kernels' edge paths (odd kernel sizes, groups split across
blocks, one-position sequences, tiny channel counts, scalar-load fallbacks, strided and
transposed convs, FiLM and residual epilogues, a long-slice GroupNorm conv streamed through
the cluster kernel's shared-memory weight ring, caller-owned counters, a conv and its 1x1
shortcut in one cluster or split-K launch or, misaligned, two), the im2col + GEMM route of
the ops (residual blocks included, contiguous and taps-major weights, outputs stored and
inputs read channels-last, GroupNorm groups held or cut into slices: clusters, one launch or two;
fp32 GEMMs over few positions), launch plans for a budget of a few SMs, denoise steps, and a small U-Net's denoising loop
(fp32 and bf16, batch 1 and 2), sequential and parallel (eagerly and in a graph loop)."""
import torch

from diffusion_policy_accelerated.kernels import ops
from diffusion_policy_accelerated.model.unet import ConditionalUnet1D
from diffusion_policy_accelerated.kernels.config import kernel_config
from diffusion_policy_accelerated.sampling.sampler import GraphedSampler
from diffusion_policy_accelerated.model.schedulers import DenoiseSchedule


def main():
    torch.manual_seed(0)
    model = ConditionalUnet1D(2, global_cond_dim=8, down_dims=[32, 64, 128], kernel_size=5).cuda().eval()
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            m = model.to(dtype)
            out = m(torch.randn(3, 16, 2, device="cuda", dtype=dtype), 7,
                    global_cond=torch.randn(3, 8, device="cuda", dtype=dtype))
            assert torch.isfinite(out).all()
    for batch, cin, cout, length, k, groups in [(3, 7, 6, 3, 3, 3), (1, 4, 8, 5, 13, 2),
                                                 (2, 9, 24, 1, 5, 24), (1, 300, 20, 17, 5, 5),
                                                 (2, 3, 6, 40, 31, 3), (1, 2, 2, 1, 1, 1),
                                                 (1, 1304, 200, 4, 5, 8)]:
        x = torch.randn(batch, cin, length, device="cuda")
        w = torch.randn(cout, cin, k, device="cuda")
        film = torch.randn(batch, 2 * cout, device="cuda")
        residual = torch.randn(batch, cout, length, device="cuda")
        assert torch.isfinite(ops.conv1d_gn_mish(x, w, None, None, None, groups)).all()
        assert torch.isfinite(ops.conv1d_gn_mish(x, w, None, None, None, groups, film=film,
                                                 residual=residual)).all()
    # Slices longer than the weight ring, so that its stages are refilled (tests/
    # test_conv1d_gn_mish.py's CLUSTER_SHAPES work out the chunks).
    for dtype, cin, cout, length, groups in [(torch.float32, 7400, 16, 4, 2), (torch.bfloat16, 7400, 16, 4, 2),
                                             (torch.bfloat16, 4096, 32, 16, 2)]:
        x = torch.randn(1, cin, length, device="cuda", dtype=dtype)
        w = torch.randn(cout, cin, 5, device="cuda", dtype=dtype) / (5 * cin) ** 0.5
        assert torch.isfinite(ops.conv1d_gn_mish(x, w, None, None, None, groups)).all()
    counters = torch.zeros(4096, dtype=torch.int32, device="cuda")
    # Pairs: thread-block clusters for both convs (the shortcut's last cluster short where its
    # channels are no multiple of a cluster's rows, with or without the weight ring, reading
    # a skip concatenation), split-K blocks where the plan does not fit, two launches misaligned.
    for batch, cin, cout, length, misaligned, short_channels, skip_channels, dtype in [
            (1, 2, 256, 16, False, 256, 0, torch.float32), (3, 256, 512, 8, False, 512, 0, torch.float32),
            (1, 2048, 512, 4, False, 1000, 1024, torch.float32), (1, 256, 512, 8, False, 517, 100, torch.bfloat16),
            (1, 1024, 256, 8, False, 256, 512, torch.bfloat16), (2, 7, 6, 3, False, 6, 0, torch.float32),
            (1, 512, 1024, 4, True, 1024, 0, torch.float32)]:
        x = torch.randn(batch, cin - skip_channels, length, device="cuda", dtype=dtype)
        skip = torch.randn(batch, skip_channels, length, device="cuda", dtype=dtype) if skip_channels else None
        w = torch.randn(cout, cin, 5, device="cuda", dtype=dtype)
        shortcut = torch.randn(short_channels * cin + misaligned, device="cuda",
                               dtype=dtype)[int(misaligned):].view(short_channels, cin, 1)
        outs = ops.conv1d_gn_mish_shortcut(x, w, None, None, None, 2, 1e-5, shortcut,
                                           torch.randn(short_channels, device="cuda", dtype=dtype),
                                           film=torch.randn(batch, 2 * cout, device="cuda", dtype=dtype),
                                           counters=counters, skip=skip)
        assert all(torch.isfinite(out).all() for out in outs)
    conv_shapes = [(1, 512, 512, 16, 3, 2, 1, False), (3, 7, 5, 9, 4, 3, 2, False), (1, 6, 9, 10, 7, 2, 0, False),
                   (1, 512, 512, 4, 4, 2, 1, True), (3, 6, 10, 5, 4, 2, 1, True), (1, 33, 65, 7, 4, 2, 1, True),
                   (2, 9, 24, 5, 2, 3, 0, True), (2, 2048, 512, 4, 1, 1, 0, False), (1, 256, 2, 16, 1, 1, 0, False)]
    for batch, cin, cout, length, k, stride, padding, transposed in conv_shapes:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(batch, cin, length, device="cuda", dtype=dtype)
            w = torch.randn(*((cin, cout) if transposed else (cout, cin)), k, device="cuda", dtype=dtype)
            out = ops.conv1d(x, w, None, stride, padding, transposed=transposed, counters=counters)
            assert torch.isfinite(out).all()
    # The same convs, and GroupNorm convs, on the im2col + GEMM route (bias, FiLM, residual),
    # with contiguous and with taps-major weights (ops.taps_major: the GEMM over x itself).
    with kernel_config(gemm_min_positions=1):
        for layout in (lambda w: w, ops.taps_major):
            for batch, cin, cout, length, k, stride, padding, transposed in conv_shapes:
                x = torch.randn(batch, cin, length, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(*((cin, cout) if transposed else (cout, cin)), k, device="cuda", dtype=torch.bfloat16)
                w = w if transposed else layout(w)
                out = ops.conv1d(x, w, torch.randn(cout, device="cuda", dtype=torch.bfloat16), stride, padding,
                                 transposed=transposed)
                out = ops.conv1d(x, w, None, stride, padding, transposed=transposed, residual=out)
                assert torch.isfinite(out).all()
            # Groups held by one block, and groups cut into slices (few blocks or many; the
            # last slice shorter; over 256 slices, merged in rounds), as clusters (Hopper, up to
            # 16 slices), in two launches and, with counters, one cooperative launch.
            for batch, cin, cout, length, k, groups in [(3, 7, 6, 3, 3, 3), (2, 9, 24, 1, 5, 24), (5, 64, 256, 8, 5, 8),
                                                         (2, 8, 16, 200, 3, 2), (3, 16, 8, 4, 7, 4),
                                                         (160, 4, 8, 130, 5, 1), (1, 16, 2048, 16, 5, 8),
                                                         (3, 8, 8, 1025, 5, 1), (1, 8, 256, 1100, 3, 1)]:
                x = torch.randn(batch, cin, length, device="cuda")
                w = layout(torch.randn(cout, cin, k, device="cuda"))
                for clusters, op_counters in [(True, None), (False, None), (False, counters)]:
                    with kernel_config(clusters=clusters):
                        out = ops.conv1d_gn_mish(x, w, torch.randn(cout, device="cuda"), None, None, groups,
                                                 film=torch.randn(batch, 2 * cout, device="cuda"),
                                                 residual=torch.randn(batch, cout, length, device="cuda"),
                                                 counters=op_counters)
                    assert torch.isfinite(out).all()
            # Residual blocks on that route: the first conv's epilogue writes the second's GEMM
            # operand (kernel sizes 1, 3, 5; length 1; groups of 5120 elements cut into slices,
            # fused where the weights are taps-major), the second's adds a shortcut's GEMM result
            # or the input (here read from a skip concatenation).
            for batch, cin, cout, length, k, skip_channels in [(3, 7, 6, 3, 3, 0), (2, 24, 24, 1, 5, 0),
                                                               (5, 64, 32, 8, 5, 32), (4, 16, 16, 5, 1, 9),
                                                               (2, 96, 256, 40, 5, 32)]:
                x = torch.randn(batch, cin - skip_channels, length, device="cuda", dtype=torch.bfloat16)
                skip = (torch.randn(batch, skip_channels, length, device="cuda", dtype=torch.bfloat16)
                        if skip_channels else None)
                weights = [layout(torch.randn(cout, cin, k, device="cuda", dtype=torch.bfloat16)),
                           layout(torch.randn(cout, cout, k, device="cuda", dtype=torch.bfloat16))]
                shortcut = (torch.randn(cout, cin, 1, device="cuda", dtype=torch.bfloat16) if cin != cout else None)
                # Slices as clusters, and in one cooperative launch (counters, no clusters).
                for clusters in (True, False):
                    with kernel_config(clusters=clusters):
                        out = ops.residual_block(x, weights[0], None, None, None, weights[1], None, None, None, 2,
                                                 1e-5, shortcut, None, counters=counters, skip=skip,
                                                 film=torch.randn(batch, cout, device="cuda", dtype=torch.bfloat16))
                        assert torch.isfinite(out).all()
                        # Its output stored channels-last, which a block of its width reads in place.
                        stored = ops.residual_block(x, weights[0], None, None, None, weights[1], None, None, None,
                                                    2, 1e-5, shortcut, None, counters=counters, skip=skip,
                                                    channels_last=True)
                        out = ops.residual_block(stored, weights[1], None, None, None, weights[1], None, None, None,
                                                 2, 1e-5, None, None, counters=counters)
                        assert torch.isfinite(out).all()
    # fp32 GEMMs over few positions on that route (narrow_gemm.cu): rows, reduction and
    # positions partly masked (also in a block of 32 positions), two batch rows, a shortcut
    # reading every fifth row of its conv's columns (the centre tap's), over 16 and 32 positions.
    with kernel_config(gemm_min_positions=1):
        for batch, cin, cout, length, k, groups in [(1, 100, 40, 12, 5, 4), (2, 1024, 96, 8, 5, 8),
                                                    (1, 100, 40, 20, 5, 4), (1, 1024, 96, 32, 5, 8)]:
            x = torch.randn(batch, cin, length, device="cuda")
            w = torch.randn(cout, cin, k, device="cuda") / (cin * k) ** 0.5
            assert torch.isfinite(ops.conv1d_gn_mish(x, w, None, None, None, groups, counters=counters)).all()
        for length in (16, 32):
            x = torch.randn(1, 1024, length, device="cuda")
            outs = ops.conv1d_gn_mish_shortcut(x, torch.randn(256, 1024, 5, device="cuda") / 72, None, None, None, 8,
                                               1e-5, torch.randn(256, 1024, 1, device="cuda") / 32, None,
                                               counters=counters)
            assert all(torch.isfinite(out).all() for out in outs)
        with kernel_config(sm_count=1):  # one slice of 40 chunks: the ring refilled throughout
            x = torch.randn(1, 1024, 16, device="cuda")
            assert torch.isfinite(ops.conv1d_gn_mish(x, torch.randn(96, 1024, 5, device="cuda") / 72, None, None,
                                                     None, 8)).all()
    # Launch plans for a budget of SMs (KernelConfig.sm_count): few, odd splits and slices.
    for sm_count, clusters in ((3, True), (7, False)):
        with kernel_config(sm_count=sm_count, clusters=clusters):
            for batch, cin, cout, length, k, groups in [(1, 256, 256, 16, 5, 8), (1, 1024, 1024, 4, 5, 8)]:
                x = torch.randn(batch, cin, length, device="cuda")
                w = torch.randn(cout, cin, k, device="cuda")
                assert torch.isfinite(ops.conv1d_gn_mish(x, w, None, None, None, groups, counters=counters)).all()
            with kernel_config(gemm_min_positions=1):
                # 8 groups of 2048 elements: as many slices as the budget's SMs call for.
                out = ops.conv1d_gn_mish(torch.randn(1, 16, 64, device="cuda"), torch.randn(256, 16, 5, device="cuda"),
                                         None, None, None, 8, counters=counters)
                assert torch.isfinite(out).all()
    assert int(counters.abs().sum()) == 0
    from diffusers import DDPMScheduler
    sched = DenoiseSchedule.from_diffusers(
        DDPMScheduler(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2"), 4).to("cuda")
    sample = torch.randn(3, 16, 2, device="cuda")
    for i in range(4):
        sample = sched.step(torch.randn_like(sample), i, sample, noise=torch.randn_like(sample))
    for dtype, batch in ((torch.float32, 1), (torch.bfloat16, 2)):
        sampler = GraphedSampler(model.to(dtype), sched, use_cuda_graph=False)
        mask = torch.zeros(batch, 8, 2, dtype=torch.bool, device="cuda")
        action = sampler(torch.randn(batch, 8, 2, device="cuda"), mask,
                         global_cond=torch.randn(batch, 8, device="cuda"))
        assert torch.isfinite(action).all()
        # Parallel sampling: eagerly, and as a graph whose loop node runs the Picard iterations
        # (a window past the last step, odd batch rows finishing at different iterations).
        for use_cuda_graph in (False, True):
            parallel = GraphedSampler(model.to(dtype), sched, use_cuda_graph=use_cuda_graph,
                                      parallel=dict(window=3, tolerance=0.5))
            action = parallel(torch.randn(batch + 2, 8, 2, device="cuda"), mask[:1].expand(batch + 2, -1, -1),
                              global_cond=torch.randn(batch + 2, 8, device="cuda"))
            assert torch.isfinite(action).all()
    torch.cuda.synchronize()
    print("sanitize case ran")


if __name__ == "__main__":
    main()
