"""Grouped blockwise-FP8 GEMMs over experts: ``grouped_gemm`` (fprop, dgrad) and ``grouped_gemm_wgrad``.

Operands are ``Float8BlockwiseQTensor``s: activations and gradients 1x128
(rowwise COMPACT for fprop/dgrad, the grouped 128x1 columnwise copy for wgrad),
weights 128x128 stacked as ``[G, N, K]``. Backends (columns of ``backend.IMPLEMENTATIONS``, one module
each, same signatures):

- ``"deepgemm"`` (``kernels/grouped_gemm_deepgemm.py``, optional): DeepGEMM's grouped
  kernels, one launch per GEMM. E4M3 only, groups of multiples of 128 rows; fprop/dgrad
  take host or device splits (no host sync), wgrad too on the DeepGEMM releases checked to read
  them on the device (``DEVICE_SPLITS_WGRAD``), else host splits.
- ``"cublas"``: one cuBLASLt GEMM per non-empty expert (``kernels/cublaslt.py``; wgrads added into
  ``main_grad`` in place); host ``m_splits``, fprop/dgrad groups of multiples of 16 rows (any reduction
  dim), wgrad groups of multiples of 128 rows, see ``kernels/grouped_gemm_cublas.py``.
- ``"triton"``: one launch per GEMM over all experts; group sizes read on the
  device (``m_splits`` may be a device tensor: no host sync, CUDA-graph safe); any sizes.
- ``"gluon"`` (``kernels/grouped_gemm_gluon.py``, Hopper under Triton 3.6): as ``"triton"`` (one launch, host or
  device splits, bitwise the same output) on warp-specialized Gluon kernels: fprop/dgrad for N a multiple of 256;
  a written wgrad (BF16 or float32, one ``[G, N, K]``) for groups of multiples of 16 rows (device splits: asserted
  on the device), its other wgrads on Triton's kernel.

Every backend takes a trailing weightless group (``m_splits`` with one group more than the weight
has experts): fprop/dgrad write zeros there without computing them, wgrad (``num_groups``) never
reads those rows. ``FP8FlowMoE(device_splits=True)`` puts its worst-case buffer's slack there.
- ``"reference"``: plain PyTorch in float32 (the oracle, and the CPU path).
- ``"auto"``: on the GPU, the first of ``AUTO_ORDER`` that can run the call (and, for
  cuBLAS, only experts large enough: ``cublas_pays``); the reference on CPU. The one place this is
  decided: ``auto_backend`` on a ``GemmCall`` (the kernels' modules say only what they can run).
  The order was measured (docs/grouped_gemm.md, ``benchmarks/bench_grouped_gemm.py``): DeepGEMM
  for fprop/dgrad, cuBLAS for wgrads (written in BF16 or float32, or added into ``main_grad``).

Host splits: the cuBLAS backend reads the per-expert row counts on the host (so does DeepGEMM's
wgrad on a release not in ``DEVICE_SPLITS_WGRAD``). It uses the list the dispatcher already holds
(``tokens_per_expert``), never a copy of a device tensor: a device tensor sends those calls to
DeepGEMM (wgrads: ``deepgemm_pays``), Gluon or Triton. What the kernels read of a
host list on the device (group sizes, DeepGEMM's per-row groups) is made once per (splits, stream)
and shared by the layer's GEMMs and transposes (``layout.m_splits_tensor``, ``layout.row_groups``).

Alignment: K and N multiples of 128 (the weights' 128x128 blocks).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Sequence, Union

import torch

from ..backend import IMPLEMENTATIONS, Implementation, implementation
from ..kernels import cublaslt, grouped_gemm_cublas as cublas, grouped_gemm_deepgemm as deepgemm  # no Triton import
from ..layout import HostSplits, MSplits, check_m_splits
from ..recipe import check_bool
from ..tensor.float8_blockwise_tensor import Float8BlockwiseQTensor

GEMM_BACKENDS = ("auto", "deepgemm", "cublas", "gluon", "triton", "reference")
# "auto"'s preference on the GPU, per GEMM kind: the first backend that can run the call. Measured at
# DeepSeek-V3 expert shapes, 512 to 16384 rows per expert (H100, docs/grouped_gemm.md): DeepGEMM leads
# fprop/dgrad (1.09-1.31 PFLOP/s); for a wgrad written in BF16 DeepGEMM has to zero, accumulate and cast a
# float32 copy (131-874 TFLOP/s) where cuBLAS writes BF16 (564-960), or float32 straight into ``out``
# (538-940 against DeepGEMM's 174-911); a wgrad added into float32 (Megatron's main_grad) is cuBLASLt's
# beta = 1 (522 / 517 at 1024 rows, 784 / 763 at 2048, fc1 / fc2) ahead of DeepGEMM's C = D (377 / 385,
# 768 / 739) and Triton's (389 / 384, 542 / 487), and it also runs on G separate main_grads (Megatron's DDP).
# Gluon's fprop/dgrad (persistent) before Triton's, after cuBLAS's where that pays: H200, 2026-12-02
# (bench_grouped_gemm_gluon_h200.md, one backend after another): 1000-1090 TFLOP/s at DeepSeek-V3's four GEMMs from
# 1024 to 16384 rows per expert against Triton's 689-786; cuBLAS per expert level to 7% ahead from 2048 rows
# (1010-1150; fc1 1120-1150 against 1080) for 1-3 ms of host time a call against Gluon's 0.4-0.8; level or behind
# at 1024 rows (fc2 961 against 1000), where ``cublas_pays`` leaves it out. docs/grouped_gemm.md.
# Gluon's written wgrad before Triton's at every size: H200, 2026-12-02 18:06 (bench_grouped_gemm_gluon_h200.md, 128x192
# tiles), TFLOP/s fc1 / fc2, BF16 out: 739 / 713 against 597 / 587 at 1024 rows per expert, 800 / 778 against 686 /
# 678 at 2048, 828 / 818 against 735 / 658 at 4096, 832 / 828 against 667 / 648 at 16384. docs/grouped_gemm.md.
# A wgrad rounded to BF16 into ``out`` ("wgrad_rounded": DDP's hook's sums, ``GroupedLinear.add_wgrad_into_main_grad``):
# Triton rounds and adds in its epilogue, where cuBLAS and DeepGEMM write the BF16 gradient and it is then added, a
# pass over ``main_grad``; so cuBLAS needs larger experts there (``CUBLAS_MIN_MEAN_ROWS``).
AUTO_ORDER = {"fprop": ("deepgemm", "cublas", "gluon", "triton"), "wgrad": ("cublas", "deepgemm", "gluon", "triton"),
              "wgrad_accumulate": ("cublas", "deepgemm", "triton"), "wgrad_rounded": ("cublas", "deepgemm", "triton")}
# A written wgrad on DeepGEMM (a zeroed float32 [G, N, K] accumulated, then cast: 4 bytes per weight element for
# the call) pays only for large experts. Device splits (the CUDA-graph path, where cuBLAS cannot run), H200
# 2026-11-28, TFLOP/s (fc1 / fc2): 583 / 587 against Triton's 624 / 622 at 2048 rows per expert, 729 / 714 against
# 713 / 654 at 4096 (H100, 8192 and 16384 rows: 785-874 against 589-702). In the captured DeepSeek-V3 block
# (bench_moe_layer, two calls on two machines) it took 8 experts of 16384 rows from 43.0 to 39.4 ms, peak 5.67 ->
# 5.79 GiB, but 32 of 4096 from 44.6 to 44.1 ms for 7.96 -> 11.5 GiB (the float32 copy of 32 experts' fc1
# gradient). So "auto" takes it for a written wgrad only where the experts average this many rows.
DEEPGEMM_WRITTEN_MIN_MEAN_ROWS = 8192
# "auto" takes cuBLAS only for experts this large on average: below it, its one launch per expert costs
# more host time than GPU time (all three GEMMs on cuBLAS, 128 experts of ~512 rows: 89 ms step for 65 ms
# of GPU work). A BF16 wgrad at 512 rows still pays: 601/451 TFLOP/s (fc1/fc2) against Triton's 380/374,
# and the EP=2 block (128 experts of ~512 rows, DeepGEMM fprop/dgrad) went from 45.7 to 39.0 ms on H200s;
# so does one added into float32 (H100: 265 / 266 against Triton's 236 / 242 and DeepGEMM's 219 / 221).
# A rounded wgrad added into main_grad (H200, 2026-11-28, bench_grouped_gemm_rounded_h200.md, TFLOP/s fc1 / fc2):
# Triton's epilogue 435 / 434 against cuBLAS written then added 349 / 346 at 1024 rows, 588 / 578 against 512 / 510
# at 2048; level at 4096 (683 / 601 against 668 / 669; another call 696 / 617 against 635 / 627), where Triton needs
# no BF16 [G, N, K] gradient beside main_grad; cuBLAS 778 / 779 against 647 / 618 at 8192, 846 / 837 at 16384.
CUBLAS_MIN_MEAN_ROWS = {"fprop": 2048, "wgrad": 512, "wgrad_accumulate": 512, "wgrad_rounded": 8192}
# Those rows were measured on DeepSeek-V3's smaller expert weight (fc2, 2048 x 7168 elements). A smaller
# weight is less GPU time per launch, so cuBLAS also needs that many multiply-adds per expert: Megatron's
# deepseek_small (weights 2048 x 2048 and 1024 x 2048, 512 rows per expert, EP=1, one H200) ran host-bound
# with cuBLAS wgrads, 145 ms per iteration for 105 ms of GPU work.
CUBLAS_MIN_WEIGHT = 2048 * 7168


def deepgemm_pays(call: "GemmCall") -> bool:
    """Whether "auto" may take DeepGEMM for ``call``: always but for a written (or rounded) wgrad, there where the
    experts average ``DEEPGEMM_WRITTEN_MIN_MEAN_ROWS`` rows (``call.rows`` over the groups: known on the host for
    device splits too)."""
    groups = len(call.m_splits)
    written = call.kind in ("wgrad", "wgrad_rounded")
    return not written or groups > 0 and call.rows >= DEEPGEMM_WRITTEN_MIN_MEAN_ROWS * groups


def cublas_pays(kind: str, m_splits: list, weight_elements: int) -> bool:
    """Whether "auto" may take cuBLAS for a ``kind`` GEMM (``AUTO_ORDER``'s keys) over ``m_splits`` (a host
    list) with ``[N, K]`` expert weights of ``weight_elements``: the experts average at least
    ``CUBLAS_MIN_MEAN_ROWS[kind]`` rows and that many rows of a ``CUBLAS_MIN_WEIGHT`` weight's work."""
    rows = CUBLAS_MIN_MEAN_ROWS[kind]
    total = m_splits.total if type(m_splits) is HostSplits else sum(m_splits)
    return total >= rows * len(m_splits) and total * weight_elements >= rows * CUBLAS_MIN_WEIGHT * len(m_splits)


