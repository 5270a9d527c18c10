"""Grouped blockwise-FP8 GEMMs through DeepGEMM (optional dependency, Hopper only).

Same signatures as ``kernels/grouped_gemm.py``. ``deep_gemm`` is imported on first
use; ``available()`` says whether it can run here. DeepGEMM's SM90 layouts, which
are ours (no copies of the operands on the way in):

- fprop/dgrad, ``m_grouped_fp8_gemm_nt_contiguous``: A ``[M, K]`` E4M3 with 1x128
  scales ``[M, K/128]`` (our COMPACT rowwise, handed over MN-major: a transposed copy, the
  TMA layout DeepGEMM would otherwise make itself), B ``[G, N, K]`` E4M3 K-major with 128x128 scales
  ``[G, N/128, K/128]``, BF16 out, and ``m_indices`` int32 ``[M]``: each row's group.
  Every group's row count must be a multiple of ``alignment()`` (128 on SM90): one
  128-row tile never spans two experts. ``m_indices`` is built on the device from
  the splits (a host list goes through one pinned non-blocking copy): no host sync,
  also for device-tensor splits (their alignment is asserted on the device).
- wgrad, ``k_grouped_fp8_gemm_nt_contiguous``: both operands expert-major (the
  grouped columnwise layout, ``layout.py``): group g's ``[N, m_g]`` block after group
  g-1's, and the block-major 128x1 scales ``[num_column_blocks, N]`` seen as the
  MN-major ``[N, sum m_g/128]`` DeepGEMM wants (a transposed view, no copy). Row counts
  each a multiple of 128, as a host list (the dispatcher's) or, where this DeepGEMM release
  reads them on the device (``device_splits_wgrad``), a device tensor (no host sync,
  CUDA-graph capturable). It computes ``D = C + A B^T`` into float32 ``[G, N, K]``: the natural
  fit for Megatron's ``main_grad`` (C = D, accumulated in place). Without ``accumulate`` the
  output is zeroed first; another ``out_dtype`` is a cast of the float32 result.

E5M2 operands (the HYBRID recipe's gradients) are not supported by DeepGEMM on SM90:
``supports`` says no and the op picks another backend.
"""

from __future__ import annotations

import functools

import torch

from . import is_hopper
from ..layout import all_multiples_of, check_on_device, m_splits_tensor, row_groups


@functools.lru_cache(maxsize=None)
def _module():
    """``deep_gemm``, or None when it cannot be imported."""
    try:
        import deep_gemm
    except ImportError:
        return None
    return deep_gemm


def import_error() -> ImportError:
    """The error raised when DeepGEMM is asked for and absent."""
    return ImportError(
        "backend='deepgemm' needs DeepGEMM (module deep_gemm >= 2.8, with a CUDA toolkit to build it): "
        "`pip install transformer_engine_moe[deepgemm]`, or build it from source "
        "(https://github.com/deepseek-ai/DeepGEMM); or use backend='auto', 'cublas' or 'triton'"
    )


# Host facts, constant for a process: torch.compile takes their value at trace time (``deep_gemm``'s functions
# are a C++ extension Dynamo cannot trace: each call was a graph break, docs/compile.md).
@torch.compiler.assume_constant_result
def available(device: torch.device) -> bool:
    """Whether DeepGEMM can run on ``device``: importable, and a Hopper (SM90) GPU."""
    return is_hopper(device) and _module() is not None


@torch.compiler.assume_constant_result
def alignment() -> int:
    """Rows per group must be a multiple of this (DeepGEMM's contiguous-layout M/K alignment)."""
    return _module().get_mk_alignment_for_contiguous_layout()


def _aligned(m_splits) -> bool:
    """A device tensor (checked on the device by the caller), or every host size a multiple of ``alignment()``
    (asked once: it calls into DeepGEMM)."""
    if isinstance(m_splits, torch.Tensor):
        return True
    return all_multiples_of(m_splits, alignment())


def supports(a_dtype: torch.dtype, b_dtype: torch.dtype, m_splits, out_dtype: torch.dtype) -> bool:
    """Whether fprop/dgrad can run here: E4M3 operands, BF16 out, groups aligned (host list; a device
    tensor's alignment is asserted on the device)."""
    return (a_dtype == b_dtype == torch.float8_e4m3fn and out_dtype == torch.bfloat16
            and _aligned(m_splits))


