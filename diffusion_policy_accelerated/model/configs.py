"""The reference models the demo, the benchmarks and the routing table run: Diffusion Policy's
Push-T U-Nets (lowdim: 20-dim observations of 2 steps; image: ResNet features of 2 steps) at
its horizon of 16, LeRobot's default DiffusionPolicy U-Net (Push-T: the 2-dim state and 32
spatial-softmax keypoints of one camera, 2 steps; LeRobot 0.6 runs it at horizon 64), and the
noise scheduler both use."""

HORIZON = 16
UNETS = {
    "lowdim": dict(input_dim=2, global_cond_dim=40, diffusion_step_embed_dim=256, down_dims=[256, 512, 1024],
                   kernel_size=5, n_groups=8, cond_predict_scale=True),
    "image": dict(input_dim=2, global_cond_dim=1028, diffusion_step_embed_dim=256, down_dims=[512, 1024, 2048],
                  kernel_size=5, n_groups=8, cond_predict_scale=True),
    "lerobot": dict(input_dim=2, global_cond_dim=132, diffusion_step_embed_dim=128, down_dims=[512, 1024, 2048],
                    kernel_size=5, n_groups=8, cond_predict_scale=True),
}
# Diffusion Policy's noise scheduler arguments, valid for diffusers' DDPMScheduler and
# DDIMScheduler alike (the rest are their defaults: DDPM's variance_type fixed_small, DDIM's
# set_alpha_to_one True and steps_offset 0, as Diffusion Policy sets them).
SCHEDULER_CONFIG = dict(num_train_timesteps=100, beta_start=0.0001, beta_end=0.02,
                        beta_schedule="squaredcos_cap_v2", clip_sample=True, prediction_type="epsilon")


def distinct_block_shapes(down_dims, horizon=HORIZON, input_dim=2, kernel_size=5):
    """(in_channels, out_channels, length, kernel_size, groups) of each distinct Conv1dBlock
    call (by in_channels, out_channels, length) of a Push-T U-Net with these widths, in call
    order, read off a forward pass on the meta device."""
    import torch

    from .unet import ConditionalUnet1D, conv1d_block_shapes

    with torch.device("meta"):
        model = ConditionalUnet1D(input_dim, global_cond_dim=32, down_dims=down_dims,
                                  kernel_size=kernel_size, cond_predict_scale=True)
    seen = set()
    for shape in (call[1:] for call in conv1d_block_shapes(model, horizon)):
        if shape[:3] not in seen:
            seen.add(shape[:3])
            yield shape
