"""The denoising loop as one CUDA graph (sampler.py; generic.py around any other denoiser),
whole policy calls as graphs (policy_graph.py), and module code made capturable
(capturable.py)."""
