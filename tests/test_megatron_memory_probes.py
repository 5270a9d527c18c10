"""benchmarks/megatron_memory_probes.py on the CPU with fake memory counters: the activation probe measures the
target micro-batch only (each MoE layer's kept bytes without its output, a recompute not counted twice, the step's
peak above what it started with), and the micro-batch search finds the largest size below an out-of-memory
threshold by doubling and bisection within its cap, freeing what a failed try allocated."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from megatron_memory_probes import MIB, ActivationProbe, StepPeaks, fits, largest_that_trains  # noqa: E402


class Memory:
    """A fake allocator: ``allocated`` bytes now and the ``peak`` since the last reset."""

    def __init__(self):
        self.now = self.high = 0

    def alloc(self, nbytes):
        self.now += nbytes
        self.high = max(self.high, self.now)

    def reset(self):
        self.high = self.now


class Layer(nn.Module):
    """A MoE layer that keeps ``keep`` MiB for backward and returns a fresh ``[4, 8]`` float32 output (128 B)
    per forward, allocated on the fake memory; returns ``(output, None)`` as Megatron's MoE layers do."""

    def __init__(self, memory, keep):
        super().__init__()
        self.memory, self.keep = memory, keep

    def forward(self, x):
        self.memory.alloc(self.keep * MIB + 128)
        return torch.zeros(4, 8), None


class Model(nn.Module):
    def __init__(self, memory, keeps):
        super().__init__()
        self.memory = memory
        self.layers = nn.ModuleList(Layer(memory, k) for k in keeps)

    def forward(self, x):
        for layer in self.layers:
            layer(x)

    def backward_and_free(self, transient_mib):
        """Backward: a transient peak, then everything the micro-batch kept is freed."""
        kept = self.memory.now
        self.memory.alloc(transient_mib * MIB)
        self.memory.now = kept - sum(layer.keep * MIB + 128 for layer in self.layers)


def _probe(keeps, target):
    memory = Memory()
    memory.alloc(1000 * MIB)  # parameters and optimizer state held throughout
    model = Model(memory, keeps)
    probe = ActivationProbe(model, list(model.layers), target, allocated=lambda: memory.now,
                            peak=lambda: memory.high, reset_peak=memory.reset)
    return memory, model, probe


def test_activation_probe_measures_the_target_micro_batch():
    memory, model, probe = _probe([30, 50], target=2)
    for micro_batch in range(4):
        model(None)
        assert probe.result() == {} or micro_batch >= 3  # known once the next micro-batch starts
        model.backward_and_free(transient_mib=5 + micro_batch)  # the target's transient: 7 MiB
    result = probe.result()
    assert result["activation_mib_moe_layers"] == [30.0, 50.0]  # kept bytes, output excluded
    assert result["activation_mib_per_moe_layer"] == 40.0 and result["probed_micro_batch"] == 2
    assert result["step_activation_peak_mib"] == pytest.approx(80 + 7 + 256 / MIB)
    # the run's peak until the probe reset the counter: the previous micro-batch's, on the held 1000 MiB
    assert result["peak_before_probe_mib"] == pytest.approx(1000 + 80 + 6 + 256 / MIB)


def test_a_recomputed_forward_in_the_target_micro_batch_is_not_counted_again():
    memory, model, probe = _probe([30], target=0)
    model(None)
    model.layers[0].keep = 999  # e.g. a checkpointed layer run again in backward
    model.layers[0](None)
    model(None)
    assert probe.result()["activation_mib_moe_layers"] == [30.0]


def test_probe_hooks_come_off_and_it_needs_moe_layers():
    memory, model, probe = _probe([10], target=5)
    probe.remove()
    for _ in range(7):
        model(None)
    assert probe.forwards == 0 and probe.result() == {}
    with pytest.raises(ValueError, match="at least one MoE layer"):
        ActivationProbe(model, [], 0)


def _oom_above(limit, calls, through_fits=False):
    """``trains(size)``: a step that runs out of memory above ``limit`` (through ``fits`` when asked: it then
    really raises torch.OutOfMemoryError)."""
    def trains(size):
        calls.append(size)
        return fits(lambda: _step(size, limit)) if through_fits else size <= limit

    return trains


