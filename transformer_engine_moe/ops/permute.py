"""MoE token permutation with TransformerEngine's names: permute(+pad) before the expert GEMMs,
unpermute(+unpad) and merge after them. FP8 rows travel with their scales; nothing syncs with the host.

Layouts (``row_id_map``, ``pad_offsets``, capacities) are described in
``reference/permute.py``. Returned per-expert counts stay on the device: the
valid rows of a padded output are ``padded_tokens_per_expert.sum()``, of an
unpadded one ``routing_map.sum()``; every other row is zero (FP8: zero bytes,
scale_inv 1; probs 0).

Tensor arguments may have any strides, on both backends (the kernels' launchers make an expanded,
sliced or transposed view contiguous: a copy only then). A row map or ``pad_offsets`` out of
range is refused by ``moe_unpermute`` when it checks the map (``_check_map_rows``); one that
escapes the check (written through ``.data``, which moves no version, or reaching a backward) is
read as the reference's ``pair_slots`` reads it: an entry out of range is a dropped pair, never an
index outside a tensor.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from typing import NamedTuple, Optional, Sequence

import torch

from ..backend import Implementation, implementation
from ..layout import HostSplits, check_on_device, host_list, m_splits_tensor
from ..recipe import HIGH_PRECISION_DTYPES
from ..reference.permute import pair_slots
from ..tensor.float8_blockwise_tensor import Float8BlockwiseQTensor
from .quantize import QuantizeArgs, quantize_in_function


def _check_inp(inp, name="inp") -> torch.Tensor:
    """The row data ``[T, H]`` of a permute input (FP8: its rowwise data)."""
    if isinstance(inp, Float8BlockwiseQTensor):
        if inp.rowwise_data is None or inp.is_2D_scaled:
            raise ValueError(f"{name}: a Float8BlockwiseQTensor needs rowwise 1x128 data to be permuted")
        if inp.dim() != 2:
            raise ValueError(f"{name} must be 2-D [num_tokens, hidden], got shape {list(inp.shape)}")
        return inp.rowwise_data
    if not isinstance(inp, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or Float8BlockwiseQTensor, got {type(inp).__name__}")
    if inp.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"{name} must be bf16/fp16/fp32 or a Float8BlockwiseQTensor, got {inp.dtype}")
    if inp.dim() != 2:
        raise ValueError(f"{name} must be 2-D [num_tokens, hidden], got shape {list(inp.shape)}")
    return inp


def _check_routing(routing_map, num_tokens: int, device) -> torch.Tensor:
    if not isinstance(routing_map, torch.Tensor):
        raise TypeError(f"routing_map must be a [num_tokens, num_experts] tensor, got {type(routing_map).__name__}")
    if routing_map.dim() != 2 or routing_map.shape[0] != num_tokens:
        raise ValueError(
            f"routing_map must be [num_tokens={num_tokens}, num_experts], got shape {list(routing_map.shape)}"
        )
    if routing_map.dtype.is_floating_point or routing_map.dtype.is_complex:
        raise TypeError(f"routing_map must be bool or integer, got {routing_map.dtype}")
    if routing_map.device != device:
        raise ValueError(f"routing_map is on {routing_map.device}, inp on {device}")
    if routing_map.shape[1] == 0:  # once a ZeroDivisionError in the Triton launcher
        raise ValueError(f"routing_map must have at least one expert column, got shape {list(routing_map.shape)}")
    if routing_map.dtype == torch.bool:
        return routing_map
    # TE's integer mask holds 1 (routed) or 0; a 2 or a -1 was once routed silently (on the device: no host sync)
    check_on_device(((routing_map == 0) | (routing_map == 1)).all(),
                    f"routing_map of dtype {routing_map.dtype} must hold only 0 and 1 (TransformerEngine's mask)")
    return routing_map != 0


def _check_probs(probs, shape, device, name="probs") -> Optional[torch.Tensor]:
    if probs is None:
        return None
    if not isinstance(probs, torch.Tensor) or not probs.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {getattr(probs, 'dtype', type(probs))}")
    if tuple(probs.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(probs.shape)}")
    if probs.device != device:
        raise ValueError(f"{name} is on {probs.device}, inp on {device}")
    return probs.contiguous()


def _check_align_size(align_size, op: str) -> None:
    if not isinstance(align_size, int) or isinstance(align_size, bool) or align_size < 1:
        raise ValueError(f"{op}: align_size must be a positive int (1: no padding), got {align_size!r}")


def _check_count(value, name) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"{name} must be a non-negative int or None, got {value!r}")


def _check_map_type(map_type, op: str) -> None:
    """TransformerEngine's ``map_type`` argument: only its ``'mask'`` routing is implemented here."""
    if map_type == "index":
        raise ValueError(f"{op}: map_type='index' (TransformerEngine's [num_tokens, topk] expert ids and its "
                         "index row map) is not supported; pass the [num_tokens, num_experts] mask with "
                         "map_type='mask' (topk_to_routing_map converts top-k ids)")
    if map_type != "mask":
        raise ValueError(f"{op}: map_type must be 'mask' or 'index', got {map_type!r}")


