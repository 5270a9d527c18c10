"""Test set-up: run Triton kernels in Triton's CPU interpreter when there is no GPU.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` kernel is defined, i.e. before
``transformer_engine_moe`` (whose ``backend.py`` imports the kernels) is imported: conftest runs
before the test modules import it.
"""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from utils import free_port  # noqa: E402,F401  benchmarks/utils.py (on pytest's pythonpath), after the line above

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

# Tests of the Triton column on CPU tensors: the interpreter, which is set above only without a GPU.
interpreter_only = pytest.mark.skipif(CUDA, reason="runs the Triton kernels on CPU tensors in Triton's "
                                      "interpreter, which conftest sets only on machines without a GPU")

# Where the Triton kernels run: the GPU when there is one, else the interpreter on CPU.
KERNEL_DEVICE = "cuda" if CUDA else "cpu"

# examples.pretrain_gpt on the CPU: its compact loop, and a model small enough for 2-step runs.
compact_loop_only = pytest.mark.skipif(CUDA, reason="the compact loop is the CPU path (GPU: megatron.training)")
TINY_GPT_ARGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --num-experts 4 "
                 "--moe-router-topk 2 --micro-batch-size 2 --train-iters 2 --log-interval 1 --swiglu "
                 "--disable-bias-linear").split()


def survives(code: str) -> str:
    """Run ``code`` in a fresh Python (the repository importable, this process's TRITON_INTERPRET) and return
    its output; assert it exited normally. For inputs that once crashed the process (an abort, a segfault):
    a regression then fails one test instead of ending the suite."""
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, f"exit {run.returncode}: {run.stderr[-2000:]}"
    return run.stdout


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float32 (the norm of ``b`` floored at 1e-30: no division by zero)."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two tensors of one shape and dtype, NaN included (``torch.equal`` says NaN != NaN):
    scales, where a block holding +-inf has scale_inv NaN; GEMM outputs of rows holding a NaN."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(bits),
                                                                      b.contiguous().view(bits))


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


@pytest.fixture(scope="module")
def world_of_one():
    """A one-rank process group (NCCL on a GPU, else gloo) with Megatron's model-parallel state, the patches
    applied and, on a CPU, the CPU shims installed (tests build Megatron models)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    import megatron_patches
    from megatron_patches.cpu_shims import apply_cpu_shims

    megatron_patches.apply()
    apply_cpu_shims()
    dist.init_process_group("nccl" if CUDA else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    parallel_state.initialize_model_parallel()
    if CUDA:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
