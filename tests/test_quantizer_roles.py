"""Roles of a recipe's quantizers: each role, given as a ``Role`` or its string, gets TransformerEngine's format
(HYBRID: E4M3 forward, E5M2 gradients) and block shape; an unknown role or a non-recipe is refused by name."""

import pytest
import torch

from transformer_engine_moe import FP8FlowRecipe, Float8BlockQuantizer, Format, Role

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EXPECTED = {  # (format, role) -> (FP8 dtype, block_scaling_dim)
    (Format.E4M3, Role.INPUT): (E4M3, 1), (Format.E4M3, Role.WEIGHT): (E4M3, 2), (Format.E4M3, Role.GRAD): (E4M3, 1),
    (Format.HYBRID, Role.INPUT): (E4M3, 1), (Format.HYBRID, Role.WEIGHT): (E4M3, 2),
    (Format.HYBRID, Role.GRAD): (E5M2, 1),  # TransformerEngine's HYBRID: E5M2 gradients
}


@pytest.mark.parametrize("spelling", ["member", "string"])
@pytest.mark.parametrize("fmt, role", list(EXPECTED), ids=[f"{f.value}-{r.value}" for f, r in EXPECTED])
def test_every_role_gets_its_format_and_block(fmt, role, spelling):
    recipe, name = FP8FlowRecipe(fmt), role if spelling == "member" else role.value
    quantizer = Float8BlockQuantizer.from_recipe(recipe, name)
    assert (quantizer.dtype, quantizer.block_scaling_dim) == EXPECTED[fmt, role]
    assert (recipe.fp8_dtype(name), recipe.block(name).dim) == EXPECTED[fmt, role]
    assert quantizer(torch.randn(4, 128)).fp8_dtype == EXPECTED[fmt, role][0]


@pytest.mark.parametrize("role", ["gradient", "GRAD", "", None, 1, Format.HYBRID])
def test_unknown_role_is_refused_by_name(role):
    message = r"role must be a Role or one of \['input', 'weight', 'grad'\], got " + repr(role).replace(".", r"\.")
    for call in (lambda: Float8BlockQuantizer.from_recipe(FP8FlowRecipe(Format.HYBRID), role),
                 lambda: FP8FlowRecipe().fp8_dtype(role), lambda: FP8FlowRecipe.block(role)):
        with pytest.raises(ValueError, match=message):
            call()


def test_recipe_must_be_a_recipe():
    with pytest.raises(TypeError, match="recipe must be an FP8FlowRecipe, got Format"):
        Float8BlockQuantizer.from_recipe(Format.HYBRID, Role.GRAD)


@pytest.mark.parametrize("make, exc, match", [
    (lambda: Float8BlockQuantizer(block_scaling_dim=True), ValueError, "block_scaling_dim must be 1 or 2, got True"),
    (lambda: Float8BlockQuantizer(block_scaling_dim=1.0), ValueError, "block_scaling_dim must be 1 or 2, got 1.0"),
    (lambda: Float8BlockQuantizer(backend="cuda"), ValueError, "backend must be one of"),
    (lambda: FP8FlowRecipe(force_pow_2_scales=0), TypeError, "force_pow_2_scales must be a bool .*, got 0"),
    (lambda: FP8FlowRecipe(force_pow_2_scales=None), TypeError, "force_pow_2_scales must be a bool .*, got None"),
], ids=["dim-bool", "dim-float", "backend", "recipe-pow2-int", "recipe-pow2-none"])
def test_settings_are_refused_when_made(make, exc, match):
    """Issue 41's probe: each was once accepted and read later (``True`` as 1, a bad backend at the first call, ``0``
    as a falsy recipe flag that the quantizers then refused)."""
    with pytest.raises(exc, match=match):
        make()
