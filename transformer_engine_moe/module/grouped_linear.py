"""GroupedLinear: G expert linears over the row ranges of one input, in blockwise FP8.

Shaped after TransformerEngine's ``GroupedLinear`` (``weight0..weight{G-1}``, each
``[out_features, in_features]``, or with TE's ``single_grouped_weight`` one ``weight``
``[G, out_features, in_features]``; ``forward(inp, m_splits)``), but its input may be
the ``Float8BlockwiseQTensor`` flowing from permute or from SwiGLU+quant: it is
used as is, never dequantized. Per step:

- forward: weights quantized 128x128 into W and W^T by one launch (W^T cached across
  micro-batches by TE's ``is_first_microbatch`` rule, ``fp8_weights``); ``out =
  grouped_gemm(inp, W)`` in BF16 (or the input's dtype), W dropped after it. Kept for
  backward: W^T (dgrad's operand: one FP8 copy of the weights lives across the step;
  W alone in recompute's first pass, ``fp8_weights``) and, when a weight gradient is
  wanted, the input's scaling-aware transpose (expert-major 128x1, what wgrad reads; the
  same bytes as the input), made before the GEMM, as TE makes an input's columnwise usage in
  forward. At small experts the host bounds the forward after the permute (docs/megatron.md):
  the GPU runs the transpose while the host issues the GEMM, where it would idle, and backward,
  where the GPU is busy, runs it no more, nor holds the input and its transpose together. In a
  ``moe_expert`` checkpoint's first pass, whose saved tensors are dropped, empty tensors stand in
  for the transpose, which the rerun makes.
- backward: the output gradient is quantized 1x128 (E4M3, or E5M2 for the HYBRID
  recipe), or taken as it comes when it arrives so quantized (``FP8FlowMoE``'s unpermute
  quantizes it per token and permutes FP8 rows), and its scaling-aware transpose queued before
  the dgrad GEMM (the GPU runs it while the host issues that GEMM: fc2's, the backward's first);
  dgrad ``dX = dY @ W_g`` through W^T (a byte transpose of W where W was kept), dropped right
  after the dgrad GEMM; wgrad ``dW_g = dY_g^T X_g`` from the scaling-aware transposes of dY and
  of the input. With
  ``fuse_wgrad_accumulation``, wgrad is added into each weight's ``main_grad``
  (Megatron), or written over it where the weights have ``overwrite_main_grad`` set
  (Megatron-FSDP), and ``.grad`` gets a zero placeholder, as in TE (an empty sparse one for a
  grouped weight: no bytes): Megatron's DDP hooks fire when the weight's gradient is accumulated,
  and skip weights whose ``grad_added_to_main_grad`` is set. With ``add_wgrad_into_main_grad`` (set by
  ``FP8FlowMoE.into_main_grad`` where Megatron's DDP adds ``.grad`` into ``main_grad`` without that fusion) the same,
  but each sum rounded to the weights' dtype before it is added: what DDP's hook adds from a ``.grad``, bit
  for bit, without the ``.grad`` buffer and the hook's pass over it.

One parameter per expert costs host time in every backward (autograd's gradient
accumulation and each hook Megatron's DDP registers there, per parameter and micro-batch);
``single_grouped_weight`` gives autograd one ``[G, N, K]`` parameter, whose gradient is
wgrad's output as is. Its state dict holds ``weight``; a per-expert checkpoint
(``weight0..``) loads into it and the reverse, as in TE.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import nn

from ..backend import implementation
from ..layout import (MSplits, address_table, check_m_splits, columnwise_data_shape, m_splits_tensor,
                      num_column_blocks, row_groups)
from ..ops.grouped_gemm import GEMM_BACKENDS, check_disjoint, grouped_gemm, grouped_gemm_wgrad
from ..ops.quantize import quantize_grouped_weight, quantize_in_function
from ..ops.transpose import transpose_grouped_weight
from ..quantizer import Float8BlockQuantizer
from ..recipe import HIGH_PRECISION_DTYPES, FP8FlowRecipe, Role, check_bool
from ..tensor.float8_blockwise_tensor import Float8BlockwiseQTensor


def _bias_rows(bias: torch.Tensor, m_splits: MSplits, m: int) -> torch.Tensor:
    """``[M, N]``: each row's group bias, zero in a trailing weightless group (no host sync for device
    splits)."""
    sizes = m_splits_tensor(m_splits, bias.device)
    if sizes.numel() > bias.shape[0]:
        bias = torch.cat([bias, bias.new_zeros(1, bias.shape[1])])
    return torch.repeat_interleave(bias, sizes, dim=0, output_size=m)


def _wgrad_out(main_grads: list[torch.Tensor]) -> Union[torch.Tensor, list[torch.Tensor], None]:
    """Where the wgrad GEMM writes straight into the weights' ``main_grad``: a single weight's contiguous
    float32 ``[G, N, K]``, or G contiguous float32 ``[N, K]`` anywhere (the op makes them one ``[G, N, K]``
    view where they lie in order; Megatron's DDP lays them out in reverse, which cuBLAS writes at each
    address and Triton through a table of them); None for other buffers (a strided or BF16 ``main_grad``:
    added after)."""
    if all(t.dtype == torch.float32 and t.is_contiguous() for t in main_grads):
        return main_grads[0] if main_grads[0].dim() == 3 else main_grads
    return None


def _accumulates_into_main_grad(weights) -> bool:
    """Whether wgrad is added into the weights' ``main_grad`` (Megatron's DDP) or overwrites it: weights
    with ``overwrite_main_grad`` set, as Megatron-FSDP sets it on its unsharded parameters (TE's rule)."""
    flags = {bool(getattr(w, "overwrite_main_grad", False)) for w in weights}
    if len(flags) > 1:
        raise ValueError("GroupedLinear: overwrite_main_grad is set on some of its weights and not on others; "
                         "the wgrad GEMM writes all experts' main_grad one way (set it on all weights or none)")
    return not flags.pop()


def _columnwise(t: Float8BlockwiseQTensor, data_t: torch.Tensor, scale_t: torch.Tensor,
                m_splits: MSplits) -> Float8BlockwiseQTensor:
    """``t``'s value held only as the 128x1 columnwise copy ``data_t``, ``scale_t`` grouped by ``m_splits``."""
    return Float8BlockwiseQTensor._of_launch(shape=t.shape, dtype=t.dtype, fp8_dtype=t.fp8_dtype,
                                             force_pow_2_scales=t.force_pow_2_scales, columnwise_data=data_t,
                                             columnwise_scale_inv=scale_t, columnwise_m_splits=m_splits)


def _quantized_grad(grad_out: torch.Tensor, args) -> Float8BlockwiseQTensor:
    """The output gradient quantized 1x128 by ``args`` (the GRAD role's), or as it arrives when it arrives so
    quantized (rowwise 1x128 with power-of-two scales, which the wgrad's scaling-aware transpose shifts), e.g.
    from ``moe_unpermute(grad_quantize=...)``; another FP8 gradient is dequantized and quantized again."""
    if isinstance(grad_out, Float8BlockwiseQTensor):
        if grad_out.rowwise_data is not None and not grad_out.is_2D_scaled and grad_out.force_pow_2_scales:
            return grad_out
        grad_out = grad_out.dequantize(grad_out.dtype)
    return quantize_in_function(grad_out.contiguous(), args)


_PLACEHOLDERS: dict[tuple, torch.Tensor] = {}


def _placeholder_wgrad(weight: torch.Tensor) -> torch.Tensor:
    """What ``weight``'s gradient is under ``main_grad`` fusion, so that autograd accumulates something and the
    hooks Megatron's DDP registers there run; they drop it at once (``param.grad = None``: with
    ``grad_added_to_main_grad`` set its value is never read, unless the weight has ``zero_out_wgrad``, when it is
    added into ``main_grad`` and so must be zero). Kept, one per shape, dtype and device:
    - an expert's ``[N, K]`` weight: a zero tensor (as TE's per-expert dummies: autograd takes it as ``.grad`` as
      it is, no copy, no memset per backward);
    - a grouped ``[G, N, K]`` weight: an empty sparse COO tensor of its shape, an exact zero that holds no bytes
      (as ``nn.Embedding(sparse=True)`` hands a dense weight a sparse gradient). A dense one would be a whole
      grouped weight's bytes, fc1's and fc2's 2.8 GB at ``dsv3_ep8_rank``'s 32 experts: kept, held through every
      micro-batch; made per backward (``torch.empty``, as Megatron's own linears make theirs), a transient on
      top of the backward's activations."""
    key = (tuple(weight.shape), weight.dtype, weight.device)
    if key not in _PLACEHOLDERS:
        if weight.dim() == 2:
            _PLACEHOLDERS[key] = torch.zeros(key[0], dtype=weight.dtype, device=weight.device)
        else:
            indices = torch.empty(weight.dim(), 0, dtype=torch.long, device=weight.device)
            values = torch.empty(0, dtype=weight.dtype, device=weight.device)
            _PLACEHOLDERS[key] = torch.sparse_coo_tensor(indices, values, key[0], is_coalesced=True,
                                                         check_invariants=False)
    return _PLACEHOLDERS[key].detach()


class _GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, m_splits, module, weight_fp8, weight_t, requantize, grad_enabled, bias, *weights):
        # no autograd Function inside this one (torch.compile could not trace it): quantize, transpose as raw ops
        # weight_fp8 None: a recompute's rerun (GroupedLinear.recompute_saved_input): no GEMM, an empty output
        x = inp if isinstance(inp, Float8BlockwiseQTensor) else quantize_in_function(
            inp.contiguous(), module.quantizers[Role.INPUT].args)
        # grad_enabled: the caller's grad mode (this forward runs without it; needs_input_grad does not say)
        ctx.wgrad = grad_enabled and (any(ctx.needs_input_grad[8:]) or module.into_main_grad)
        ctx.impl = implementation("auto", x, "GroupedLinear")  # the scaling-aware transposes of x and dy
        if ctx.wgrad:  # only wgrad reads the input, 128x1: its scaling-aware transpose (the same bytes as x)
            m_splits = check_m_splits(m_splits, x.shape[0], device=x.device)  # before the transpose (the GEMM too)
            if module._saved_input_dropped:  # a checkpoint's first pass: empty tensors of x^T's shapes stand in
                m, k = x.shape
                x_t = (x.rowwise_data.new_empty(columnwise_data_shape(m, k, m_splits)),
                       x.rowwise_scale_inv.new_empty((num_column_blocks(m, m_splits), k)))
            else:
                x_t = ctx.impl.scaling_aware_transpose(x.rowwise_data, x.rowwise_scale_inv, m_splits)
            ctx.save_for_backward(*x_t)
            ctx.x_meta = (tuple(x.shape), x.dtype, x.fp8_dtype, x.force_pow_2_scales)
            del x_t
        if weight_fp8 is None:
            out = torch.empty(0, dtype=inp.dtype, device=inp.device)
        else:
            out = grouped_gemm(x, weight_fp8, m_splits, out_dtype=inp.dtype, backend=module.backend)
            if bias is not None:
                out = out + _bias_rows(bias, m_splits, out.shape[0]).to(out.dtype)
        # not saved_tensors (a cached copy is reused, never re-saved): W^T, or W where no W^T was made; nothing
        # where backward quantizes the weights again (requantize_in_backward without a cache)
        ctx.requantize = requantize
        ctx.weight_bwd = None if ctx.requantize else weight_fp8 if weight_t is None else weight_t
        ctx.transpose_in_backward = weight_t is None
        ctx.m_splits, ctx.module, ctx.weights = m_splits, module, weights
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        module, m_splits = ctx.module, ctx.m_splits
        # saved tensors first: under a recompute (moe_expert) unpacking them reruns the checkpointed forward,
        # which is then alive next to grad_out alone, not also next to dy, dgrad and dy^T (peak memory)
        saved = ctx.saved_tensors
        weight, ctx.weight_bwd = ctx.weight_bwd, None
        if weight is None and not ctx.requantize:
            raise RuntimeError("GroupedLinear's backward ran twice through one graph: it drops its FP8 weights "
                               "after the dgrad GEMM (as TransformerEngine frees its FP8 tensors in backward), so "
                               "backward with retain_graph=True a second time is not supported")
        dy = _quantized_grad(grad_out, module.quantizers[Role.GRAD].args)
        if ctx.wgrad:
            # dy^T before the dgrad GEMM: the GPU runs it while the host issues that GEMM (where the backward's first
            # GEMM waited for its host); dy^T alone is kept (no rowwise copy), dy's bytes go after the dgrad
            dy_t = _columnwise(dy, *ctx.impl.scaling_aware_transpose(dy.rowwise_data, dy.rowwise_scale_inv, m_splits),
                               m_splits)
        dgrad = None
        if ctx.needs_input_grad[0]:
            if ctx.requantize:  # the weights as the forward quantized them (they do not change in between)
                weight_t = module.quantize_weights(transpose=True)[1]
            else:
                weight_t = transpose_grouped_weight(weight, backend=module.weight_backend) \
                    if ctx.transpose_in_backward else weight
            dgrad = grouped_gemm(dy, weight_t, m_splits, out_dtype=grad_out.dtype, backend=module.backend)
            del weight_t
        del weight, dy  # the wgrad output below need not coexist with the FP8 weights and dy (peak memory)
        dweights = [None] * len(ctx.weights)
        if ctx.wgrad:
            (data, scale), saved = saved, None
            shape, dtype, fp8_dtype, pow2 = ctx.x_meta
            x_t = Float8BlockwiseQTensor._of_launch(shape=shape, dtype=dtype, fp8_dtype=fp8_dtype,
                                                    force_pow_2_scales=pow2, columnwise_data=data,
                                                    columnwise_scale_inv=scale, columnwise_m_splits=m_splits)
            if module.into_main_grad:
                main_grads = [w.main_grad for w in ctx.weights]  # per expert [N, K], or one [G, N, K]
                accumulate = _accumulates_into_main_grad(ctx.weights)
                out = _wgrad_out(main_grads)
                # float32 sums (fusion), or rounded to the weights' dtype first (add_wgrad_into_main_grad)
                grad_dtype = torch.float32 if module.fuse_wgrad_accumulation else ctx.weights[0].dtype
                if out is not None:  # in place (cuBLASLt's beta = 1, DeepGEMM's C = D, Triton's read-add-write)
                    grouped_gemm_wgrad(dy_t, x_t, m_splits, out=out, accumulate=accumulate, out_dtype=grad_dtype,
                                       num_groups=module.num_gemms, backend=module.backend)
                else:
                    wgrad = grouped_gemm_wgrad(dy_t, x_t, m_splits, out_dtype=grad_dtype, num_groups=module.num_gemms,
                                               backend=module.backend)
                    parts = [wgrad] if module.single_grouped_weight else list(wgrad.unbind(0))
                    (torch._foreach_add_ if accumulate else torch._foreach_copy_)(main_grads, parts)
                for w in ctx.weights:
                    w.grad_added_to_main_grad = True
                dweights = [_placeholder_wgrad(w) for w in ctx.weights]
            else:  # written in the weights' dtype: no FP32 [G, N, K] buffer
                wgrad = grouped_gemm_wgrad(dy_t, x_t, m_splits, out_dtype=ctx.weights[0].dtype,
                                           num_groups=module.num_gemms, backend=module.backend)
                dweights = [wgrad] if module.single_grouped_weight else list(wgrad.unbind(0))
        dbias = None
        if ctx.has_bias:
            rows = row_groups(m_splits, grad_out.shape[0], grad_out.device)
            dbias = torch.zeros((module.num_gemms + 1, grad_out.shape[1]), dtype=torch.float32, device=grad_out.device)
            g = grad_out.dequantize() if isinstance(grad_out, Float8BlockwiseQTensor) else grad_out.float()
            dbias = dbias.index_add_(0, rows, g)[:-1].to(module.bias_dtype)  # row G: weightless
        return (dgrad, None, None, None, None, None, None, dbias, *dweights)


