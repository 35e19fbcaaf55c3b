"""transformers' MoE routers through ``torch.ops.moe_lora.route`` (one Triton launch per layer at decode on CUDA).

``fuse_router(module)`` swaps a router's class for a subclass whose ``forward`` calls the op with the router's own
parameters: same module, parameters, state-dict names and hooks, and ``isinstance`` still holds (transformers
records ``output_router_logits`` with hooks on the router class). Only routers whose ``forward`` source is one we
have read and matched (:data:`VERIFIED_ROUTERS`: transformers 5.17 and 5.24 have the same text; the fingerprint is a
hash of it) are swapped; any other router keeps transformers' forward (logged once at debug level). DeepSeek-V3's
router (sigmoid scores, ``e_score_correction_bias``, group-limited top-k) is not covered and stays as it is;
Llama-4's MoE block is swapped whole (:class:`~moe_lora_compile.models.experts.Llama4MoELoRABlock`), and its
router to :class:`Llama4TopKMixin`'s forward (the op, or transformers' math without ``fused_router``).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import textwrap
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn as nn
from torch import Tensor

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterSpec:
    """How a transformers router class maps onto ``moe_lora.route``. ``renormalize``: a bool, or the name of the
    router's attribute holding it (``norm_topk_prob``); ``scores_fp32``: transformers returns fp32 weights
    (Mixtral) instead of the logits dtype; ``fingerprint``: :func:`forward_fingerprint` of the verified forward."""

    scoring: str
    fingerprint: str
    renormalize: Union[bool, str] = False
    scores_fp32: bool = False


_SOFTMAX_TOPK = "e4a79c7b17f172af"  # Qwen3-MoE, Qwen2-MoE and OLMoE share one forward
VERIFIED_ROUTERS = {
    "GptOssTopKRouter": RouterSpec("topk_softmax", "abb722c1419727e8"),
    "Qwen3MoeTopKRouter": RouterSpec("softmax_topk", _SOFTMAX_TOPK, renormalize="norm_topk_prob"),
    "Qwen2MoeTopKRouter": RouterSpec("softmax_topk", _SOFTMAX_TOPK, renormalize="norm_topk_prob"),
    "OlmoeTopKRouter": RouterSpec("softmax_topk", _SOFTMAX_TOPK, renormalize="norm_topk_prob"),
    "MixtralTopKRouter": RouterSpec("softmax_topk", "b3dd489e297f20c8", renormalize=True, scores_fp32=True),
    "Llama4Router": RouterSpec("topk_sigmoid", "1f5a37ddffd2f9c9"),  # called by Llama4MoELoRABlock
}

_logged: set[str] = set()


def forward_fingerprint(cls: type) -> Optional[str]:
    """First 16 hex digits of the sha256 of ``cls.forward``'s dedented source, or None without source."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None
    return hashlib.sha256(textwrap.dedent(source).strip().encode()).hexdigest()[:16]


def verified_spec(module: nn.Module) -> Optional[RouterSpec]:
    """The :class:`RouterSpec` of ``module``'s class if its forward is the verified one, else None (logged once)."""
    cls = type(module)
    spec = VERIFIED_ROUTERS.get(cls.__name__)
    if spec is None:
        return None
    if forward_fingerprint(cls) != spec.fingerprint:
        if cls.__name__ not in _logged:
            _logged.add(cls.__name__)
            _log.debug("%s.forward differs from the verified transformers source; it keeps its own forward "
                       "(no moe_lora.route)", cls.__name__)
        return None
    return spec


def route_options(module: nn.Module, spec: RouterSpec) -> tuple:
    """``(top_k, scoring, renormalize, scores_dtype)`` of ``moe_lora.route`` for a router of ``spec``."""
    renormalize = spec.renormalize if isinstance(spec.renormalize, bool) else bool(getattr(module, spec.renormalize))
    return (int(module.top_k), spec.scoring, renormalize, torch.float32 if spec.scores_fp32 else None)


class FusedRouterMixin:
    """``forward(hidden_states [..., H]) -> (logits [T, E], scores [T, k], ids [T, k] int64)``, as transformers'
    top-k routers return, from one ``moe_lora.route`` call. ``moe_lora_route``: the op's options (a tuple, so
    Dynamo keeps them constants)."""

    moe_lora_route: tuple

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
        return torch.ops.moe_lora.route(hidden, self.weight, getattr(self, "bias", None), *self.moe_lora_route)

    def __reduce_ex__(self, protocol):  # pickle / torch.save: the class made at run time is rebuilt from its base
        return _swapped_instance, ("fused", type(self).__mro__[2]), self.__getstate__()