def _check_row_id_map(row_id_map) -> int:
    """Number of experts of a row_id_map ``[T, 2E+1]`` int32."""
    if not isinstance(row_id_map, torch.Tensor) or row_id_map.dtype != torch.int32 or row_id_map.dim() != 2 \
            or row_id_map.shape[1] % 2 != 1:
        raise TypeError(
            "row_id_map must be the int32 [num_tokens, 2 * num_experts + 1] tensor a moe_permute op returned, "
            f"got {getattr(row_id_map, 'dtype', type(row_id_map))} of shape {list(getattr(row_id_map, 'shape', []))}"
        )
    return (row_id_map.shape[1] - 1) // 2


def _check_map_rows(row_id_map: torch.Tensor, pad_offsets: Optional[torch.Tensor], num_rows: int, op: str) -> None:
    """Each token's first n entries (n = ``row_id_map[t, 2E]``) name an expert in ``[0, E)`` and a row that,
    plus the expert's padding, lies in ``[0, num_rows)``; the other entries are -1 (``check_on_device``: a
    loud error where the kernels and the reference would silently drop such a pair, ``pair_slots``)."""
    e = (row_id_map.shape[1] - 1) // 2
    rows, experts, n = row_id_map[:, :e].long(), row_id_map[:, e:2 * e].long(), row_id_map[:, 2 * e:].long()
    slot = torch.arange(e, device=row_id_map.device) < n
    final = rows + (pad_offsets.long()[experts.clamp(0, max(e - 1, 0))] if pad_offsets is not None else 0)
    used_ok = (rows >= 0) & (final >= 0) & (final < num_rows) & (experts >= 0) & (experts < e)
    ok = ((n >= 0) & (n <= e)).all() & torch.where(slot, used_ok, (rows == -1) & (experts == -1)).all()
    check_on_device(ok, f"{op}: row_id_map names rows outside inp's {num_rows} rows (with pad_offsets) or "
                        "malformed entries: pass the map, pad_offsets and output of one permute call")
    # this package's layout lists a token's experts ascending; TransformerEngine's lists them descending
    ascending = ((experts[:, 1:] > experts[:, :-1]) | ~slot[:, 1:]).all()
    check_on_device(ascending, f"{op}: row_id_map lists a token's experts out of ascending order: a map built "
                               "by TransformerEngine (descending) or by hand; use the map a moe_permute op "
                               "of this package returned (docs/permute.md)")


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, probs, row_id_map, pad_offsets, capacity: int, impl: Implementation):
        fp8 = isinstance(inp, Float8BlockwiseQTensor)
        x = inp.rowwise_data if fp8 else inp
        out, out_probs, out_scale = impl.permute(
            x, row_id_map, capacity, pad_offsets, probs, inp.rowwise_scale_inv if fp8 else None
        )
        if fp8:
            out = Float8BlockwiseQTensor._of_launch(
                shape=out.shape, dtype=inp.dtype, fp8_dtype=inp.fp8_dtype, force_pow_2_scales=inp.force_pow_2_scales,
                rowwise_data=out, rowwise_scale_inv=out_scale,
            )
        ctx.save_for_backward(row_id_map, pad_offsets)
        ctx.impl = impl
        ctx.probs_meta = (probs.shape, probs.dtype) if probs is not None else None
        ctx.mark_non_differentiable(row_id_map)
        return out, out_probs

    @staticmethod
    def backward(ctx, grad_out, grad_probs):
        row_id_map, pad_offsets = ctx.saved_tensors
        grad_inp = None
        if ctx.needs_input_grad[0]:
            grad_inp = ctx.impl.unpermute(grad_out, row_id_map, None, pad_offsets)
        grad_in_probs = None
        if ctx.needs_input_grad[1] and grad_probs is not None:
            shape, dtype = ctx.probs_meta
            valid, experts, final = pair_slots(row_id_map, pad_offsets, grad_probs.shape[0])
            # slots that are no pair read an appended zero (also when no row was routed: grad_probs is empty)
            padded_grad = torch.cat([grad_probs, grad_probs.new_zeros(1)])
            picked = padded_grad[torch.where(valid, final, grad_probs.shape[0])]
            grad_in_probs = torch.zeros(shape, dtype=grad_probs.dtype, device=grad_probs.device)
            grad_in_probs.scatter_add_(1, experts, picked)
            grad_in_probs = grad_in_probs.to(dtype)
        return grad_inp, grad_in_probs, None, None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, merging_probs, row_id_map, pad_offsets, impl: Implementation,
                grad_quantize: Optional[QuantizeArgs]):
        out = impl.unpermute(inp, row_id_map, merging_probs, pad_offsets)
        ctx.save_for_backward(inp if merging_probs is not None else None, merging_probs, row_id_map, pad_offsets)
        ctx.impl, ctx.capacity, ctx.grad_quantize = impl, inp.shape[0], grad_quantize
        return out

    @staticmethod
    def backward(ctx, grad):
        inp, merging_probs, row_id_map, pad_offsets = ctx.saved_tensors
        grad = grad.contiguous()
        impl, args = ctx.impl, ctx.grad_quantize
        if merging_probs is None and args is not None:  # each token's row quantized once, its FP8 copies permuted
            q = quantize_in_function(grad, args)
            data, _, scale = impl.permute(q.rowwise_data, row_id_map, ctx.capacity, pad_offsets, None,
                                          q.rowwise_scale_inv)
            dinp = Float8BlockwiseQTensor._of_launch(shape=data.shape, dtype=grad.dtype, fp8_dtype=args.fp8_dtype,
                                                     force_pow_2_scales=args.force_pow_2_scales, rowwise_data=data,
                                                     rowwise_scale_inv=scale)
            return dinp, None, None, None, None, None
        if merging_probs is None:
            dinp, _, _ = impl.permute(grad, row_id_map, ctx.capacity, pad_offsets, None, None)
            return dinp, None, None, None, None, None
        dinp, dprobs = impl.unpermute_backward(grad, inp, row_id_map, merging_probs, ctx.capacity, pad_offsets)
        return dinp, dprobs.to(merging_probs.dtype), None, None, None, None


