"""benchmarks/sdpa_attention.py on the CPU: the torch SDPA core attention computes what Megatron's local
DotProductAttention computes (causal, FP32), forward and backward, with grouped-query heads and with MLA's
head dims (query/key 24 = 16 + rope 8, value 16, scale given by the caller); the flash path's value padding
changes nothing; it refuses what it does not implement; the spec swap replaces every local core attention."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install megatron-core==0.16.1)")

import torch

from conftest import CUDA, relerr, requires_cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from sdpa_attention import SDPACoreAttention, sdpa_layer_spec  # noqa: E402

cpu_only = pytest.mark.skipif(CUDA, reason="FP32 comparison with Megatron's core on CPU tensors (GPU: the flash test)")

SEQ, BATCH = 12, 2


def _config(heads, groups, kv_channels):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=heads, num_query_groups=groups,
                             kv_channels=kv_channels, attention_dropout=0.0, use_cpu_initialization=True,
                             masked_softmax_fusion=False)


def _pair(heads, groups, dk, dv, scale=None):
    """Megatron's DotProductAttention (kv_channels = dv: its output width; ``scale`` given as MLA gives it) and
    SDPACoreAttention built as MLA builds it (k_channels dk, v_channels dv)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    config = _config(heads, groups, dv)
    stock = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                                softmax_scale=scale)
    ours = SDPACoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                             softmax_scale=scale, k_channels=dk, v_channels=dv)
    return stock, ours


def _run(module, q, k, v, dout):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = module(q, k, v, None)
    out.backward(dout)
    return out, q.grad, k.grad, v.grad


@cpu_only
@pytest.mark.parametrize("heads, groups, dk, dv, scale", [
    (4, 2, 16, 16, None),  # grouped-query attention, Megatron's default scale 1/sqrt(16)
    (4, 4, 16, 16, None),  # plain multi-head
    (4, 4, 24, 16, 0.3),   # MLA: query/key 16 + rope 8, value 16, the caller's scale
], ids=["gqa", "mha", "mla"])
def test_sdpa_core_equals_megatrons_dot_product_attention(world_of_one, heads, groups, dk, dv, scale):
    stock, ours = _pair(heads, groups, dk, dv, scale)
    q = torch.randn(SEQ, BATCH, heads, dk)
    k, v = torch.randn(SEQ, BATCH, groups, dk), torch.randn(SEQ, BATCH, groups, dv)
    dout = torch.randn(SEQ, BATCH, heads * dv)
    expected, got = _run(stock, q, k, v, dout), _run(ours, q, k, v, dout)
    assert got[0].shape == (SEQ, BATCH, heads * dv)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    assert ours.backend == "SDPA's choice (on the CPU)"


@cpu_only
def test_attention_is_causal(world_of_one):
    """The first query sees only the first key: its output is the first value row whatever comes after."""
    _, ours = _pair(2, 2, 8, 8)
    q, k, v = torch.randn(SEQ, 1, 2, 8), torch.randn(SEQ, 1, 2, 8), torch.randn(SEQ, 1, 2, 8)
    out = ours(q, k, v, None)
    torch.testing.assert_close(out[0], v[0].reshape(1, -1))
    k2, v2 = k.clone(), v.clone()
    k2[1:], v2[1:] = torch.randn_like(k[1:]), torch.randn_like(v[1:])
    torch.testing.assert_close(ours(q, k2, v2, None)[0], out[0])


