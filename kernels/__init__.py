"""Kernels for VeriCache: each op has a torch reference, a Triton kernel (CUDA) and a dispatch.

The dispatch functions exported here pick the Triton kernel when the tensors live on CUDA and
Triton imports, and the torch reference everywhere else.
"""
