"""Make PEFT's expert LoRA (``target_parameters``) traceable in one graph: :func:`functional_expert_lora`.

PEFT's ``ParamWrapper`` applies its adapter by registering a ``torch.nn.utils.parametrize`` parametrization on the
experts module for each forward (and removing it after). Under ``torch.compile`` that costs, per MoE layer:
graph breaks (Dynamo cannot trace the registration), a recompile of the experts frame on *every* call
(registration creates a new ``Parametrized<Experts>`` class, and Dynamo guards on the type), eager experts once
``torch._dynamo.config.recompile_limit`` (8) is hit, and the merged weight ``W + s * lhs @ rhs`` returned by the
graph (Dynamo replays the parametrize cache write), so it stays computed.

:func:`functional_expert_lora` changes how the outermost wrapper of each experts module runs (an instance
attribute, no class change): it computes the same merged weights and calls the experts with them through
``torch.func.functional_call``. Same values as PEFT's forward, one graph, no recompiles; the merged weights then
feed only the expert matmuls, and :class:`~moe_lora_compile.passes.MoELoRAPass` replaces all of it by one
``fused_moe_lora`` per MoE layer that reads ``W`` and the LoRA factors. Every case it does not cover (adapters
disabled or merged, ``adapter_names=``, 2-D parameters, float8 weights, a PEFT without ``get_delta_factors``) runs
PEFT's own forward.
"""

from __future__ import annotations

import types

import torch
from torch import nn

_FORWARD = "forward"


def _wrappers(outer) -> tuple[list, nn.Module]:
    """The chain of nested ``ParamWrapper`` s from ``outer`` inwards, and the experts module they wrap."""
    from peft.tuners.lora.layer import ParamWrapper

    chain = [outer]
    while isinstance(chain[-1].base_layer, ParamWrapper):
        chain.append(chain[-1].base_layer)
    return chain, chain[-1].base_layer


def _functional(wrapper) -> bool:
    """Whether the functional forward computes what PEFT's would (else PEFT's forward runs)."""
    chain, base = _wrappers(wrapper)
    for w in chain:
        param = getattr(base, w.parameter_name)
        if w.disable_adapters or w.merged or param.dim() != 3 or not hasattr(w, "get_delta_factors") \
                or not param.dtype.is_floating_point or param.element_size() == 1:
            return False
    return True


def _forward(self, x, *args, **kwargs):
    """``ParamWrapper.forward`` without the parametrization: the experts run on ``W + sum_a s_a lhs_a @ rhs_a``."""
    from peft.tuners.lora.layer import ParamWrapper

    if kwargs.get("adapter_names") is not None or not _functional(self):
        return ParamWrapper.forward(self, x, *args, **kwargs)
    chain, base = _wrappers(self)
    merged = {}
    for w in chain:
        weight = getattr(base, w.parameter_name)
        with torch.autocast(device_type=weight.device.type, enabled=False):  # as PEFT: the merge in W's dtype
            for adapter in w.active_adapters:
                if adapter in w.lora_A:
                    lhs, rhs, scale = w.get_delta_factors(adapter)
                    weight = torch.baddbmm(weight, lhs, rhs, alpha=scale)
        merged[w.parameter_name] = weight
    return torch.func.functional_call(base, merged, (x, *args), kwargs, strict=False)


def functional_expert_lora(model: nn.Module, enable: bool = True) -> nn.Module:
    """Run every outermost PEFT ``ParamWrapper`` of ``model`` functionally (``enable=False``: PEFT's forward again).

    Returns ``model`` (changed in place), e.g.
    ``torch.compile(functional_expert_lora(peft_model), options={"post_grad_custom_post_pass": MoELoRAPass()})``.
    """
    from peft.tuners.lora.layer import ParamWrapper

    inner = {id(m.base_layer) for m in model.modules() if isinstance(m, ParamWrapper)}
    for module in model.modules():
        if isinstance(module, ParamWrapper) and id(module) not in inner:
            if enable:
                module.forward = types.MethodType(_forward, module)
            else:
                module.__dict__.pop(_FORWARD, None)
    return model
