"""GPT-OSS with MXFP4 experts, built without the hub (format and transformers' own path: :mod:`..ops.mxfp4`).

transformers runs MXFP4 experts only through hub kernels (``kernels-community/gpt-oss-triton-kernels``) and
otherwise dequantizes them at load, so the quantized experts here are ours: :class:`GptOssMxfp4Experts` holds the
checkpoint's tensors under the checkpoint's names (``gate_up_proj_blocks`` uint8 ``[E, 2I, H/32, 16]``,
``gate_up_proj_scales`` uint8 ``[E, 2I, H/32]``, ``down_proj_blocks`` ``[E, H, I/32, 16]``, ``down_proj_scales``
``[E, H, I/32]`` as buffers; ``gate_up_proj_bias [E, 2I]``, ``down_proj_bias [E, H]`` as frozen parameters in the
model dtype), so a real checkpoint's state dict loads into it as is, and its forward has transformers' experts
signature (dequantize, then the reference). ``attach`` keeps it quantized: it adds the LoRA slot buffers (model
dtype) and from then on the forward is ``torch.ops.moe_lora.fused_moe_lora_mxfp4`` over the blocks and scales
(the Triton kernels decode them in their load path on CUDA; no dense copy of the experts is ever made).

:func:`build_mxfp4_gpt_oss` makes a random stand-in for the checkpoint from a config: transformers'
``GptOssForCausalLM`` with every ``mlp.experts`` swapped for a quantized one (weights through
:func:`..ops.mxfp4.quantize_mxfp4`) and ``config.quantization_config`` set like the checkpoint's, so
``save_pretrained`` writes an MXFP4 checkpoint that transformers' ``from_pretrained`` loads (dequantizing, without
the ``kernels`` package).
"""

from __future__ import annotations

import copy
import json
import os
from typing import Optional, Union

import torch
import torch.nn as nn
from torch import Tensor

from ..ops.contract import GPTOSS_ALPHA, GPTOSS_LIMIT
from ..ops.mxfp4 import BYTES_PER_GROUP, GROUP_SIZE, Mxfp4Weight, fused_moe_lora_mxfp4_reference, quantize_mxfp4

# The openai/gpt-oss checkpoints' quantization_config (config.json): experts only.
MXFP4_QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"],
}


