"""Read a PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) into per-module LoRA
factors in the slot layout, validated against the base model's geometry.

Output per module (fp32, scaling folded into B, not yet padded to the slot rank):

- experts: :class:`ExpertsLoRA` ``a13 [E,r,H]``, ``b13 [E,2I,r]`` (2I rows in the base weight's own gate/up order),
  ``a2 [E,r2,I]``, ``b2 [E,H,r2]``; either projection may be absent (it then contributes zero).
- dense linears: :class:`LinearLoRA` ``a [r,in]``, ``b [out,r]``.

Expert keys come in two layouts:

- 3-D (PEFT ``target_parameters``): ``<experts>.base_layer.lora_{A,B}.weight`` / ``<experts>.lora_{A,B}.weight``
  with ``A [E*r, d_a]`` expert-major and ``B [d_b, r*E]`` expert-minor. Which parameter a pair belongs to and on which
  side A sits come from the shapes (gate_up pairs span ``{H, 2I}``, down pairs ``{H, I}``); only where both sides
  have the same size does ``peft_version`` break the tie (PEFT < 0.19.1 put A on the weight's dim 1).
- per expert: ``<experts>.<e>.<gate|up|down>.lora_{A,B}.weight`` (``gate_proj/up_proj/down_proj``, Mixtral
  ``w1/w3/w2``). Gate and up with identical A share it (rank r); otherwise their A's are stacked and B is
  block-diagonal (rank r_gate + r_up).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_KEY_RE = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_PER_EXPERT_RE = re.compile(r"^(?P<experts>.+)\.(?P<index>\d+)\.(?P<leaf>[A-Za-z0-9_]+)$")
_FIRST_FIXED_PEFT = (0, 19, 1)  # PEFT versions before this read a 3-D weight [E, d1, d2] as in = d1


@dataclass(frozen=True)
class ExpertsTarget:
    """Geometry of one experts module of the base model, and what the loader needs to know about its family."""

    num_experts: int
    hidden: int
    intermediate: int
    layout: str
    per_expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    peft_a_on_output: bool = False


@dataclass(frozen=True)
class LinearTarget:
    in_features: int
    out_features: int


@dataclass
class ExpertsLoRA:
    a13: Optional[Tensor] = None  # [E, r, H]
    b13: Optional[Tensor] = None  # [E, 2I, r]
    a2: Optional[Tensor] = None   # [E, r2, I]
    b2: Optional[Tensor] = None   # [E, H, r2]


@dataclass
class LinearLoRA:
    a: Tensor  # [r, in]
    b: Tensor  # [out, r]


ModuleLoRA = Union[ExpertsLoRA, LinearLoRA]


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of ``adapter_config.json`` that define the delta."""

    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict
    alpha_pattern: dict
    peft_version: Optional[str]

    def _pattern_value(self, patterns: dict, name: str, default):
        # PEFT semantics: a pattern matches a module name when it matches a dot-separated suffix of it.
        for pattern, value in patterns.items():
            if re.match(rf"(.*\.)?({pattern})$", name):
                return value
        return default

    def rank_of(self, name: str) -> int:
        return int(self._pattern_value(self.rank_pattern, name, self.r))

    def scaling_of(self, name: str) -> float:
        r = self.rank_of(name)
        alpha = float(self._pattern_value(self.alpha_pattern, name, self.lora_alpha))
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def a_on_weight_dim1(self) -> Optional[bool]:
        """True if this adapter's PEFT put A on dim 1 of every 3-D weight (old PEFT), None if unknown."""
        if not self.peft_version:
            return None
        numbers = tuple(int(n) for n in re.findall(r"\d+", self.peft_version)[:3])
        return numbers < _FIRST_FIXED_PEFT


