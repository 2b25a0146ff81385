"""Numerics for intellect-node, installed as ``intellect_kernels``.

A reference implementation of each kernel, in plain torch; fast paths join later behind the same functions.
Named ``intellect_kernels`` when installed because transformers probes for Hugging Face's own ``kernels``.
"""