class GptOssMxfp4Experts(nn.Module):
    """GPT-OSS routed experts in MXFP4; ``forward(hidden_states [T,H], top_k_index [T,k], top_k_weights [T,k])
    -> [T,H]`` in hidden_states' dtype (experts dequantized to it, fp32 accumulation), like ``GptOssExperts``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 dtype: torch.dtype = torch.bfloat16, device=None, alpha: float = GPTOSS_ALPHA,
                 limit: float = GPTOSS_LIMIT):
        super().__init__()
        for name, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if size % GROUP_SIZE:
                raise ValueError(f"{name} ({size}) must be a multiple of {GROUP_SIZE} for MXFP4 experts")
        E, H, I = num_experts, hidden_size, intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I
        self.alpha, self.limit = float(alpha), float(limit)
        u8 = dict(dtype=torch.uint8, device=device)
        self.register_buffer("gate_up_proj_blocks", torch.zeros(E, 2 * I, H // GROUP_SIZE, BYTES_PER_GROUP, **u8))
        self.register_buffer("gate_up_proj_scales", torch.zeros(E, 2 * I, H // GROUP_SIZE, **u8))
        self.register_buffer("down_proj_blocks", torch.zeros(E, H, I // GROUP_SIZE, BYTES_PER_GROUP, **u8))
        self.register_buffer("down_proj_scales", torch.zeros(E, H, I // GROUP_SIZE, **u8))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I, dtype=dtype, device=device), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.zeros(E, H, dtype=dtype, device=device), requires_grad=False)

    @classmethod
    def from_experts(cls, experts: nn.Module) -> "GptOssMxfp4Experts":
        """Quantize transformers' ``GptOssExperts`` (``gate_up_proj [E,H,2I]``, ``down_proj [E,I,H]``, biases)."""
        E, H, two_i = experts.gate_up_proj.shape
        bias = experts.gate_up_proj_bias
        module = cls(E, H, two_i // 2, dtype=bias.dtype, device=bias.device,
                     alpha=getattr(experts, "alpha", GPTOSS_ALPHA), limit=getattr(experts, "limit", GPTOSS_LIMIT))
        module.load_weights(quantize_mxfp4(experts.gate_up_proj.detach()), quantize_mxfp4(experts.down_proj.detach()),
                            bias.detach(), experts.down_proj_bias.detach())
        return module

    @torch.no_grad()
    def load_weights(self, gate_up: Mxfp4Weight, down: Mxfp4Weight, gate_up_bias: Optional[Tensor] = None,
                     down_bias: Optional[Tensor] = None) -> None:
        """Copy MXFP4 weights (and biases) in, all checked before any is copied: shapes must match the module's
        (ValueError otherwise: a bias of another shape would broadcast), weights must be :class:`Mxfp4Weight` s
        (TypeError)."""
        pairs = []
        for name, w in (("gate_up_proj", gate_up), ("down_proj", down)):
            if not isinstance(w, Mxfp4Weight):
                raise TypeError(f"{name}: an Mxfp4Weight(blocks, scales), got {type(w).__name__}")
            pairs += [(f"{name}_{part}", getattr(self, f"{name}_{part}"), getattr(w, part))
                      for part in ("blocks", "scales")]
        pairs += [(name, dst, src) for name, dst, src in (("gate_up_proj_bias", self.gate_up_proj_bias, gate_up_bias),
                                                          ("down_proj_bias", self.down_proj_bias, down_bias))
                  if src is not None]
        for name, dst, src in pairs:
            if src.shape != dst.shape:
                raise ValueError(f"{name}: expected {list(dst.shape)}, got {list(src.shape)}")
        for _, dst, src in pairs:
            dst.copy_(src)

    @property
    def gate_up(self) -> Mxfp4Weight:
        """w13: dequantizes to ``[E, H, 2I]``, gate/up interleaved."""
        return Mxfp4Weight(self.gate_up_proj_blocks, self.gate_up_proj_scales)

    @property
    def down(self) -> Mxfp4Weight:
        """w2: dequantizes to ``[E, I, H]``."""
        return Mxfp4Weight(self.down_proj_blocks, self.down_proj_scales)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        if getattr(self, "moe_lora_layout", None) is not None:  # attached (models.experts.add_lora_buffers)
            return self._lora_forward(hidden_states, top_k_index, top_k_weights)
        T = hidden_states.shape[0]
        E, H, I = self.num_experts, self.hidden_size, self.intermediate_size
        like = dict(dtype=hidden_states.dtype, device=hidden_states.device)
        # Base only: every token -1, so the (one-slot, rank-1) LoRA stacks are never used.
        no_lora = torch.full((T,), -1, dtype=torch.int32, device=hidden_states.device)
        a13, b13 = torch.zeros(1, E, 1, H, **like), torch.zeros(1, E, 2 * I, 1, **like)
        a2, b2 = torch.zeros(1, E, 1, I, **like), torch.zeros(1, E, H, 1, **like)
        return fused_moe_lora_mxfp4_reference(
            hidden_states, top_k_index, top_k_weights.to(hidden_states.dtype), no_lora, self.gate_up, self.down,
            a13, b13, a2, b2, w13_bias=self.gate_up_proj_bias, w2_bias=self.down_proj_bias,
            alpha=self.alpha, limit=self.limit)

    def _lora_forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """Every token adds the LoRA delta of slot ``token_lora_ids[t]`` (-1: none), like
        :func:`..models.experts.moe_lora_experts_forward` for dense experts."""
        token_lora_ids = self.token_lora_ids[: hidden_states.shape[0]]
        alpha, limit = self.moe_lora_activation_constants
        kwargs = dict(w13_bias=self.gate_up_proj_bias, w2_bias=self.down_proj_bias, layout=self.moe_lora_layout,
                      activation=self.moe_lora_activation, alpha=alpha, limit=limit,
                      routing_weight_on_input=self.moe_lora_routing_on_input, lora_ranks=self.lora_ranks)
        lora = (self.lora_a13, self.lora_b13, self.lora_a2, self.lora_b2)
        if self.moe_lora_use_ops:  # plain tensors into the op (no Mxfp4Weight to trace under torch.compile)
            return torch.ops.moe_lora.fused_moe_lora_mxfp4(
                hidden_states, top_k_index, top_k_weights, token_lora_ids, self.gate_up_proj_blocks,
                self.gate_up_proj_scales, self.down_proj_blocks, self.down_proj_scales, *lora, **kwargs)
        return fused_moe_lora_mxfp4_reference(hidden_states, top_k_index, top_k_weights, token_lora_ids,
                                              self.gate_up, self.down, *lora, **kwargs)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, mxfp4")


