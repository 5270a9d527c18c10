"""Choice between an op's Triton kernel and its plain-PyTorch reference.

``backend="auto"`` runs the Triton kernel on CUDA tensors and the reference
elsewhere. ``"triton"`` forces the kernel: on CPU tensors that needs Triton's
interpreter (``TRITON_INTERPRET=1`` set before Triton is imported), which is
how the CPU test suite exercises the kernels. ``"reference"`` forces the oracle.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

BACKENDS = ("auto", "triton", "reference")


def use_triton(backend: str, tensor: torch.Tensor, op_name: str) -> bool:
    """True when ``op_name`` should run its Triton kernel on ``tensor``'s device."""
    if backend not in BACKENDS:
        raise ValueError(f"{op_name}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return False
    if tensor.is_cuda:
        return True
    if backend == "auto":
        return False
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{op_name}: backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before "
            f"Triton is imported to run the kernel in Triton's CPU interpreter; got a tensor on "
            f"{tensor.device}"
        )
    return True


def implementation(kernel: bool, op: str) -> ModuleType:
    """The module implementing ``op``: ``kernels.<op>`` (imported on first use: it needs Triton) or
    ``reference.<op>``. Both expose the same function names and signatures."""
    return importlib.import_module(f"..{'kernels' if kernel else 'reference'}.{op}", __package__)

