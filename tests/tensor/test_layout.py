"""COMPACT <-> TransformerEngine GEMM_READY scale layouts, and the TE adapters."""

import pytest
import torch

from transformer_engine_moe import quantize_blockwise
from transformer_engine_moe.tensor import compact_to_gemm_ready, gemm_ready_to_compact


@pytest.mark.parametrize(
    "block,usage,expected",
    [
        # TE's Float8BlockQuantizer.get_scale_shape for a [M=300, K=520] tensor
        ("1x128", "rowwise", (5, 300)),  # (ceil(K/128), pad4(M))
        ("1x128", "columnwise", (3, 520)),  # (ceil(M/128), pad4(K))
        ("128x128", "rowwise", (3, 8)),  # (ceil(M/128), pad4(ceil(K/128)))
        ("128x128", "columnwise", (5, 4)),  # (ceil(K/128), pad4(ceil(M/128)))
    ],
)
def test_gemm_ready_shapes_match_te_and_round_trip(block, usage, expected):
    q = quantize_blockwise(torch.randn(300, 520), block, columnwise=True)
    compact = getattr(q, f"{usage}_scale_inv")
    g = q.scale_inv_gemm_ready(usage)
    assert tuple(g.shape) == expected
    is_2d = block == "128x128"
    n = compact.shape[1] if is_2d else compact.shape[0]
    assert torch.equal(gemm_ready_to_compact(g, is_2d, n), compact)
    unpadded = compact if is_2d else compact.t()
    assert torch.equal(g[:, : unpadded.shape[1]], unpadded)
    assert (g[:, unpadded.shape[1]:] == 0).all()


def test_gemm_ready_padding_of_rows():
    s = torch.rand(5, 2)  # 1x128 rowwise scales of M=5 rows
    g = compact_to_gemm_ready(s, False)
    assert g.shape == (2, 8)
    with pytest.raises(ValueError, match="at least 9 columns"):
        gemm_ready_to_compact(g, False, 9)


def test_te_adapters_round_trip():
    pytest.importorskip("transformer_engine.pytorch", reason="TransformerEngine not installed")
    from transformer_engine_moe import from_te, to_te

    for block in ("1x128", "128x128"):
        q = quantize_blockwise(torch.randn(300, 512, dtype=torch.bfloat16, device="cuda"), block,
                               columnwise=True)
        te_t = to_te(q)
        assert torch.equal(te_t.dequantize(dtype=torch.float32), q.dequantize())
        back = from_te(te_t)
        for u in q.usages:
            assert torch.equal(getattr(back, f"{u}_scale_inv"), getattr(q, f"{u}_scale_inv"))
            assert torch.equal(back.dequantize(usage=u), q.dequantize(usage=u))


def test_te_adapters_without_te_raise_import_error():
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        from transformer_engine_moe import to_te

        with pytest.raises(ImportError, match="need TransformerEngine"):
            to_te(quantize_blockwise(torch.randn(2, 128)))
    else:
        pytest.skip("TransformerEngine is installed")
