"""GPU time of one step by kernel, for the benchmarks' ``--profile``: per category of kernel (``CATEGORIES``),
then the largest kernels, each with the op that launched it and its launches per step (torch.profiler, CPU and
CUDA activities: the profiler ties each kernel to the CPU op that launched it)."""

from __future__ import annotations

import collections

import torch

# Kernel name fragments (lower case) -> category, for the profile (first match wins): cuBLAS / CUTLASS /
# DeepGEMM / Triton GEMMs, TransformerEngine's casts and padding (te_* rows), this package's Triton kernels by
# name, then torch's own kernels.
CATEGORIES = (("gemm", ("gemm", "sm90_xmma", "cutlass", "wgrad", "nvjet")),
              ("TE casts / padding", ("block_scaled", "cast_transpose", "padding")),
              ("weight quantization + W^T", ("grouped_weight", "byte_transpose", "128x128")),
              ("activation quantization", ("quantize",)), ("scaling-aware transpose", ("transpose", "shift")),
              ("permute / unpermute", ("permute", "_chunk_", "expert_layout", "_fill_kernel", "row_id")),
              ("swiglu", ("swiglu",)),
              ("torch sort / gather / scatter / index", ("sort", "radix", "gather", "scatter", "index")),
              ("torch elementwise / fill / copy / reduce", ("elementwise", "fill", "memset", "memcpy", "copy",
                                                           "reduce", "catarray")))
PROFILE_STEPS = 5


def kernel_times(step, top: int = 30) -> list[dict]:
    """``step``'s GPU time per step by category (``CATEGORIES``), then its ``top`` largest kernels, each with
    the op that launched it (``launched_by``) and its launches per step (``PROFILE_STEPS`` steps averaged)."""
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(PROFILE_STEPS):
            step()
        torch.cuda.synchronize()
    per_kernel, sites = kernel_sites(prof.events())
    total = sum(per_kernel.values())
    cats = collections.Counter()
    for name, ms in per_kernel.items():
        cats[category(name)] += ms
    rows = [dict(what=f"category: {c}", ms=ms, share=ms / total) for c, ms in cats.most_common()]
    top_sites = sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
    return rows + [dict(what=kernel[:90], launched_by=site, ms=ms, share=ms / total, launches=n)
                   for (kernel, site), (ms, n) in top_sites]


def category(kernel: str) -> str:
    """The ``CATEGORIES`` entry of a kernel's name (the first whose fragments it contains), else "other"."""
    low = kernel.lower()
    return next((c for c, keys in CATEGORIES if any(k in low for k in keys)), "other")


def kernel_sites(events, steps: int = PROFILE_STEPS) -> tuple[collections.Counter, dict]:
    """From torch.profiler ``events`` (CPU and CUDA) of ``steps`` steps: ``(kernel name -> ms per step,
    (kernel name, launched_by) -> [ms per step, launches per step])``. ``launched_by`` is ``launcher``'s name
    for the CPU op the profiler tied the kernel to; kernel time it tied to no op keeps ``launched_by`` ""."""
    per_kernel, sites = collections.Counter(), collections.defaultdict(lambda: [0.0, 0.0])
    cuda = torch.autograd.DeviceType.CUDA
    for e in events:
        if e.device_type == cuda:
            per_kernel[e.name] += e.device_time / steps / 1e3
    for e in events:
        for k in getattr(e, "kernels", ()) if e.device_type != cuda else ():
            if k.name not in per_kernel:  # not a kernel of the trace (the legacy profiler's op-time entries)
                continue
            site = sites[k.name, launcher(e)]
            site[0] += k.duration / steps / 1e3
            site[1] += 1 / steps
    tied = collections.Counter()
    for (kernel, _), (ms, _) in sites.items():
        tied[kernel] += ms
    for kernel, ms in per_kernel.items():
        if ms - tied[kernel] > 1e-3:  # a microsecond per step not tied to any op
            sites[kernel, ""][0] += ms - tied[kernel]
    return per_kernel, dict(sites)


def launcher(event) -> str:
    """``event``'s op name, with the nearest enclosing op outside ``aten::`` (a custom op, the backward of an
    autograd Function, ...) after ``<``: ``aten::fill_ < tem::grouped_gemm_wgrad``."""
    outer = event.cpu_parent
    while outer is not None and outer.name.startswith("aten::"):
        outer = outer.cpu_parent
    return event.name if outer is None else f"{event.name} < {outer.name}"