# DeepGEMM releases whose SM90 k-grouped wgrad takes each group's size from ``ks_tensor`` on the device (read in
# 2.8.2's source, tested bitwise against host splits on the GPU): its scheduler walks ``grouped_layout`` group by
# group and moves the TMA descriptors to each group's rows on the device; the host ``ks`` only picks the launch
# configuration (from the largest group), bounds the scale descriptors (its total) and seeds the first operand
# descriptor, which the kernel rewrites before its first load. So a device-splits wgrad gives it a nominal host
# list of the same count and total (``_nominal_ks``). Any other release: host splits only (a device tensor's wgrad
# runs on Triton), as that reading is not DeepGEMM's documented contract.
DEVICE_SPLITS_WGRAD = ("2.8.2",)


def version():
    """The installed DeepGEMM's ``__version__``: None where it is absent or its build has none."""
    return getattr(_module(), "__version__", None)


@torch.compiler.assume_constant_result
def device_splits_wgrad() -> bool:
    """Whether the installed DeepGEMM runs a wgrad on device-tensor splits (``DEVICE_SPLITS_WGRAD``)."""
    return version() in DEVICE_SPLITS_WGRAD


def supports_wgrad(a_dtype: torch.dtype, b_dtype: torch.dtype, m_splits) -> bool:
    """Whether wgrad can run here: E4M3 operands; host splits each a multiple of the alignment, or a device tensor
    (its alignment asserted on the device) where ``device_splits_wgrad``."""
    if not a_dtype == b_dtype == torch.float8_e4m3fn:
        return False
    if isinstance(m_splits, torch.Tensor):
        return device_splits_wgrad()
    return isinstance(m_splits, list) and _aligned(m_splits)


def _check_aligned_on_device(m_splits: torch.Tensor) -> None:
    """Device-tensor splits: every group a multiple of ``alignment()``, asserted on the device (no host sync)."""
    check_on_device((m_splits % alignment() == 0).all(),
                    f"deepgemm: every group's rows must be a multiple of {alignment()}")


def _m_indices(m_splits, m: int, device, num_weights: int) -> torch.Tensor:
    """int32 ``[M]``: the group of each row (DeepGEMM's ``m_indices``), -1 for the rows of a trailing
    weightless group (``g >= num_weights``: DeepGEMM skips those tiles' MMAs), without a host sync."""
    if isinstance(m_splits, torch.Tensor):
        _check_aligned_on_device(m_splits)
    groups = row_groups(m_splits, m, device, torch.int32)
    return groups if len(m_splits) <= num_weights else torch.where(groups < num_weights, groups, -1)


# DeepGEMM's JIT picks a kernel layout (block_n, cluster, stages) for each call from its shape, the total rows M
# included, and compiles every layout it meets first: one NVCC run of 2.4-6.9 s (H200). At many 128-row blocks it
# settles on one layout per (N, K); with few rows the layout moves with M (every change below 15,616 rows at the
# configurations' expert shapes: docs/grouped_gemm.md, "Layouts and M"). Under expert parallelism routing leaves
# some rank with few rows at random micro-batches, so new layouts were met, and compiled, mid-run while the other
# ranks waited at the next all-to-all: qwen3_moe_like at EP=4 (H200s) had NVCC compiles in 5 of 6 iterations and
# iterations of 7-28 s against 4.4 s with the compiles cached. So a call with fewer rows than its shape has had
# runs as one of min(MIN_ROWS, the most rows that shape has had) rows: the extra rows are a weightless group
# (m_indices -1: DeepGEMM skips their MMAs, not their A loads) and the output is the leading M rows. A shape whose
# calls always have about as many rows (EP=1: the tokens times top-k) is not padded and pays nothing.
MIN_ROWS = 32768
_MOST_ROWS: dict = {}  # (groups, N, K, device) -> the most rows a call of that shape has had in this process


def _rows_to_run(m: int, b: torch.Tensor) -> int:
    """The rows DeepGEMM runs a call of ``m`` rows on weights ``b [G, N, K]`` as: ``m``, or up to ``MIN_ROWS`` when
    calls of that shape have had more (``_MOST_ROWS``)."""
    key = (*b.shape, b.device)
    most = _MOST_ROWS[key] = max(_MOST_ROWS.get(key, 0), m)
    return max(m, min(MIN_ROWS, most))


