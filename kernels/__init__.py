"""Triton kernels (GPU path), each with a torch reference of the same signature in reference.py."""