@dataclasses.dataclass(frozen=True)
class GemmCall:
    """What decides the backend of one grouped GEMM call (``why_not``, ``auto_backend``), as plain values: the rule
    runs, and is tested, without a GPU. ``kind``: an ``AUTO_ORDER`` key ("fprop" for fprop and dgrad, "wgrad"
    written, "wgrad_accumulate" added into float32 ``out``, "wgrad_rounded" rounded to BF16 into it); the operands'
    FP8 dtypes (the first: X, dY or dY^T); ``m_splits`` (host list or device tensor); the output dtype;
    ``weight_elements``: N x K of one expert's weight (``cublas_pays``); ``out_list``: a wgrad's ``out`` is G separate
    tensors; ``cuda``: the operands are on a GPU, where ``deepgemm`` (importable, Hopper), ``cublaslt`` (>= 12.9,
    Hopper) and ``gluon`` (Hopper, Triton 3.6) can run or not; ``n``: the output's columns (the Gluon kernel's tiles
    are 256 wide); ``rows``: M, the rows the splits divide (``deepgemm_pays``)."""

    kind: str
    a_dtype: torch.dtype
    b_dtype: torch.dtype
    m_splits: MSplits
    out_dtype: torch.dtype
    weight_elements: int = 0
    out_list: bool = False
    cuda: bool = True
    deepgemm: bool = False
    cublaslt: bool = False
    gluon: bool = False
    n: int = 0
    rows: int = 0

    @classmethod
    def of(cls, kind: str, a: torch.Tensor, b_dtype: torch.dtype, m_splits, out_dtype: torch.dtype,
           weight_elements: int = 0, out_list: bool = False, n: int = 0, rows: int = 0) -> "GemmCall":
        """The call on ``a`` (the first operand's FP8 data) and its device."""
        return cls(kind, a.dtype, b_dtype, m_splits, out_dtype, weight_elements, out_list, a.is_cuda,
                   a.is_cuda and deepgemm.available(a.device), a.is_cuda and cublaslt.available(a.device),
                   a.is_cuda and gluon_available(a.device), n, rows)


