"""Memory measured inside Megatron's training step (benchmark only; ``megatron_bench_entry.py`` installs them).

Four measurements, in MiB (``torch.cuda.memory_allocated``: the caching allocator's live tensors, no
synchronisation; the counters are arguments, so the logic is tested on the CPU with fakes):

- ``ActivationProbe``: on one micro-batch of the run (``target``, counted in model forwards from 0; the
  benchmark takes the second micro-batch of the second iteration: not the run's first, not a step's first,
  whose forward quantizes and caches FP8 weights), per MoE layer, the memory allocated when its forward
  returns minus when it started, less the bytes of its output (the output feeds the residual add and is not
  kept for backward): **what the layer keeps for its backward** (``activation_mib_per_moe_layer``, the mean over
  the MoE layers). And **the step's activation peak** (``step_activation_peak_mib``): the most memory allocated
  between that micro-batch's forward start and the next micro-batch's forward start (its forward, loss,
  backward and gradient accumulation) minus what was allocated when it started. It resets the peak counter
  there, so it keeps the peak it found (``peak_before_probe_mib``: the run's until then, the second iteration's
  first micro-batch included), which Megatron's later memory reports no longer see.
- ``StepPeaks``: where a steady iteration's memory peak is set: the peak just before the second optimizer step
  (since the activation probe's reset in that iteration: its micro-batches, with the optimizer state made by
  the first step and the FP8 weight cache; ``peak_before_optimizer_mib``) and just after it
  (``peak_after_optimizer_mib``). Megatron's memory report after the second iteration is the larger; which of
  the two it is tells what a change must cut.
- ``graph_pool_mib``: with the expert path in CUDA graphs, what their private memory pools hold (the
  activations a graphed layer keeps live there, allocated at capture), per MoE layer.
- ``largest_that_trains``: the largest micro-batch size whose forward and backward run without
  ``torch.OutOfMemoryError``, by doubling from a size then bisecting, up to a cap. The entry runs it after the
  timed iterations, when the parameters, main gradients and optimizer state all exist (the memory a real step
  holds), freeing everything between tries (``fits``).
"""

from __future__ import annotations

import gc
from typing import Callable, Optional

import torch

MIB = 1 << 20


def _output_bytes(output) -> int:
    """Bytes of a layer's output tensor (the first tensor of a tuple, as Megatron's MoE layers return one)."""
    if isinstance(output, (tuple, list)):
        output = next((o for o in output if isinstance(o, torch.Tensor)), None)
    return output.untyped_storage().nbytes() if isinstance(output, torch.Tensor) else 0


