"""examples.multi_tensor: the device-side stand-ins give Megatron's local fallbacks' results, and install()
replaces only those fallbacks."""

import pytest
import torch

from examples import multi_tensor


def _tensors():
    gen = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (7,), (0, 4), (2, 2, 2)]
    ts = [torch.randn(s, generator=gen) for s in shapes] + [torch.randn(4, generator=gen).bfloat16()]
    ts[0][1, 1] = 0.0
    return ts


def test_l2_norm_is_the_norm_of_all_tensors():
    ts = _tensors()
    norm, none = multi_tensor.l2_norm(2048, None, [ts], False)
    expected = torch.stack([torch.norm(t).double() for t in ts]).norm()  # as the fallback: per tensor in its dtype
    assert none is None and norm.shape == (1,) and norm.dtype == torch.float32
    assert torch.allclose(norm.double(), expected.reshape(1), rtol=1e-6)
    assert multi_tensor.l2_norm(2048, None, [[]], False)[0].item() == 0.0


def test_l2_norm_keeps_non_finite_values():
    ts = _tensors()
    ts[1][3] = float("nan")
    assert multi_tensor.l2_norm(2048, None, [ts], False)[0].isnan().all()
    ts[1][3] = float("inf")
    assert multi_tensor.l2_norm(2048, None, [ts], False)[0].isinf().all()


@pytest.mark.parametrize("factor", [1.0, 0.25, torch.tensor(0.5)])
@pytest.mark.parametrize("in_place", [False, True])
def test_scale_equals_megatrons_local_scale(factor, in_place):
    from megatron.core.utils import local_multi_tensor_scale

    src = _tensors()
    dst, expected = [torch.empty_like(t) for t in src], [torch.empty_like(t) for t in src]
    if in_place:
        dst, ref_src = src, [t.clone() for t in src]
        local_multi_tensor_scale(2048, None, [ref_src, ref_src], factor)
        multi_tensor.scale(2048, None, [dst, dst], factor)
        expected = ref_src
    else:
        local_multi_tensor_scale(2048, None, [src, expected], factor)
        multi_tensor.scale(2048, None, [src, dst], factor)
    for got, want in zip(dst, expected):
        assert torch.equal(got, want)


def test_install_replaces_only_the_local_fallbacks(monkeypatch):
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    monkeypatch.setattr(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", utils.local_multi_tensor_scale)
    kernel = object()  # TE's or apex's kernel: kept
    monkeypatch.setattr(optimizer, "multi_tensor_scale_impl", kernel)
    assert multi_tensor.install() == ["megatron.core.optimizer.clip_grads.l2_norm_impl",
                                      "megatron.core.optimizer.clip_grads.multi_tensor_scale_impl"]
    assert clip_grads.l2_norm_impl is multi_tensor.l2_norm and clip_grads.multi_tensor_scale_impl is multi_tensor.scale
    assert optimizer.multi_tensor_scale_impl is kernel
