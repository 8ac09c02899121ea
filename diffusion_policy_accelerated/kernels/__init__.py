"""The compiled ops (ops.py), their configuration (config.py), the library that holds them
(library.py) and the route each conv takes (routing.py, asking csrc/conv1d/conv_route.h)."""
