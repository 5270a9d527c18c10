"""Device-side stand-ins for Megatron's multi-tensor fallbacks, installed by ``pretrain_gpt`` only.

Without TransformerEngine or apex, Megatron's optimizer falls back to ``local_multi_tensor_l2_norm`` and
``local_multi_tensor_scale`` (``megatron.core.utils``): the gradient-clipping norm reads every gradient's
norm to the host, one synchronisation per parameter, and clipping and the FP32->BF16 parameter copy launch
a kernel pair per tensor. With per-expert weights (TransformerEngine's grouped-expert layout, also
FP8-Flow's) that is about 550 host syncs per iteration on the 4-layer, 64-expert benchmark model
(``benchmarks/bench_megatron_pretrain.py``).
Users with TE or apex get one multi-tensor kernel instead; these do the same math with torch's foreach
ops, on the device. ``install()`` replaces only the local fallbacks, never TE's or apex's kernels.
"""

from __future__ import annotations

import torch


def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``multi_tensor_l2norm``'s contract: ``(float32 [1] norm of all tensors of tensor_lists[0], None)``,
    computed on the tensors' device (the fallback builds it on the host, ``float()`` per tensor)."""
    tensors = [t for tensors in tensor_lists for t in tensors]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device="cuda" if torch.cuda.is_available() else "cpu"), None
    norms = torch.stack([n.float() for n in torch._foreach_norm(tensors)])
    return torch.linalg.vector_norm(norms).reshape(1), None


def scale(chunk_size, noop_flag, tensor_lists, scale):
    """``multi_tensor_scale``'s contract: ``tensor_lists[1][i] = tensor_lists[0][i] * scale`` (in place when
    the two lists are one), in foreach kernels."""
    src, dst = tensor_lists
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif isinstance(scale, (int, float)) and scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def install() -> list[str]:
    """Replace Megatron's local multi-tensor fallbacks where it took them; the names replaced."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    replaced = []
    for module, name, local, ours in ((clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm, l2_norm),
                                      (clip_grads, "multi_tensor_scale_impl", utils.local_multi_tensor_scale, scale),
                                      (optimizer, "multi_tensor_scale_impl", utils.local_multi_tensor_scale, scale)):
        if getattr(module, name, None) is local:
            setattr(module, name, ours)
            replaced.append(f"{module.__name__}.{name}")
    return replaced