def read_adapter_config(path: str) -> AdapterConfig:
    """Parse and check ``adapter_config.json``; ValueError for features this library does not serve."""
    config_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"path: no {CONFIG_NAME} in adapter folder {path!r}")
    with open(config_path) as f:
        raw = json.load(f)
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"path: {path!r} is a {raw.get('peft_type')} adapter; only LoRA is supported")
    unsupported = {
        "use_dora": bool(raw.get("use_dora")),
        "lora_bias": bool(raw.get("lora_bias")),
        "bias": raw.get("bias", "none") != "none",
        "modules_to_save": bool(raw.get("modules_to_save")),
        "trainable_token_indices": bool(raw.get("trainable_token_indices")),
        "layer_replication": bool(raw.get("layer_replication")),
        "use_qalora": bool(raw.get("use_qalora")),
    }
    bad = [name for name, used in unsupported.items() if used]
    if bad:
        raise ValueError(f"path: adapter {path!r} uses unsupported PEFT feature(s) {bad}; only plain LoRA is served")
    return AdapterConfig(
        r=int(raw["r"]), lora_alpha=float(raw["lora_alpha"]), use_rslora=bool(raw.get("use_rslora")),
        rank_pattern=dict(raw.get("rank_pattern") or {}), alpha_pattern=dict(raw.get("alpha_pattern") or {}),
        peft_version=raw.get("peft_version"),
    )


def read_adapter_weights(path: str) -> dict[str, Tensor]:
    """``{key without 'base_model.model.': fp32 tensor}`` from ``adapter_model.safetensors``; ValueError on NaN/Inf."""
    from safetensors.torch import load_file

    weights_path = os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(weights_path):
        raise FileNotFoundError(f"path: no {WEIGHTS_NAME} in adapter folder {path!r}")
    tensors = {}
    for key, value in load_file(weights_path).items():
        if not torch.isfinite(value).all():
            raise ValueError(f"path: adapter weight {key!r} in {path!r} contains NaN or Inf")
        tensors[key.removeprefix(_PEFT_PREFIX)] = value.float()
    return tensors