@functools.cache
def _gluon():
    """``kernels.grouped_gemm_gluon``; only where its column is in ``IMPLEMENTATIONS`` (Triton 3.6 importable)."""
    from ..kernels import grouped_gemm_gluon

    return grouped_gemm_gluon


@torch.compiler.assume_constant_result  # a host fact (GemmCall.of runs in every GEMM call, traced too)
def gluon_available(device: torch.device) -> bool:
    """Whether the Gluon kernel runs on ``device``: it imports (Triton with the Gluon API) and ``available`` says
    so (a Hopper GPU under Triton 3.6)."""
    return "gluon" in IMPLEMENTATIONS and _gluon().available(device)


def why_not(backend: str, call: GemmCall) -> Optional[str]:
    """None if GPU ``backend`` can run ``call``, else the reason it cannot."""
    if backend not in IMPLEMENTATIONS:
        return "it needs Triton installed"
    if backend == "triton":
        return None
    if not call.cuda:
        return "it needs CUDA tensors"
    wgrad = call.kind != "fprop"
    if backend == "gluon":
        if not call.gluon:
            return "it needs a Hopper (SM90) GPU and Triton 3.6 (the Gluon API it is written against)"
        if wgrad:
            return None  # what its kernel does not take (grouped_gemm_gluon.takes_wgrad) runs on Triton's
        return None if _gluon().supports(call.a_dtype, call.b_dtype, call.n, call.out_dtype) else (
            f"it needs FP8 operands and N a multiple of {_gluon().BLOCK_N}, got N={call.n}")
    if backend == "deepgemm":
        if not call.deepgemm:
            return "DeepGEMM is not installed or the GPU is not a Hopper (SM90)"
        if call.out_list:
            return "it writes one float32 [G, N, K] buffer, and out is G separate tensors"
        ok = (deepgemm.supports_wgrad(call.a_dtype, call.b_dtype, call.m_splits) if wgrad
              else deepgemm.supports(call.a_dtype, call.b_dtype, call.m_splits, call.out_dtype))
        if ok:
            return None
        where = (f" as a host list (its wgrad takes device-tensor splits in DeepGEMM "
                 f"{' or '.join(deepgemm.DEVICE_SPLITS_WGRAD)} only, found "
                 f"{deepgemm.version() or 'no version'})"
                 if wgrad and isinstance(call.m_splits, torch.Tensor) else "")
        return (f"it needs E4M3 operands{'' if wgrad else ', BF16 output'}, and groups of multiples of "
                f"{deepgemm.alignment()} rows{where}")
    if not call.cublaslt:
        return "it needs a Hopper (SM90) GPU and cuBLASLt >= 12.9 (blockwise scales) in the process"
    if wgrad:
        return None if cublas.supports_wgrad(call.a_dtype, call.b_dtype, call.m_splits) else (
            "it needs m_splits as a host list, every group a multiple of 128 rows, and not both operands E5M2")
    return None if cublas.supports(call.a_dtype, call.b_dtype, call.m_splits, call.out_dtype) else (
        f"it needs m_splits as a host list, every group a multiple of {cublas.ROW_ALIGNMENT} rows, BF16 or "
        f"float32 output (got {call.out_dtype}), and not both operands E5M2")


