"""Diffusion Policy's ConditionalUnet1D on the fused ops (unet.py), the DDPM/DDIM schedules
(schedulers.py), the reference configurations (configs.py) and each conv's route (routes.py)."""
