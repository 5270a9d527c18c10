"""cuBLASLt's blockwise-FP8 matmul called directly (ctypes): the grouped GEMMs, one cuBLASLt call per expert.

``torch._scaled_mm`` runs the same cuBLASLt kernels, but has no beta (a wgrad added into Megatron's float32
``main_grad`` needed a float32 temporary and an add per expert), costs 37-66 us of host setup per call (H100
host), and in torch 2.11 passes 128x128 scales with a leading dimension cuBLAS does not read them with (its
pitfall: wrong results when the reduction has a number of 128-blocks that is not a multiple of 4). Here each
expert is addressed by pointer offsets into the grouped operands and their scales (no tensor per expert), each
launch names its stream (no stream switch), and the scale layouts are cuBLAS's own (CUDA 13.0's cublasLt.h and
cuBLAS's "scaling factors layouts"): an expert costs a few ctypes calls of host time (docs/grouped_gemm.md).

Both run "TN" in cuBLAS's column-major terms (Hopper's FP8 kernels take no other): ``D [mm, nn] = op_T(A) @ B``
with A stored ``[kk, mm]`` and B ``[kk, nn]`` column-major, leading dimension kk (the reduction contiguous).

- ``grouped_gemm`` (fprop, dgrad): ``out[rows of g] = a[rows of g] @ b[g]^T``. A = ``b[g]`` (the K-major weight
  ``[N, R]`` row-major, 128x128 scales: ``BLK128x128_32F``, laid out ``[N/128, pad4(R/128)]`` row-major: the
  reduction's blocks contiguous, their row padded to a multiple of 4), B = expert g's rows of ``a [M, R]``
  (1x128 scales: ``VEC128_32F``, laid out ``[R/128, m_g]`` row-major: the rows contiguous, per expert), D = its
  rows of ``out [M, N]``. The reduction R needs only be a multiple of 128.
- ``grouped_wgrad``: for each group g of ``m_g`` rows (a multiple of 128), ``out[g] [N, K] (+)= A_g [N, m_g] @
  B_g [K, m_g]^T``, where ``A_g`` is expert g's block of the expert-major columnwise copy ``a_t`` (flat FP8,
  blocks ``[N, m_g]`` expert after expert, the reduction contiguous) and its 1x128 scales are rows ``lo_g/128
  ...`` of the block-major ``a_scale_inv [sum(m)/128, N]``; the same for ``b_t``/``b_scale_inv`` with ``K``. In
  cuBLAS's terms ``out[g]^T [K, N] = op_T(A) @ B`` with A = ``B_g`` seen as ``[m_g, K]`` and B = ``A_g`` seen as
  ``[m_g, N]`` (both ``VEC128_32F`` as they lie); beta = 1 adds into ``out`` in the epilogue.

No host sync; capturable. Needs cuBLASLt >= 12.9 (the first with blockwise scales) and a Hopper GPU:
``available(device)``. The library is the one torch loaded (found in the process's mapped files), so both use
one cuBLAS.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Optional, Sequence, Union

import torch

from . import is_hopper

# The C enums used (cublasLt.h, library_types.h, cublas_api.h; checked against CUDA 13.0's, cuBLAS 13.0.2)
_R_32F, _COMPUTE_32F = 0, 68
_TYPES = {torch.float8_e4m3fn: 28, torch.float8_e5m2: 29, torch.bfloat16: 14, torch.float32: _R_32F}
_DESC_TRANSA, _DESC_TRANSB, _DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 3, 4, 17, 18
_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE, _OP_N, _OP_T = 31, 32, 0, 1
VEC128, BLK128x128 = 4, 5  # cublasLtMatmulMatrixScale_t: 1x128 blocks (activations), 128x128 (weights)
_PREF_MAX_WORKSPACE_BYTES, _HEURISTIC_RESULT_BYTES, _HEURISTIC_WORKSPACE_OFFSET = 1, 96, 64
MIN_VERSION = 120900
# Per stream that runs these GEMMs. The kernels cuBLAS picks for these shapes asked for 4 bytes (H100).
WORKSPACE_BYTES = 1 << 20
# The per-expert calls' constant arguments as ctypes objects (``_library``'s raw functions take them as they are)
_A_SCALE_ATTR, _B_SCALE_ATTR = ctypes.c_int(_DESC_A_SCALE_POINTER), ctypes.c_int(_DESC_B_SCALE_POINTER)
_POINTER_BYTES, _WORKSPACE_SIZE = ctypes.c_size_t(8), ctypes.c_size_t(WORKSPACE_BYTES)


class NoKernel(RuntimeError):
    """cuBLASLt's heuristic offers no kernel for one expert's shape (raised before any launch of the call; the
    shape is remembered). ``ops.grouped_gemm``'s "auto" then runs the call on its next backend instead of stopping
    a training run (as a Megatron run on an H200 stopped, 2026-11-27, while ``plan`` queried with null scale
    pointers: cublasStatus_t 7 for every shape)."""


def _check(status: int, what: str) -> None:
    if status:
        raise RuntimeError(f"cuBLASLt {what} failed with cublasStatus_t {status}")


@functools.lru_cache(maxsize=None)
def _library() -> Optional[ctypes.CDLL]:
    """The cuBLASLt torch loaded, with the prototypes used; None without one of at least ``MIN_VERSION``."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "libcublasLt.so" in line})
    except OSError:
        paths = []
    for path in paths + ["libcublasLt.so.13", "libcublasLt.so.12"]:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if lib.cublasLtGetVersion() < MIN_VERSION:
            return None
        p, vp, i32, sz, u64 = ctypes.POINTER, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_uint64
        lib.cublasLtCreate.argtypes = [p(vp)]
        lib.cublasLtMatmulDescCreate.argtypes = [p(vp), i32, i32]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, i32, vp, sz]
        lib.cublasLtMatrixLayoutCreate.argtypes = [p(vp), i32, u64, u64, ctypes.c_int64]
        lib.cublasLtMatmulPreferenceCreate.argtypes = [p(vp)]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, i32, vp, sz]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp] * 7 + [i32, vp, p(i32)]
        lib.cublasLtMatmul.argtypes = [vp] * 14 + [sz, vp]
        # the per-expert calls, without argtypes: given ctypes objects, they convert nothing (8.0 -> 3.5 us of host
        # time per expert's three calls on the CI's CPU, measured against a stub library)
        lib.raw_set_attribute = lib._FuncPtr(("cublasLtMatmulDescSetAttribute", lib))
        lib.raw_matmul = lib._FuncPtr(("cublasLtMatmul", lib))
        return lib
    return None