class _MapRecord(NamedTuple):
    """What a permute call returned with its ``row_id_map``: the map and its ``pad_offsets`` (weak references
    and the versions autograd counts in-place writes by), the rows of its output (``capacity``) and, for a
    padded permute with host counts, the rows without the padding (``rows``)."""
    map_ref: weakref.ref
    map_version: int
    pad_ref: Optional[weakref.ref]
    pad_version: Optional[int]
    capacity: int
    rows: Optional[int]


# The row_id_maps this module's permutes returned, by the map object's id (checked through the weak reference:
# tensors compare elementwise, so they cannot be weak dict keys); an entry leaves when its map is freed. Host-
# side; nothing under torch.compile; a copy of a map is not recognised. ``moe_unpermute`` asks here
# (``_permute_record``) whether its arguments are one permute call's, unchanged: then the map was built in
# range for that output and its bounds check (about 25 small launches per call) is skipped; and whether an
# ``inp`` without ``pad_offsets`` is a padded output (the map is the same with and without padding:
# pre-padding rows, as in TE).
_PERMUTE_MAPS: dict[int, _MapRecord] = {}


def _register_map(row_id_map: torch.Tensor, pad_offsets: Optional[torch.Tensor], capacity: int,
                  rows: Optional[int]) -> None:
    key = id(row_id_map)
    _PERMUTE_MAPS[key] = _MapRecord(
        weakref.ref(row_id_map, lambda _: _PERMUTE_MAPS.pop(key, None)), row_id_map._version,
        weakref.ref(pad_offsets) if pad_offsets is not None else None,
        pad_offsets._version if pad_offsets is not None else None, capacity, rows)


def _permute_record(row_id_map: torch.Tensor) -> Optional[_MapRecord]:
    """The record of a map a permute call returned and nobody wrote since, else None."""
    rec = _PERMUTE_MAPS.get(id(row_id_map))
    if rec is None or rec.map_ref() is not row_id_map or rec.map_version != row_id_map._version:
        return None
    return rec


def _same_call(rec: Optional[_MapRecord], pad_offsets: Optional[torch.Tensor], num_rows: int) -> bool:
    """Whether ``pad_offsets`` and an output of ``num_rows`` rows are, unchanged, what ``rec``'s call returned."""
    if rec is None or num_rows != rec.capacity:
        return False
    if pad_offsets is None or rec.pad_ref is None:
        return pad_offsets is None and rec.pad_ref is None
    return rec.pad_ref() is pad_offsets and rec.pad_version == pad_offsets._version


class PermuteLayout(NamedTuple):
    """What a padded permute computes from its routing map alone (``routing_layout``), made ahead of it, e.g.
    queued before a host wait (the local dispatcher's): ``row_id_map [T, 2E+1]`` int32, ``counts [E]`` int64
    (``routing_map.sum(0)``), ``pad_offsets [E]`` and ``padded [E]`` int64 for ``align_size``, and the
    ``routing_map`` it was made from. Make it with ``permute_layout``: a permute sizes and indexes its output by
    these tensors, so it takes only a layout ``permute_layout`` made, from the map it permutes by, none of its
    tensors replaced or written since (``_LAYOUTS``)."""
    routing_map: torch.Tensor
    align_size: int
    row_id_map: torch.Tensor
    counts: torch.Tensor
    pad_offsets: torch.Tensor
    padded: torch.Tensor


