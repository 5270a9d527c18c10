"""The launchers as ``torch.library`` custom ops, so that ``torch.compile`` traces the ops without graph breaks.

Each launcher of each column of ``backend.py``'s table is registered as ``te_moe::<launcher>_<column>``
(e.g. ``te_moe::permute_triton``) with a fake implementation giving its outputs' shapes and dtypes, as
TransformerEngine registers its permutation kernels (``transformer_engine/pytorch/permutation.py``). The
compiler sees one opaque node per launch: the Triton kernel, or the reference's data-dependent steps, run
as in eager mode, and nothing in them breaks the graph.

Eager calls go straight to the launcher: a custom-op call costs about 20 us of host time (measured on
the CI's CPU), and a block step makes about 25 launcher calls, so the table's function calls the op only
while ``torch.compiler.is_compiling()``. ``tests/test_custom_ops.py`` checks every op with
``torch.library.opcheck`` (fake against real, schema, aliasing).

Schema limits handled here: ``m_splits`` (None, a host list or a device tensor) travels as two
arguments, ``int[]? m_splits, Tensor? m_splits_tensor``; an output that may be None travels as an
empty float32 tensor; ``grouped_gemm_wgrad`` into a given ``out`` is the mutating op ``..._into``
(``..._into_list`` for a list of G tensors, e.g. the experts' ``main_grad``s).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from .layout import columnwise_data_shape, num_column_blocks
from .recipe import BLOCK_SIZE


@dataclasses.dataclass(frozen=True)
class _Spec:
    """A launcher's op: ``schema`` (arguments as the table passes them, ``MSplits m_splits`` for the
    splits), its ``fake``, and ``optional``: output index -> the argument whose None/False makes it None."""

    schema: str
    fake: Callable
    optional: dict


_SPECS: dict[str, _Spec] = {}
_OPS: dict[tuple[str, Callable], Callable] = {}  # (launcher, launcher function) -> what the table holds


def _spec(schema: str, **optional: int):
    """Register the decorated fake (named after its launcher) with ``schema``; ``optional``: argument
    name -> index of the output that is None when that argument is None or False."""
    def register(fake):
        _SPECS[fake.__name__] = _Spec(schema, fake, {i: name for name, i in optional.items()})
        return fake
    return register


def _blocks(n: int) -> int:
    return -(-n // BLOCK_SIZE)


def _empty(like: torch.Tensor, *shape: int, dtype=None) -> torch.Tensor:
    return like.new_empty(shape, dtype=dtype or like.dtype)


# ------------------------------------------------------------------ the fakes: outputs' shapes and dtypes
@_spec("(Tensor x, ScalarType fp8_dtype, bool force_pow_2_scales, float amax_epsilon) -> (Tensor, Tensor)")
def quantize_1x128(x, fp8_dtype, force_pow_2_scales, amax_epsilon):
    m, k = x.shape
    return _empty(x, m, k, dtype=fp8_dtype), _empty(x, m, _blocks(k), dtype=torch.float32)


@_spec("(Tensor x, ScalarType fp8_dtype, bool force_pow_2_scales, float amax_epsilon, MSplits m_splits) "
       "-> (Tensor, Tensor)")
def quantize_128x1(x, fp8_dtype, force_pow_2_scales, amax_epsilon, m_splits):
    m, k = x.shape
    return (_empty(x, *columnwise_data_shape(m, k, m_splits), dtype=fp8_dtype),
            _empty(x, num_column_blocks(m, m_splits), k, dtype=torch.float32))


@_spec("(Tensor x, ScalarType fp8_dtype, bool force_pow_2_scales, float amax_epsilon) -> (Tensor, Tensor)")
def quantize_128x128(x, fp8_dtype, force_pow_2_scales, amax_epsilon):
    m, k = x.shape
    return _empty(x, m, k, dtype=fp8_dtype), _empty(x, _blocks(m), _blocks(k), dtype=torch.float32)


@_spec("(Tensor[] weights, ScalarType fp8_dtype, bool force_pow_2_scales, float amax_epsilon, bool transpose) "
       "-> (Tensor, Tensor, Tensor, Tensor)", transpose=2)
def quantize_grouped_weight(weights, fp8_dtype, force_pow_2_scales, amax_epsilon, transpose):
    w, (g, (n, k)) = weights[0], (len(weights), weights[0].shape)
    scales = (_empty(w, g, n // BLOCK_SIZE, k // BLOCK_SIZE, dtype=torch.float32),
              _empty(w, g, k // BLOCK_SIZE, n // BLOCK_SIZE, dtype=torch.float32))
    return (_empty(w, g, n, k, dtype=fp8_dtype), scales[0],
            *((_empty(w, g, k, n, dtype=fp8_dtype), scales[1]) if transpose else (None, None)))


@_spec("(Tensor data, Tensor scale_inv, ScalarType dtype) -> Tensor")
def dequantize_1x128(data, scale_inv, dtype):
    return _empty(data, *data.shape, dtype=dtype)


@_spec("(Tensor data_t, Tensor scale_inv_t, ScalarType dtype, MSplits m_splits) -> Tensor")
def dequantize_128x1(data_t, scale_inv_t, dtype, m_splits):
    k = scale_inv_t.shape[1]
    return _empty(data_t, data_t.numel() // k, k, dtype=dtype)


@_spec("(Tensor data, Tensor scale_inv, ScalarType dtype) -> Tensor")
def dequantize_128x128(data, scale_inv, dtype):
    return _empty(data, *data.shape, dtype=dtype)


@_spec("(Tensor data, Tensor scale_inv, MSplits m_splits) -> (Tensor, Tensor)")
def scaling_aware_transpose(data, scale_inv, m_splits):
    m, k = data.shape
    return (_empty(data, *columnwise_data_shape(m, k, m_splits)),
            _empty(data, num_column_blocks(m, m_splits), k, dtype=torch.float32))


@_spec("(Tensor data, Tensor scale_inv) -> (Tensor, Tensor)")
def transpose_128x128(data, scale_inv):
    return _empty(data, *data.transpose(1, 2).shape), _empty(scale_inv, *scale_inv.transpose(1, 2).shape)


@_spec("(Tensor topk_idx, Tensor topk_weights, int num_experts) -> (Tensor, Tensor, Tensor)")
def topk_routing(topk_idx, topk_weights, num_experts):
    t = topk_idx.shape[0]
    return (_empty(topk_idx, t, num_experts, dtype=torch.bool), _empty(topk_weights, t, num_experts),
            _empty(topk_idx, 2, dtype=torch.int32))


@_spec("(Tensor routing_map, int align_size) -> (Tensor, Tensor, Tensor, Tensor)")
def routing_layout(routing_map, align_size):
    t, e = routing_map.shape
    counts = [_empty(routing_map, e, dtype=torch.int64) for _ in range(3)]
    return (_empty(routing_map, t, 2 * e + 1, dtype=torch.int32), *counts)


@_spec("(Tensor x, Tensor row_id_map, int capacity, Tensor? pad_offsets, Tensor? probs, Tensor? scale_inv) "
       "-> (Tensor, Tensor, Tensor)", probs=1, scale_inv=2)
def permute(x, row_id_map, capacity, pad_offsets, probs, scale_inv):
    return (_empty(x, capacity, x.shape[1]), None if probs is None else _empty(probs, capacity),
            None if scale_inv is None else _empty(scale_inv, capacity, scale_inv.shape[1], dtype=torch.float32))


@_spec("(Tensor x, Tensor row_id_map, Tensor? merging_probs, Tensor? pad_offsets) -> Tensor")
def unpermute(x, row_id_map, merging_probs, pad_offsets):
    return _empty(x, row_id_map.shape[0], x.shape[1])


@_spec("(Tensor grad, Tensor x, Tensor row_id_map, Tensor merging_probs, int capacity, Tensor? pad_offsets) "
       "-> (Tensor, Tensor)")
def unpermute_backward(grad, x, row_id_map, merging_probs, capacity, pad_offsets):
    return _empty(grad, capacity, grad.shape[1]), _empty(grad, *merging_probs.shape, dtype=torch.float32)


@_spec("(Tensor x, Tensor? probs, ScalarType fp8_dtype, bool force_pow_2_scales) -> (Tensor, Tensor)")
def weighted_swiglu_quant(x, probs, fp8_dtype, force_pow_2_scales):
    m, f = x.shape[0], x.shape[1] // 2
    return _empty(x, m, f, dtype=fp8_dtype), _empty(x, m, f // BLOCK_SIZE, dtype=torch.float32)


@_spec("(Tensor dy, Tensor x, Tensor? probs, ScalarType? grad_fp8_dtype, bool force_pow_2_scales) "
       "-> (Tensor, Tensor, Tensor)", grad_fp8_dtype=1, probs=2)
def weighted_swiglu_backward(dy, x, probs, grad_fp8_dtype, force_pow_2_scales):
    m, f2 = x.shape
    return (_empty(x, m, f2, dtype=grad_fp8_dtype or x.dtype),
            None if grad_fp8_dtype is None else _empty(x, m, f2 // BLOCK_SIZE, dtype=torch.float32),
            None if probs is None else _empty(x, m, dtype=torch.float32))


@_spec("(Tensor a, Tensor a_scale_inv, Tensor b, Tensor b_scale_inv, MSplits m_splits, ScalarType out_dtype) "
       "-> Tensor")
def grouped_gemm(a, a_scale_inv, b, b_scale_inv, m_splits, out_dtype):
    return _empty(a, a.shape[0], b.shape[1], dtype=out_dtype)


@_spec("(Tensor a_t, Tensor a_t_scale_inv, Tensor b_t, Tensor b_t_scale_inv, MSplits m_splits, Tensor? out, "
       "bool accumulate, ScalarType out_dtype) -> Tensor")
def grouped_gemm_wgrad(a_t, a_t_scale_inv, b_t, b_t_scale_inv, m_splits, out, accumulate, out_dtype):
    groups = len(m_splits) if isinstance(m_splits, list) else m_splits.numel()
    return _empty(a_t, groups, a_t_scale_inv.shape[1], b_t_scale_inv.shape[1], dtype=out_dtype)


# ------------------------------------------------------------------ registration
def _arguments(schema: str) -> list[str]:
    return [a.strip().rsplit(" ", 1)[-1] for a in schema[1:schema.index(") ->")].split(",")]


def _device(args) -> torch.device:
    first = next(a for a in args if isinstance(a, (torch.Tensor, list)))
    return (first[0] if isinstance(first, list) else first).device


def _unaliased(outputs: tuple, args: tuple) -> tuple:
    """``outputs`` with a copy of any that shares storage with an input or an earlier output (a custom op's
    outputs may not alias: e.g. ``.contiguous()`` of an already contiguous transpose returns its input)."""
    seen = {t.untyped_storage().data_ptr() for a in args for t in (a if isinstance(a, list) else [a])
            if isinstance(t, torch.Tensor) and t.numel()}
    fresh = []
    for o in outputs:
        ptr = o.untyped_storage().data_ptr() if o.numel() else None
        fresh.append(o.clone() if ptr in seen else o)
        seen.add(ptr)
    return tuple(fresh)


def _run(fn: Callable, m_pos: Optional[int], returns: bool = True, real: bool = True) -> Callable:
    """An op implementation calling ``fn`` (``real``: the launcher, else the fake): joins the splits, sends
    None outputs as empties, never returns an alias (``returns=False``: an op writing into its ``out``
    argument, returning nothing)."""
    def run(*args):
        if m_pos is not None:  # (list, tensor) -> the one m_splits argument
            args = (*args[:m_pos], args[m_pos] if args[m_pos] is not None else args[m_pos + 1], *args[m_pos + 2:])
        out = fn(*args)
        if not returns:
            return None
        single = not isinstance(out, tuple)
        out = tuple(torch.empty(0, device=_device(args)) if o is None else o for o in ((out,) if single else out))
        out = _unaliased(out, args) if real else out
        return out[0] if single else out
    return run


def _register(name: str, schema: str, fn: Callable, fake: Callable, m_pos: Optional[int], into: str = ""):
    """``te_moe::<name>``: ``fn`` (``into``: the variant writing into a given ``out``, a ``"tensor"`` or a
    ``"list"`` of tensors)."""
    schema = schema.replace("MSplits m_splits", "int[]? m_splits, Tensor? m_splits_tensor")
    if into:
        out = "Tensor(a!)[] out" if into == "list" else "Tensor(a!) out"
        schema = schema.replace("Tensor? out", out).replace("-> Tensor", "-> ()")
    op = torch.library.custom_op(f"te_moe::{name}", _run(fn, m_pos, not into), mutates_args=("out",) if into else (),
                                 schema=schema)
    op.register_fake(_run(fake, m_pos, not into, real=False))
    return op


def _traced(args) -> bool:
    """Whether a tensor argument (or one in a list argument) is a compiler's stand-in: torch 2.11's Dynamo runs
    a tensor subclass's methods (``Float8BlockwiseQTensor.dequantize``) on fake tensors without
    ``is_compiling()`` being set, and the launcher must then be the op, not the kernel."""
    for a in args:
        if isinstance(a, (list, tuple)):  # a list of tensors, or of ints (host splits: nothing to look at)
            if a and isinstance(a[0], torch.Tensor) and any(isinstance(t, (FakeTensor, FunctionalTensor)) for t in a):
                return True
        elif isinstance(a, (FakeTensor, FunctionalTensor)):
            return True
    return False


def launcher_op(launcher: str, column: str, fn: Callable) -> Callable:
    """``fn``, the ``launcher`` of the table's ``column``, as the custom op ``te_moe::<launcher>_<column>``
    (a launcher taking ``out`` also as ``te_moe::<launcher>_into_<column>`` and, for a list ``out``,
    ``..._into_list_<column>``). Returns what the table holds:
    a function with ``fn``'s signature that calls ``fn`` in eager mode and the op while ``torch.compile``
    traces."""
    if (launcher, fn) in _OPS:  # a launcher shared by two columns: one op
        return _OPS[launcher, fn]
    spec = _SPECS[launcher]
    names = _arguments(spec.schema)
    m_pos = names.index("m_splits") if "m_splits" in names else None
    op = _register(f"{launcher}_{column}", spec.schema, fn, spec.fake, m_pos)
    into = {kind: _register(f"{launcher}_into{suffix}_{column}", spec.schema, fn, spec.fake, m_pos, into=kind)
            for kind, suffix in (("tensor", ""), ("list", "_list"))} if "out" in names else None
    params = list(inspect.signature(fn).parameters.values())[:len(names)]

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not (torch.compiler.is_compiling() or _traced(args)):
            return fn(*args, **kwargs)
        values = [*args, *(kwargs.get(p.name, p.default) for p in params[len(args):])]
        given = {i: values[names.index(name)] is not None and values[names.index(name)] is not False
                 for i, name in spec.optional.items()}
        out_arg = values[names.index("out")] if into is not None else None
        if m_pos is not None:
            m_splits = values[m_pos]
            values[m_pos:m_pos + 1] = (None, m_splits) if isinstance(m_splits, torch.Tensor) else (m_splits, None)
        if out_arg is not None:
            into["list" if isinstance(out_arg, list) else "tensor"](*values)
            return out_arg
        out = op(*values)
        if not isinstance(out, tuple):
            return out
        return tuple(o if given.get(i, True) else None for i, o in enumerate(out))

    call.op = getattr(torch.ops.te_moe, f"{launcher}_{column}")  # what torch.compile's graph holds
    _OPS[launcher, fn] = call
    return call