@torch.compiler.assume_constant_result
def available(device: torch.device) -> bool:
    """Whether ``grouped_gemm`` and ``grouped_wgrad`` can run on ``device``: a Hopper (SM90) GPU and cuBLASLt >= 12.9
    in the process."""
    return torch.version.cuda is not None and is_hopper(device) and _library() is not None


class _Context:
    """One device's handle, one matmul descriptor per pair of scale modes (its scale pointers set per call, under
    ``lock``), and the layouts, kernels and per-stream workspaces met so far."""

    def __init__(self, device: torch.device):
        self.lib = lib = _library()
        self.lock = threading.Lock()
        self.device, self.handle, self.pref = device, ctypes.c_void_p(), ctypes.c_void_p()
        with torch.cuda.device(device):
            _check(lib.cublasLtCreate(ctypes.byref(self.handle)), "create")
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)), "preference")
        ws = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(self.pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
               "preference attribute")
        self.descs, self.layouts, self.plans, self.workspaces, self.no_kernel = {}, {}, {}, {}, {}
        self.one, self.zero = ctypes.byref(ctypes.c_float(1.0)), ctypes.byref(ctypes.c_float(0.0))
        # Each launch's addresses go through these (set by value, the scale pointers passed by reference): no
        # ctypes object is made per launch.
        self.a, self.b, self.d, self.a_scale, self.b_scale = (ctypes.c_void_p() for _ in range(5))
        self.a_scale_ref, self.b_scale_ref = ctypes.byref(self.a_scale), ctypes.byref(self.b_scale)

    def desc(self, modes: tuple[int, int]) -> ctypes.c_void_p:
        """The "TN" matmul descriptor with A's and B's scale ``modes`` (float32 accumulation)."""
        if modes not in self.descs:
            desc = ctypes.c_void_p()
            _check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F), "descriptor")
            for attr, value in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N), (_DESC_A_SCALE_MODE, modes[0]),
                                (_DESC_B_SCALE_MODE, modes[1])):
                v = ctypes.c_int(value)
                _check(self.lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(v), 4), "descriptor attribute")
            self.descs[modes] = desc
        return self.descs[modes]

    def layout(self, dtype: torch.dtype, rows: int, cols: int) -> ctypes.c_void_p:
        """A column-major ``rows x cols`` layout with leading dimension ``rows``."""
        key = (dtype, rows, cols)
        if key not in self.layouts:
            lay = ctypes.c_void_p()
            _check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), _TYPES[dtype], rows, cols, rows), "layout")
            self.layouts[key] = lay
        return self.layouts[key]

    def set_scales(self, desc: ctypes.c_void_p, a_scale: int, b_scale: int) -> None:
        """Point ``desc``'s A and B scale pointers at these addresses (the caller holds ``lock``)."""
        self.a_scale.value, self.b_scale.value = a_scale, b_scale
        if (self.lib.raw_set_attribute(desc, _A_SCALE_ATTR, self.a_scale_ref, _POINTER_BYTES)
                or self.lib.raw_set_attribute(desc, _B_SCALE_ATTR, self.b_scale_ref, _POINTER_BYTES)):
            raise RuntimeError("cuBLASLt could not set the descriptor's scale pointers")

    def plan(self, modes: tuple[int, int], kk: int, mm: int, nn: int, a_dtype, b_dtype, d_dtype, a_scale: int,
             b_scale: int) -> tuple:
        """(descriptor, layouts A ``[kk, mm]``, B ``[kk, nn]``, D ``[mm, nn]``, the address of cuBLAS's first
        heuristic pick, the result holding it) for one expert's ``D = op_T(A) @ B``, found once per shape (the
        caller holds ``lock``). The heuristic refuses a block-scaled descriptor whose scale pointers are null
        (cublasStatus_t 7, every shape, H100 and H200): they are set to the call's ``a_scale``/``b_scale`` first."""
        key = (modes, kk, mm, nn, a_dtype, b_dtype, d_dtype)
        if key in self.no_kernel:
            raise NoKernel(self.no_kernel[key])
        if key not in self.plans:
            desc = self.desc(modes)
            self.set_scales(desc, a_scale, b_scale)
            la, lb, ld = self.layout(a_dtype, kk, mm), self.layout(b_dtype, kk, nn), self.layout(d_dtype, mm, nn)
            result, count = (ctypes.c_uint8 * _HEURISTIC_RESULT_BYTES)(), ctypes.c_int(0)
            status = self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, la, lb, ld, ld, self.pref, 1,
                                                             ctypes.addressof(result), ctypes.byref(count))
            if status or count.value == 0:
                self.no_kernel[key] = (f"cuBLASLt has no blockwise-FP8 kernel for scale modes {modes}, reduction "
                                       f"{kk}, {mm} x {nn}, {a_dtype} x {b_dtype} -> {d_dtype} (cublasStatus_t "
                                       f"{status}, {count.value} kernels)")
                raise NoKernel(self.no_kernel[key])
            assert ctypes.c_size_t.from_buffer(result, _HEURISTIC_WORKSPACE_OFFSET).value <= WORKSPACE_BYTES
            # (the algorithm is the result's first field; the result is kept alive with its address)
            self.plans[key] = (desc, la, lb, ld, ctypes.c_void_p(ctypes.addressof(result)), result)
        return self.plans[key]

    def launches(self, streams: Sequence[torch.cuda.Stream]) -> list[tuple[ctypes.c_void_p, ctypes.c_void_p]]:
        """(stream, workspace) of each of ``streams``: its workspace allocated on it once and kept for the process, as
        torch keeps cuBLAS's."""
        for s in streams:
            if s.cuda_stream not in self.workspaces:
                with torch.cuda.stream(s):
                    ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
                self.workspaces[s.cuda_stream] = (ctypes.c_void_p(s.cuda_stream), ctypes.c_void_p(ws.data_ptr()), ws)
        return [self.workspaces[s.cuda_stream][:2] for s in streams]

    def matmul(self, plan: tuple, a: int, a_scale: int, b: int, b_scale: int, d: int, beta, launch: tuple) -> None:
        """``D = op_T(A) @ B (+ D)`` at these addresses (the caller holds ``lock``), on ``launch``'s (stream,
        workspace)."""
        desc, la, lb, ld, algo, _ = plan
        self.set_scales(desc, a_scale, b_scale)
        self.a.value, self.b.value, self.d.value = a, b, d
        lib, stream, workspace = self.lib, launch[0], launch[1]
        _check(lib.raw_matmul(self.handle, desc, self.one, self.a, la, self.b, lb, beta, self.d, ld, self.d, ld, algo,
                              workspace, _WORKSPACE_SIZE, stream), "matmul")


