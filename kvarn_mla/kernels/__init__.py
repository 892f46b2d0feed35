"""Triton kernels and their launchers. Nothing here imports transformers."""
