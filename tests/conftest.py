"""Test set-up: run Triton kernels in Triton's CPU interpreter when there is no GPU.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` kernel is defined, i.e. before
``transformer_engine_moe`` (whose ``backend.py`` imports the kernels) is imported: conftest runs
before the test modules import it.
"""

import os
import socket

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

# Where the Triton kernels run: the GPU when there is one, else the interpreter on CPU.
KERNEL_DEVICE = "cuda" if CUDA else "cpu"


def free_port() -> int:
    """A free TCP port on 127.0.0.1, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two float32 tensors, NaN included (``torch.equal`` says NaN != NaN): scales,
    where a block holding +-inf has scale_inv NaN."""
    return a.shape == b.shape and a.dtype == b.dtype == torch.float32 and torch.equal(
        a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def assert_no_host_sync(step) -> None:
    """Run ``step()`` once (compiling its kernels), then again with CUDA's sync debug mode raising on
    any host-device synchronisation."""
    step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
