"""cuBLASLt's blockwise-FP8 matmul called directly (ctypes): the grouped wgrad, written or added (beta = 1).

``torch._scaled_mm`` runs the same cuBLASLt kernels, but has no beta: a wgrad added into Megatron's float32
``main_grad`` needed a float32 temporary and an add per expert, and its host setup costs 37-66 us per call
(H100 host). Here ``D = C = out`` with beta = 1 accumulates in the kernel's epilogue, and the per-expert
loop touches no tensors: pointers are offsets from the grouped operands, and each launch names its stream
(no stream switch), so an expert costs a few ctypes calls of host time (measurements: docs/grouped_gemm.md).

``grouped_wgrad(a_t, a_scale_inv, b_t, b_scale_inv, m_splits, out, accumulate, streams)``: for each group g
of ``m_g`` rows (a multiple of 128), ``out[g] [N, K] (+)= A_g [N, m_g] @ B_g [K, m_g]^T``, where ``A_g`` is
expert g's block of the expert-major columnwise copy ``a_t`` (flat FP8, blocks ``[N, m_g]`` expert after
expert, the reduction contiguous) and its 1x128 scales are rows ``lo_g/128 ...`` of the block-major
``a_scale_inv [sum(m)/128, N]``; the same for ``b_t``/``b_scale_inv`` with ``K``. In cuBLAS's column-major
terms (its FP8 kernels take "TN" only): ``out[g]^T [K, N] = op_T(A) @ B`` with A = ``B_g`` seen as
``[m_g, K]`` and B = ``A_g`` seen as ``[m_g, N]``, both with leading dimension ``m_g``; the scale layouts
are cuBLAS's ``VEC128_32F`` ones as they lie. No host sync; capturable.

Needs cuBLASLt >= 12.9 (the first with 1x128 scales) and a Hopper GPU: ``available(device)``. The library is
the one torch loaded (found in the process's mapped files), so both use one cuBLAS.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Optional, Sequence, Union

import torch

# The C enums used (cublasLt.h, library_types.h, cublas_api.h; the same in CUDA 12.9 and 13.0)
_R_32F, _COMPUTE_32F = 0, 68
_TYPES = {torch.float8_e4m3fn: 28, torch.float8_e5m2: 29, torch.bfloat16: 14, torch.float32: _R_32F}
_DESC_TRANSA, _DESC_TRANSB, _DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 3, 4, 17, 18
_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE, _SCALE_VEC128_32F, _OP_N, _OP_T = 31, 32, 4, 0, 1
_PREF_MAX_WORKSPACE_BYTES, _HEURISTIC_RESULT_BYTES, _HEURISTIC_WORKSPACE_OFFSET = 1, 96, 64
MIN_VERSION = 120900
# Per stream that runs these GEMMs. The kernels cuBLAS picks for these shapes asked for 4 bytes (H100).
WORKSPACE_BYTES = 1 << 20


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
        return lib
    return None


@torch.compiler.assume_constant_result
def available(device: torch.device) -> bool:
    """Whether ``grouped_wgrad`` can run on ``device``: a Hopper (SM90) GPU and cuBLASLt >= 12.9 in the process."""
    return (device.type == "cuda" and torch.version.cuda is not None
            and torch.cuda.get_device_capability(device)[0] == 9 and _library() is not None)


class _Context:
    """One device's handle, one matmul descriptor (its scale pointers set per call, under ``lock``), and the
    layouts, kernels and per-stream workspaces met so far."""

    def __init__(self, device: torch.device):
        self.lib = lib = _library()
        self.lock = threading.Lock()
        self.device, self.handle, self.desc, self.pref = device, ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        with torch.cuda.device(device):
            _check(lib.cublasLtCreate(ctypes.byref(self.handle)), "create")
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "descriptor")
        for attr, value in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N), (_DESC_A_SCALE_MODE, _SCALE_VEC128_32F),
                            (_DESC_B_SCALE_MODE, _SCALE_VEC128_32F)):
            v = ctypes.c_int(value)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4), "descriptor attribute")
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)), "preference")
        ws = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(self.pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
               "preference attribute")
        self.layouts, self.algos, self.workspaces = {}, {}, {}
        self.one, self.zero = ctypes.byref(ctypes.c_float(1.0)), ctypes.byref(ctypes.c_float(0.0))
        # the descriptor's scale pointers are set from these (by reference: no ctypes object per launch)
        self.a_scale, self.b_scale = ctypes.c_void_p(), ctypes.c_void_p()
        self.a_scale_ref, self.b_scale_ref = ctypes.byref(self.a_scale), ctypes.byref(self.b_scale)

    def layout(self, dtype: torch.dtype, rows: int, cols: int) -> ctypes.c_void_p:
        """A column-major ``rows x cols`` layout with leading dimension ``rows``."""
        key = (dtype, rows, cols)
        if key not in self.layouts:
            lay = ctypes.c_void_p()
            _check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), _TYPES[dtype], rows, cols, rows), "layout")
            self.layouts[key] = lay
        return self.layouts[key]

    def plan(self, m: int, n: int, k: int, a_dtype, b_dtype, out_dtype) -> tuple:
        """Layouts A, B, D and the address of cuBLAS's first heuristic pick for one expert of ``m`` rows
        (found once per shape; the descriptor's scale pointers set)."""
        key = (m, n, k, a_dtype, b_dtype, out_dtype)
        if key not in self.algos:
            la, lb, ld = self.layout(b_dtype, m, k), self.layout(a_dtype, m, n), self.layout(out_dtype, k, n)
            result, count = (ctypes.c_uint8 * _HEURISTIC_RESULT_BYTES)(), ctypes.c_int(0)
            status = self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, la, lb, ld, ld, self.pref, 1,
                                                             ctypes.addressof(result), ctypes.byref(count))
            if status or count.value == 0:
                raise RuntimeError(f"cuBLASLt has no blockwise-FP8 kernel for {key} (cublasStatus_t {status})")
            assert ctypes.c_size_t.from_buffer(result, _HEURISTIC_WORKSPACE_OFFSET).value <= WORKSPACE_BYTES
            # (the algorithm is the result's first field; the result is kept alive with its address)
            self.algos[key] = (la, lb, ld, ctypes.addressof(result), result)
        return self.algos[key]

    def workspace(self, stream: torch.cuda.Stream) -> int:
        """This stream's workspace (allocated on it, kept for the process, as torch keeps cuBLAS's)."""
        if stream.cuda_stream not in self.workspaces:
            with torch.cuda.stream(stream):
                self.workspaces[stream.cuda_stream] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8,
                                                                  device=self.device)
        return self.workspaces[stream.cuda_stream].data_ptr()