class ActivationProbe:
    """Forward hooks on ``model`` (counting its forwards: one per micro-batch) and on each of ``moe_layers``.

    ``allocated() -> int``, ``peak() -> int``, ``reset_peak()``: the memory counters (default CUDA's). After the
    micro-batch after ``target`` has started, ``result()`` gives ``activation_mib_per_moe_layer``,
    ``activation_mib_moe_layers`` (per layer), ``step_activation_peak_mib`` and ``probed_micro_batch``; before
    that it is empty. ``remove()`` takes the hooks off.
    """

    def __init__(self, model: torch.nn.Module, moe_layers: list, target: int,
                 allocated: Callable[[], int] = torch.cuda.memory_allocated,
                 peak: Callable[[], int] = torch.cuda.max_memory_allocated,
                 reset_peak: Callable[[], None] = torch.cuda.reset_peak_memory_stats):
        if not moe_layers:
            raise ValueError("ActivationProbe needs at least one MoE layer, got none")
        self.target, self.allocated, self.peak, self.reset_peak = target, allocated, peak, reset_peak
        self.forwards = 0
        self.before: Optional[int] = None
        self.step_peak: Optional[int] = None
        self.peak_before: Optional[int] = None
        self.kept: dict[int, int] = {}
        self._starts: dict[int, int] = {}
        self._handles = [model.register_forward_pre_hook(self._micro_batch)]
        for i, layer in enumerate(moe_layers):
            self._handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: self._layer_start(i)))
            self._handles.append(layer.register_forward_hook(lambda m, a, out, i=i: self._layer_end(i, out)))

    def _micro_batch(self, module, args) -> None:
        if self.forwards == self.target:
            self.peak_before = self.peak()
            self.reset_peak()
            self.before = self.allocated()
        elif self.forwards == self.target + 1:
            self.step_peak = self.peak() - self.before
        self.forwards += 1

    def _probing(self) -> bool:
        return self.forwards == self.target + 1  # inside the target micro-batch (counted at its start)

    def _layer_start(self, i: int) -> None:
        if self._probing() and i not in self.kept:  # a layer's first forward in the micro-batch, not a recompute
            self._starts[i] = self.allocated()

    def _layer_end(self, i: int, output) -> None:
        if self._probing() and i in self._starts:
            self.kept[i] = self.allocated() - self._starts.pop(i) - _output_bytes(output)

    def result(self) -> dict:
        if self.step_peak is None or not self.kept:
            return {}
        layers = [self.kept[i] / MIB for i in sorted(self.kept)]
        return dict(activation_mib_per_moe_layer=sum(layers) / len(layers), activation_mib_moe_layers=layers,
                    step_activation_peak_mib=self.step_peak / MIB, probed_micro_batch=self.target,
                    peak_before_probe_mib=self.peak_before / MIB)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class StepPeaks:
    """Wraps ``optimizer.step`` until its ``step``-th call (from 1): the memory peak (``peak() -> int``, default
    CUDA's) just before and just after that call; the wrapper is then taken off (or by ``remove()``).
    ``result()``: ``peak_before_optimizer_mib``, ``peak_after_optimizer_mib`` and ``peaks_step`` once that step
    ran, else empty."""

    def __init__(self, optimizer, step: int = 2, peak: Callable[[], int] = torch.cuda.max_memory_allocated):
        if step < 1:
            raise ValueError(f"StepPeaks counts optimizer steps from 1, got step={step}")
        self.optimizer, self.target, self.peak = optimizer, step, peak
        self.step, self.own = optimizer.step, "step" in vars(optimizer)
        self.calls, self.peaks = 0, None
        optimizer.step = self._step

    def _step(self, *args, **kwargs):
        self.calls += 1
        if self.calls != self.target:
            return self.step(*args, **kwargs)
        before = self.peak()
        self.remove()
        try:
            return self.step(*args, **kwargs)
        finally:
            self.peaks = (before, self.peak())

    def result(self) -> dict:
        if self.peaks is None:
            return {}
        return dict(peak_before_optimizer_mib=self.peaks[0] / MIB, peak_after_optimizer_mib=self.peaks[1] / MIB,
                    peaks_step=self.target)

    def remove(self) -> None:
        if self.optimizer.step == self._step:
            if self.own:
                self.optimizer.step = self.step
            else:
                del self.optimizer.step


def graph_pool_mib(segments: list, moe_layers: int) -> dict:
    """What CUDA graphs hold, from the caching allocator's ``segments`` (``torch.cuda.memory_snapshot()``): the
    MiB allocated and reserved in segments of private pools (every pool but the default ``(0, 0)``: with
    ``--moe-fp8-flow-cuda-graph`` the expert graphs', Megatron's own graphs being refused alongside), and the
    allocated MiB per MoE layer. A graphed layer keeps its activations there, allocated once at capture and held
    for the run, so ``ActivationProbe``'s difference around a forward does not see them: this is the figure."""
    if moe_layers < 1:
        raise ValueError(f"graph_pool_mib needs at least one MoE layer, got {moe_layers}")
    private = [s for s in segments if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]
    allocated = sum(s["allocated_size"] for s in private) / MIB
    return dict(graph_pool_allocated_mib=allocated, graph_pool_reserved_mib=sum(s["total_size"] for s in private) / MIB,
                graph_pool_mib_per_moe_layer=allocated / moe_layers)


def fits(step: Callable[[], object]) -> bool:
    """Whether ``step()`` ran without ``torch.OutOfMemoryError``; what it allocated is freed either way (its
    frames are gone when this returns; then the garbage collector and the caching allocator's cache)."""
    try:
        step()
        ok = True
    except torch.OutOfMemoryError:
        ok = False
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return ok


def largest_that_trains(trains: Callable[[int], bool], start: int, cap: int) -> tuple[int, list]:
    """``(largest size that trains, tries)``: sizes ``start, 2 start, 4 start, ...`` (at most ``cap``) until one
    fails, then bisection between the last that trained and the first that did not. ``trains(size) -> bool``.
    The size is 0 if not even 1 trains, and ``cap`` (maybe more would) if ``cap`` trains. ``tries``: ``[(size,
    trained), ...]`` in order."""
    if not 1 <= start <= cap:
        raise ValueError(f"largest_that_trains needs 1 <= start <= cap, got start={start}, cap={cap}")
    tries: list = []

    def attempt(size: int) -> bool:
        tries.append((size, trains(size)))
        return tries[-1][1]

    good, bad, size = 0, None, start
    while bad is None:
        if not attempt(size):
            bad = size
        elif size == cap:
            return cap, tries
        else:
            good, size = size, min(2 * size, cap)
    while bad - good > 1:
        middle = (good + bad) // 2
        if attempt(middle):
            good = middle
        else:
            bad = middle
    return good, tries
