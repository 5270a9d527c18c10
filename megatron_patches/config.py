"""Teach megatron-core's ``TransformerConfig`` the FP8-Flow settings.

``patch_transformer_config()`` (idempotent) makes ``TransformerConfig`` and its dataclass
subclasses accept the fields of ``settings.FP8FlowFields`` (constructor keyword, dataclass field,
so Megatron-LM's argument-to-config copy and its argument factory see them), accept
``"moe_expert"`` in ``recompute_modules`` (stock ``__post_init__`` rejects unknown modules), and
validate the FP8-Flow combinations after Megatron's own checks.
"""

import dataclasses
import functools
import importlib

import torch

from .settings import (
    MOE_EXPERT,
    FP8FlowFields,
    FP8FlowView,
    cuda_graph_conflicts,
    fp8_flow_problems,
    raise_on_problems,
    unsupported_settings,
)

SUPPORTED_MEGATRON_CORE = "megatron-core 0.16.1 or 0.19.x"

# Attribute set on the patched __init__ / __post_init__ of each class.
_MARK = "__megatron_patches_fp8_flow__"

# How config-side messages spell the settings whose field name alone would mislead.
_CONFIG_NAMES = {
    "swiglu": "gated_linear_unit=True with activation_func=F.silu",
    "add_bias_linear": "add_bias_linear=False",
}


def megatron_core_version() -> str:
    """The installed megatron-core version; raises RuntimeError outside 0.16.1 and 0.19.x."""
    try:
        version = importlib.import_module("megatron.core.package_info").__version__
    except ImportError as error:
        raise RuntimeError(
            f"megatron_patches needs {SUPPORTED_MEGATRON_CORE}: megatron.core is not importable "
            f"({error}); pip install megatron-core==0.16.1 (Python 3.11) or ==0.19.2 (Python 3.12)"
        ) from None
    parts = version.split(".")
    if not (version == "0.16.1" or parts[:2] == ["0", "19"]):
        raise RuntimeError(
            f"megatron_patches supports {SUPPORTED_MEGATRON_CORE}; found megatron-core {version}"
        )
    return version


def _view(config) -> FP8FlowView:
    return FP8FlowView(
        moe_fp8_flow=config.moe_fp8_flow,
        num_moe_experts=config.num_moe_experts,
        fp8=config.fp8,
        moe_fp8_flow_format=config.moe_fp8_flow_format,
        fp8_recipe=config.fp8_recipe,
        moe_grouped_gemm=config.moe_grouped_gemm,
        moe_token_dispatcher_type=config.moe_token_dispatcher_type,
        swiglu=config.gated_linear_unit and config.activation_func is torch.nn.functional.silu,
        add_bias_linear=config.add_bias_linear,
        recompute_granularity=config.recompute_granularity,
        recompute_modules=config.recompute_modules or (),
        moe_router_topk=config.moe_router_topk,
        hidden_size=config.hidden_size,
        moe_ffn_hidden_size=config.moe_ffn_hidden_size,
        moe_flex_dispatcher_backend=config.moe_flex_dispatcher_backend,
        moe_fp8_flow_single_grouped_weight=config.moe_fp8_flow_single_grouped_weight,
        unsupported=unsupported_settings(config),
        moe_fp8_flow_cuda_graph=config.moe_fp8_flow_cuda_graph,
        graph_conflicts=cuda_graph_conflicts(config),
        moe_fp8_flow_gradient_accumulation_fusion=config.moe_fp8_flow_gradient_accumulation_fusion,
    )


def validate_fp8_flow_config(config) -> None:
    """Raise ValueError naming every FP8-Flow rule ``config`` breaks."""
    problems = fp8_flow_problems(_view(config), lambda field: _CONFIG_NAMES.get(field, field))
    raise_on_problems(problems, "TransformerConfig")


def _patch_init(cls) -> None:
    """Accept the FP8-Flow fields as keywords; they are set before Megatron's ``__post_init__``."""
    original = cls.__init__
    defaults = {f.name: f.default for f in dataclasses.fields(FP8FlowFields)}

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        for name, default in defaults.items():
            setattr(self, name, kwargs.pop(name, default))
        original(self, *args, **kwargs)

    setattr(__init__, _MARK, True)
    cls.__init__ = __init__


def _patch_post_init(cls) -> None:
    """Hide ``moe_expert`` from Megatron's recompute-module check, then validate FP8-Flow."""
    original = cls.__post_init__

    @functools.wraps(original)
    def __post_init__(self):
        modules = self.recompute_modules
        if isinstance(modules, str):  # "moe_expert" once matched as a substring, then was split into its letters
            raise ValueError(f"recompute_modules must be a list of module names, got the string {modules!r} "
                             f"(write [{modules!r}])")
        ours = modules is not None and MOE_EXPERT in modules
        if ours:
            self.recompute_modules = [m for m in modules if m != MOE_EXPERT]
        original(self)
        if ours:
            self.recompute_modules.append(MOE_EXPERT)
        if not getattr(self, "_fp8_flow_validating", False):
            validate_fp8_flow_config(self)

    setattr(__post_init__, _MARK, True)
    cls.__post_init__ = __post_init__


def _config_classes():
    from megatron.core.transformer.transformer_config import TransformerConfig

    classes, todo = [], [TransformerConfig]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    return classes


def patch_transformer_config() -> None:
    """Patch ``TransformerConfig`` and every subclass defined so far; idempotent.

    A subclass's ``__post_init__`` that calls ``super().__post_init__()`` reaches the patched
    base; the validation runs once, after the outermost Megatron check.
    """
    fields = {f.name: f for f in dataclasses.fields(FP8FlowFields)}
    for cls in _config_classes():
        if not dataclasses.is_dataclass(cls) or getattr(cls.__init__, _MARK, False):
            continue
        for name, field in fields.items():
            cls.__dataclass_fields__[name] = field
            setattr(cls, name, field.default)
        _patch_init(cls)
        if "__post_init__" in cls.__dict__:
            _patch_post_init_once(cls)


def _patch_post_init_once(cls) -> None:
    """Subclasses run the base's patched ``__post_init__`` through ``super()``; only the class that
    owns the check (TransformerConfig) gets the wrapper, subclasses get a guard so the FP8-Flow
    validation runs after their own checks exactly once."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if cls is TransformerConfig:
        _patch_post_init(cls)
        return
    original = cls.__post_init__

    @functools.wraps(original)
    def __post_init__(self):
        outermost = not getattr(self, "_fp8_flow_validating", False)
        self._fp8_flow_validating = True
        try:
            original(self)
        finally:
            if outermost:
                del self._fp8_flow_validating
        if outermost:
            validate_fp8_flow_config(self)

    setattr(__post_init__, _MARK, True)
    cls.__post_init__ = __post_init__
