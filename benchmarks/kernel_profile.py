"""GPU time of one step by kernel, for the benchmarks' ``--profile``: per category of kernel (``CATEGORIES``),
then the largest kernels, each with the op that launched it and its launches per step (torch.profiler, CPU and
CUDA activities: the profiler ties each kernel to the CPU op that launched it). For the Megatron benchmark's
profile of a training iteration: ``site_category`` refines a kernel's category by that op (expert against dense
GEMMs, the optimizer's step, gradient accumulation), ``iteration_rows`` tables the iteration's time by group
(``GROUPS``) and category, each variant against a baseline's."""

from __future__ import annotations

import collections

import torch

# Kernel name fragments (lower case) -> category, for the profile (first match wins): NCCL, attention cores (torch
# SDPA's flash / memory-efficient / cuDNN kernels, TE's fused attention; before the GEMMs: fmha_cutlass...), cuBLAS /
# CUTLASS / DeepGEMM / Triton GEMMs, TransformerEngine's casts and padding (te_* rows), this package's Triton kernels
# by name, fused Adam, normalization, then torch's own kernels (foreach ones included).
CATEGORIES = (("communication", ("nccl",)),
              ("attention core", ("flash", "fmha", "sdpa", "cudnn", "attention")),
              ("gemm", ("gemm", "sm90_xmma", "cutlass", "wgrad", "nvjet", "gemv", "splitk")),
              ("TE casts / padding", ("block_scaled", "cast_transpose", "padding")),
              ("weight quantization + W^T", ("grouped_weight", "byte_transpose", "128x128")),
              ("activation quantization", ("quantize",)), ("scaling-aware transpose", ("transpose", "shift")),
              ("permute / unpermute", ("permute", "_chunk_", "expert_layout", "_fill_kernel", "row_id")),
              ("swiglu", ("swiglu",)), ("optimizer", ("adam",)),
              ("norm", ("layer_norm", "layernorm", "rms_norm", "rmsnorm", "gammabeta", "rowwisemoments")),
              ("torch sort / gather / scatter / index", ("sort", "radix", "gather", "scatter", "index")),
              ("torch elementwise / fill / copy / reduce", ("elementwise", "fill", "memset", "memcpy", "copy",
                                                           "reduce", "catarray", "multi_tensor", "softmax")))
# The profiler range the Megatron benchmark puts around the optimizer's step (``megatron_bench_entry.py``): with
# torch's own ``Optimizer.step#...`` ranges, what ``site_category`` counts as the optimizer's.
OPTIMIZER_SCOPE = "megatron optimizer step"
# Groups of ``site_category``'s categories, for a training iteration's profile (``iteration_rows``); any other
# category (norms, torch's sort / index and elementwise kernels, other) is in ``OTHER``.
FP8_FLOW_KERNELS = ("weight quantization + W^T", "activation quantization", "scaling-aware transpose",
                    "permute / unpermute", "swiglu")
GROUPS = {"attention core": "attention core", "dense gemm": "dense GEMMs", "expert gemm": "expert GEMMs",
          **dict.fromkeys(FP8_FLOW_KERNELS, "FP8-Flow non-GEMM"), "TE casts / padding": "TE FP8 casts",
          "gradient accumulation": "gradient accumulation", "optimizer": "optimizer",
          "communication": "communication"}
OTHER = "other elementwise / norm / index"
TIMED = "iteration (timed runs' median, unprofiled)"
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


def site_category(kernel: str, launched_by: str) -> str:
    """``category(kernel)`` refined by the op that launched it (``kernel_sites``' ``launched_by``): a kernel
    launched inside an optimizer's step (``OPTIMIZER_SCOPE``, torch's ``Optimizer.step#...``) is "optimizer"
    (communication stays communication); a GEMM launched by a grouped op (torch's ``_grouped_mm`` and its
    backward, FP8-Flow's and TE's grouped linears: their autograd Functions) is an "expert gemm", any other GEMM
    a "dense gemm"; a kernel of autograd's ``AccumulateGrad`` (DDP's hooks adding ``.grad`` into ``main_grad``)
    is "gradient accumulation"."""
    cat, site = category(kernel), launched_by.lower()
    if cat == "communication":
        return cat
    if "optimizer" in site:
        return "optimizer"
    if cat == "gemm":
        return "expert gemm" if "grouped" in site else "dense gemm"
    return "gradient accumulation" if "accumulategrad" in site else cat


