"""Our experts implementation: transformers' fused experts routed through the multi-LoRA MoE reference (or op).

Each experts module gets LoRA slot buffers (``lora_a13 [L,E,R,H]``, ``lora_b13 [L,E,2I,R]``, ``lora_a2 [L,E,R,I]``,
``lora_b2 [L,E,H,R]``, in the weights' dtype), ``lora_ranks [2, L]`` int32 (each slot's w13 and w2 rank: the
kernels read no factor entry past it; the max rank until :class:`~..adapters.slots.AdapterSlots` writes a slot) and
the shared ``token_lora_ids`` buffer; forward reads ``token_lora_ids[:T]``. Decorated experts
(``@use_experts_implementation``) are routed here through transformers' ``ExpertsInterface`` under the name
:data:`EXPERTS_IMPLEMENTATION`; Llama-4's MoE block is swapped for
:class:`Llama4MoELoRABlock`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from ..ops.contract import GPTOSS_ALPHA, GPTOSS_LIMIT
from ..ops.layout import expert_geometry
from ..ops.reference import fused_moe_lora_reference
from .routers import llama4_topk_router

EXPERTS_IMPLEMENTATION = "moe_lora"


def experts_geometry(experts: nn.Module, layout: str) -> tuple[int, int, int]:
    """``(E, H, I)`` of an experts module from its ``gate_up_proj`` / ``down_proj`` in ``layout`` (MXFP4 experts,
    :class:`.mxfp4_gpt_oss.GptOssMxfp4Experts`: from the shapes they dequantize to)."""
    from .mxfp4_gpt_oss import GptOssMxfp4Experts

    if isinstance(experts, GptOssMxfp4Experts):
        return expert_geometry(layout, experts.gate_up.shape, experts.down.shape)
    if not experts.gate_up_proj.is_floating_point():
        raise ValueError(f"experts: quantized {type(experts).__name__} ({experts.gate_up_proj.dtype} gate_up_proj, "
                         f"e.g. transformers' hub-kernel MXFP4 experts) is not supported; hold MXFP4 experts as "
                         f"GptOssMxfp4Experts (moe_lora_compile.models.mxfp4_gpt_oss) or load them dequantized")
    return expert_geometry(layout, experts.gate_up_proj.shape, experts.down_proj.shape)


def lora_buffer_shapes(max_loras: int, E: int, H: int, I: int, max_rank: int) -> dict[str, tuple[int, ...]]:
    """The experts' slot buffers (name -> shape; the model dtype): A and B of gate_up and of down, per slot and
    expert, padded to ``max_rank``."""
    return dict(lora_a13=(max_loras, E, max_rank, H), lora_b13=(max_loras, E, 2 * I, max_rank),
                lora_a2=(max_loras, E, max_rank, I), lora_b2=(max_loras, E, H, max_rank))


def add_lora_buffers(experts: nn.Module, *, layout: str, activation: str, routing_weight_on_input: bool,
                     max_loras: int, max_rank: int, token_lora_ids: Tensor, use_ops: bool) -> None:
    """Register zeroed slot buffers and the static MoE attributes our forward reads on ``experts``."""
    E, H, I = experts_geometry(experts, layout)
    weight = getattr(experts, "gate_up_proj", None)
    if weight is None:  # MXFP4 experts: LoRA in the model dtype (their biases')
        weight = experts.gate_up_proj_bias
    like = dict(dtype=weight.dtype, device=weight.device)
    for name, shape in lora_buffer_shapes(max_loras, E, H, I, max_rank).items():
        experts.register_buffer(name, torch.zeros(shape, **like), persistent=False)
    experts.register_buffer("lora_ranks", torch.full((2, max_loras), max_rank, dtype=torch.int32, device=weight.device),
                            persistent=False)
    experts.register_buffer("token_lora_ids", token_lora_ids, persistent=False)
    experts.moe_lora_layout = layout
    experts.moe_lora_activation = activation
    experts.moe_lora_routing_on_input = routing_weight_on_input
    # (alpha, limit) as one tuple attribute, not two float attributes: under torch.compile(dynamic=True) Dynamo
    # turns a float attribute into a SymFloat graph input (the pass then cannot read the constant, and the op's float
    # attributes would get a SymFloat), while the elements of a tuple attribute stay Python constants (guarded).
    experts.moe_lora_activation_constants = (float(getattr(experts, "alpha", GPTOSS_ALPHA)),
                                             float(getattr(experts, "limit", GPTOSS_LIMIT)))
    experts.moe_lora_use_ops = use_ops


def moe_lora_experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                             top_k_weights: Tensor) -> Tensor:
    """transformers' experts signature: ``hidden_states [T,H]``, ``top_k_index [T,k]``, ``top_k_weights [T,k]``
    -> ``[T,H]``. Every token adds the LoRA delta of slot ``token_lora_ids[t]`` (-1: none)."""
    token_lora_ids = self.token_lora_ids[: hidden_states.shape[0]]
    has_bias = getattr(self, "has_bias", False)
    w13_bias = self.gate_up_proj_bias if has_bias else None
    w2_bias = self.down_proj_bias if has_bias else None
    fn = torch.ops.moe_lora.fused_moe_lora if self.moe_lora_use_ops else fused_moe_lora_reference
    alpha, limit = self.moe_lora_activation_constants
    return fn(
        hidden_states, top_k_index, top_k_weights, token_lora_ids, self.gate_up_proj, self.down_proj,
        self.lora_a13, self.lora_b13, self.lora_a2, self.lora_b2, w13_bias=w13_bias, w2_bias=w2_bias,
        layout=self.moe_lora_layout, activation=self.moe_lora_activation, alpha=alpha,
        limit=limit, routing_weight_on_input=self.moe_lora_routing_on_input, lora_ranks=self.lora_ranks,
    )


def register_experts_implementation() -> None:
    """Register :func:`moe_lora_experts_forward` in transformers' ``ExpertsInterface`` (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, moe_lora_experts_forward)


class Llama4MoELoRABlock(nn.Module):
    """Drop-in for transformers' ``Llama4TextMoe`` (same children, same parameter names) with multi-LoRA experts.

    The original runs every expert on every token with the input scaled by ``sigmoid(top-k logit)`` (0 elsewhere);
    that equals the top-k routed sum with the routing weight on the input, which is what this block computes.
    ``fused_router``: the router runs as one ``moe_lora.route`` call (``"topk_sigmoid"``), else as transformers'
    ``F.linear`` + ``topk`` + ``sigmoid``. Returns ``(out [T,H], router_logits [T,E])`` like the original.
    """

    def __init__(self, block: nn.Module, fused_router: bool = False):
        super().__init__()
        self.top_k = block.top_k
        self.hidden_dim = block.hidden_dim
        self.num_experts = block.num_experts
        self.experts = block.experts
        self.router = llama4_topk_router(block.router, fused_router)
        self.shared_expert = block.shared_expert
        self.fused_router = fused_router

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        (top_weights, top_index), router_logits = self.router(hidden_states)  # a module call: transformers' hook
        routed = moe_lora_experts_forward(self.experts, hidden_states, top_index, top_weights)
        return self.shared_expert(hidden_states) + routed, router_logits
