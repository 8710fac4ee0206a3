"""Triton kernels, one module per op; each module also holds the op's public wrapper."""