def _step(size, limit):
    held = torch.empty(size)  # freed whatever happens
    if size > limit:
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} GiB")
    return held


@pytest.mark.parametrize("limit, start, cap, expected", [
    (11, 4, 64, 11), (4, 4, 64, 4), (3, 4, 64, 3), (0, 4, 64, 0), (100, 4, 64, 64), (63, 4, 64, 63),
    (1, 1, 1, 1), (12, 1, 64, 12), (40, 3, 40, 40), (5, 1, 64, 5)])
def test_largest_that_trains_doubles_then_bisects(limit, start, cap, expected):
    calls = []
    size, tries = largest_that_trains(_oom_above(limit, calls), start, cap)
    assert size == expected and [s for s, _ in tries] == calls
    assert all(ok == (s <= limit) for s, ok in tries) and max(calls) <= cap
    assert len(calls) <= 2 * (cap.bit_length() + 1)


def test_search_sequence_through_out_of_memory_errors():
    calls = []
    assert largest_that_trains(_oom_above(11, calls, through_fits=True), 4, 64)[0] == 11
    assert calls == [4, 8, 16, 12, 10, 11]


def test_fits_lets_other_errors_through_and_bad_bounds_are_refused():
    assert fits(lambda: None) and not fits(lambda: _step(2, 1))
    with pytest.raises(ValueError, match="not memory"):
        fits(lambda: (_ for _ in ()).throw(ValueError("not memory")))
    with pytest.raises(ValueError, match="1 <= start <= cap"):
        largest_that_trains(lambda s: True, 8, 4)


def test_graph_pools_are_the_segments_outside_the_default_pool():
    from megatron_memory_probes import graph_pool_mib

    segments = [dict(segment_pool_id=(0, 0), allocated_size=64 * MIB, total_size=100 * MIB),
                dict(segment_pool_id=(0, 1), allocated_size=30 * MIB, total_size=40 * MIB),
                dict(segment_pool_id=(0, 2), allocated_size=10 * MIB, total_size=20 * MIB)]
    assert graph_pool_mib(segments, 4) == dict(graph_pool_allocated_mib=40.0, graph_pool_reserved_mib=60.0,
                                               graph_pool_mib_per_moe_layer=10.0)
    assert graph_pool_mib(segments[:1], 2)["graph_pool_allocated_mib"] == 0  # no graphs: nothing private
    with pytest.raises(ValueError, match="at least one MoE layer, got 0"):
        graph_pool_mib(segments, 0)


class Optimizer:
    """A fake optimizer whose ``step`` allocates its states once (``states_mib``) on the fake memory."""

    def __init__(self, memory, states_mib):
        self.memory, self.states_mib, self.steps = memory, states_mib, 0

    def step(self):
        if not self.steps:
            self.memory.alloc(self.states_mib * MIB)
        self.steps += 1
        return "stepped"


@pytest.mark.parametrize("states_mib", [10, 500])
def test_step_peaks_say_where_the_second_iteration_peaks(states_mib):
    memory = Memory()
    memory.alloc(1000 * MIB)  # parameters, main grads
    optimizer = Optimizer(memory, states_mib)
    peaks = StepPeaks(optimizer, peak=lambda: memory.high)
    assert optimizer.step() == "stepped" and peaks.result() == {}  # the first step makes the states
    memory.reset()  # as the activation probe does in the second iteration
    memory.alloc(300 * MIB)  # the second iteration's micro-batches: a transient peak beside the states
    memory.now -= 300 * MIB
    assert optimizer.step() == "stepped" and "step" not in vars(optimizer)  # taken off after the second step
    memory.alloc(900 * MIB)  # later peaks are not that iteration's
    optimizer.step()
    assert peaks.result() == dict(peak_before_optimizer_mib=1300 + states_mib, peak_after_optimizer_mib=1300
                                  + states_mib, peaks_step=2)
    StepPeaks(optimizer).remove()
    assert "step" not in vars(optimizer) and optimizer.steps == 3
    with pytest.raises(ValueError, match="from 1"):
        StepPeaks(optimizer, step=0)
