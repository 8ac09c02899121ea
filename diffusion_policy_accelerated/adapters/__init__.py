"""Diffusion Policy's policies (diffusion_policy.py: accelerate) and workspace checkpoints
(checkpoint.py), and LeRobot's DiffusionPolicy and its folders (lerobot.py); neither package is
imported."""