@functools.lru_cache(maxsize=None)
def _context(device: torch.device) -> _Context:
    return _Context(device)


def _check_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if not t.is_contiguous():  # the launches address them by offsets
            raise ValueError(f"{name} must be contiguous, got strides {tuple(t.stride())}")


def grouped_gemm(a: torch.Tensor, a_scale_em: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                 m_splits: Sequence[int], out: torch.Tensor, streams: Sequence[torch.cuda.Stream]) -> None:
    """``out[rows of g] = a[rows of g] @ b[g]^T`` for every non-empty group g of the host list ``m_splits`` (one per
    weight, covering the leading rows; each a multiple of 16), launched round-robin on ``streams`` (each must wait
    for the operands and ``out``; the caller joins them). ``a [M, R]`` FP8 rowwise; ``a_scale_em`` float32, its
    1x128 scales expert-major (group g's ``[R/128, m_g]`` at element ``R/128 * lo_g``, ``expert_major_scales``);
    ``b [G, N, R]`` FP8 (not both E5M2) with 128x128 scales ``b_scale [G, N/128, pad4(R/128)]`` float32 (the last
    dimension padded to a multiple of 4); ``out [M, N]`` BF16 or float32. All contiguous. Rows after the groups
    and empty groups are left as they are."""
    _check_contiguous(a=a, a_scale_em=a_scale_em, b=b, b_scale=b_scale, out=out)
    g, n, r = b.shape
    rb, ld = r // 128, b_scale.shape[-1]
    if ld != -(-rb // 4) * 4:
        raise ValueError(f"b_scale must be [G, N/128, pad4(R/128)={-(-rb // 4) * 4}] (cuBLAS's 128x128 layout), got "
                         f"{list(b_scale.shape)}")
    ctx = _context(a.device)
    launch = ctx.launches(streams)
    pa, psa, pb, psb, po = a.data_ptr(), a_scale_em.data_ptr(), b.data_ptr(), b_scale.data_ptr(), out.data_ptr()
    row_bytes, w_scale_bytes = n * out.element_size(), 4 * (n // 128) * ld
    lo, job = 0, 0
    with ctx.lock:  # the descriptor's scale pointers are this launch's until cublasLtMatmul has read them
        plans = {size: ctx.plan((BLK128x128, VEC128), r, n, size, b.dtype, a.dtype, out.dtype, psb, psa)
                 for size in set(m_splits[:g]) if size}  # all first: NoKernel before any launch
        for e, size in enumerate(m_splits[:g]):
            if size:
                ctx.matmul(plans[size], pb + e * n * r, psb + e * w_scale_bytes, pa + lo * r, psa + 4 * rb * lo,
                           po + lo * row_bytes, ctx.zero, launch[job % len(launch)])
                job += 1
            lo += size


def grouped_wgrad(a_t: torch.Tensor, a_scale_inv: torch.Tensor, b_t: torch.Tensor, b_scale_inv: torch.Tensor,
                  m_splits: Sequence[int], out: Union[torch.Tensor, Sequence[torch.Tensor]], accumulate: bool,
                  streams: Sequence[torch.cuda.Stream]) -> None:
    """``out[g] [N, K] (+)= A_g @ B_g^T`` for every non-empty group (module docstring), launched round-robin on
    ``streams`` (each must wait for the operands and ``out``; the caller joins them). ``a_t``/``b_t``
    contiguous FP8 (not both E5M2) holding at least ``N * sum(m)`` / ``K * sum(m)`` elements; the scales
    contiguous float32 ``[>= sum(m)/128, N]`` / ``[.., K]``; ``m_splits`` a host list of multiples of 128;
    ``out`` a contiguous ``[G, N, K]`` or G contiguous ``[N, K]``, float32 or BF16 (float32 when
    ``accumulate``: NaN/inf there stay). Empty groups are left as they are."""
    _check_contiguous(a_t=a_t, a_scale_inv=a_scale_inv, b_t=b_t, b_scale_inv=b_scale_inv)
    n, k = a_scale_inv.shape[1], b_scale_inv.shape[1]
    ctx = _context(a_t.device)
    if isinstance(out, torch.Tensor):
        step = n * k * out.element_size()
        out_ptrs = range(out.data_ptr(), out.data_ptr() + step * out.shape[0], step)
        out_dtype = out.dtype
    else:
        out_ptrs, out_dtype = [o.data_ptr() for o in out], out[0].dtype if out else None
    launch = ctx.launches(streams)
    a, sa, b, sb = a_t.data_ptr(), a_scale_inv.data_ptr(), b_t.data_ptr(), b_scale_inv.data_ptr()
    beta = ctx.one if accumulate else ctx.zero
    lo, job = 0, 0
    with ctx.lock:  # the descriptor's scale pointers are this launch's until cublasLtMatmul has read them
        plans = {size: ctx.plan((VEC128, VEC128), size, k, n, b_t.dtype, a_t.dtype, out_dtype, sb, sa)
                 for size in set(m_splits) if size}  # all first: NoKernel before any launch
        for size, out_ptr in zip(m_splits, out_ptrs):
            if size:
                ctx.matmul(plans[size], b + k * lo, sb + 4 * k * (lo // 128), a + n * lo, sa + 4 * n * (lo // 128),
                           out_ptr, beta, launch[job % len(launch)])
                job += 1
            lo += size