def _pair_keys(tensors: dict[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """``{module path: (A, B)}``; ValueError for keys that are not plain LoRA weights or lack a partner."""
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, value in tensors.items():
        match = _KEY_RE.match(key)
        if match is None:
            raise ValueError(f"path: unsupported adapter weight {key!r} (only lora_A/lora_B weights are served)")
        pairs.setdefault(match["module"], {})[match["ab"]] = value
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"path: module {module!r} has lora_{next(iter(ab))} but no partner weight")
    return {module: (ab["A"], ab["B"]) for module, ab in pairs.items()}


def _renamed(module: str, aliases: dict[str, str]) -> str:
    for old, new in aliases.items():
        module = module.replace(f".{old}.", f".{new}.")
    return module


def load_peft_adapter(
    path: str,
    experts_targets: dict[str, ExpertsTarget],
    linear_targets: dict[str, LinearTarget],
    *,
    max_rank: int,
    aliases: Optional[dict[str, str]] = None,
) -> dict[str, ModuleLoRA]:
    """Read and fully validate the adapter at ``path`` against the base model's targets.

    ``experts_targets`` / ``linear_targets`` map module names (as in ``model.named_modules()``) to their geometry;
    ``aliases`` renames module path segments of older checkpoints (``{"block_sparse_moe": "mlp"}``). Raises
    FileNotFoundError / ValueError naming the problem; returns ``{module name: ExpertsLoRA | LinearLoRA}``.
    """
    config = read_adapter_config(path)
    pairs = _pair_keys(read_adapter_weights(path))
    aliases = aliases or {}
    result: dict[str, ModuleLoRA] = {}
    per_expert: dict[str, dict[str, dict[int, tuple[str, Tensor, Tensor]]]] = {}
    three_d: dict[str, list[tuple[str, Tensor, Tensor]]] = {}

    for module, (a, b) in sorted(pairs.items()):
        name = _renamed(module, aliases)
        if name in linear_targets:
            result[name] = _linear_lora(module, a, b, linear_targets[name], config)
            continue
        base = name
        while base.endswith(".base_layer"):
            base = base.removesuffix(".base_layer")
        if base in experts_targets:
            three_d.setdefault(base, []).append((module, a, b))
            continue
        match = _PER_EXPERT_RE.match(name)
        if match and match["experts"] in experts_targets:
            target = experts_targets[match["experts"]]
            if match["leaf"] not in target.per_expert_names:
                raise ValueError(f"path: unknown expert projection {match['leaf']!r} in {module!r}; expected one "
                                 f"of {list(target.per_expert_names)}")
            index = int(match["index"])
            if index >= target.num_experts:
                raise ValueError(f"path: {module!r} names expert {index} but the base model has "
                                 f"{target.num_experts} experts (adapter made for another base model?)")
            per_expert.setdefault(match["experts"], {}).setdefault(match["leaf"], {})[index] = (module, a, b)
            continue
        raise ValueError(f"path: adapter targets {module!r}, which is not a LoRA target of this model "
                         f"(experts modules and dense targets: {_summary(experts_targets, linear_targets)})")

    for name in sorted(set(three_d) & set(per_expert)):
        raise ValueError(f"path: experts module {name!r} has both 3-D and per-expert LoRA weights")
    for name, entries in three_d.items():
        result[name] = _experts_from_3d(entries, experts_targets[name], config, name)
    for name, leaves in per_expert.items():
        result[name] = _experts_from_per_expert(leaves, experts_targets[name], config)

    for name, lora in result.items():
        for factor in ("a", "a13", "a2"):
            t = getattr(lora, factor, None)
            if t is not None and t.shape[-2] > max_rank:
                raise ValueError(f"path: rank {t.shape[-2]} of {name!r} exceeds max_rank={max_rank} "
                                 f"(attach with a larger max_rank)")
    return result


def _summary(experts_targets, linear_targets) -> str:
    names = list(experts_targets) + list(linear_targets)
    leaves = sorted({n.rpartition(".")[2] for n in names})
    return f"{len(names)} modules with leaf names {leaves}"


def _check_rank(module: str, config_name: str, rank: int, config: AdapterConfig) -> None:
    expected = config.rank_of(config_name)
    if rank != expected:
        raise ValueError(f"path: {module!r} has rank {rank} but adapter_config.json gives rank {expected} "
                         f"for {config_name!r} (adapter made for another base model, e.g. another expert count?)")


def _linear_lora(module: str, a: Tensor, b: Tensor, target: LinearTarget, config: AdapterConfig) -> LinearLoRA:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != target.in_features or b.shape[0] != target.out_features \
            or a.shape[0] != b.shape[1]:
        raise ValueError(
            f"path: {module!r} has lora_A {list(a.shape)} / lora_B {list(b.shape)}, expected [r, "
            f"{target.in_features}] / [{target.out_features}, r] (adapter made for another base model?)"
        )
    _check_rank(module, module, a.shape[0], config)
    return LinearLoRA(a=a, b=b * config.scaling_of(module))


def _experts_from_3d(entries, target: ExpertsTarget, config: AdapterConfig, name: str) -> ExpertsLoRA:
    """3-D ``target_parameters`` pairs of one experts module -> :class:`ExpertsLoRA`."""
    E, H, I = target.num_experts, target.hidden, target.intermediate
    sides = {"gate_up_proj": (H, 2 * I), "down_proj": (I, H)}  # (input, output) of each projection
    out = ExpertsLoRA()
    for module, a, b in entries:
        d_a, d_b = (a.shape[1], b.shape[0]) if a.dim() == 2 and b.dim() == 2 else (None, None)
        param = next((p for p, (n_in, n_out) in sides.items() if {d_a, d_b} == {n_in, n_out}), None)
        if param is None or a.shape[0] % E or b.shape[1] % E or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"path: {module!r} has lora_A {list(a.shape)} / lora_B {list(b.shape)}, which match neither "
                f"gate_up_proj nor down_proj of a base with E={E}, H={H}, I={I} (adapter made for another base "
                f"model?)"
            )
        n_in, n_out = sides[param]
        r = a.shape[0] // E
        _check_rank(module, f"{name}.{param}", r, config)
        a_r = a.reshape(E, r, d_a)                       # expert-major rows
        b_r = b.reshape(d_b, r, E).permute(2, 0, 1)      # expert-minor columns -> [E, d_b, r]
        if n_in != n_out:
            a_on_output = d_a == n_out
        else:
            old_peft = config.a_on_weight_dim1()
            # Weight dim 1 is the output for [E, out, in] (concat) and the input for transposed layouts.
            a_on_output = (not target.layout.startswith("transposed")) if old_peft else target.peft_a_on_output
        if a_on_output:  # delta = A^T B^T per expert: our A is PEFT's B^T, our B is PEFT's A^T
            a_r, b_r = b_r.transpose(1, 2), a_r.transpose(1, 2)
        b_r = b_r * config.scaling_of(f"{name}.{param}")
        if param == "gate_up_proj":
            if out.a13 is not None:
                raise ValueError(f"path: two gate_up_proj LoRA pairs for {name!r}")
            out.a13, out.b13 = a_r.contiguous(), b_r.contiguous()
        else:
            if out.a2 is not None:
                raise ValueError(f"path: two down_proj LoRA pairs for {name!r}")
            out.a2, out.b2 = a_r.contiguous(), b_r.contiguous()
    return out


