"""Triton kernels with thin launchers on raw tensors; they import nothing else from the package
but its constants and layout arithmetic (``recipe``, ``layout``)."""

import functools

import torch


@functools.lru_cache(maxsize=None)
def is_hopper(device: torch.device) -> bool:
    """Whether ``device`` (a tensor's: with its index) is an SM90 GPU, asked once per device: the GEMM backends
    (DeepGEMM, cuBLASLt, Gluon) ask in every GEMM call, and each uncached ask is a device-properties lookup."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