def auto_backend(call: GemmCall, skip: tuple = ()) -> Optional[str]:
    """The backend ``"auto"`` runs ``call`` on: on the GPU the first of ``AUTO_ORDER[call.kind]`` (less ``skip``)
    that can run it, cuBLAS and DeepGEMM only where they pay (``cublas_pays``, ``deepgemm_pays``); None where none
    can (the reference off the GPU)."""
    if not call.cuda:
        return None
    for name in (n for n in AUTO_ORDER[call.kind] if n not in skip):
        if name == "cublas" and isinstance(call.m_splits, list) and not cublas_pays(call.kind, call.m_splits,
                                                                                     call.weight_elements):
            continue
        if name == "deepgemm" and not deepgemm_pays(call):
            continue
        if why_not(name, call) is None:
            return name
    return None


def _impl(backend: str, call: GemmCall, a: torch.Tensor, op: str) -> Implementation:
    """The implementation running ``op`` (``call`` on the operands, ``a`` the first one's FP8 data)."""
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"{op}: backend must be one of {GEMM_BACKENDS}, got {backend!r}")
    if backend in ("deepgemm", "cublas", "gluon"):
        if backend == "deepgemm" and deepgemm._module() is None:
            raise deepgemm.import_error()
        why = why_not(backend, call)
        if why:
            raise ValueError(f"{op}: backend={backend!r} cannot run this call: {why}; use 'auto' or 'triton'")
        return IMPLEMENTATIONS[backend]
    name = auto_backend(call) if backend == "auto" else None
    return IMPLEMENTATIONS[name] if name else implementation(backend, a, op)