def grouped_gemm(a, a_scale_inv, b, b_scale_inv, m_splits, out_dtype=torch.bfloat16, config=None):
    """As ``kernels.grouped_gemm.grouped_gemm``: ``a [M, R]`` E4M3 1x128, ``b [G, N, R]`` E4M3 128x128
    -> ``C [M, N]`` BF16, ``C[rows of g] = A[rows of g] @ B_g^T``; the rows of a trailing weightless
    group (``m_splits`` with G + 1 groups) are skipped by DeepGEMM and zeroed by a Triton kernel. A call with
    fewer rows than ``_rows_to_run`` says has its operands copied into buffers of that many rows (one kernel layout
    per shape under uneven routing) and ``C`` is the leading ``M`` rows of the larger output (a contiguous view)."""
    m, n = a.shape[0], b.shape[1]
    rows = _rows_to_run(m, b) if m else 0
    c = torch.empty((rows, n), dtype=out_dtype, device=a.device)
    if m:
        m_indices = _m_indices(m_splits, m, a.device, b.shape[0])
        if rows > m:
            a, a_scale_inv, m_indices = (torch.cat([t, t.new_empty((rows - m, *t.shape[1:]))])
                                         for t in (a, a_scale_inv, m_indices))
            m_indices[m:] = -1
        # the scales MN-major (a [K/128, M] copy seen as [M, K/128]), as the SM90 kernel reads them: DeepGEMM then
        # skips its own transform (a JIT lookup and a launch on the host), which sat on the host-bound path into the
        # GEMM where the GPU idled 0.2-0.4 ms per call at small experts (H200, qwen3_moe_like; docs/grouped_gemm.md);
        # M is a multiple of 128, so TMA-aligned
        sfa = a_scale_inv.t().contiguous().t()
        _module().m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, b_scale_inv), c, m_indices)
        c = c[:m]
        from .grouped_gemm import zero_weightless_rows  # Triton: present wherever DeepGEMM runs

        zero_weightless_rows(c, m_splits, b.shape[0])
    return c


def grouped_gemm_wgrad(a_t, a_t_scale_inv, b_t, b_t_scale_inv, m_splits, out=None, accumulate=False,
                       out_dtype=torch.float32, config=None):
    """As ``kernels.grouped_gemm.grouped_gemm_wgrad``, on expert-major operands: ``C_g [N, K] =
    A_g^T B_g`` over group g's rows, float32 accumulation into ``out`` (added to it when
    ``accumulate``) or a new ``[G, N, K]`` tensor in ``out_dtype``. ``m_splits``: G sizes of the leading rows (those
    after them, a weightless group, are never read), a host list or, where ``device_splits_wgrad``, a device tensor."""
    if isinstance(out, list):
        raise ValueError("deepgemm: wgrad's out must be one float32 [G, N, K] tensor (DeepGEMM's D), not a list")
    n, k, groups = a_t_scale_inv.shape[1], b_t_scale_inv.shape[1], len(m_splits)
    d = out if out is not None else torch.empty((groups, n, k), dtype=torch.float32, device=a_t.device)
    if not accumulate:
        d.zero_()
    if groups:
        if isinstance(m_splits, torch.Tensor):
            _check_aligned_on_device(m_splits)
            # the groups lie in the leading whole 128-row blocks of the operands' M rows (each group aligned); the
            # kernel reads their sizes from the device tensor and never reaches the rows after them
            rows = a_t.numel() // max(n, 1) // 128 * 128
            ks, ks_tensor = _nominal_ks(rows, groups), m_splits.to(torch.int32).contiguous()
        else:
            rows = sum(m_splits)
            ks, ks_tensor = list(m_splits), m_splits_tensor(m_splits, a_t.device, torch.int32)
        blocks = rows // 128  # whole 128-row column blocks (every group aligned)
        _module().k_grouped_fp8_gemm_nt_contiguous(
            (a_t.view(-1)[:rows * n], a_t_scale_inv[:blocks].t()),
            (b_t.view(-1)[:rows * k], b_t_scale_inv[:blocks].t()), d, ks, ks_tensor, c=d)
    return d if out is not None or out_dtype == torch.float32 else d.to(out_dtype)


def _nominal_ks(rows: int, groups: int) -> list[int]:
    """The host ``ks`` of a device-splits wgrad (``DEVICE_SPLITS_WGRAD``): ``groups`` multiples of 128 summing to
    ``rows`` (a multiple of 128), as even as they go: the balanced routing, whose largest group picks the launch
    configuration a host-splits call of that routing gets."""
    each = rows // 128 // groups * 128
    return [rows - each * (groups - 1)] + [each] * (groups - 1)
