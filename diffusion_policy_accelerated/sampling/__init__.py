"""The denoising loop as one CUDA graph (sampler.py) and whole policy calls as graphs
(policy_graph.py)."""