def quantize_gpt_oss_experts_(model: nn.Module) -> int:
    """Swap every transformers ``GptOssExperts`` in ``model`` for :class:`GptOssMxfp4Experts` (in place; weights
    quantized with :func:`..ops.mxfp4.quantize_mxfp4`) and set ``model.config.quantization_config`` like the
    checkpoint's. Returns the number of experts modules swapped (ValueError if none)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    names = [name for name, module in model.named_modules() if isinstance(module, GptOssExperts)]
    attached = [name for name in names if getattr(model.get_submodule(name), "moe_lora_layout", None) is not None]
    if attached:  # the MultiLoRAModel's slots point at the old modules: the new ones would run without LoRA
        raise ValueError(f"model: {attached[0]!r} is attached (mlc.attach): quantize the experts before attach, "
                         f"then attach the quantized model")
    if not names:
        raise ValueError("model: no GptOssExperts to quantize (expects transformers' GPT-OSS)")
    for name in names:
        experts = model.get_submodule(name)
        model.set_submodule(name, GptOssMxfp4Experts.from_experts(experts))
        del experts
    model.config.quantization_config = dict(MXFP4_QUANTIZATION_CONFIG)
    return len(names)


def _float_dtype(dtype, config) -> torch.dtype:
    """``dtype`` as a floating torch.dtype: a torch.dtype, its name ("bfloat16"), or "auto" (transformers'
    spelling: the config's dtype, else bfloat16, the checkpoint's); TypeError for anything else."""
    if isinstance(dtype, str) and dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.bfloat16
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype, its name, or 'auto', got {dtype!r}")
    return dtype


def build_mxfp4_gpt_oss(config, *, dtype: torch.dtype = torch.bfloat16, device=None, seed: int = 0,
                        bias_std: Optional[float] = None) -> nn.Module:
    """A random ``GptOssForCausalLM`` of ``config`` whose experts hold MXFP4 blocks/scales; no network.

    transformers' random init (``dtype`` on ``device``), then every experts module quantized; expert biases are
    drawn from N(0, ``bias_std``) (default ``config.initializer_range``; transformers' init leaves them zero, the
    checkpoint's are not). ``config.quantization_config`` may be absent or MXFP4-style (``quant_method`` "mxfp4",
    e.g. ``Mxfp4Config().to_dict()``); hidden and intermediate sizes must be multiples of 32. Returns the model
    in eval mode, parameters frozen."""
    from transformers import AutoModelForCausalLM

    if getattr(config, "model_type", None) != "gpt_oss":
        raise ValueError(f"config: expected a GPT-OSS config (model_type 'gpt_oss'), got "
                         f"{getattr(config, 'model_type', None)!r}")
    quant = getattr(config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if quant is not None and str(getattr(method, "value", method)) != "mxfp4":
        raise ValueError(f"config.quantization_config: expected quant_method 'mxfp4', got {method!r}")
    for name in ("hidden_size", "intermediate_size"):
        if getattr(config, name) % GROUP_SIZE:
            raise ValueError(f"config.{name} ({getattr(config, name)}) must be a multiple of {GROUP_SIZE} for MXFP4")
    dtype = _float_dtype(dtype, config)
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):  # (a copy: the model keeps its config, whose quantization_config is set)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype)
    std = config.initializer_range if bias_std is None else bias_std
    quantize_gpt_oss_experts_(model)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, GptOssMxfp4Experts):
                module.gate_up_proj_bias.normal_(0.0, std)
                module.down_proj_bias.normal_(0.0, std)
    return model.eval().requires_grad_(False)


def load_mxfp4_gpt_oss(path: str, *, dtype: Union[torch.dtype, str] = torch.bfloat16, device=None) -> nn.Module:
    """GPT-OSS from an MXFP4 checkpoint folder (``config.json`` + ``*.safetensors``: a download of openai/gpt-oss-20b
    or -120b, or what ``save_pretrained`` of :func:`build_mxfp4_gpt_oss` writes) with its experts kept in MXFP4:
    :class:`GptOssMxfp4Experts` get the stored blocks and scales as they are, every other tensor is cast to
    ``dtype``, all on ``device`` (default CPU). transformers' own ``from_pretrained`` dequantizes the experts unless
    its hub kernels are installed (then they are swizzled for those, a layout ``attach`` refuses); this loader makes
    no dense copy of the experts at any point (the model is laid out on the meta device first). ValueError for a
    config that is not an MXFP4 GPT-OSS, or a checkpoint whose tensors miss, exceed or disagree with the model's.
    Returns the model in eval mode, parameters frozen: ``attach`` it as any model."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = AutoConfig.from_pretrained(path)
    dtype = _float_dtype(dtype, config)
    if getattr(config, "model_type", None) != "gpt_oss":
        raise ValueError(f"{path}: expected a GPT-OSS checkpoint (model_type 'gpt_oss'), got "
                         f"{getattr(config, 'model_type', None)!r}")
    quant = getattr(config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if str(getattr(method, "value", method)) != "mxfp4":
        raise ValueError(f"{path}: config.json has no MXFP4 quantization_config (quant_method {method!r}): load it "
                         f"with transformers' from_pretrained")
    device = torch.device(device or "cpu")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        for name, module in list(model.named_modules()):
            if isinstance(module, GptOssExperts):
                E, H, two_i = module.gate_up_proj.shape
                model.set_submodule(name, GptOssMxfp4Experts(
                    E, H, two_i // 2, dtype=dtype, alpha=getattr(module, "alpha", GPTOSS_ALPHA),
                    limit=getattr(module, "limit", GPTOSS_LIMIT)))
    model.to_empty(device=device)
    for name, module in list(model.named_modules()):  # buffers made at init from the config (rotary inv_freq)
        if module._non_persistent_buffers_set:
            if not hasattr(module, "config"):
                raise ValueError(f"{name}: {type(module).__name__} has buffers computed at init and no config to "
                                 f"compute them again")
            model.set_submodule(name, type(module)(module.config).to(device))
    targets = model.state_dict(keep_vars=True)
    loaded = set()
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt", device=str(device)) as f:
            for key in f.keys():
                if key not in targets:
                    raise ValueError(f"{file}: tensor {key!r} has no place in the model (not an MXFP4 GPT-OSS "
                                     f"checkpoint of this config?)")
                src, dst = f.get_tensor(key), targets[key]
                if src.shape != dst.shape:
                    raise ValueError(f"{file}: {key} has shape {list(src.shape)}, the model {list(dst.shape)}")
                if dst.dtype == torch.uint8:  # blocks / scales: the stored bits, never a value conversion
                    scales = key.endswith("_scales")
                    if src.dtype == torch.int8 or (scales and src.dtype == torch.float8_e8m0fnu):
                        src = src.view(torch.uint8)
                    elif src.dtype != torch.uint8:
                        raise ValueError(f"{file}: {key} is {src.dtype}; MXFP4 blocks must be uint8 or int8 bytes "
                                         f"(E2M1 pairs), scales uint8, int8 or float8_e8m0fnu (E8M0 exponents)")
                elif not src.is_floating_point():
                    raise ValueError(f"{file}: {key} is {src.dtype}, the model's {dst.dtype}")
                with torch.no_grad():
                    dst.copy_(src)  # uint8 blocks/scales as stored; float tensors cast to dtype
                loaded.add(key)
    if config.tie_word_embeddings:
        model.tie_weights()
        loaded |= {k for k in targets if k.endswith("lm_head.weight")}
    missing = sorted(set(targets) - loaded)
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks {len(missing)} of the model's tensors, e.g. {missing[:3]}")
    if os.path.isfile(os.path.join(path, "generation_config.json")):  # as from_pretrained: its stop tokens
        from transformers import GenerationConfig               # (<|call|>, <|endoftext|>), do_sample, ...

        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval().requires_grad_(False)


def _safetensors_files(path: str) -> list[str]:
    """The checkpoint's safetensors files: its index's shards, else the ``*.safetensors`` in the folder."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, shard) for shard in shards]
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors file")
    return files
