"""GraphedFP8FlowMoE: an ``FP8FlowMoE``'s training step replayed from CUDA graphs, one launch per pass.

At hidden 2048 one FP8-Flow layer step spends more time on its host (Python, autograd, about 70 kernel
launches) than on its GPU (docs/megatron.md). With ``device_splits=True`` the block never waits for its host,
so its forward and its backward can each be captured once and replayed: per micro-batch the host copies the
inputs into static buffers and launches one graph, in forward and again in backward::

    block = FP8FlowMoE(..., device_splits=True, device="cuda")
    graphed = GraphedFP8FlowMoE(block)                # pool=GraphPool(): one pool for several blocks
    out = graphed(hidden, probs, routing_map, is_first_microbatch=True)   # as block(hidden, probs, routing_map)
    out.backward(grad)

Three graphs per block. Its first training call (module in training mode, grad enabled; other calls, e.g.
evaluation, always run the block eagerly) runs eagerly, forward and backward, and keeps a copy of its inputs; at its
second training call the pool captures the graphs of every block that ran so, as
``torch.cuda.make_graphed_callables`` does for its callables: two eager warm-up steps each on a side stream with
zero output gradients (a first micro-batch's path, then a later one's: kernels compiled, the address tables the
kernels read built; where the graphs add into ``main_grad`` the warm-up adds zeros into it), then the weights and
forward graphs in the order the blocks were first called, then the backward graphs in reverse: the order Megatron
replays them (layers forward, then backward from the last). So every capture runs in a forward, outside autograd's
backward: a capture inside it (a reentrant ``torch.autograd.grad``) let the autograd engine run the surrounding
backward's ready nodes on the capturing thread, recording them into the graph. A call inside a backward (a
forward re-run by Megatron's full recompute) runs eagerly and captures nothing. The weights graphs go into a
memory pool of their own, the forwards and backwards into another; the captures see the weights through leaves
of their own (``_weight_leaves``).

- weights: fc1's and fc2's FP8 weights quantized into static buffers, the FP8 weight cache, by TE's
  ``is_first_microbatch`` rule: replayed when it is True or None and after ``reset_fp8_weight_cache``; False
  replays nothing and the forward reads the weights of the last replay, so an optimizer step (which writes
  the weights in place) reaches the graphs at the next True;
- forward: ``block(hidden, probs, routing_map, is_first_microbatch=False)`` on static inputs ``[T, H]``,
  ``[T, E]``, ``[T, E]`` (``T`` as at capture; with ``moe_expert`` the checkpoint's first pass);
- backward: the gradients of ``hidden``, ``probs`` and the weights (with ``moe_expert`` the rerun inside).

Weight gradients, as the eager block gives them:

- into each weight's ``main_grad`` (Megatron's DDP buffers) when the block's ``GroupedLinear``s fuse wgrad
  accumulation, or with ``accumulate_into_main_grad=True`` when every weight has a ``main_grad`` at capture:
  the wgrad GEMMs add the gradient rounded to the weights' dtype into it
  (``GroupedLinear.add_wgrad_into_main_grad``, set from the warm-up on), which is what Megatron's DDP hook adds
  from ``.grad`` (the same sums, bit for bit; written over it where ``overwrite_main_grad`` is set); the weights get
  ``grad_added_to_main_grad = True`` and autograd the kept zero placeholders, so DDP's hooks fire and add
  nothing, as with TE's fused wgrad. No ``[G, N, K]`` gradient leaves the graph;
- otherwise into static buffers that autograd accumulates into ``.grad`` (a copy: autograd cannot take over
  a buffer the graph writes again).

Replays equal eager steps of the same block bit for bit (tests/module/test_graphed_moe.py). What a replay
needs, and what is refused:

- CUDA tensors of the captured shapes and dtypes (ValueError otherwise: another token count needs another
  ``GraphedFP8FlowMoE``);
- one micro-batch in flight per block: a forward replay overwrites the activations the previous one saved,
  so a backward for an overwritten forward, or a second backward of one forward, raises RuntimeError;
- the weights and their ``main_grad`` at the addresses they had at capture (optimizers write in place),
  checked at each weights replay (RuntimeError);
- graphs sharing one ``GraphPool`` replayed in the order they were captured (as with
  ``torch.cuda.make_graphed_callables``): Megatron's layers run forwards in layer order, then backwards in
  reverse, every micro-batch (no pipeline schedule interleaving micro-batches).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch

from .grouped_linear import _placeholder_wgrad
from .moe import FP8FlowMoE

# the eager warm-up steps before the capture, by their is_first_microbatch: quantizing (and caching) the weights,
# then reusing the cache (the byte transpose W^T -> W), each with its backward
WARMUP = (True, False)
_INPUTS = ("hidden", "probs", "routing_map")


class GraphPool:
    """The captures of several ``GraphedFP8FlowMoE``s replayed in one order (a model's layers), made together
    into shared CUDA-graph memory pools (the weights graphs' one, the forwards' and backwards' another:
    ``capture_pending``), as ``torch.cuda.make_graphed_callables`` shares one across its callables: memory a
    graph frees during its capture serves the graphs captured after it, instead of every layer keeping its own
    temporaries. It holds the blocks that ran their first training call eagerly, in the order they ran."""

    def __init__(self):
        self._pending: list = []

    def register(self, graphed: "GraphedFP8FlowMoE") -> None:
        """``graphed`` ran its first training call: its graphs are made at the next ``capture_pending``."""
        if not isinstance(graphed, GraphedFP8FlowMoE):  # once an AttributeError at the capture
            raise TypeError(f"graphed must be a GraphedFP8FlowMoE, got {type(graphed).__name__}")
        if graphed not in self._pending:
            self._pending.append(graphed)

    def capture_pending(self) -> None:
        """The registered blocks' graphs, into two new memory pools: their warm-ups, their weights and forward graphs
        in the order they registered, their backward graphs in reverse (the order they replay). Nothing while
        autograd's backward runs (a forward re-run inside it, e.g. Megatron's full recompute), where its other
        ready nodes could run inside the capture."""
        if torch._C._current_graph_task_id() != -1 or not self._pending:
            return
        if not torch.cuda.is_available():  # torch's own error here names a "dummy base class"
            raise RuntimeError("GraphPool: a CUDA graph memory pool needs a CUDA GPU, and torch sees none")
        blocks, self._pending = self._pending, []
        for graphed in blocks:
            graphed._warm_up()
        # Two pools. The weights graphs replay only when the weights change (is_first_microbatch True), the others
        # every micro-batch: in one pool a weights graph's FP8 cache took memory an earlier forward's capture had
        # freed, and a later micro-batch's replay of that forward, with no weights replay after it, wrote its
        # temporaries over the cache (Megatron's tiny GPT drifted from the eager losses at the third micro-batch,
        # its pretrain gave NaN gradients; H200). In a pool of their own the caches stay out of every forward's and
        # backward's way, and a weights graph's temporaries only meet other weights graphs' temporaries.
        weights_pool, pool = torch.cuda.graph_pool_handle(), torch.cuda.graph_pool_handle()
        for graphed in blocks:
            graphed._capture_forward(weights_pool, pool)
        for graphed in reversed(blocks):
            graphed._capture_backward(pool)


@dataclasses.dataclass(slots=True)
class _Captured:
    """The graphs of one block and what they read and write: the static inputs (``inputs``: buffers the
    replays copy into; ``leaves``: the same memory as the autograd leaves of the capture, with their own version
    counters, so those copies do not invalidate what the captured forward saved), the static output, the
    weights autograd sees (``params``: the block's; ``weight_leaves``: the captured graphs' leaves over them,
    ``_weight_leaves``), their FP8 caches, the addresses checked before each weights replay, and the address
    tables the kernels read (kept alive here: a capture holds no reference to what it reads)."""

    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    leaves: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    params: list[torch.nn.Parameter]
    weight_leaves: list[torch.nn.Parameter]
    main_grad: bool
    weights_graph: torch.cuda.CUDAGraph
    forward_graph: torch.cuda.CUDAGraph
    caches: list
    output: torch.Tensor
    addresses: list[int]
    tables: list[torch.Tensor]
    graph_root: Optional[torch.Tensor] = None  # the captured forward's output, until the backward's capture
    backward_graph: Optional[torch.cuda.CUDAGraph] = None
    grad_output: Optional[torch.Tensor] = None
    grads: tuple = ()  # static gradients: hidden, probs (and the weights', without main_grad)


class GraphedFP8FlowMoE:
    """``block``'s training step replayed from CUDA graphs; called as ``block`` is (``FP8FlowMoE.forward``).

    Args:
        block: an ``FP8FlowMoE`` with ``device_splits=True`` (local dispatcher: no host sync), on the GPU. Not
            copied: its parameters and its eager calls stay its own.
        pool: the ``GraphPool`` its graphs allocate from; share one between blocks run in one order (default:
            a pool of its own).
        accumulate_into_main_grad: add the weight gradients into the weights' ``main_grad`` inside the backward
            graph where every weight has one at capture (Megatron's DDP), as DDP's hook would add ``.grad``
            (``FP8FlowMoE.into_main_grad``; the block's own ``accumulate_into_main_grad`` does the same).
    """

    def __init__(self, block: FP8FlowMoE, pool: Optional[GraphPool] = None, accumulate_into_main_grad: bool = False):
        if not isinstance(block, FP8FlowMoE):
            raise TypeError(f"block must be an FP8FlowMoE, got {type(block).__name__}")
        if not block.device_splits:
            raise ValueError("block must be built with device_splits=True: with host counts its dispatch waits for "
                             "the host every step, which a CUDA graph cannot replay")
        if pool is not None and not isinstance(pool, GraphPool):
            raise TypeError(f"pool must be a GraphPool or None, got {type(pool).__name__}")
        if not isinstance(accumulate_into_main_grad, bool):
            raise TypeError(f"accumulate_into_main_grad must be a bool, got {accumulate_into_main_grad!r}")
        self.block, self.pool = block, pool or GraphPool()
        self.accumulate_into_main_grad = accumulate_into_main_grad
        self._captured: Optional[_Captured] = None
        self._sample: Optional[tuple] = None  # the first training call's inputs (copies), until the capture
        self._weights_current = False  # the weights graph's last replay holds the current weights
        self._generation = 0  # forward replays so far
        self._awaiting_backward: Optional[int] = None  # the generation whose saved activations the pool holds

    @property
    def captured(self) -> bool:
        """Whether the graphs exist (after the second training call of a block of the pool)."""
        return self._captured is not None

    def reset_fp8_weight_cache(self) -> None:
        """The next training call quantizes the weights whatever its ``is_first_microbatch`` (a weights replay);
        also drops the block's eager cache (``FP8FlowMoE.reset_fp8_weight_cache``). The static buffers stay:
        the graphs own them."""
        self._weights_current = False
        self.block.reset_fp8_weight_cache()

    def __call__(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                 is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """``hidden [T, H]`` BF16/FP32, the router's ``probs [T, E]`` and ``routing_map [T, E]`` bool -> ``[T, H]``
        (``FP8FlowMoE.forward``). In training with grad enabled from the graphs (the first such call eagerly, the
        graphs captured at the second); otherwise eagerly."""
        if not (self.block.training and torch.is_grad_enabled()):
            return self.block(hidden, probs, routing_map, is_first_microbatch)
        if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
            raise TypeError(f"is_first_microbatch must be None or a bool, got {is_first_microbatch!r}")
        if self._captured is None:
            if self._sample is not None:  # a second training call: capture the pool's blocks, this one included
                self.pool.capture_pending()
            if self._captured is None:  # the first training call (or one inside a backward): eagerly
                if self._sample is None:
                    _check_capturable(hidden, probs, routing_map)
                    self._sample = (hidden.detach().clone(), probs.detach().clone(), routing_map.detach().clone())
                    self.pool.register(self)
                return self.block(hidden, probs, routing_map, is_first_microbatch)
        self._check_inputs(hidden, probs, routing_map)
        if is_first_microbatch is not False or not self._weights_current:
            self._replay_weights()
        self._weights_current = is_first_microbatch is not None
        return _Replay.apply(self, hidden, probs, routing_map, *self._captured.params)

    # ------------------------------------------------------------------ capture (GraphPool.capture_pending)
    def _leaves(self) -> tuple:
        """Autograd leaves over the first call's inputs (the static input buffers from now on): the same memory
        with version counters of their own, so the replays' copies into the buffers do not invalidate what the
        captured forward saved; and the weights autograd sees."""
        inputs = self._sample
        leaves = (inputs[0].data.requires_grad_(), inputs[1].data.requires_grad_(), inputs[2].data)
        return leaves, [p for p in self.block.parameters() if p.requires_grad]

    def _warm_up(self) -> None:
        """Two eager steps on a side stream, on the first call's inputs."""
        leaves, params = self._leaves()
        self.block.into_main_grad(self.accumulate_into_main_grad or self.block.accumulate_into_main_grad)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for first in WARMUP:
                out = self.block(*leaves, is_first_microbatch=first)
                torch.autograd.grad(out, [*leaves[:2], *params], torch.zeros_like(out))
            del out
        torch.cuda.current_stream().wait_stream(side)

    def _capture_forward(self, weights_pool, pool) -> None:
        """The weights graph (in ``weights_pool``) and the forward graph (in ``pool``); the forward's autograd graph
        is kept for ``_capture_backward``."""
        (leaves, params), inputs, self._sample = self._leaves(), self._sample, None
        block = self.block
        linears = (block.linear_fc1, block.linear_fc2)
        main_grad = linears[0].into_main_grad  # as the warm-up decided (FP8FlowMoE.into_main_grad)
        tables = [t for lin in linears for t in lin.address_tables()]
        weights_graph, forward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with _weight_leaves(block) as weight_leaves:
            with torch.cuda.graph(weights_graph, pool=weights_pool, capture_error_mode="thread_local"):
                block.prefetch_fp8_weights(True)
            caches = [lin._cache for lin in linears]  # the static FP8 weights (W^T; fc1's W under moe_expert)
            block.drop_prefetched_fp8_weights()
            with torch.cuda.graph(forward_graph, pool=pool, capture_error_mode="thread_local"):
                out = block(*leaves, is_first_microbatch=False)
        self._captured = _Captured(inputs=inputs, leaves=leaves, params=params, weight_leaves=weight_leaves,
                                   main_grad=main_grad,
                                   weights_graph=weights_graph, forward_graph=forward_graph, caches=caches,
                                   output=out.detach(), addresses=_addresses(params, main_grad), tables=tables,
                                   graph_root=out)

    def _capture_backward(self, pool) -> None:
        """The backward graph, through the captured forward's autograd graph (consumed): the gradients of
        ``hidden`` and ``probs``, the weights' added into their ``main_grad`` (what DDP's hook adds from ``.grad``:
        same dtypes, same sums; the block's own fused accumulation adds them itself) or returned after those two."""
        c = self._captured
        c.grad_output = torch.empty_like(c.output)
        c.backward_graph = torch.cuda.CUDAGraph()
        with _weight_leaves(self.block, c.weight_leaves), \
                torch.cuda.graph(c.backward_graph, pool=pool, capture_error_mode="thread_local"):
            self._install_caches(c)  # what a moe_expert rerun reads
            grads = torch.autograd.grad(c.graph_root, [*c.leaves[:2], *c.weight_leaves], c.grad_output)
            c.grads = grads[:2] if c.main_grad else grads  # with main_grad: the weights' are placeholders
            del grads
        c.graph_root = None

    # ------------------------------------------------------------------ replay
    def _check_inputs(self, hidden, probs, routing_map) -> None:
        for name, t, ref in zip(_INPUTS, (hidden, probs, routing_map), self._captured.inputs):
            if not isinstance(t, torch.Tensor) or (t.shape, t.dtype, t.device) != (ref.shape, ref.dtype, ref.device):
                got = f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"{name} must be {ref.dtype} {list(ref.shape)} on {ref.device} as when the graphs were captured, "
                    f"got {got}: CUDA graphs replay fixed shapes (Megatron: one --seq-length and --micro-batch-size); "
                    "another token count needs its own GraphedFP8FlowMoE, or the eager block")

    def _replay_weights(self) -> None:
        c = self._captured
        if _addresses(c.params, c.main_grad) != c.addresses:
            raise RuntimeError("the experts' weights or their main_grad moved since the CUDA graphs were captured (a "
                               "parameter's .data or main_grad was replaced, not written in place); the graphs read "
                               "the old addresses: build a new GraphedFP8FlowMoE after moving them")
        c.weights_graph.replay()
        self._install_caches(c)

    def _install_caches(self, c: _Captured) -> None:
        """The static FP8 weights as the block's own cache: an eager call saying False reads them, and the
        block keeps one FP8 copy of its weights, not two."""
        for lin, cache in zip((self.block.linear_fc1, self.block.linear_fc2), c.caches):
            lin._cache = cache

    def _forward(self, hidden, probs, routing_map) -> tuple[torch.Tensor, int]:
        c = self._captured
        for buf, t in zip(c.inputs, (hidden, probs, routing_map)):
            buf.copy_(t)
        c.forward_graph.replay()
        self._generation += 1
        self._awaiting_backward = self._generation
        return c.output.detach(), self._generation

    def _backward(self, grad: torch.Tensor, generation: int) -> tuple:
        c = self._captured
        if self._awaiting_backward != generation:
            raise RuntimeError("GraphedFP8FlowMoE: this output's backward cannot run: a later forward replay overwrote "
                               "the activations it saved, or its backward already ran (retain_graph). The graphs hold "
                               "one micro-batch in flight: a forward, then its backward, before the next forward (no "
                               "pipeline schedules, no forward re-run in backward)")
        self._awaiting_backward = None
        c.grad_output.copy_(grad)
        c.backward_graph.replay()
        if not c.main_grad:
            return c.grads
        for p in c.params:
            p.grad_added_to_main_grad = True
        return (*c.grads, *(_placeholder_wgrad(p) for p in c.params))


def _check_capturable(hidden, probs, routing_map) -> None:
    """CUDA tensors, and tokens to capture."""
    for name, t in zip(_INPUTS, (hidden, probs, routing_map)):
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
            raise ValueError(f"GraphedFP8FlowMoE replays CUDA graphs: {name} must be a CUDA tensor, got "
                             f"{getattr(t, 'device', type(t).__name__)} (run the FP8FlowMoE block itself there)")
    if hidden.dim() != 2 or hidden.shape[0] == 0:
        raise ValueError(f"hidden must be [T, H] with T > 0 tokens to capture, got {list(hidden.shape)}")


def _addresses(params, main_grad: bool) -> list[int]:
    """The weights' data addresses, and their ``main_grad``s' when the graphs write those."""
    return [p.data_ptr() for p in params] + ([p.main_grad.data_ptr() for p in params] if main_grad else [])


class _Replay(torch.autograd.Function):
    """The graphs as one autograd node: inputs ``hidden``, ``probs``, ``routing_map`` and the weights."""

    @staticmethod
    def forward(ctx, graphed: GraphedFP8FlowMoE, hidden, probs, routing_map, *params):
        out, ctx.generation = graphed._forward(hidden, probs, routing_map)
        ctx.graphed = graphed
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        grad_hidden, grad_probs, *grad_params = ctx.graphed._backward(grad, ctx.generation)
        return None, grad_hidden, grad_probs, None, *grad_params


@contextlib.contextmanager
def _weight_leaves(block: torch.nn.Module, leaves: Optional[list] = None):
    """Within: each trainable parameter of ``block`` replaced, in its module, by a parameter of its own over the
    same memory (same version counter) with the same attributes (``main_grad``...), or by ``leaves`` (those of an
    earlier use, in the same order); yields them. They are the captured graphs' weight leaves: the forward's and
    the backward's (a ``moe_expert`` rerun reads the weights inside it). Megatron's DDP keeps each parameter's
    AccumulateGrad node alive from its set-up, where it was made on the default stream, and a backward captured
    into such a node makes the legacy stream wait on the capture: ``cudaErrorStreamCaptureImplicit`` (torch warns
    "The AccumulateGrad node's stream does not match..."; Megatron's tiny GPT on an H200). A new parameter's node
    is made inside the capture, on its stream. Replays read and write the same memory, and ``_Replay`` hands
    autograd the block's own parameters."""
    swapped = [(module, name, p) for module in block.modules() for name, p in module._parameters.items()
               if p is not None and p.requires_grad]
    if leaves is None:
        leaves = [torch.nn.Parameter(p.detach()) for *_, p in swapped]
        for leaf, (*_, p) in zip(leaves, swapped):
            leaf.__dict__.update(p.__dict__)
    for (module, name, _), leaf in zip(swapped, leaves):
        module._parameters[name] = leaf
    try:
        yield leaves
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p