class GroupedLinear(nn.Module):
    """``num_gemms`` linears ``[in_features] -> [out_features]``, expert g applied to rows of group g.

    Args (as TransformerEngine's ``GroupedLinear``):
        num_gemms: number of experts G.
        in_features, out_features: K and N, multiples of 128 (the weights' 128x128 blocks).
        bias: one ``[out_features]`` bias per expert, named ``bias0..``.
        params_dtype: master weights' dtype (BF16 or FP32).
        device: where parameters live.
        recipe: the ``FP8FlowRecipe`` (E4M3 or HYBRID, power-of-two scales).
        fuse_wgrad_accumulation: add weight gradients into ``weight{i}.main_grad`` (FP32)
            instead of ``.grad`` (which gets a kept zero placeholder, as in TE), as Megatron's
            gradient-accumulation fusion; write them over it where the weights have
            ``overwrite_main_grad = True`` (Megatron-FSDP's attribute, honoured as TE does).
        backend: ``"auto"``, ``"triton"``, ``"cublas"`` or ``"reference"`` (``ops.grouped_gemm``).
        single_grouped_weight: one parameter ``weight [G, out_features, in_features]`` instead of
            ``weight0..`` (TE's name; biases stay per expert). Same arithmetic, bit for bit.
        requantize_in_backward: without an FP8 weight cache (``is_first_microbatch=None``), the forward
            quantizes W alone and keeps no FP8 weight for backward, which quantizes the weights again for its
            dgrad: one weight quantization more per call, for one byte per weight parameter less between
            forward and backward (under activation recompute, where little else is kept, the difference
            between one layer's FP8 weights alive at a time and every layer's). The weights must not change
            between a forward and its backward. Same arithmetic, bit for bit.
    """

    def __init__(self, num_gemms: int, in_features: int, out_features: int, bias: bool = False,
                 params_dtype: torch.dtype = torch.bfloat16, device: Union[str, torch.device, None] = None,
                 recipe: Optional[FP8FlowRecipe] = None, fuse_wgrad_accumulation: bool = False,
                 init_method=None, backend: str = "auto", single_grouped_weight: bool = False,
                 requantize_in_backward: bool = False):
        super().__init__()
        for name, v in (("num_gemms", num_gemms), ("in_features", in_features), ("out_features", out_features)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if in_features % 128 or out_features % 128:
            raise ValueError(f"in_features and out_features must be multiples of 128 (128x128 weight blocks), "
                             f"got {in_features} and {out_features}")
        if params_dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"params_dtype must be torch.bfloat16 or torch.float32, got {params_dtype}")
        if recipe is not None and not isinstance(recipe, FP8FlowRecipe):
            raise TypeError(f"recipe must be an FP8FlowRecipe (e.g. FP8FlowRecipe(fp8_format=Format.HYBRID)), "
                            f"got {recipe!r}")
        if recipe is not None and not recipe.force_pow_2_scales:
            raise ValueError("recipe.force_pow_2_scales must be True: the wgrad operands come from the scaling-aware "
                             "transpose, which shifts exponents and needs power-of-two scales")
        if backend not in GEMM_BACKENDS:
            raise ValueError(f"backend must be one of {GEMM_BACKENDS}, got {backend!r}")
        for name, v in (("bias", bias), ("fuse_wgrad_accumulation", fuse_wgrad_accumulation),
                        ("single_grouped_weight", single_grouped_weight),
                        ("requantize_in_backward", requantize_in_backward)):
            if not isinstance(v, bool):  # bias="no" once made biases
                raise TypeError(f"{name} must be a bool, got {v!r}")
        check_init_method(init_method)
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.recipe = recipe or FP8FlowRecipe()
        self.quantizers = {role: Float8BlockQuantizer.from_recipe(self.recipe, role) for role in Role}
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        # set by FP8FlowMoE.into_main_grad (the module docstring): gradients rounded to the weights' dtype, then added
        self.add_wgrad_into_main_grad = False
        self.backend = backend
        self.bias_dtype = params_dtype
        self.single_grouped_weight = single_grouped_weight
        # the weight parameters' names, read from _parameters (nn.Module's __getattr__ costs about 1 us a name, and
        # the G per-expert weights are read several times a step)
        self._weight_keys = ("weight",) if single_grouped_weight else tuple(f"weight{i}" for i in range(num_gemms))
        self.requantize_in_backward = requantize_in_backward
        # True only while a non-reentrant checkpoint's first pass runs this module (FP8FlowMoE's moe_expert): what the
        # forward saves is dropped there and made again by the rerun, so the input's transpose is not made and
        # empty tensors of its shapes stand in (the checkpoint checks the rerun's against their shapes)
        self._saved_input_dropped = False
        init = init_method or (lambda t: nn.init.kaiming_uniform_(t, a=5 ** 0.5))
        if single_grouped_weight:
            self.weight = nn.Parameter(torch.empty(num_gemms, out_features, in_features, dtype=params_dtype,
                                                   device=device))
            with torch.no_grad():  # expert by expert, as the per-expert weights are drawn
                for w in self.weight.unbind(0):
                    init(w)
        for i in range(num_gemms):
            if not single_grouped_weight:
                w = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype, device=device))
                init(w)
                self.register_parameter(f"weight{i}", w)
            if bias:
                self.register_parameter(f"bias{i}", nn.Parameter(
                    torch.zeros(out_features, dtype=params_dtype, device=device)))
        self.use_bias = bias
        self._cache = self._prefetched = None
        self._main_grad_addresses = None  # the main_grads last found disjoint (forward)

    @property
    def into_main_grad(self) -> bool:
        """Whether the wgrad GEMM adds (or writes) into the weights' ``main_grad``: ``fuse_wgrad_accumulation`` or
        ``add_wgrad_into_main_grad`` (the module docstring)."""
        return self.fuse_wgrad_accumulation or self.add_wgrad_into_main_grad

    @property
    def weight_backend(self) -> str:
        """The backend of the weights' quantization and transpose: the reference with ``backend="reference"``,
        else ``"auto"`` (those ops have no cuBLAS or DeepGEMM form)."""
        return "reference" if self.backend == "reference" else "auto"

    @property
    def weights(self) -> list[torch.Tensor]:
        """The G ``[out_features, in_features]`` expert weights (views of ``weight`` when single)."""
        if self.single_grouped_weight:
            return list(self.weight.unbind(0))
        return self.weight_params

    @property
    def weight_params(self) -> list[nn.Parameter]:
        """The weight parameters autograd sees: ``[weight]`` when single, else ``weight0..``."""
        params = self._parameters
        return [params[key] for key in self._weight_keys]

    def fp8_weights(self, is_first_microbatch: Optional[bool] = None, transpose: bool = True
                    ) -> tuple[Float8BlockwiseQTensor, Optional[Float8BlockwiseQTensor]]:
        """``(W [G, N, K], W^T [G, K, N])`` 128x128 FP8: the forward GEMM's and the dgrad GEMM's K-major
        operands (``ops.quantize_grouped_weight``: one launch quantizes the G weights in place and writes
        both). The forward drops W after its GEMM and backward keeps W^T as is; a cache holds W^T alone,
        and its reuse gives W by a byte transpose (``ops.transpose_grouped_weight``) in the forward. One
        FP8 copy of the weights lives across a step, cached or not.

        ``transpose=False`` writes W alone (W^T is None) for a forward whose saved state is dropped and
        rerun (``moe_expert`` recompute's first pass): a cache then holds W, which the rerun reads as is,
        and backward makes W^T. W^T is also left out without a cache and without autograd (inference).

        TransformerEngine's ``is_first_microbatch`` rule: None quantizes the current weights and
        keeps nothing; True quantizes them and caches the result; False reuses the cache (the
        weights have not changed since the micro-batch that said True). Optimizers write weights
        through ``.data`` or flat buffers without bumping parameter versions, so only the caller
        knows when the cache is stale.
        """
        check_is_first_microbatch(is_first_microbatch)  # a public method: "yes" once cached as True does
        check_bool(transpose, "transpose")
        if is_first_microbatch is False and self._cache is not None:
            w, w_t = self._cache
            return (transpose_grouped_weight(w_t, backend=self.weight_backend) if w is None else w), w_t
        self._cache = None  # not alive next to its replacement
        transpose = transpose and (is_first_microbatch is not None or torch.is_grad_enabled())
        w, w_t = self.quantize_weights(transpose)
        if is_first_microbatch is not None:
            self._cache = (None, w_t) if transpose else (w, None)
        return w, w_t

    def quantize_weights(self, transpose: bool = True
                         ) -> tuple[Float8BlockwiseQTensor, Optional[Float8BlockwiseQTensor]]:
        """``(W, W^T or None)``: the current weights quantized 128x128 by the weight quantizer, nothing cached
        (``ops.quantize_grouped_weight``, one launch for the G weights)."""
        q = self.quantizers[Role.WEIGHT]
        with torch.no_grad():
            return quantize_grouped_weight(self.weights, q.dtype, q.force_pow_2_scales, q.amax_epsilon,
                                           transpose=transpose, backend=self.weight_backend)

    def address_tables(self) -> list[torch.Tensor]:
        """The device tables of addresses this module's kernels read (``layout.address_table``): its weights'
        (the grouped weight quantization) and, with ``fuse_wgrad_accumulation`` into separate float32
        ``main_grad``s, theirs (the wgrad GEMM). Made here where missing (a CUDA graph capture refuses to make
        one) and returned, so that whoever captures a graph reading them keeps them alive: they are cached by
        address, and a captured graph holds no reference to what it reads."""
        tables = [address_table(self.weights)]
        if self.into_main_grad:
            out = _wgrad_out([w.main_grad for w in self.weight_params])
            if isinstance(out, list):
                tables.append(address_table(out))
        return [table for table, _ in tables]

    def prefetch_fp8_weights(self, is_first_microbatch: Optional[bool] = None, transpose: bool = True) -> None:
        """Make now the FP8 weights that the next ``forward`` with the same ``is_first_microbatch`` takes
        (``fp8_weights(is_first_microbatch, transpose)``), e.g. while the host waits for a dispatch: that
        forward quantizes nothing (a second call with the same arguments before it keeps the first's
        weights). They are for that one call, and the weights must not change before it;
        ``drop_prefetched_fp8_weights`` discards them if it never comes (``FP8FlowMoE`` does, whatever its
        forward raises)."""
        if self._prefetched is None or self._prefetched[:2] != (is_first_microbatch, transpose):
            self._prefetched = (is_first_microbatch, transpose, self.fp8_weights(is_first_microbatch, transpose))

    def drop_prefetched_fp8_weights(self) -> None:
        """Discard FP8 weights from ``prefetch_fp8_weights`` that no forward took."""
        self._prefetched = None

    def reset_fp8_weight_cache(self) -> None:
        """Drop the FP8 weights cached by ``is_first_microbatch=True`` (and any prefetched); the next call
        quantizes the current weights whatever its flag. ``load_state_dict`` calls it."""
        self._cache = self._prefetched = None

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self.reset_fp8_weight_cache()
        _remap_weight_keys(state_dict, prefix, self.num_gemms, self.single_grouped_weight)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, inp: Union[torch.Tensor, Float8BlockwiseQTensor], m_splits: Union[Sequence[int], torch.Tensor],
                is_first_microbatch: Optional[bool] = None):
        """``inp [M, in_features]`` BF16/FP32 or a rowwise 1x128 Float8BlockwiseQTensor; ``m_splits``
        per-expert row counts (host list or device int tensor; one more trailing count for a weightless
        group: rows whose output is zero and whose gradients are left out, ``ops.grouped_gemm``) ->
        ``[M, out_features]`` in ``inp``'s (logical) dtype. ``is_first_microbatch``: FP8 weight caching
        as in TE (``fp8_weights``)."""
        self._check_input(inp)
        check_is_first_microbatch(is_first_microbatch)
        if self.into_main_grad and torch.is_grad_enabled():
            named = [(name, w) for name, w in self._weight_names() if w.requires_grad]
            for name, w in named:
                _check_main_grad(name, w, "fuse_wgrad_accumulation" if self.fuse_wgrad_accumulation
                                 else "add_wgrad_into_main_grad")
            if len(named) > 1 and not torch.compiler.is_compiling():  # addresses: host-side, not traced
                self._check_main_grads_disjoint(named)
        requantize = self.requantize_in_backward and is_first_microbatch is None
        prefetched, self._prefetched = self._prefetched, None
        w, w_t = prefetched[2] if prefetched and prefetched[0] is is_first_microbatch else \
            self.fp8_weights(is_first_microbatch, transpose=not requantize)
        del prefetched
        return self._function(inp, m_splits, w, None if requantize else w_t, requantize)

    def _check_main_grads_disjoint(self, named) -> None:
        """No two weights' ``main_grad`` share memory (one buffer for two experts once had both gradients written,
        or raced, into it): checked when their addresses change, not every forward (about 15 us for 128 experts
        against 80). Refused here, named, before any backward, and the only check of ``main_grad``s added after
        the GEMM (BF16/FP16 or strided: ``_wgrad_out``). Contiguous float32 ones go to the wgrad op as its
        ``out`` list, which checks them again in backward (``check_disjoint``, about 25 us for 128): that also
        catches buffers replaced after this forward, and skipping it soundly would need their addresses read
        again (about 15 us)."""
        addresses = tuple(w.main_grad.data_ptr() for _, w in named)
        if addresses != self._main_grad_addresses:
            check_disjoint([w.main_grad for _, w in named], [f"{name}.main_grad" for name, _ in named])
            self._main_grad_addresses = addresses

    def recompute_saved_input(self, inp: Union[torch.Tensor, Float8BlockwiseQTensor],
                              m_splits: Union[Sequence[int], torch.Tensor]) -> None:
        """Inside the rerun of a non-reentrant ``torch.utils.checkpoint`` whose first pass called
        ``forward(inp, m_splits, ...)``: regenerate only what that forward saved for backward (the input's
        FP8 rowwise copy, which backward transposes), without the GEMM or the FP8 weights. The autograd node it
        makes saves the same tensors in the same order, so checkpoint's early stop ends the rerun here when they are the
        region's last (``FP8FlowMoE``'s ``moe_expert``: fc2); the first pass's backward reads them. Same
        input checks as ``forward``."""
        self._check_input(inp)
        self._function(inp, m_splits, None, None)

    def _function(self, inp, m_splits, w, w_t, requantize: bool = False):
        """The autograd Function over ``inp``, ``m_splits`` (a tuple as a list), FP8 ``w``/``w_t`` (None: a
        rerun without GEMM; ``requantize``: backward quantizes the weights again, nothing kept), the stacked
        biases and the weight parameters."""
        bias = torch.stack([getattr(self, f"bias{i}") for i in range(self.num_gemms)]) if self.use_bias else None
        return _GroupedLinearFunction.apply(inp, list(m_splits) if isinstance(m_splits, tuple) else m_splits, self,
                                            w, w_t, requantize, torch.is_grad_enabled(), bias, *self.weight_params)

    def _check_input(self, inp) -> None:
        if not isinstance(inp, torch.Tensor):
            raise TypeError(f"inp must be a tensor or Float8BlockwiseQTensor, got {type(inp).__name__}")
        if inp.dim() != 2 or inp.shape[1] != self.in_features:
            raise ValueError(f"inp must have shape [M, in_features={self.in_features}], got {list(inp.shape)}")
        if not isinstance(inp, Float8BlockwiseQTensor) and inp.dtype not in (torch.bfloat16, torch.float16,
                                                                             torch.float32):
            raise TypeError(f"inp must be bf16/fp16/fp32 or a Float8BlockwiseQTensor, got {inp.dtype}")
        device = self._parameters[self._weight_keys[0]].device
        if inp.device != device:
            raise ValueError(f"inp is on {inp.device}, the weights on {device}: move one of them")
        if isinstance(inp, Float8BlockwiseQTensor) and (inp.is_2D_scaled or not inp.force_pow_2_scales
                                                        or inp.rowwise_data is None):
            raise ValueError("an FP8 inp must be rowwise 1x128 with power-of-two scales (the input role's "
                             f"quantization; wgrad transposes it by exponent shifts), got {inp!r}")

    def _weight_names(self) -> list[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` of each weight parameter (``weight_params``)."""
        params = self._parameters
        return [(key, params[key]) for key in self._weight_keys]

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.use_bias}, recipe={self.recipe}, single_grouped_weight={self.single_grouped_weight}")


def check_is_first_microbatch(is_first_microbatch) -> None:
    """TE's ``is_first_microbatch``: None or a bool (TypeError otherwise)."""
    if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
        raise TypeError(f"is_first_microbatch must be None or a bool, got {is_first_microbatch!r}")


def check_init_method(init_method, name: str = "init_method") -> None:
    """None or a callable initialising a weight in place (TypeError naming ``name`` otherwise)."""
    if init_method is not None and not callable(init_method):
        raise TypeError(f"{name} must be None or a callable that initialises a weight tensor in place (e.g. "
                        f"Megatron's config.init_method, torch.nn.init.normal_), got {init_method!r}")


def _check_main_grad(name: str, weight: nn.Parameter, flag: str) -> None:
    """Under ``flag`` (``fuse_wgrad_accumulation`` or ``add_wgrad_into_main_grad``): ``weight.main_grad`` a plain
    floating tensor of the weight's shape on its device (float32 as Megatron's DDP allocates it, or BF16/FP16: added
    after the wgrad GEMM), checked in forward so that a wrong buffer fails here and not in backward."""
    want = (f"a bf16/fp16/fp32 tensor {list(weight.shape)} on {weight.device} (float32 as Megatron's DDP "
            f"allocates it)")
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        raise ValueError(f"{flag}=True adds weight gradients into each weight's main_grad ({want}); "
                         f"{name} has none")
    if not isinstance(main_grad, torch.Tensor) or isinstance(main_grad, Float8BlockwiseQTensor) \
            or main_grad.dtype not in HIGH_PRECISION_DTYPES:
        got = f"{type(main_grad).__name__} of dtype {main_grad.dtype}" if isinstance(main_grad, torch.Tensor) \
            else type(main_grad).__name__
        raise TypeError(f"{name}.main_grad must be {want}, got {got}")
    if main_grad.shape != weight.shape or main_grad.device != weight.device:
        raise ValueError(f"{name}.main_grad must be {want}, got {list(main_grad.shape)} on {main_grad.device}")


def _remap_weight_keys(state_dict, prefix: str, num_gemms: int, single: bool) -> None:
    """Between TE's two checkpoint forms, in place: per-expert ``weight0..`` into one stacked ``weight``
    for a single-weight module, and the reverse (``weight`` split into ``weight{i}``)."""
    stacked_key, keys = f"{prefix}weight", [f"{prefix}weight{i}" for i in range(num_gemms)]
    if single and stacked_key not in state_dict and all(k in state_dict for k in keys):
        state_dict[stacked_key] = torch.stack([state_dict.pop(k) for k in keys])
    elif not single and stacked_key in state_dict and not any(k in state_dict for k in keys):
        stacked = state_dict.pop(stacked_key)
        if stacked.dim() != 3 or stacked.shape[0] != num_gemms:
            raise ValueError(f"{stacked_key}: a single grouped weight [num_gemms={num_gemms}, N, K] was expected, "
                             f"got {list(stacked.shape)}")
        state_dict.update(zip(keys, stacked.unbind(0)))