def kernel_sites(events, steps: int = PROFILE_STEPS) -> tuple[collections.Counter, dict]:
    """From torch.profiler ``events`` (CPU and CUDA) of ``steps`` steps: ``(kernel name -> ms per step,
    (kernel name, launched_by) -> [ms per step, launches per step])``. ``launched_by`` is ``launcher``'s name
    for the CPU op the profiler tied the kernel to; kernel time it tied to no op keeps ``launched_by`` ""."""
    per_kernel, sites = collections.Counter(), collections.defaultdict(lambda: [0.0, 0.0])
    cuda = torch.autograd.DeviceType.CUDA
    for e in events:
        if e.device_type == cuda and not e.is_user_annotation:  # a profiler range's span on the GPU: no kernel
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


def iteration_rows(profiles: dict[str, dict], baseline: str, timed_ms: dict, top: int = 15) -> list[dict]:
    """A training iteration's profile table from each variant's profile (``{"wall_ms", "kernels": [{kernel,
    launched_by, ms, launches}]}``: ``kernel_sites`` of one iteration), rows by ``part`` (``_compared``): "by
    group" (``GROUPS``), closing with all kernels, the GPU's idle time (wall - kernels; < 0 where streams
    overlapped), the profiled wall and ``timed_ms`` (``TIMED``); "by category" (``site_category``, with its
    group); then each variant's ``top`` kernels ("top kernels: {variant}"). Each against ``baseline``'s
    (``vs_{baseline}_ms``). A variant without a profile (``{"error": ...}``): one row, its ``error``."""
    rows = [dict(part="by group", variant=v, group="no profile", error=p["error"]) for v, p in profiles.items()
            if "kernels" not in p]
    done = {v: p for v, p in profiles.items() if "kernels" in p}
    walls = {v: p["wall_ms"] for v, p in done.items()}
    cats, groups = {v: collections.Counter() for v in done}, {v: collections.Counter() for v in done}
    for v, p in done.items():
        for k in p["kernels"]:
            cat = site_category(k["kernel"], k["launched_by"])
            cats[v][cat] += k["ms"]
            groups[v][GROUPS.get(cat, OTHER)] += k["ms"]
        total = sum(cats[v].values())
        groups[v].update({"all kernels": total, "GPU idle (wall - kernels)": walls[v] - total,
                          "iteration wall (profiled)": walls[v]})
        groups[v][TIMED] = timed_ms.get(v)
    closing = ("all kernels", "GPU idle (wall - kernels)", "iteration wall (profiled)", TIMED)
    rows += _compared("group", groups, walls, baseline, closing)
    rows += [dict(r, group=GROUPS.get(r["category"], OTHER)) for r in _compared("category", cats, walls, baseline)]
    for v, p in done.items():
        rows += [dict(part=f"top kernels: {v}", variant=v, kernel=k["kernel"][:90], launched_by=k["launched_by"],
                      category=site_category(k["kernel"], k["launched_by"]), ms=k["ms"], share=k["ms"] / walls[v],
                      launches=k["launches"])
                 for k in sorted(p["kernels"], key=lambda k: -k["ms"])[:top]]
    return rows


def _compared(key: str, table: dict[str, dict], walls: dict[str, float], baseline: str,
              closing: tuple = ()) -> list[dict]:
    """Rows ``part`` "by {key}" of ``table`` (variant -> {name: ms per iteration}): per name (largest ms first,
    then the ``closing`` names), per variant, its ``ms`` (0 where the variant ran none of it), ``share`` of the
    variant's profiled wall ms and ``vs_{baseline}_ms`` (ms less ``baseline``'s; None without it)."""
    names = sorted({n for t in table.values() for n in t if n not in closing},
                   key=lambda n: -max(t.get(n, 0.0) for t in table.values()))
    rows = []
    for name in names + list(closing):
        values = {v: t.get(name, 0.0) for v, t in table.items()}
        base = values.get(baseline)
        rows += [dict(part=f"by {key}", variant=v, **{key: name}, ms=ms, share=None if ms is None else ms / walls[v],
                      **{f"vs_{baseline}_ms": None if ms is None or base is None else ms - base})
                 for v, ms in values.items()]
    return rows