@dataclasses.dataclass
class _LayoutRecord:
    """What ``permute_layout`` made: weak references to the layout's tensors (``_layout_tensors``), their versions
    and its ``align_size``; and the counts ``layout_host_counts`` read from it (``host_counts``)."""
    refs: tuple
    versions: tuple
    align_size: int
    host_counts: Optional[HostSplits] = None


# The layouts permute_layout made, by their row map's id (a tuple cannot be weakly referenced; an entry leaves when
# its row map is freed). Eager only: a layout made under torch.compile is not recorded, and a permute refuses it.
_LAYOUTS: dict[int, _LayoutRecord] = {}


def _layout_tensors(layout: PermuteLayout) -> tuple:
    return layout.routing_map, layout.row_id_map, layout.counts, layout.pad_offsets, layout.padded


def permute_layout(routing_map: torch.Tensor, align_size: int, *, backend: str = "auto") -> PermuteLayout:
    """The layout ``moe_permute_and_pad_with_probs(..., align_size, layout=...)`` takes instead of computing it
    (four small launches, no host sync): ``routing_map [T, E]`` bool, ``align_size`` >= 1."""
    if not isinstance(routing_map, torch.Tensor) or routing_map.dtype != torch.bool:
        raise TypeError(f"routing_map must be a bool [num_tokens, num_experts >= 1] tensor, got "
                        f"{getattr(routing_map, 'dtype', type(routing_map).__name__)}")
    if routing_map.dim() != 2 or routing_map.shape[1] == 0:
        raise ValueError(f"routing_map must be [num_tokens, num_experts >= 1], got shape {list(routing_map.shape)}")
    _check_align_size(align_size, "permute_layout")
    impl = implementation(backend, routing_map, "permute_layout")
    layout = PermuteLayout(routing_map, align_size, *impl.routing_layout(routing_map, align_size))
    if not torch.compiler.is_compiling():
        key, tensors = id(layout.row_id_map), _layout_tensors(layout)
        refs = tuple(weakref.ref(t, lambda _: _LAYOUTS.pop(key, None)) if t is layout.row_id_map
                     else weakref.ref(t) for t in tensors)
        _LAYOUTS[key] = _LayoutRecord(refs, tuple(t._version for t in tensors), align_size)
    return layout


def _layout_record(layout, op: str) -> _LayoutRecord:
    """The record of ``layout``, one ``permute_layout`` made as it made it, unchanged since."""
    if not isinstance(layout, PermuteLayout):
        raise TypeError(f"{op}: layout must be None or a PermuteLayout (permute_layout), got {type(layout).__name__}")
    rec, tensors = _LAYOUTS.get(id(layout.row_id_map)), _layout_tensors(layout)
    if rec is None or any(r() is not t for r, t in zip(rec.refs, tensors)) or rec.align_size != layout.align_size:
        raise ValueError(f"{op}: layout must be one permute_layout made, as it made it (a layout's row map and counts "
                         "size and index the output: one built or edited elsewhere is not taken)")
    if rec.versions != tuple(t._version for t in tensors):
        raise ValueError(f"{op}: layout's routing_map or tensors were written since permute_layout made it: make it "
                         "again from the map as it is")
    return rec


def _check_layout(layout, routing_map, align_size: int, op: str) -> _LayoutRecord:
    """``layout`` one ``permute_layout`` made from ``routing_map`` itself for ``align_size``, unchanged since."""
    rec = _layout_record(layout, op)
    if layout.routing_map is not routing_map:
        raise ValueError(f"{op}: layout was made from another routing_map: make it with permute_layout(routing_map, "
                         "align_size) from the map passed here")
    if layout.align_size != align_size:
        raise ValueError(f"{op}: layout was made for align_size={layout.align_size}, this call pads to {align_size}")
    return rec


def layout_host_counts(layout: PermuteLayout, before_host_wait=None) -> HostSplits:
    """``layout.counts`` (tokens per expert) on the host, a read-only ``HostSplits``: the one host sync of a padded
    permute with host counts (``layout.host_list``: ``before_host_wait`` runs once the copy is queued, so the GPU
    runs what it queues while the host waits). A permute given these very counts with this layout takes them
    without checking them against its map on the device (four launches after the wait): they are the layout's."""
    rec = _layout_record(layout, "layout_host_counts")
    rec.host_counts = HostSplits(host_list(layout.counts, before_host_wait))
    return rec.host_counts


