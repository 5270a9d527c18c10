"""Memory of one MoE layer step: FP8-Flow's blocks against the BF16 grouped block, on the GPU or, launches faked, on
the CPU.

Configurations (``--config``): ``bench_host_time.CONFIGS`` (``qwen3_moe_like``, ``deepseek_small``,
``dsv3_ep8_rank``: one EP=8 rank of DeepSeek-V3's experts, 32 local experts, hidden 7168, ffn 2048, top-8), at
16384 tokens unless ``--tokens`` says otherwise. Blocks: ``bench_host_time.make_blocks`` (the BF16 ``_grouped_mm``
block, FP8-Flow with a single weight, per-expert weights, single weight with ``moe_expert``), the FP8 weights
cached as on a step's later micro-batches, gradients set to None before the step (``utils.moe_step``).

Per block: ``peak_mib``, the most memory allocated during one forward+backward above what was allocated before it
(the step's activations, its transients and the weight gradients it makes), and ``saved_mib``, what the forward
leaves allocated for backward (the output included).

- On the GPU: ``torch.cuda.max_memory_allocated`` and ``memory_allocated`` (``CudaBytes``; ``bench_step_memory``).
- ``--cpu-faked``: the package's launches replaced by their fakes (``bench_host_time.faked_launches``: outputs of
  the kernels' shapes, nothing computed; the routing real), and the bytes of the tensors the step makes tracked
  storage by storage while they live (``LiveBytes``). The kernels allocate nothing else, so this is the GPU's
  figure less the caching allocator's rounding: for comparing versions of the package's memory on a machine
  without a GPU (the BF16 block's torch ops have no fakes here and are left out; ``bench_step_memory_cpu``).

Run: ``python benchmarks/bench_step_memory.py --config qwen3_moe_like dsv3_ep8_rank [--cpu-faked]``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import utils
from transformer_engine_moe import Float8BlockwiseQTensor
from bench_host_time import CONFIGS, faked_launches, make_blocks, make_inputs

MIB = 2 ** 20


class LiveBytes(TorchDispatchMode):
    """Within: the bytes of the storages the ops make, counted from the op that makes one until it is freed;
    ``now`` and ``peak``. Views add nothing; storages of the tensors alive on entry (parameters, inputs, FP8 weight
    caches: every tensor the garbage collector finds then) are not counted."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def __enter__(self):
        gc.collect()
        alive = (t for t in gc.get_objects() if issubclass(type(t), torch.Tensor))  # type(): no attribute read
        self.before = {t.untyped_storage()._cdata for t in alive
                       if type(t) is not Float8BlockwiseQTensor and t.layout == torch.strided}
        return super().__enter__()

    def _sweep(self) -> None:
        for key in [key for key, (ref, _) in self.live.items() if ref.expired()]:
            self.now -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage._cdata not in self.live and storage._cdata not in self.before:
                    self.live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                    self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        return out

    def __exit__(self, *exc):
        self._sweep()
        return super().__exit__(*exc)


class CudaBytes:
    """Within: ``now`` and ``peak``, torch.cuda's allocated and max allocated memory above what was allocated on
    entry (``LiveBytes``' figures on the GPU)."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.before = torch.cuda.memory_allocated()
        return self

    @property
    def now(self) -> int:
        return torch.cuda.memory_allocated() - self.before

    @property
    def peak(self) -> int:
        return torch.cuda.max_memory_allocated() - self.before

    def __exit__(self, *exc):
        torch.cuda.synchronize()


def step_memory(block, inputs, cpu_faked: bool) -> dict:
    """``peak_mib`` and ``saved_mib`` of one cached step of ``block`` after three: on the GPU (``CudaBytes``), or
    with ``cpu_faked`` on the CPU, launches faked and the step's tensors tracked (``LiveBytes``)."""
    x, ids, probs, dy = inputs
    with faked_launches() if cpu_faked else contextlib.nullcontext():
        step = utils.moe_step(block, *inputs, fp8_weights="cached")
        for _ in range(3):
            step()
        block.zero_grad(set_to_none=True)
        x.grad = None
        with LiveBytes() if cpu_faked else CudaBytes() as meter:
            y = block.forward_topk(x, ids, probs, is_first_microbatch=False)
            saved = meter.now
            y.backward(dy)
    return dict(peak_mib=meter.peak / MIB, saved_mib=saved / MIB)


def rows_for(config: str, tokens: int, device: str) -> list[dict]:
    """One row per block at ``config``'s shapes and ``tokens`` on ``device`` ("cuda", or "cpu": launches faked,
    FP8-Flow's blocks alone)."""
    c = CONFIGS[config]
    shape = dict(config=config, experts=c["experts"], hidden=c["hidden"], ffn=c["ffn"], topk=c["topk"], tokens=tokens)
    inputs = make_inputs(tokens, c["hidden"], c["experts"], c["topk"], device)
    rows = []
    for name, block in make_blocks(c["experts"], c["hidden"], c["ffn"], c["topk"], device).items():
        if device == "cpu" and not name.startswith("fp8_flow"):
            continue
        rows.append(dict(shape, block=name, **step_memory(block, inputs, cpu_faked=device == "cpu")))
        del block
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", nargs="+", choices=list(CONFIGS), default=["qwen3_moe_like", "dsv3_ep8_rank"])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per step")
    parser.add_argument("--cpu-faked", action="store_true",
                        help="no GPU: FP8-Flow's blocks with their launches faked (bench_step_memory_cpu)")
    args = parser.parse_args(argv)
    if args.tokens < 1:
        parser.error(f"--tokens must be positive, got {args.tokens}")
    return args


def main():
    args = parse_args()
    device = "cpu" if args.cpu_faked else "cuda"
    env = utils.environment({"device": "CPU, launches faked", "cpus": len(os.sched_getaffinity(0))}
                            if args.cpu_faked else None)
    rows = [r for config in args.config for r in rows_for(config, args.tokens, device)]
    columns = ["config", "experts", "hidden", "ffn", "topk", "tokens", "block", "peak_mib", "saved_mib"]
    notes = ("peak_mib: the most memory allocated during one forward+backward above what was allocated before it "
             "(activations, transients and the weight gradients the step makes); saved_mib: what the forward leaves "
             "allocated for backward. FP8 weights cached, gradients None before the step. ")
    title = "Memory of one MoE layer step"
    if args.cpu_faked:
        path = utils.write_results("bench_step_memory_cpu", title, env, {}, rows, columns, notes=notes + (
            "CPU: the package's launches faked, the step's tensors tracked storage by storage (LiveBytes)."))
    else:
        path = utils.write_results("bench_step_memory", title, env, {}, rows, columns,
                                   notes=notes + "GPU: torch.cuda's allocated and max allocated memory.")
    print(path.read_text())


if __name__ == "__main__":
    main()