def _stack_experts(experts: dict[int, tuple[str, Tensor, Tensor]], E: int, n_in: int, n_out: int,
                   config: AdapterConfig) -> tuple[Tensor, Tensor]:
    """Per-expert pairs of one projection -> ``A [E,r,in]``, scaled ``B [E,out,r]`` (zeros for absent experts)."""
    ranks = {a.shape[0] for _, a, _ in experts.values()}
    if len(ranks) != 1:
        raise ValueError(f"path: experts of one projection have different ranks {sorted(ranks)}")
    r = ranks.pop()
    a_all, b_all = torch.zeros(E, r, n_in), torch.zeros(E, n_out, r)
    for e, (module, a, b) in experts.items():
        if list(a.shape) != [r, n_in] or list(b.shape) != [n_out, r]:
            raise ValueError(f"path: {module!r} has lora_A {list(a.shape)} / lora_B {list(b.shape)}, expected "
                             f"[{r}, {n_in}] / [{n_out}, {r}] (adapter made for another base model?)")
        _check_rank(module, module, r, config)
        a_all[e], b_all[e] = a, b * config.scaling_of(module)
    return a_all, b_all


def _merge_gate_up(gate: Optional[Tensor], up: Optional[Tensor], layout: str) -> Tensor:
    """``gate``/``up`` row blocks ``[E, I, r]`` -> ``[E, 2I, r]`` in the layout's gate/up order."""
    if layout == "transposed_interleaved":
        return torch.stack([gate, up], dim=2).flatten(1, 2)
    return torch.cat([gate, up], dim=1)


def _experts_from_per_expert(leaves, target: ExpertsTarget, config: AdapterConfig) -> ExpertsLoRA:
    E, H, I = target.num_experts, target.hidden, target.intermediate
    gate_name, up_name, down_name = target.per_expert_names
    out = ExpertsLoRA()
    if down_name in leaves:
        out.a2, out.b2 = _stack_experts(leaves[down_name], E, I, H, config)
    gate = _stack_experts(leaves[gate_name], E, H, I, config) if gate_name in leaves else None
    up = _stack_experts(leaves[up_name], E, H, I, config) if up_name in leaves else None
    if gate is None and up is None:
        return out
    if gate is not None and up is not None and gate[0].shape == up[0].shape and torch.equal(gate[0], up[0]):
        out.a13 = gate[0]
        out.b13 = _merge_gate_up(gate[1], up[1], target.layout)
        return out
    # Separate A's: stack them and make B block-diagonal, so gate rows only see gate's rank and up rows up's.
    parts = [p for p in (gate, up) if p is not None]
    out.a13 = torch.cat([a for a, _ in parts], dim=1)
    r_total = out.a13.shape[1]
    r_gate = gate[0].shape[1] if gate is not None else 0
    gate_b = torch.zeros(E, I, r_total)
    up_b = torch.zeros(E, I, r_total)
    if gate is not None:
        gate_b[:, :, :r_gate] = gate[1]
    if up is not None:
        up_b[:, :, r_gate:] = up[1]
    out.b13 = _merge_gate_up(gate_b, up_b, target.layout)
    return out
