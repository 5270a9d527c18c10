"""The one choice between an op's Triton kernel and its plain-PyTorch reference: a static table.

Every raw-tensor launcher has one name and one signature in ``reference/<op>.py`` (plain PyTorch,
the oracle) and in ``kernels/<op>.py`` (Triton; a kernel may add keyword arguments with defaults,
e.g. ``config`` for benchmark sweeps). ``Implementation`` holds one column of that table:
``REFERENCE`` and ``TRITON``, and for the grouped GEMMs ``CUBLAS`` and ``DEEPGEMM`` (``TRITON``'s
launchers with those libraries' GEMMs) and ``GLUON`` (``TRITON``'s with the Gluon fprop/dgrad kernel, whose twin is
Triton's; ``ops/grouped_gemm.py`` picks among them per call). An op
resolves its implementation once per call, with ``implementation(backend, tensor, op_name)``, and its
autograd Function keeps it on ``ctx`` for backward. The tensor type reaches its launchers through
this table too, never through ``ops/``. Every launcher is also a ``torch.library`` custom op, which
``torch.compile`` traces as one node (``custom_ops.py``).

``backend="auto"`` runs the Triton kernels on CUDA tensors and the reference elsewhere. ``"triton"``
forces the kernels: on CPU tensors that needs Triton's interpreter (``TRITON_INTERPRET=1`` set before
this package, which imports Triton, is imported): how the CPU test suite runs the kernels.
``"reference"`` forces the oracle. Without Triton (optional off Linux) only ``REFERENCE`` exists.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

import torch

from .custom_ops import launcher_op
from .reference import dequantize as rd, grouped_gemm as rg, permute as rp, quantize as rq, swiglu as rs
from .reference import transpose as rt

BACKENDS = ("auto", "triton", "reference")


def _launcher(op: str):
    """A field of ``Implementation``: a launcher of ``reference/<op>.py`` and ``kernels/<op>.py``."""
    return dataclasses.field(metadata={"op": op})


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One implementation of every raw-tensor launcher (shapes and layouts: the reference's docstrings)."""

    name: str
    quantize_1x128: Callable = _launcher("quantize")
    quantize_128x1: Callable = _launcher("quantize")
    quantize_128x128: Callable = _launcher("quantize")
    quantize_grouped_weight: Callable = _launcher("quantize")
    dequantize_1x128: Callable = _launcher("dequantize")
    dequantize_128x1: Callable = _launcher("dequantize")
    dequantize_128x128: Callable = _launcher("dequantize")
    scaling_aware_transpose: Callable = _launcher("transpose")
    transpose_128x128: Callable = _launcher("transpose")
    topk_routing: Callable = _launcher("permute")
    routing_layout: Callable = _launcher("permute")
    permute: Callable = _launcher("permute")
    unpermute: Callable = _launcher("permute")
    unpermute_backward: Callable = _launcher("permute")
    weighted_swiglu_quant: Callable = _launcher("swiglu")
    weighted_swiglu_backward: Callable = _launcher("swiglu")
    grouped_gemm: Callable = _launcher("grouped_gemm")
    grouped_gemm_wgrad: Callable = _launcher("grouped_gemm")


def _column(name: str, **modules) -> Implementation:
    """An implementation from its op modules: ``quantize=..., dequantize=..., ...`` (each field's op), every
    launcher registered as a custom op (``custom_ops.py``)."""
    launchers = dataclasses.fields(Implementation)[1:]
    return Implementation(name, **{f.name: launcher_op(f.name, name, getattr(modules[f.metadata["op"]], f.name))
                                   for f in launchers})


REFERENCE = _column("reference", quantize=rq, dequantize=rd, transpose=rt, permute=rp, swiglu=rs, grouped_gemm=rg)
TRITON: Optional[Implementation] = None
CUBLAS: Optional[Implementation] = None
DEEPGEMM: Optional[Implementation] = None
GLUON: Optional[Implementation] = None
try:
    from .kernels import dequantize as kd, grouped_gemm as kg, permute as kp, quantize as kq, swiglu as ks
    from .kernels import grouped_gemm_cublas, grouped_gemm_deepgemm, transpose as kt
except ModuleNotFoundError as err:  # Triton absent: the reference path only
    if err.name != "triton":
        raise
else:
    # the 128x1 and 128x128 dequantizations have no kernel (off the hot path): the reference
    TRITON = dataclasses.replace(_column("triton", quantize=kq, dequantize=rd, transpose=kt, permute=kp, swiglu=ks,
                                         grouped_gemm=kg),
                                 dequantize_1x128=launcher_op("dequantize_1x128", "triton", kd.dequantize_1x128))
    CUBLAS, DEEPGEMM = (dataclasses.replace(
        TRITON, name=name, grouped_gemm=launcher_op("grouped_gemm", name, module.grouped_gemm),
        grouped_gemm_wgrad=launcher_op("grouped_gemm_wgrad", name, module.grouped_gemm_wgrad))
        for name, module in (("cublas", grouped_gemm_cublas), ("deepgemm", grouped_gemm_deepgemm)))
    try:  # Triton 3.6's Gluon API: absent or moved in other Triton releases, which then run without this column
        from .kernels import grouped_gemm_gluon
    except ImportError:
        pass
    else:  # the GEMMs (its wgrad runs the Triton twin where the Gluon kernel does not take the call)
        GLUON = dataclasses.replace(
            TRITON, name="gluon", grouped_gemm=launcher_op("grouped_gemm", "gluon", grouped_gemm_gluon.grouped_gemm),
            grouped_gemm_wgrad=launcher_op("grouped_gemm_wgrad", "gluon", grouped_gemm_gluon.grouped_gemm_wgrad))

IMPLEMENTATIONS = {impl.name: impl for impl in (REFERENCE, TRITON, CUBLAS, DEEPGEMM, GLUON) if impl is not None}


def use_triton(backend: str, tensor: torch.Tensor, op_name: str) -> bool:
    """True when ``op_name`` should run its Triton kernel on ``tensor``'s device (``backend``: ``BACKENDS``)."""
    if backend not in BACKENDS:
        raise ValueError(f"{op_name}: backend must be one of {BACKENDS}, got {backend!r}")
    if tensor.device.type == "meta":  # once a NotImplementedError from Triton, a RuntimeError from .item() deep inside
        raise ValueError(f"{op_name}: got a tensor on the meta device, which holds no data to compute with; "
                         "materialise it first (e.g. module.to_empty(device=...) and initialise the weights)")
    if backend == "reference" or (backend == "auto" and not tensor.is_cuda):
        return False
    if TRITON is None:
        raise ImportError(f"{op_name}: backend={backend!r} on {tensor.device} needs Triton (pip install triton), "
                          "or use backend='reference'")
    if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{op_name}: backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before "
            f"transformer_engine_moe (which imports Triton) is imported, to run the kernel in Triton's CPU "
            f"interpreter; got a tensor on {tensor.device}"
        )
    return True


def implementation(backend: str, tensor: torch.Tensor, op_name: str) -> Implementation:
    """``TRITON`` or ``REFERENCE`` for ``op_name`` on ``tensor`` (see ``use_triton``)."""
    return TRITON if use_triton(backend, tensor, op_name) else REFERENCE