@cpu_only
def test_padded_flash_path_gives_the_unpadded_result(world_of_one, monkeypatch):
    """Flash needs one head dim: MLA's value is zero-padded to the query's and the output sliced back. Run that
    path on the CPU (SDPA's own choice standing in for flash)."""
    import contextlib

    import sdpa_attention

    stock, ours = _pair(4, 4, 24, 16, 0.3)
    monkeypatch.setattr(ours, "_kernels", lambda q, v: [("flash", True)])
    monkeypatch.setattr(sdpa_attention, "_only", lambda name: contextlib.nullcontext())
    q, k, v = torch.randn(SEQ, BATCH, 4, 24), torch.randn(SEQ, BATCH, 4, 24), torch.randn(SEQ, BATCH, 4, 16)
    dout = torch.randn(SEQ, BATCH, 64)
    for name, a, b in zip(("out", "dq", "dk", "dv"), _run(ours, q, k, v, dout), _run(stock, q, k, v, dout)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    assert ours.backend == "flash (V padded 16 -> 24)"


@cpu_only
def test_a_refusing_kernel_is_said_and_not_asked_again(world_of_one, monkeypatch):
    """MLA's order (cuDNN, then padded flash): cuDNN refusing once leaves padded flash, then SDPA's own choice
    when both refuse; each refusal named in ``backend``."""
    import contextlib

    import sdpa_attention

    _, ours = _pair(2, 2, 24, 16)
    monkeypatch.setattr(ours, "_kernels", lambda q, v: [k for k in [("cudnn", False), ("flash", True)]
                                                        if k[0] not in ours._refused])
    asked, refusing = [], {"cudnn"}

    def only(name):
        asked.append(name)
        if name in refusing:
            raise RuntimeError(f"No available kernel ({name}). Aborting execution.\nmore")
        return contextlib.nullcontext()

    monkeypatch.setattr(sdpa_attention, "_only", only)
    q, v = torch.randn(SEQ, 1, 2, 24), torch.randn(SEQ, 1, 2, 16)
    first = ours(q, q, v, None)
    assert asked == ["cudnn", "flash"] and ours.backend == "flash (V padded 16 -> 24)"
    torch.testing.assert_close(ours(q, q, v, None), first)
    assert asked == ["cudnn", "flash", "flash"]  # cuDNN not asked again
    refusing.add("flash")
    torch.testing.assert_close(ours(q, q, v, None), first, rtol=1e-5, atol=1e-5)
    assert ours.backend == ("SDPA's choice (cudnn refused: No available kernel (cudnn). Aborting execution.; "
                            "flash refused: No available kernel (flash). Aborting execution.)")


@cpu_only
def test_refuses_what_it_does_not_implement(world_of_one):
    from megatron.core.transformer.enums import AttnMaskType

    _, ours = _pair(2, 2, 8, 8)
    q = torch.randn(SEQ, 1, 2, 8)
    with pytest.raises(ValueError, match="without attention_mask"):
        ours(q, q, q, torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask_type must be causal"):
        ours(q, q, q, None, attn_mask_type=AttnMaskType.no_mask)
    with pytest.raises(ValueError, match="attn_mask_type=.*causal.*got"):
        SDPACoreAttention(_config(2, 2, 8), 1, AttnMaskType.padding, "self")


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
def test_spec_swap_replaces_every_local_core_attention(mla):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = get_gpt_layer_local_spec(num_experts=4, multi_latent_attention=mla)
    assert layer.submodules.self_attention.submodules.core_attention is DotProductAttention
    swapped = sdpa_layer_spec(layer)
    assert swapped.submodules.self_attention.submodules.core_attention is SDPACoreAttention
    assert layer.submodules.self_attention.submodules.core_attention is DotProductAttention  # a copy
    block = sdpa_layer_spec(TransformerBlockSubmodules(layer_specs=[layer, layer]))
    assert [s.submodules.self_attention.submodules.core_attention for s in block.layer_specs] == [SDPACoreAttention] * 2
    with pytest.raises(ValueError, match="no self-attention"):
        sdpa_layer_spec(swapped)


@requires_cuda
@pytest.mark.parametrize("heads, groups, dk, dv", [(32, 4, 128, 128), (16, 16, 192, 128)], ids=["gqa", "mla"])
def test_fused_kernels_on_the_gpu_match_the_math_path(heads, groups, dk, dv):
    """On the GPU the core runs flash (GQA) or cuDNN's attention (MLA's 192/128 head dims) in BF16 and agrees with
    SDPA in FP32 on the same BF16 inputs (no fused kernel asked: SDPA's own choice), output and input gradients
    within BF16 rounding."""
    from megatron.core.transformer.enums import AttnMaskType

    ours = SDPACoreAttention(_config(heads, groups, dv), 1, AttnMaskType.causal, "self", softmax_scale=dk ** -0.5,
                             k_channels=dk, v_channels=dv)
    q = torch.randn(512, 2, heads, dk, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(512, 2, groups, dk, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(512, 2, groups, dv, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(512, 2, heads * dv, device="cuda", dtype=torch.bfloat16)
    got = _run(ours, q, k, v, dout)
    assert ours.backend == ("flash" if dk == dv else "cudnn")
    math = SDPACoreAttention(_config(heads, groups, dv), 1, AttnMaskType.causal, "self", softmax_scale=dk ** -0.5,
                             k_channels=dk, v_channels=dv)
    math._kernels = lambda q, v: []
    expected = _run(math, *(t.float() for t in (q, k, v, dout)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        assert relerr(a.float(), b) < 1e-2, name  # BF16 rounding of the flash path
