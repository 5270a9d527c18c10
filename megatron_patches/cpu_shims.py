"""Shims that let megatron-core's GPTModel with MoE layers train on a CPU-only torch.

megatron-core assumes CUDA in a few places that a CPU run reaches. Each shim below replaces one
of them with its host equivalent; ``apply_cpu_shims()`` installs them only when
``torch.cuda.is_available()`` is False, and installing twice changes nothing. With a GPU none of
them is ever active. Checked on megatron-core 0.16.1 (torch 2.13.0+cpu, gloo); the names patched
exist unchanged in 0.19.2.

They replace ``torch.cuda.current_device`` and ``torch.cuda.synchronize`` for the whole process, so
only a CPU entry point installs them, by calling ``apply_cpu_shims()`` itself (``examples.compact_loop``,
tests that build Megatron models on the CPU); ``megatron_patches.apply()`` never does.
"""

import contextlib
import functools

import torch

# Attribute set on every object a shim installs, so a second apply() recognises its own work.
_MARK = "__megatron_patches_cpu_shim__"


def _mark(obj):
    setattr(obj, _MARK, True)
    return obj


def _installed(obj) -> bool:
    return getattr(obj, _MARK, False)


def _host_device() -> torch.device:
    """Stands in for ``torch.cuda.current_device()``: the CPU."""
    return torch.device("cpu")


def _shim_current_device() -> None:
    """``torch.cuda.current_device`` -> the CPU device.

    The router (weight and aux-loss tensors), ``GroupedMLP``, ``GlobalMemoryBuffer.get_tensor``,
    attention and GPTModel pass ``device=torch.cuda.current_device()``; a CPU-only torch raises
    there. Answering ``torch.device("cpu")`` puts those tensors on the host, which covers the
    global memory buffer as well.
    """
    if not _installed(torch.cuda.current_device):
        torch.cuda.current_device = _mark(_host_device)


@functools.lru_cache(maxsize=None)
def _host_causal_mask(sq: int) -> torch.Tensor:
    """``[sq, sq]`` bool, True above the diagonal (masked), on the CPU."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _shim_causal_mask() -> None:
    """``megatron.core.fusions.fused_softmax.get_default_causal_mask`` -> a CPU mask.

    The unfused softmax builds its default causal mask with ``device="cuda"`` when the caller
    passes no attention mask. Replaced in ``fused_softmax``'s namespace, where it is looked up.
    """
    from megatron.core.fusions import fused_softmax

    if not _installed(fused_softmax.get_default_causal_mask):
        fused_softmax.get_default_causal_mask = _mark(_host_causal_mask)


@contextlib.contextmanager
def _host_fork(self, name: str = "model-parallel-rng"):
    """A fork that keeps the (only) CPU generator: no separate model-parallel stream."""
    yield


def _shim_rng_fork() -> None:
    """``CudaRNGStatesTracker.fork`` -> a no-op context.

    The tracker's states are CUDA generator states seeded by ``model_parallel_cuda_manual_seed``;
    on CPU ``fork()`` raises "cuda rng state model-parallel-rng is not added" (attention dropout,
    weight init without ``use_cpu_initialization``). Without tensor parallelism the separate
    stream only matters for reproducing GPU dropout masks, which a CPU run cannot do anyway.
    """
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    if not _installed(CudaRNGStatesTracker.fork):
        CudaRNGStatesTracker.fork = _mark(_host_fork)


def _no_cuda_rng_state(*args, **kwargs):
    """Stands in for getting and setting the CUDA generator state: there is none."""
    return None


def _shim_checkpoint_rng() -> None:
    """``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` -> no-ops.

    Megatron's activation checkpointing (``tensor_parallel.checkpoint``, used by selective
    recompute such as 'moe') saves and restores the CUDA generator state around the recomputed
    forward; a CPU-only torch has none. The CPU generator is still saved and restored by Megatron.
    """
    from megatron.core.tensor_parallel import random

    if not _installed(random._get_cuda_rng_state):
        random._get_cuda_rng_state = _mark(_no_cuda_rng_state)
        random._set_cuda_rng_state = _mark(_no_cuda_rng_state)


def _shim_router_gemm() -> None:
    """``moe_utils.te_general_gemm`` -> ``None`` when TransformerEngine is absent.

    ``moe_utils`` imports it only inside its TransformerEngine block, yet the router's gating
    GEMM (``moe_router_dtype`` set) tests ``te_general_gemm is not None``: a NameError without TE.
    ``None`` selects the plain ``torch.mm`` path that is already there.
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _host_dtoh_and_synchronize(self, point: str, tokens_per_expert=None):
    """At the dispatcher's device-to-host point, turn the split tensors into NumPy arrays (as
    the CUDA version does on its side stream); on the CPU there is nothing to wait for."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _shim_alltoall_streams() -> None:
    """``MoEAlltoAllTokenDispatcher`` without CUDA streams.

    Its constructor creates a class-wide ``torch.cuda.Stream`` for device-to-host copies of the
    split sizes (only when the class attribute is still None), and
    ``_maybe_dtoh_and_synchronize`` copies on that stream. On the CPU the class attribute is set
    to a marker (never used as a stream) and the method is replaced by its host version.
    """
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as A2A

    if not _installed(A2A._maybe_dtoh_and_synchronize):
        A2A.cuda_dtoh_stream = "host: no CUDA stream (megatron_patches.cpu_shims)"
        A2A._maybe_dtoh_and_synchronize = _mark(_host_dtoh_and_synchronize)


def _host_synchronize(device=None) -> None:
    """Stands in for ``torch.cuda.synchronize()``: with no device there is nothing to wait for."""


def _shim_synchronize() -> None:
    """``torch.cuda.synchronize`` -> a no-op.

    Megatron's distributed checkpoint (``dist_checkpointing``, torch_dist format) synchronizes
    the device before copying tensors to the host; a CPU-only torch raises there.
    """
    if not _installed(torch.cuda.synchronize):
        torch.cuda.synchronize = _mark(_host_synchronize)


SHIMS = (
    _shim_current_device,
    _shim_synchronize,
    _shim_causal_mask,
    _shim_rng_fork,
    _shim_checkpoint_rng,
    _shim_router_gemm,
    _shim_alltoall_streams,
)


def apply_cpu_shims() -> bool:
    """Install every shim in ``SHIMS`` when CUDA is unavailable; idempotent.

    Returns True when the shims are in place, False on a machine with CUDA (nothing installed).
    """
    if torch.cuda.is_available():
        return False
    for shim in SHIMS:
        shim()
    return True