def _swapped_instance(kind: str, base: type) -> nn.Module:
    """An empty instance of ``base``'s swapped class (``kind``: "fused" or "llama4_topk"), for unpickling."""
    cls = _fused_class(base) if kind == "fused" else _topk_class(base)
    return cls.__new__(cls)


_fused_classes: dict[type, type] = {}


def _fused_class(cls: type) -> type:
    fused = _fused_classes.get(cls)
    if fused is None:
        fused = type(f"Fused{cls.__name__}", (FusedRouterMixin, cls), {"__module__": __name__})
        _fused_classes[cls] = fused
    return fused


def fuse_router(module: nn.Module) -> bool:
    """Route ``module`` (a transformers router) through ``moe_lora.route`` in place if it is a verified one;
    returns whether it was swapped."""
    spec = verified_spec(module)
    if spec is None or spec.scoring == "topk_sigmoid":  # Llama-4: its block calls the op
        name = type(module).__name__
        if spec is None and name.endswith("Router") and name not in _logged:  # e.g. DeepseekV3TopKRouter
            _logged.add(name)
            _log.debug("%s is not a verified router; it keeps transformers' forward (no moe_lora.route)", name)
        return False
    module.moe_lora_route = route_options(module, spec)
    module.__class__ = _fused_class(type(module))
    return True


class Llama4TopKMixin:
    """Llama-4's router inside :class:`~moe_lora_compile.models.experts.Llama4MoELoRABlock`: ``forward(hidden
    [T, H]) -> ((weights [T, k], ids [T, k] int64), logits [T, E])``, the top-k the block routes with, and the logits
    at index 1 where transformers records them (``OutputRecorder(Llama4Router, index=1)``: a hook on the router
    class, so the block must call the module). ``moe_lora_fused``: one ``moe_lora.route`` call
    (``"topk_sigmoid"``), else transformers' ``F.linear`` + ``topk`` + ``sigmoid``."""

    moe_lora_fused: bool

    def forward(self, hidden_states: Tensor) -> tuple[tuple[Tensor, Tensor], Tensor]:
        if self.moe_lora_fused:
            logits, weights, ids = torch.ops.moe_lora.route(hidden_states, self.weight, self.bias, int(self.top_k),
                                                            "topk_sigmoid")
        else:
            logits = torch.nn.functional.linear(hidden_states, self.weight, self.bias)
            values, ids = torch.topk(logits, self.top_k, dim=1)
            weights = torch.sigmoid(values.float()).to(hidden_states.dtype)
        return (weights, ids), logits

    def __reduce_ex__(self, protocol):  # as FusedRouterMixin's
        return _swapped_instance, ("llama4_topk", type(self).__mro__[2]), self.__getstate__()


_topk_classes: dict[type, type] = {}


def llama4_topk_router(module: nn.Module, fused: bool) -> nn.Module:
    """Swap ``module`` (a ``Llama4Router``) in place to :class:`Llama4TopKMixin`'s forward: same module,
    parameters and hooks, ``isinstance`` still holds. Returns it."""
    cls = type(module)
    if isinstance(module, Llama4TopKMixin):
        cls = cls.__mro__[2]  # swapped before (an attach refused after it): the original class
    module.moe_lora_fused = bool(fused)
    module.__class__ = _topk_class(cls)
    return module


def _topk_class(cls: type) -> type:
    swapped = _topk_classes.get(cls)
    if swapped is None:
        swapped = type(f"{cls.__name__}TopK", (Llama4TopKMixin, cls), {"__module__": __name__})
        _topk_classes[cls] = swapped
    return swapped


def fuse_routers(model: nn.Module, block_names) -> list[str]:
    """Swap the verified router child of each MoE block named in ``block_names``; returns the swapped names."""
    fused = []
    for block_name in block_names:
        for child_name, child in model.get_submodule(block_name).named_children():
            if isinstance(child, FusedRouterMixin) or not fuse_router(child):
                continue
            fused.append(f"{block_name}.{child_name}")
    return fused