@functools.lru_cache(maxsize=None)
def _context(device: torch.device) -> _Context:
    return _Context(device)


def grouped_wgrad(a_t: torch.Tensor, a_scale_inv: torch.Tensor, b_t: torch.Tensor, b_scale_inv: torch.Tensor,
                  m_splits: Sequence[int], out: Union[torch.Tensor, Sequence[torch.Tensor]], accumulate: bool,
                  streams: Sequence[torch.cuda.Stream]) -> None:
    """``out[g] [N, K] (+)= A_g @ B_g^T`` for every non-empty group (module docstring), launched round-robin on
    ``streams`` (each must wait for the operands and ``out``; the caller joins them). ``a_t``/``b_t``
    contiguous FP8 (not both E5M2) holding at least ``N * sum(m)`` / ``K * sum(m)`` elements; the scales
    contiguous float32 ``[>= sum(m)/128, N]`` / ``[.., K]``; ``m_splits`` a host list of multiples of 128;
    ``out`` a contiguous ``[G, N, K]`` or G contiguous ``[N, K]``, float32 or BF16 (float32 when
    ``accumulate``: NaN/inf there stay). Empty groups are left as they are."""
    for name, t in (("a_t", a_t), ("a_scale_inv", a_scale_inv), ("b_t", b_t), ("b_scale_inv", b_scale_inv)):
        if not t.is_contiguous():  # the launches address them by offsets
            raise ValueError(f"{name} must be contiguous, got strides {tuple(t.stride())}")
    n, k = a_scale_inv.shape[1], b_scale_inv.shape[1]
    ctx = _context(a_t.device)
    lib, desc, handle = ctx.lib, ctx.desc, ctx.handle
    if isinstance(out, torch.Tensor):
        step = n * k * out.element_size()
        out_ptrs = range(out.data_ptr(), out.data_ptr() + step * out.shape[0], step)
        out_dtype = out.dtype
    else:
        out_ptrs, out_dtype = [o.data_ptr() for o in out], out[0].dtype if out else None
    launch = [(s.cuda_stream, ctx.workspace(s)) for s in streams]
    a, sa, b, sb = a_t.data_ptr(), a_scale_inv.data_ptr(), b_t.data_ptr(), b_scale_inv.data_ptr()
    beta = ctx.one if accumulate else ctx.zero
    lo, job = 0, 0
    with ctx.lock:  # the descriptor's scale pointers are this launch's until cublasLtMatmul has read them
        for size, out_ptr in zip(m_splits, out_ptrs):
            if size:
                ctx.a_scale.value, ctx.b_scale.value = sb + 4 * k * (lo // 128), sa + 4 * n * (lo // 128)
                _check(lib.cublasLtMatmulDescSetAttribute(desc, _DESC_A_SCALE_POINTER, ctx.a_scale_ref, 8),
                       "A scale pointer")
                _check(lib.cublasLtMatmulDescSetAttribute(desc, _DESC_B_SCALE_POINTER, ctx.b_scale_ref, 8),
                       "B scale pointer")
                la, lb, ld, algo, _ = ctx.plan(size, n, k, a_t.dtype, b_t.dtype, out_dtype)
                stream, workspace = launch[job % len(launch)]
                _check(lib.cublasLtMatmul(handle, desc, ctx.one, b + k * lo, la, a + n * lo, lb, beta, out_ptr, ld,
                                          out_ptr, ld, algo, workspace, WORKSPACE_BYTES, stream), "matmul")
                job += 1
            lo += size