def _run(backend: str, call: GemmCall, a: torch.Tensor, op: str, run: Callable[[Implementation], object]):
    """``run`` on the implementation of ``op`` (``_impl``). Under "auto", a call sent to cuBLAS for whose shapes
    cuBLASLt has no kernel (``cublaslt.NoKernel``, raised before any launch) runs on the next backend of
    ``AUTO_ORDER`` instead; with ``backend="cublas"`` the error stands."""
    impl = _impl(backend, call, a, op)
    try:
        return run(impl)
    except cublaslt.NoKernel:
        if backend != "auto":
            raise
        return run(IMPLEMENTATIONS[auto_backend(call, skip=("cublas",))])


def _check_act(t, name: str, usage: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(t, Float8BlockwiseQTensor):
        raise TypeError(f"{name} must be a Float8BlockwiseQTensor (1x128), got {type(t).__name__}")
    if t.is_2D_scaled or t.dim() != 2:
        raise ValueError(f"{name} must be a 2-D 1x128-scaled tensor [M, K], got shape {list(t.shape)}"
                         f"{' with 128x128 scales' if t.is_2D_scaled else ''}")
    data = t.rowwise_data if usage == "rowwise" else t.columnwise_data
    if data is None:
        raise ValueError(f"{name} has no {usage} data (usages: {t.usages})")
    if t.shape[1] % 128:
        raise ValueError(f"{name}: the reduction/feature dim must be a multiple of 128, got shape {list(t.shape)}")
    if usage == "rowwise":  # stored contiguous (the tensor's rule)
        return data, t.rowwise_scale_inv
    # a columnwise copy may be a strided view (the tensor keeps split's column slices): the kernels read densely
    return data.contiguous(), t.columnwise_scale_inv.contiguous()


def _check_splits(m_splits: MSplits, m: int, groups: Optional[int], device) -> tuple[MSplits, int]:
    """Validated ``(m_splits, number of groups)``; ``groups``: the weight's experts, which the splits have,
    or one more: a trailing weightless group (None: any count)."""
    if m_splits is None:
        raise ValueError("m_splits is required: a host list or a device int tensor of per-expert row counts")
    m_splits = check_m_splits(m_splits, m, device=device)
    n = len(m_splits) if isinstance(m_splits, list) else m_splits.numel()
    if groups is not None and n not in (groups, groups + 1):
        raise ValueError(f"m_splits has {n} groups but the weight has {groups} experts (m_splits takes {groups} "
                         f"groups, or {groups + 1}: the last one weightless)")
    return m_splits, n


def check_grouped_weight(weight, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """``(data [G, N, K], scale_inv [G, N/128, K/128])`` of a stacked 128x128 FP8 weight."""
    if not isinstance(weight, Float8BlockwiseQTensor):
        raise TypeError(f"{name} must be a Float8BlockwiseQTensor [G, N, K] (128x128), got {type(weight).__name__}")
    if not weight.is_2D_scaled or weight.dim() != 3 or weight.rowwise_data is None:
        raise ValueError(f"{name} must be 128x128-scaled rowwise [G, N, K], got shape {list(weight.shape)}, "
                         f"is_2D_scaled={weight.is_2D_scaled}, usages {weight.usages}")
    g, n, k = weight.shape
    if n % 128 or k % 128:
        raise ValueError(f"{name}: N and K must be multiples of 128, got [G={g}, N={n}, K={k}]")
    return weight.rowwise_data.view(g, n, k), weight.rowwise_scale_inv.view(g, n // 128, k // 128)


def grouped_gemm(inp: Float8BlockwiseQTensor, weight: Float8BlockwiseQTensor, m_splits: MSplits, *,
                 out_dtype: torch.dtype = torch.bfloat16, backend: str = "auto") -> torch.Tensor:
    """``out[rows of g] = inp[rows of g] @ weight[g]^T``: ``inp [M, K]`` 1x128 rowwise, ``weight
    [G, N, K]`` 128x128 -> ``[M, N]`` in ``out_dtype``. fprop passes the weights, dgrad their
    ``ops.transpose.transpose_grouped_weight`` and the output gradient as ``inp``. Not differentiable (see
    ``module.GroupedLinear``). ``m_splits``: G row counts summing to M, or G + 1 whose last group is
    weightless: its rows of ``out`` are zero and no backend computes them (the slack of a worst-case
    buffer sized without a host sync: ``FP8FlowMoE(device_splits=True)``)."""
    a, a_scale = _check_act(inp, "inp", "rowwise")
    b, b_scale = check_grouped_weight(weight)
    if inp.shape[1] != weight.shape[2]:
        raise ValueError(f"inp has {inp.shape[1]} features but weight expects K={weight.shape[2]} "
                         f"(weight shape {list(weight.shape)})")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"out_dtype must be bf16/fp16/fp32, got {out_dtype}")
    m_splits, _ = _check_splits(m_splits, inp.shape[0], weight.shape[0], a.device)
    call = GemmCall.of("fprop", a, b.dtype, m_splits, out_dtype, weight_elements=weight.shape[1] * weight.shape[2],
                       n=weight.shape[1], rows=inp.shape[0])
    return _run(backend, call, a, "grouped_gemm",
                lambda impl: impl.grouped_gemm(a, a_scale, b, b_scale, m_splits, out_dtype))


def stacked_view(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """G contiguous ``[N, K]`` of one dtype (``_check_wgrad_out`` checked them) as one ``[G, N, K]`` view where
    they lie one after another in one storage, else None (e.g. Megatron's DDP, which lays parameters'
    ``main_grad``s out in reverse order)."""
    t0 = tensors[0]
    step = t0.numel()
    for i, t in enumerate(tensors):
        if (t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr()
                or t.storage_offset() != t0.storage_offset() + i * step):
            return None
    return t0.as_strided((len(tensors), *t0.shape), (step, *t0.stride()))


def check_disjoint(tensors: Sequence[torch.Tensor], name: Union[str, Sequence[str]],
                   nbytes: Optional[int] = None) -> None:
    """Raise ValueError naming two of ``tensors`` (on one device; ``name[i]``, or the names given as a list) that
    share memory: a buffer given twice (one ``main_grad`` for two experts) once had two experts' gradients written,
    or raced, into it silently. The one implementation of this check: a wgrad's ``out`` list (``_check_wgrad_out``,
    every call) and ``GroupedLinear``'s weights' ``main_grad``s (in forward) call it. Host-side: contiguous tensors
    by their address ranges, sorted by start (an overlap shows between neighbours); a strided one (whose range may
    interleave with another's without sharing an element) by its first address only. ``nbytes``: every tensor is
    known contiguous and that long (a wgrad's ``out`` list), so their addresses alone say it (about 25 us of host
    time for 128 tensors, against 80)."""
    if nbytes is not None:
        starts = sorted(t.data_ptr() for t in tensors)
        if not nbytes or all(b - a >= nbytes for a, b in zip(starts, starts[1:])):
            return
        spans = sorted((p, p + nbytes, i) for i, p in enumerate(t.data_ptr() for t in tensors))  # to name them
    else:
        spans = sorted((p, p + t.element_size() * t.numel() if t.is_contiguous() else p + 1, i)
                       for i, t in enumerate(tensors) if t.numel() for p in (t.data_ptr(),))
    for (first, end, i), (start, _, j) in zip(spans, spans[1:]):
        if start < end or start == first:
            a, b = (f"{name}[{k}]" if isinstance(name, str) else name[k] for k in sorted((i, j)))
            raise ValueError(f"{a} and {b} share memory: each group needs its own buffer (e.g. one main_grad per "
                             "expert)")


def _check_wgrad_out(out, shape: tuple[int, int, int], device) -> Union[torch.Tensor, list, None]:
    """``out`` validated: a contiguous float32 ``[G, N, K]``, or G contiguous float32 ``[N, K]`` no two of which
    share memory (as one ``[G, N, K]`` view where they lie in order, else a list)."""
    if out is None or isinstance(out, torch.Tensor):
        if out is not None and (out.dtype != torch.float32 or tuple(out.shape) != shape or not out.is_contiguous()
                                or out.device != device):  # another device's out once came back unwritten
            raise ValueError(f"out must be a contiguous float32 tensor of shape {list(shape)} on {device} (or a list "
                             f"of {shape[0]} [N, K]), got {out.dtype} {list(out.shape)} on {out.device}")
        return out
    if not isinstance(out, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in out):
        raise TypeError(f"out must be a tensor or a list of tensors, got {type(out).__name__}")
    bad = [i for i, t in enumerate(out) if t.dtype != torch.float32 or tuple(t.shape) != shape[1:]
           or not t.is_contiguous() or t.device != device]
    if len(out) != shape[0] or bad:
        raise ValueError(f"out as a list must hold {shape[0]} contiguous float32 [{shape[1]}, {shape[2]}] tensors "
                         f"on {device} (one per group); got {len(out)}"
                         + (f", out[{bad[0]}] is {out[bad[0]].dtype} {list(out[bad[0]].shape)} on "
                            f"{out[bad[0]].device}" if bad else ""))
    check_disjoint(out, "out", nbytes=4 * shape[1] * shape[2])  # each checked above: contiguous float32 [N, K]
    if not out:
        return list(out)
    stacked = stacked_view(out)
    return stacked if stacked is not None else list(out)


def grouped_gemm_wgrad(grad_output: Float8BlockwiseQTensor, inp: Float8BlockwiseQTensor, m_splits: MSplits, *,
                       out: Union[torch.Tensor, Sequence[torch.Tensor], None] = None, accumulate: bool = False,
                       out_dtype: torch.dtype = torch.float32, num_groups: Optional[int] = None,
                       backend: str = "auto"):
    """``dW[g] = grad_output[rows of g]^T @ inp[rows of g]`` -> ``[G, N, K]`` float32, from the grouped
    (expert-major) 128x1 columnwise copies of ``grad_output [M, N]`` and ``inp [M, K]`` (scaling-aware
    transpose with these ``m_splits``). ``out``: float32 written, or added to when ``accumulate``
    (Megatron's ``main_grad`` fusion): one ``[G, N, K]`` buffer, or a list of G ``[N, K]`` anywhere in memory
    but no two sharing any (ValueError naming them): each expert's ``main_grad``; DeepGEMM needs one buffer, so
    a list that is not one runs on cuBLAS or Triton. Returned as given. Without ``out``, a new tensor in
    ``out_dtype`` (FP32 accumulation, one rounding at the end). With ``out`` and ``out_dtype`` BF16, each sum is
    rounded to BF16 before it is written or added: what writing or adding a BF16 gradient into ``out`` gives
    (Megatron DDP's hook without gradient-accumulation fusion), bit for bit; in Triton's epilogue, while cuBLAS and
    DeepGEMM (which hand over float32 sums) write the BF16 gradient, which is then added ("auto": ``AUTO_ORDER``'s
    "wgrad_rounded"). ``num_groups``: the gradients of the first ``num_groups`` groups only (None: all); one less
    than the groups of ``m_splits`` leaves out a trailing weightless group (``grouped_gemm``), whose rows no backend
    reads."""
    a, a_scale = _check_act(grad_output, "grad_output", "columnwise")
    b, b_scale = _check_act(inp, "inp", "columnwise")
    if grad_output.shape[0] != inp.shape[0]:
        raise ValueError(f"grad_output has {grad_output.shape[0]} rows, inp {inp.shape[0]}")
    m_splits, groups = _check_splits(m_splits, inp.shape[0], None, a.device)
    for name, t in (("grad_output", grad_output), ("inp", inp)):
        own = t.columnwise_m_splits
        if (own is not m_splits) and not (isinstance(own, list) and own == m_splits):
            raise ValueError(f"{name}'s columnwise copy is grouped by "
                             f"{own if isinstance(own, list) else 'another tensor'}, not by these m_splits; "
                             "transpose it with the same m_splits")
    if num_groups is not None:
        if type(num_groups) is not int or num_groups not in (groups, groups - 1):
            raise ValueError(f"num_groups must be None, {groups} or {groups - 1} (m_splits' groups, or one less: "
                             f"a trailing weightless group), got {num_groups!r}")
        if num_groups < groups:
            m_splits, groups = m_splits[:num_groups], num_groups  # a device tensor's view: no host sync
    shape = (groups, grad_output.shape[1], inp.shape[1])
    given, out = out, _check_wgrad_out(out, shape, a.device)
    check_bool(accumulate, "accumulate")  # "no" once added into out
    if accumulate and out is None:
        raise ValueError("accumulate=True needs out (the main_grad buffer)")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"out_dtype must be torch.float32 or torch.bfloat16, got {out_dtype}")
    rounded = out is not None and out_dtype != torch.float32
    kind = "wgrad_rounded" if rounded else "wgrad_accumulate" if accumulate else "wgrad"
    call = GemmCall.of(kind, a, b.dtype, m_splits, out_dtype,
                       weight_elements=shape[1] * shape[2], out_list=isinstance(out, list) and not rounded,
                       rows=inp.shape[0])

    def launch(impl: Implementation):
        if rounded and impl.name in ("cublas", "deepgemm"):  # float32 sums handed over: the BF16 gradient, then out
            grad = impl.grouped_gemm_wgrad(a, a_scale, b, b_scale, m_splits, None, False, out_dtype)
            outs, parts = (out, list(grad.unbind(0))) if isinstance(out, list) else ([out], [grad])
            (torch._foreach_add_ if accumulate else torch._foreach_copy_)(outs, parts)
            return out
        return impl.grouped_gemm_wgrad(a, a_scale, b, b_scale, m_splits, out, accumulate, out_dtype)

    result = _run(backend, call, a, "grouped_gemm_wgrad", launch)
    return result if given is None else given
