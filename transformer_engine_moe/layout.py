"""Scale layouts: this package's COMPACT layout, TransformerEngine's GEMM_READY, and groups.

COMPACT (what every op here produces and consumes), for a logical ``[M, K]``:

==========================  ==================  ===============================
usage, block                data                scale_inv (float32)
==========================  ==================  ===============================
rowwise, 1x128              ``[M, K]``          ``[M, ceil(K/128)]``
columnwise, 128x1           ``[K, M]``          ``[num_column_blocks, K]``
columnwise, 128x1, grouped  ``[M*K]`` (below)   ``[num_column_blocks, K]``
rowwise, 128x128            ``[M, K]``          ``[ceil(M/128), ceil(K/128)]``
columnwise, 128x128         ``[K, M]``          ``[ceil(K/128), ceil(M/128)]``
==========================  ==================  ===============================

Columnwise data is the transpose: the ``X^T [K, m]`` operand of a wgrad GEMM,
tokens contiguous. Its 128x1 blocks run along M and, when the rows are split
into groups (experts, ``m_splits``), never cross a group boundary: each group
starts a new block and a group whose size is not a multiple of 128 ends in a
partial block. The scales are block-major, ``[num_column_blocks, K]``, so a
GEMM reading one 128-token step of a group loads one contiguous scale row.

Expert-major (grouped columnwise data): a contiguous 1-D ``[M*K]`` FP8 tensor
holding each group's own transpose ``X_g^T [K, m_g]``, row-major, one after
another: group g starts at element ``K * (m_0 + ... + m_{g-1})``. Each expert's
wgrad operand is then one contiguous block (DeepGEMM's k-grouped layout, and
the concatenation of TransformerEngine's per-expert columnwise tensors).
Ungrouped data is the one-group case, kept 2-D ``[K, M]``.
``columnwise_index`` gives every element's place.

``num_column_blocks`` is ``ceil(M/128)`` without groups, ``sum(ceil(m_i/128))``
for a host list of group sizes, and the worst case ``M // 128 + G`` for a
device tensor of G group sizes (no host sync to learn the exact count; the
unused trailing rows hold scale 1).

GEMM_READY (TransformerEngine's default for cuBLAS): same data; rowwise 1x128
scales transposed; the last scale dimension padded to a multiple of 4
(1x128 rowwise ``[ceil(K/128), pad4(M)]``, 128x1 columnwise ``[ceil(M/128), pad4(K)]``,
128x128 ``[blocks, pad4(blocks)]``).
"""

from __future__ import annotations

import dataclasses
import functools

from typing import Callable, Optional, Sequence, Union

import torch

from .recipe import BLOCK_SIZE

GEMM_READY_ALIGNMENT = 4

MSplits = Optional[Union[Sequence[int], torch.Tensor]]


def _pad_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _transposed_in_gemm_ready(is_2D_scaled: bool, columnwise: bool) -> bool:
    return not is_2D_scaled and not columnwise


def compact_to_gemm_ready(scale_inv: torch.Tensor, is_2D_scaled: bool, columnwise: bool) -> torch.Tensor:
    """COMPACT scale_inv -> TE GEMM_READY (a new tensor, zero padding)."""
    s = scale_inv.t() if _transposed_in_gemm_ready(is_2D_scaled, columnwise) else scale_inv
    out = s.new_zeros(s.shape[0], _pad_to(s.shape[1], GEMM_READY_ALIGNMENT))
    out[:, : s.shape[1]] = s
    return out


def gemm_ready_to_compact(scale_inv: torch.Tensor, is_2D_scaled: bool, columnwise: bool, n: int) -> torch.Tensor:
    """TE GEMM_READY scale_inv -> COMPACT.

    ``n`` is the unpadded length of the padded (last) dimension: M for 1x128
    rowwise scales, K for 128x1 columnwise scales, the number of 128-blocks
    along the inner dimension for 128x128 scales.
    """
    if scale_inv.dim() != 2 or scale_inv.shape[1] < n:
        raise ValueError(
            f"GEMM_READY scale_inv must be 2-D with at least {n} columns, "
            f"got shape {tuple(scale_inv.shape)}"
        )
    s = scale_inv[:, :n]
    return s.t().contiguous() if _transposed_in_gemm_ready(is_2D_scaled, columnwise) else s.contiguous()


