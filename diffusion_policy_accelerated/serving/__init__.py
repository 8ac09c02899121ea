"""Serving policies over the network: `dpa serve` (server.py, one process per device, batching
concurrent requests), its wire format (protocol.py), a Python client (client.py) and a Ray
Serve deployment (ray_serve.py) for many GPUs and machines.

Submodules are imported on use: a robot's client needs neither torch nor aiohttp.
"""