def _permute(inp, probs, routing_map, num_out_tokens, align_size, tokens_per_expert, backend, op, layout=None):
    x = _check_inp(inp)
    num_tokens = x.shape[0]
    rec = _check_layout(layout, routing_map, align_size, op) if layout is not None else None
    routing_map = _check_routing(routing_map, num_tokens, x.device)
    num_experts = routing_map.shape[1]
    probs = _check_probs(probs, (num_tokens, num_experts), x.device)
    _check_count(num_out_tokens, "num_out_tokens")
    # the layout's own counts, read by layout_host_counts: checked when made, and equal to the map's by construction
    layout_counts = rec is not None and tokens_per_expert is not None and tokens_per_expert is rec.host_counts
    host_counts = tokens_per_expert if layout_counts else \
        _check_tokens_per_expert(tokens_per_expert, num_experts, x.device)
    impl = implementation(backend, x, op)
    a = max(align_size or 1, 1)
    row_id_map, counts, pad_offsets, padded = impl.routing_layout(routing_map, a) if layout is None else layout[2:]
    if tokens_per_expert is not None and not layout_counts:
        want = m_splits_tensor(host_counts, counts.device) if host_counts is not None else tokens_per_expert
        check_on_device((want.to(counts.device, torch.int64) == counts).all(),
                        f"{op}: tokens_per_expert differs from routing_map.sum(0)")
    if host_counts is not None:  # the exact padded size, known on the host: no slack rows
        capacity = host_counts.padded(a).total if type(host_counts) is HostSplits else \
            sum(-(-c // a) * a for c in host_counts)
    else:
        if num_out_tokens is None:
            num_out_tokens = num_tokens * num_experts  # a mask's worst case: pass num_tokens * topk instead
        else:
            check_on_device(counts.sum() <= num_out_tokens,
                            f"{op}: routing_map routes more than num_out_tokens={num_out_tokens} pairs")
        capacity = num_out_tokens + (num_experts * (a - 1) if align_size is not None else 0)
    if align_size is None:
        pad_offsets = padded = None
    if not torch.compiler.is_compiling():
        _register_map(row_id_map, pad_offsets, capacity,
                      None if host_counts is None or align_size is None else
                      host_counts.total if type(host_counts) is HostSplits else sum(host_counts))
    out, out_probs = _Permute.apply(inp, probs, row_id_map, pad_offsets, capacity, impl)
    return out, out_probs, row_id_map, pad_offsets, padded


def _check_tokens_per_expert(tokens_per_expert, num_experts: int, device) -> Optional[list[int]]:
    """The per-expert counts as a host list when given as one (else None); a tensor must be ``[E]``."""
    if tokens_per_expert is None:
        return None
    if isinstance(tokens_per_expert, (list, tuple)):
        if len(tokens_per_expert) != num_experts or not all(
                isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in tokens_per_expert):
            raise ValueError(f"tokens_per_expert as a host list must hold num_experts={num_experts} ints >= 0, "
                             f"got {list(tokens_per_expert)}")
        return list(tokens_per_expert)
    if not isinstance(tokens_per_expert, torch.Tensor) or tuple(tokens_per_expert.shape) != (num_experts,):
        raise ValueError(f"tokens_per_expert must be a [num_experts={num_experts}] tensor or a host list, got "
                         f"{type(tokens_per_expert).__name__} {list(getattr(tokens_per_expert, 'shape', []))}")
    if tokens_per_expert.dtype not in (torch.int32, torch.int64):  # a float tensor was once truncated to counts
        raise TypeError(f"tokens_per_expert must be an int32/int64 tensor, got {tokens_per_expert.dtype}")
    if tokens_per_expert.device not in (device, torch.device("cpu")):
        raise ValueError(f"tokens_per_expert is on {tokens_per_expert.device}; routing_map (and inp) on {device}: "
                         "pass it there, or as a CPU tensor or host list")
    return None


def moe_permute(inp, routing_map: torch.Tensor, num_out_tokens: Optional[int] = None, max_token_num: int = -1,
                map_type: str = "mask", *, backend: str = "auto"):
    """Permute tokens expert-major: ``(output [num_out_tokens, H], row_id_map [T, 2E+1])``.

    ``inp``: ``[T, H]`` bf16/fp16/fp32 or a rowwise 1x128 Float8BlockwiseQTensor
    (its scale rows move with the data; the output is one too). ``routing_map``:
    ``[T, E]`` bool/int mask (DeepEP's top-k format: ``topk_to_routing_map``).
    ``num_out_tokens``: output rows, at least the routed pairs (e.g. ``T * topk``;
    default ``T * E``); unused rows are zero. ``max_token_num`` and ``map_type`` are
    TransformerEngine's: the first is ignored for a mask (as there), the second must be ``'mask'``.
    """
    _check_map_type(map_type, "moe_permute")
    if not isinstance(max_token_num, int) or isinstance(max_token_num, bool):
        raise TypeError(f"moe_permute: max_token_num must be an int (ignored for a mask), got {max_token_num!r}")
    out, _, row_id_map, _, _ = _permute(inp, None, routing_map, num_out_tokens, None, None, backend, "moe_permute")
    return out, row_id_map


def moe_permute_with_probs(
    inp, probs: torch.Tensor, routing_map: torch.Tensor, num_out_tokens: Optional[int] = None, *,
    backend: str = "auto",
):
    """``moe_permute`` that also moves the router probs ``[T, E]``:
    ``(output [num_out_tokens, H], permuted_probs [num_out_tokens], row_id_map [T, 2E+1])``."""
    out, out_probs, row_id_map, _, _ = _permute(
        inp, probs, routing_map, num_out_tokens, None, None, backend, "moe_permute_with_probs"
    )
    return out, out_probs, row_id_map


def moe_permute_and_pad_with_probs(
    inp, probs: torch.Tensor, routing_map: torch.Tensor, tokens_per_expert, align_size: int,
    num_out_tokens: Optional[int] = None, *, backend: str = "auto", layout: Optional[PermuteLayout] = None,
):
    """``moe_permute_with_probs`` with each expert's rows padded to a multiple of ``align_size``.

    Returns ``(output, permuted_probs, row_id_map, pad_offsets [E] int64,
    padded_tokens_per_expert [E] int64)``. ``tokens_per_expert`` (``routing_map.sum(0)``,
    checked on the device; required, as in TransformerEngine) is a device tensor or a host
    list: with a host list (what a dispatcher holds) the output has exactly
    ``sum(ceil(count / align_size) * align_size)`` rows, as TransformerEngine's; with a
    tensor (no host sync) the worst-case ``num_out_tokens + E * (align_size - 1)`` rows
    (``num_out_tokens`` default ``T * E``), the slack at the end. Padding rows between
    experts and slack rows are zero (FP8: scale_inv 1). ``align_size`` >= 1 (1: no
    padding). Pass ``pad_offsets`` to ``moe_unpermute``. ``layout``: ``permute_layout(routing_map,
    align_size)`` made ahead (e.g. before a host wait), taken instead of computing it here.
    """
    if tokens_per_expert is None:
        raise ValueError("moe_permute_and_pad_with_probs: tokens_per_expert must be given (routing_map.sum(0) as "
                         "a device tensor, or the dispatcher's host list), as in TransformerEngine")
    _check_align_size(align_size, "moe_permute_and_pad_with_probs")
    return _permute(inp, probs, routing_map, num_out_tokens, align_size, tokens_per_expert, backend,
                    "moe_permute_and_pad_with_probs", layout)


def moe_unpermute(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    merging_probs: Optional[torch.Tensor] = None,
    restore_shape: Optional[Sequence[int]] = None,
    map_type: str = "mask",
    probs: Optional[torch.Tensor] = None,
    pad_offsets: Optional[torch.Tensor] = None,
    *,
    grad_quantize: Optional[QuantizeArgs] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Merge expert outputs back per token: ``out[t] = sum_e merging_probs[t, e] * inp[row(t, e)]``.

    ``inp``: ``[rows, H]`` bf16/fp16/fp32 expert outputs in the permuted layout;
    ``merging_probs``: ``[T, E]`` (None: plain sum); ``pad_offsets``: what
    ``moe_permute_and_pad_with_probs`` returned (padding rows are skipped).
    Float32 accumulation in ascending expert order, one cast to ``inp``'s dtype.
    Returns ``[T, H]``, or ``restore_shape``. TransformerEngine's signature: ``map_type``
    must be ``'mask'``; ``probs`` is its deprecated name of ``merging_probs`` (a warning).
    A ``row_id_map`` or ``pad_offsets`` naming rows outside ``inp`` raises (a device-side assert on the GPU);
    one written through ``.data`` after its permute escapes that check, and its out-of-range entries are
    dropped pairs (zero contribution and gradients; module doc), never reads outside ``inp``.

    ``grad_quantize`` (no ``merging_probs``): 1x128 rowwise ``QuantizeArgs`` with ``amax_epsilon`` 0 (e.g. the
    consuming ``GroupedLinear``'s ``quantizers[Role.GRAD].args``): backward quantizes the incoming gradient once
    per token (``[T, H]``) and permutes the FP8 rows and scales, so ``inp``'s gradient is a rowwise 1x128
    Float8BlockwiseQTensor, bit for bit the quantization of the BF16 gradient it is otherwise (a 1x128 block lies
    within a row; padding rows are zero with scale_inv 1 both ways): 1/topk of the rows quantized and one byte
    per element permuted instead of two, written and read again.
    """
    _check_map_type(map_type, "moe_unpermute")
    if probs is not None:
        if merging_probs is not None:
            raise ValueError("moe_unpermute: both merging_probs and its deprecated name probs were given")
        warnings.warn("moe_unpermute: probs is deprecated (as in TransformerEngine); pass merging_probs",
                      DeprecationWarning, stacklevel=2)
        merging_probs = probs
    if isinstance(inp, Float8BlockwiseQTensor):
        raise TypeError("moe_unpermute merges high-precision expert outputs; dequantize the FP8 tensor first")
    if not isinstance(inp, torch.Tensor) or inp.dtype not in HIGH_PRECISION_DTYPES or inp.dim() != 2:
        raise TypeError(
            f"inp must be a 2-D bf16/fp16/fp32 tensor, got {getattr(inp, 'dtype', type(inp))} "
            f"of shape {list(getattr(inp, 'shape', []))}"
        )
    num_experts = _check_row_id_map(row_id_map)
    if row_id_map.device != inp.device:
        raise ValueError(f"row_id_map is on {row_id_map.device}, inp on {inp.device}")
    num_tokens = row_id_map.shape[0]
    merging_probs = _check_probs(merging_probs, (num_tokens, num_experts), inp.device, "merging_probs")
    if pad_offsets is not None and (not isinstance(pad_offsets, torch.Tensor)
                                    or tuple(pad_offsets.shape) != (num_experts,)
                                    or pad_offsets.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"pad_offsets must be the int64 [num_experts={num_experts}] tensor the padded permute "
                         f"returned, got {getattr(pad_offsets, 'dtype', type(pad_offsets).__name__)} of shape "
                         f"{list(getattr(pad_offsets, 'shape', []))}")
    if pad_offsets is not None and pad_offsets.device != inp.device:
        raise ValueError(f"pad_offsets is on {pad_offsets.device}, inp on {inp.device}")
    if restore_shape is not None:
        try:
            restore_shape = torch.Size(restore_shape)
        except TypeError:
            raise TypeError(f"restore_shape must be a sequence of ints holding [num_tokens, hidden], got "
                            f"{restore_shape!r}") from None
        if restore_shape.numel() != num_tokens * inp.shape[1] or restore_shape[-1] != inp.shape[1]:
            raise ValueError(
                f"restore_shape {list(restore_shape)} does not hold [num_tokens={num_tokens}, hidden={inp.shape[1]}]"
            )
    rec = _permute_record(row_id_map) if not torch.compiler.is_compiling() else None
    if pad_offsets is None and rec is not None and rec.pad_ref is not None and inp.shape[0] == rec.capacity \
            and rec.capacity != rec.rows:
        raise ValueError(
            f"moe_unpermute: row_id_map comes from moe_permute_and_pad_with_probs and inp has that call's "
            f"{rec.capacity} padded rows, but pad_offsets was not given: pass the pad_offsets it returned "
            "(without them each token's rows are read from pre-padding positions, i.e. other tokens' rows)")
    if not _same_call(rec, pad_offsets, inp.shape[0]):  # a map from elsewhere, or used on other rows
        _check_map_rows(row_id_map, pad_offsets, inp.shape[0], "moe_unpermute")
    _check_grad_quantize(grad_quantize, merging_probs)
    impl = implementation(backend, inp, "moe_unpermute")
    out = _Unpermute.apply(inp.contiguous(), merging_probs, row_id_map, pad_offsets, impl, grad_quantize)
    return out.view(restore_shape) if restore_shape is not None else out


def _check_grad_quantize(args, merging_probs) -> None:
    if args is None:
        return
    if not isinstance(args, QuantizeArgs):
        raise TypeError(f"grad_quantize must be None or QuantizeArgs (a quantizer's .args), got {type(args).__name__}")
    if args.block.is_2D or not args.rowwise or args.columnwise or args.amax_epsilon:
        raise ValueError(f"grad_quantize must be 1x128 rowwise only with amax_epsilon 0 (then the permuted FP8 rows "
                         f"are bitwise the quantized permuted gradient), got {args}")
    if merging_probs is not None:
        raise ValueError("grad_quantize needs merging_probs None: with merging probs each row's gradient is the "
                         "token's scaled by its expert's prob, not a copy of the token's")


class _TopkRouting(torch.autograd.Function):
    """``impl.topk_routing``, differentiable in the weights: each slot's gradient is its expert's probs gradient
    (0 for an unused slot)."""

    @staticmethod
    def forward(ctx, topk_idx, topk_weights, num_experts, impl):
        routing_map, probs, errors = impl.topk_routing(topk_idx, topk_weights, num_experts)
        ctx.save_for_backward(topk_idx)
        ctx.mark_non_differentiable(routing_map, errors)
        return routing_map, probs, errors

    @staticmethod
    def backward(ctx, _, grad_probs, __):
        (topk_idx,) = ctx.saved_tensors
        grad = grad_probs.gather(1, topk_idx.long().clamp(min=0))
        return None, torch.where(topk_idx >= 0, grad, 0.0), None, None


def topk_to_routing_map(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, *,
                        backend: str = "auto"):
    """DeepEP's format -> ``(routing_map [T, E] bool, probs [T, E])``.

    ``topk_idx`` ``[T, k]`` int (-1: slot not selected, e.g. an expert on another
    rank), ``topk_weights`` ``[T, k]`` float (probs in its dtype). Differentiable in ``topk_weights``
    (the probs' gradient flows back to the selected slots). One kernel (``topk_routing``) writes both and
    counts bad ids: out-of-range or repeated ids raise ``ValueError`` on CPU and trip a device-side assert
    on the GPU (no host sync).
    """
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or topk_idx.dtype not in (
        torch.int32, torch.int64
    ):
        raise TypeError(f"topk_idx must be a 2-D int32/int64 tensor [num_tokens, k], got "
                        f"{getattr(topk_idx, 'dtype', type(topk_idx))}")
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts <= 0:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    topk_weights = _check_probs(topk_weights, topk_idx.shape, topk_idx.device, "topk_weights")
    return checked_topk_routing(topk_idx, topk_weights, num_experts, backend, "topk_idx")


def checked_topk_routing(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, backend: str,
                         name: str):
    """``topk_to_routing_map`` on arguments whose types, shapes and devices are checked: the kernel, then its
    counts of bad ids as device-side checks whose messages name the ids ``name`` (a dispatcher's
    ``topk_ids``)."""
    impl = implementation(backend, topk_idx, "topk_to_routing_map")
    routing_map, probs, errors = _TopkRouting.apply(topk_idx, topk_weights, num_experts, impl)
    check_on_device(errors[0] == 0, f"{name} holds expert ids outside [-1, num_experts={num_experts})")
    check_on_device(errors[1] == 0, f"{name} names an expert twice for one token")
    return routing_map, probs


def checked_topk_probs(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, backend: str = "auto"):
    """``probs [T, E]`` of ``checked_topk_routing`` for ids it checked already, bit for bit (the same kernel),
    without its device-side checks and without autograd: the ``moe_expert`` rerun's probs of the ids its forward's
    dispatch checked (the checkpoint's saved inputs refuse ids written in place since). The kernel never writes
    out of bounds; the probs of ids that were never checked mean nothing."""
    with torch.no_grad():
        return implementation(backend, topk_idx, "topk_to_routing_map").topk_routing(topk_idx, topk_weights,
                                                                                     num_experts)[1]


def routing_map_to_topk(probs: torch.Tensor, routing_map: torch.Tensor, topk: int):
    """Megatron's router output -> DeepEP's format: ``probs [T, E]`` float, ``routing_map [T, E]`` bool
    (at most ``topk`` experts per token) -> ``(topk_idx [T, topk] int64, -1 for unused slots; topk_weights
    [T, topk] float32)``. Differentiable in ``probs``. No host sync."""
    if not isinstance(routing_map, torch.Tensor) or routing_map.dtype != torch.bool or routing_map.dim() != 2:
        got = (f"{routing_map.dtype} of shape {list(routing_map.shape)}" if isinstance(routing_map, torch.Tensor)
               else type(routing_map).__name__)
        raise TypeError(f"routing_map must be a 2-D bool tensor [T, E], got {got}")
    if not isinstance(topk, int) or isinstance(topk, bool) or not 0 < topk <= routing_map.shape[1]:
        raise ValueError(f"topk must be an int in [1, E={routing_map.shape[1]}], got {topk!r}")
    probs = _check_probs(probs, routing_map.shape, routing_map.device)
    check_on_device((routing_map.sum(1) <= topk).all(), f"routing_map selects more than topk={topk} experts")
    # the selected experts first (ties kept in expert order by a stable sort of the mask)
    idx = torch.sort(routing_map.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :topk]
    selected = routing_map.gather(1, idx)
    weights = torch.where(selected, probs.gather(1, idx), 0.0)
    return torch.where(selected, idx, -1), weights.float()


# ---------------------------------------------------------------- raw rows, for the token dispatchers
def row_id_map_of(routing_map: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``row_id_map [T, 2E+1]`` int32 of a ``[T, E]`` bool mask (no padding). No checks, no autograd: the
    dispatchers' send layout, with the EP ranks as the "experts"."""
    return implementation(backend, routing_map, "row_id_map_of").routing_layout(routing_map, 1)[0]


def permute_rows(data: torch.Tensor, scale_inv: Optional[torch.Tensor], row_id_map: torch.Tensor, num_rows: int,
                 *, backend: str = "auto") -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Raw rows ``data [T, H]`` (FP8 bytes or BF16) and their ``scale_inv [T, S]`` (or None) to the
    ``[num_rows, ...]`` layout of ``row_id_map`` (``row_id_map_of``). No checks, no autograd."""
    out, _, out_scale = implementation(backend, data, "permute_rows").permute(
        data, row_id_map, num_rows, None, None, scale_inv)
    return out, out_scale


def unpermute_rows(x: torch.Tensor, row_id_map: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Per token, the float32 sum of its rows of ``x`` in the layout of ``row_id_map``, cast to ``x``'s dtype:
    ``[T, ...]``. No checks, no autograd."""
    return implementation(backend, x, "unpermute_rows").unpermute(x, row_id_map)