def check_on_device(cond: torch.Tensor, message: str) -> None:
    """Raise ValueError on CPU; on the GPU a device-side assert (no host sync), loud all the same: the
    kernels queued after it never run on bad values. Under ``torch.compile`` the assert on every device
    (a RuntimeError on CPU): reading ``cond`` on the host would break the graph."""
    if cond.device.type == "cpu" and not torch.compiler.is_compiling():
        if not bool(cond):
            raise ValueError(message)
    else:
        torch._assert_async(cond, message)


def host_list(counts: torch.Tensor, before_host_wait: Optional[Callable[[], object]] = None) -> list[int]:
    """``counts`` (an int device tensor) as a host list: a dispatcher's one host sync, waiting for the
    copy alone. On CUDA the copy goes to pinned memory behind an event; ``before_host_wait`` runs once it
    is queued, so the GPU work that callable queues is not waited for: the GPU runs it while the host
    waits and issues the next kernels (after a plain ``tolist()`` the GPU idles until the host has issued
    them). Elsewhere: ``before_host_wait``, then ``tolist()``."""
    copied = None
    if counts.device.type == "cuda":
        host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
        counts = host.copy_(counts, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
    if before_host_wait is not None:
        before_host_wait()
    if copied is not None:
        copied.synchronize()
    return counts.tolist()


class HostSplits(list):
    """Group sizes on the host, checked once: a read-only list of ints >= 0 (a write raises TypeError) with its
    ``total`` computed when made and its ``column_blocks`` (``num_column_blocks``) when first read. ``check_m_splits``
    and ``own_m_splits`` take one in O(1) (its total compared with M; kept as it is, no copy), and the size rules
    read its cached facts (``multiple_of``, ``padded``): ``FP8FlowMoE``'s permute makes its padded splits once per
    step, and the GEMMs, transposes and FP8 tensors after it check them without walking the E sizes again (about
    twenty walks of 128 sizes per step, host time on the forward's critical path)."""

    def __init__(self, sizes):
        super().__init__(sizes)
        if not self:
            raise ValueError("HostSplits must be non-empty and >= 0, got []")
        if set(map(type, self)) != {int}:
            raise TypeError(f"HostSplits takes ints, got {[type(s).__name__ for s in self if type(s) is not int][:1]}")
        if min(self) < 0:
            raise ValueError(f"HostSplits must be non-empty and >= 0, got {list(self)}")
        self._cache_facts({})

    def _cache_facts(self, multiple_of: dict) -> None:
        """The total, and the caches of the facts read later (``multiple_of`` what is known already)."""
        self.total, self._multiple_of, self._padded, self._column_blocks = sum(self), multiple_of, {}, None

    @property
    def column_blocks(self) -> int:
        """``num_column_blocks``: the 128-row column blocks of the groups (each group starts a block)."""
        if self._column_blocks is None:
            self._column_blocks = self.total // BLOCK_SIZE if self.multiple_of(BLOCK_SIZE) else \
                sum([(s + BLOCK_SIZE - 1) // BLOCK_SIZE for s in self])
        return self._column_blocks

    def multiple_of(self, n: int) -> bool:
        """Whether every size is a multiple of ``n`` (computed once per ``n``)."""
        if n not in self._multiple_of:
            self._multiple_of[n] = all(s % n == 0 for s in self)
        return self._multiple_of[n]

    def padded(self, align: int) -> "HostSplits":
        """Each size rounded up to a multiple of ``align`` (an int >= 1), as a ``HostSplits`` made once per
        ``align`` (a permute and its ``moe_expert`` rerun pad the same counts)."""
        if type(align) is not int or align < 1:
            raise ValueError(f"align must be an int >= 1, got {align!r}")
        if align not in self._padded:
            out = HostSplits.__new__(HostSplits)
            list.__init__(out, [(s + align - 1) // align * align for s in self])  # ints >= 0: no check again
            out._cache_facts({align: True})
            self._padded[align] = out
        return self._padded[align]

    def _read_only(self, *args, **kwargs):
        raise TypeError("HostSplits is read-only (its checks and totals are cached): change a copy, list(splits)")

    append = extend = insert = pop = remove = clear = sort = reverse = _read_only
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _read_only

    def __reduce__(self):
        return HostSplits, (list(self),)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


def all_multiples_of(m_splits: Sequence[int], n: int) -> bool:
    """Whether every host size is a multiple of ``n`` (a ``HostSplits``' cached answer)."""
    return m_splits.multiple_of(n) if type(m_splits) is HostSplits else all(s % n == 0 for s in m_splits)


def check_m_splits(m_splits: MSplits, m: int, name: str = "m_splits", device=None) -> MSplits:
    """Validate group sizes for M rows: None, a host sequence of ints >= 0 summing to M, or a 1-D
    integer tensor of the same (checked with ``check_on_device``: no host sync on the GPU). Every op
    taking splits checks them here: a negative size whose sum is still M would make the kernels and
    the references index out of bounds. ``device``: where the rows live (a tensor of splits must be
    there too). Returns a new list, a ``HostSplits`` itself (read-only, checked when made: only its total is
    compared), or the tensor itself (``own_m_splits`` makes the copy a stored tensor needs)."""
    if m_splits is None:
        return None
    if type(m_splits) is HostSplits:
        if m_splits.total != m:
            raise ValueError(f"{name} must be non-empty, >= 0 and sum to M={m}, got {list(m_splits)}")
        return m_splits
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dim() != 1 or m_splits.dtype not in (torch.int32, torch.int64) or m_splits.numel() == 0:
            raise TypeError(
                f"{name} as a tensor must be a non-empty 1-D int32/int64 tensor, "
                f"got {m_splits.dtype} of shape {list(m_splits.shape)}"
            )
        if device is not None and m_splits.device != torch.device(device):
            raise ValueError(f"{name} is on {m_splits.device}, the rows it splits on {device}")
        # each size in [0, M] as well as the sum: sizes near 2**63 whose int64 sum wraps around to M once passed
        # and crashed the kernels (a segfault); bounded so, G sizes sum to at most G * M, far from wrapping
        check_on_device(((m_splits >= 0) & (m_splits <= m)).all() & (m_splits.sum() == m),
                        f"{name} must be >= 0 and sum to M={m} (each size at most M)")
        return m_splits
    if not isinstance(m_splits, (list, tuple)) or not all(type(s) is int for s in m_splits):
        raise TypeError(f"{name} must be a list of ints or an integer tensor, got {type(m_splits).__name__}")
    if len(m_splits) == 0 or min(m_splits) < 0 or sum(m_splits) != m:
        raise ValueError(f"{name} must be non-empty, >= 0 and sum to M={m}, got {list(m_splits)}")
    return list(m_splits)


@dataclasses.dataclass(frozen=True, eq=False)
class OwnedSplits:
    """Group sizes kept by an object that reads them later (``own_m_splits``). ``values``: what it computes
    with, a private list of host sizes or a clone of a device tensor, so a later write into the caller's
    splits never reaches it. ``given``: the device tensor the caller passed (None for host sizes), kept
    for its identity only (``as_given``)."""

    values: Union[list[int], torch.Tensor]
    given: Optional[torch.Tensor] = None

    def as_given(self) -> Union[list[int], torch.Tensor]:
        """What a caller compares its own splits with: a new list of the host sizes (compared by value), or
        the device tensor it passed (compared by identity: values on the device cannot be compared without a
        host sync, so "the same tensor" is the contract, and its values at the time of the copy are the ones
        the owner uses)."""
        return list(self.values) if self.given is None else self.given


def own_m_splits(m_splits: Union[MSplits, OwnedSplits], m: int, name: str = "m_splits",
                 device=None) -> Optional[OwnedSplits]:
    """``check_m_splits``, then the copy that whoever stores the splits keeps: a list of host sizes (a new
    list), a device tensor cloned (a device-side copy, no host sync; it reads the values the checks and the
    kernels queued before it read). An ``OwnedSplits`` (another owner's, shared with its storage, already
    checked) is returned as it is; None stays None."""
    if m_splits is None or isinstance(m_splits, OwnedSplits):
        return m_splits
    m_splits = check_m_splits(m_splits, m, name, device)
    if isinstance(m_splits, torch.Tensor):
        return OwnedSplits(m_splits.clone(), m_splits)
    return OwnedSplits(m_splits)


def num_column_blocks(m: int, m_splits: MSplits) -> int:
    """Rows of the 128x1 columnwise scale_inv of M rows split into groups ``m_splits``."""
    if m_splits is None:
        return -(-m // BLOCK_SIZE)
    if type(m_splits) is HostSplits:
        return m_splits.column_blocks
    if isinstance(m_splits, torch.Tensor):
        return m // BLOCK_SIZE + m_splits.numel()
    return sum(-(-s // BLOCK_SIZE) for s in m_splits)


def m_splits_tensor(m_splits, device, dtype=torch.int64) -> torch.Tensor:
    """``m_splits`` (host list or tensor) as a ``dtype`` tensor on ``device``. Read it, never write it: on
    a GPU a host list's tensor is shared (below).

    A host list goes through pinned memory with a non-blocking copy (a pageable host-to-device copy
    would sync with the host). One layer's forward and backward convert the same list about ten times
    (permute, each GEMM's group table, the transposes); each conversion was a pinned allocation and a
    copy, about 50 us of host time (Megatron ``deepseek_small`` profile, H100). So on a GPU a list's
    tensor is made once per (values, device, dtype, stream) and reused (``_device_splits``): its copy
    was queued on that stream, so readers there see it landed. Not under torch.compile (a traced
    graph makes its own copy) nor while a CUDA graph is being captured: a copy captured there reads a
    pinned buffer the graph does not own, and a graph's splits are device tensors anyway (docs/moe.md,
    "CUDA graphs")."""
    if isinstance(m_splits, torch.Tensor):
        return m_splits.to(device=device, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(list(m_splits), dtype=dtype, device=device)
    if not _may_share(device):
        return _to_device(tuple(m_splits), device, dtype)
    return _device_splits(tuple(m_splits), *_stream_key(device), dtype)


def _may_share(device: torch.device) -> bool:
    """Whether a host list's tensors on ``device`` may come from the caches below: a GPU, not under
    torch.compile and not during a CUDA graph capture (``m_splits_tensor`` says why)."""
    return device.type == "cuda" and not (torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing())


def _stream_key(device: torch.device) -> tuple[torch.device, int]:
    """(CUDA ``device`` with its index, its current stream's handle): where a cached tensor was made."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device, torch.cuda.current_stream(device).cuda_stream


def _to_device(values: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``values`` as a ``dtype`` tensor on CUDA ``device``: pinned host copy, non-blocking transfer."""
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


@functools.lru_cache(maxsize=64)
def _device_splits(values: tuple[int, ...], device: torch.device, stream: int, dtype: torch.dtype) -> torch.Tensor:
    """``_to_device`` once per (values, device, stream, dtype): the copy runs on ``stream``, where the
    caller reads it. The cached tensor is never written (``m_splits_tensor``'s readers only read)."""
    return _to_device(values, device, dtype)


@functools.lru_cache(maxsize=64)
def _device_row_groups(values: tuple[int, ...], device: torch.device, stream: int, dtype: torch.dtype) -> torch.Tensor:
    """``group_of_row`` of host sizes once per (values, device, stream, dtype), as ``_device_splits``."""
    return group_of_row(_device_splits(values, device, stream, torch.int64), sum(values), dtype)


def address_table(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """(int64 ``[G]`` tensor of the ``tensors``' data addresses on their device, whether all are 16-byte
    aligned), for kernels that read or write G separate tensors (the experts' weights, their
    ``main_grad``s). Made once per set of addresses (``_address_table``): weights and gradient buffers stay
    where they are between steps (optimizers update them in place), so later steps, and a CUDA graph
    capturing one, copy nothing from the host."""
    return _address_table(tuple(t.data_ptr() for t in tensors), tensors[0].device)


@functools.lru_cache(maxsize=256)
def _address_table(addresses: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, bool]:
    """``address_table``'s result, cached by the addresses: only they are kept, and a table's content is
    its key, so a reused address cannot make it stale."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("these tensors' addresses were not seen before the CUDA graph capture; run the step "
                           "once eagerly first (as torch.cuda.graphs requires a warm-up), so the table of their "
                           "addresses is on the GPU instead of a host copy captured in the graph")
    table = torch.tensor(addresses, dtype=torch.int64)
    table = table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table
    return table, all(a % 16 == 0 for a in addresses)


def group_of_row(sizes: torch.Tensor, m: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``[M]`` ``dtype``: the group each of the M rows belongs to, for group ``sizes`` (a device tensor
    summing to M), without a host sync."""
    return torch.repeat_interleave(torch.arange(sizes.numel(), device=sizes.device, dtype=dtype), sizes,
                                   output_size=m)


def row_groups(m_splits, m: int, device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``[M]`` ``dtype``: the group of each of the M rows split by ``m_splits`` (host list or device tensor,
    summing to M), without a host sync. Read it, never write it: for a host list on a GPU it is made once
    per (values, device, stream, dtype) and shared, as ``m_splits_tensor`` (each GEMM of a layer asks)."""
    device = torch.device(device)
    if isinstance(m_splits, torch.Tensor) or not _may_share(device):
        return group_of_row(m_splits_tensor(m_splits, device), m, dtype)
    return _device_row_groups(tuple(m_splits), *_stream_key(device), dtype)


def column_block_of_row(m: int, m_splits: MSplits, device) -> torch.Tensor:
    """int64 ``[M]``: the columnwise scale row (128x1 block) each data row belongs to.

    Computed on the device without a host sync.
    """
    rows = torch.arange(m, device=device)
    if m_splits is None:
        return rows // BLOCK_SIZE
    sizes = m_splits_tensor(m_splits, device)
    starts = torch.cumsum(sizes, 0) - sizes
    blocks = (sizes + BLOCK_SIZE - 1) // BLOCK_SIZE
    block_starts = torch.cumsum(blocks, 0) - blocks
    group = group_of_row(sizes, m)
    return block_starts[group] + (rows - starts[group]) // BLOCK_SIZE


def columnwise_index(m: int, k: int, m_splits: MSplits, device) -> torch.Tensor:
    """int64 ``[M, K]``: where element ``(r, c)`` of a logical ``[M, K]`` tensor sits in its 128x1 columnwise
    data, flattened: ``c * M + r`` without groups, ``K * first_g + c * m_g + (r - first_g)`` for row r of
    group g (expert-major). Computed on the device without a host sync (the references' gather/scatter)."""
    rows = torch.arange(m, device=device)
    cols = torch.arange(k, device=device)
    if m_splits is None:
        return cols[None, :] * m + rows[:, None]
    sizes = m_splits_tensor(m_splits, device)
    group = group_of_row(sizes, m)
    first, size = (torch.cumsum(sizes, 0) - sizes)[group], sizes[group]
    return (k * first + rows - first)[:, None] + cols[None, :] * size[:, None]


def columnwise_data_shape(m: int, k: int, m_splits: MSplits) -> tuple[int, ...]:
    """Shape of the 128x1 columnwise data of a logical ``[M, K]``: ``(K, M)``, or ``(M*K,)`` grouped."""
    return (k, m) if m_splits is None else (m * k,)


def to_columnwise(x: torch.Tensor, m_splits: MSplits) -> torch.Tensor:
    """``x [M, K]`` (any dtype) laid out as 128x1 columnwise data (``[K, M]``, or expert-major ``[M*K]``)."""
    m, k = x.shape
    if m_splits is None:
        return x.t().contiguous()
    out = torch.empty(m * k, dtype=x.dtype, device=x.device)
    _bytes(out)[columnwise_index(m, k, m_splits, x.device).view(-1)] = _bytes(x).reshape(-1)
    return out


def from_columnwise(data_t: torch.Tensor, m: int, k: int, m_splits: MSplits) -> torch.Tensor:
    """The logical ``[M, K]`` of 128x1 columnwise data (``to_columnwise``'s inverse)."""
    if m_splits is None:
        return data_t.t()
    return _bytes(data_t)[columnwise_index(m, k, m_splits, data_t.device)].view(data_t.dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """FP8 tensors as uint8 (indexing kernels have no FP8 variants); others as they are."""
    return t.view(torch.uint8) if t.element_size() == 1 else t
