"""Read a PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) into per-module LoRA
factors in the slot layout, validated against the base model's geometry.

Output per module (in the slot dtype, fp32 unless told, scaling folded into B, not yet padded to the slot rank):

- experts: :class:`ExpertsLoRA` ``a13 [E,r,H]``, ``b13 [E,2I,r]`` (2I rows in the base weight's own gate/up order),
  ``a2 [E,r2,I]``, ``b2 [E,H,r2]``; either projection may be absent (it then contributes zero).
- dense linears: :class:`LinearLoRA` ``a [r,in]``, ``b [out,r]``.

Expert keys come in two layouts:

- 3-D (PEFT ``target_parameters``): ``<experts>.base_layer.lora_{A,B}.weight`` / ``<experts>.lora_{A,B}.weight``
  with ``A [E*r, d_a]`` expert-major and ``B [d_b, r*E]`` expert-minor. Which parameter a pair belongs to and on which
  side A sits come from the shapes (gate_up pairs span ``{H, 2I}``, down pairs ``{H, I}``; the parameter must be one
  the config's ``target_parameters`` name: another geometry's gate_up can have our down's shapes); only where both
  sides have the same size does ``peft_version`` break the tie (PEFT < 0.19.0 put A on the weight's dim 1, 0.19.0 on the
  side opposite today's: see ``_PEFT_3D_SWAP``).
- per expert: ``<experts>.<e>.<gate|up|down>.lora_{A,B}.weight`` (``gate_proj/up_proj/down_proj``, Mixtral
  ``w1/w3/w2``). Gate and up with identical A share it (rank r); otherwise their A's are stacked and B is
  block-diagonal (rank r_gate + r_up).

Everything a folder says is checked before any slot is written: the config's numbers and patterns, the file's
integrity and tensor dtypes, the final tensors after scaling and the cast to the slot dtype (finite: a value that
overflows the slot dtype is an error, never an Inf in a slot), and the base model the adapter was made for, as PEFT
recorded it. Every problem is a ValueError naming the folder, the file and the problem. A config target of this base
with no pair in the file (an incomplete file) loads with a warning, as in PEFT.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from dataclasses import dataclass
from typing import Mapping, Optional, Union

import torch
from torch import Tensor

from ..ops.layout import is_interleaved, is_transposed, merge_gate_up

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_WEIGHTS_NAME = "adapter_model.bin"  # PEFT's save with safe_serialization=False: refused, named in the error
_PEFT_PREFIX = "base_model.model."
_KEY_RE = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_PER_EXPERT_RE = re.compile(r"^(?P<experts>.+)\.(?P<index>\d+)\.(?P<leaf>[A-Za-z0-9_]+)$")
# Where PEFT put A (its in_features side) on a 3-D expert weight [E, d1, d2]: before 0.19.0 always on d1; 0.19.0
# swapped in/out where the experts module says ``is_transposed`` (GPT-OSS); 0.19.1 on swaps exactly where 0.19.0 did
# not (``ndim == 3 and not is_transposed``). So 0.19.0's side is the opposite of today's for every family.
_PEFT_3D_SWAP = (0, 19, 0)
_PEFT_3D_CURRENT = (0, 19, 1)
_PEFT_DEFAULT_ALPHA = 8  # LoraConfig's default lora_alpha, used when a config omits it (as PEFT does)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_ROUTER_LEAVES = ("gate", "router", "shared_expert_gate")  # routers' leaf names in the MoE families (named in errors)
_PARENT_LIBRARY_RE = re.compile(r"^transformers\.models\.(?P<model_type>[A-Za-z0-9_]+)\.")


class AdapterFileError(ValueError):
    """A problem with one file of an adapter folder; :func:`load_peft_adapter` adds the folder to the message."""

    def __init__(self, file: str, problem: str):
        super().__init__(f"{file}: {problem}")
        self.file, self.problem = file, problem


def _config_error(problem: str) -> AdapterFileError:
    return AdapterFileError(CONFIG_NAME, problem)


def _weights_error(problem: str) -> AdapterFileError:
    return AdapterFileError(WEIGHTS_NAME, problem)


@dataclass(frozen=True)
class ExpertsTarget:
    """Geometry of one experts module of the base model, and what the loader needs to know about its family."""

    num_experts: int
    hidden: int
    intermediate: int
    layout: str
    per_expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    peft_a_on_output: bool = False
    per_expert_targets: bool = True  # PEFT's target_modules reach these experts through per_expert_names


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
    base_model_type: Optional[str] = None  # the base's model_type as PEFT recorded it (or its local config.json)
    base_model_source: str = ""  # where base_model_type was read
    # what the config says it adapts (PEFT suffix semantics): a list's entries, or None for a regex / "all-linear"
    target_modules: Optional[tuple[str, ...]] = None
    target_parameters: tuple[str, ...] = ()  # 3-D expert parameters, e.g. "mlp.experts.gate_up_proj"
    # PEFT's further limits on target_modules (not on target_parameters): layer indices (None: every layer), the
    # names before a layer index, excluded modules (a regex, or names matched as suffixes); read for the check that
    # every module the config adapts has its weights (_warn_untouched_targets)
    layers_to_transform: Optional[tuple[int, ...]] = None
    layers_pattern: tuple[str, ...] = ()
    exclude_modules: Union[None, str, tuple[str, ...]] = None

    def adapts(self, module: str) -> bool:
        """Whether PEFT adapts the base's module ``module`` (a full name) through the listed ``target_modules``:
        its suffix rule, ``exclude_modules``, ``layers_to_transform`` / ``layers_pattern`` (the first numbered
        name part after ``layers_pattern``, or after any name when it is empty, is the layer index)."""
        if isinstance(self.exclude_modules, str):
            if re.fullmatch(self.exclude_modules, module):
                return False
        elif self.exclude_modules and any(_suffix_match(module, e) for e in self.exclude_modules):
            return False
        if not self.target_modules or not any(_suffix_match(module, t) for t in self.target_modules):
            return False
        if self.layers_to_transform is None:
            return True
        regexes = ([rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\." for p in self.layers_pattern] if self.layers_pattern
                   else [r".*?\.[^.]*\.(?P<idx>\d+)\."])
        match = next((m for m in (re.match(r, module) for r in regexes) if m is not None), None)
        return match is not None and int(match["idx"]) in self.layers_to_transform

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

    def peft_3d_rule(self) -> Optional[str]:
        """Which PEFT rule placed A on this adapter's 3-D expert weights: ``"dim1"`` (PEFT < 0.19.0: A on the
        weight's dim 1), ``"0.19.0"`` (the opposite side of today's), ``"current"`` (>= 0.19.1); None if the
        config does not say (read as current)."""
        if not self.peft_version:
            return None
        numbers = tuple(int(n) for n in re.findall(r"\d+", self.peft_version)[:3])
        if numbers < _PEFT_3D_SWAP:
            return "dim1"
        return "0.19.0" if numbers < _PEFT_3D_CURRENT else "current"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive_int(field: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _config_error(f"{field} must be a positive int, got {value!r}")
    return value


def _finite_number(field: str, value) -> float:
    if not _is_number(value) or not math.isfinite(value):
        raise _config_error(f"{field} must be a finite number, got {value!r}")
    return float(value)


def _names(field: str, value, regex_ok: bool) -> Optional[tuple[str, ...]]:
    """``target_modules`` / ``target_parameters``: a list of names -> a tuple; None (absent, or for
    ``target_modules`` a regex string such as "all-linear", whose matches only the base model can tell)."""
    if value is None or (regex_ok and isinstance(value, str)):
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(n, str) for n in value):
        raise _config_error(f"{field} must be a list of module names, got {value!r}")
    return tuple(value)


def _suffix_match(name: str, target: str) -> bool:
    """PEFT's rule for a listed target: the whole name, or a dot-separated suffix of it."""
    return name == target or name.endswith("." + target)


def _patterns(field: str, raw: dict, check_value) -> dict:
    """``rank_pattern`` / ``alpha_pattern``: ``{regex: value}``; every regex must compile, every value pass."""
    patterns = raw.get(field) or {}
    if not isinstance(patterns, dict):
        raise _config_error(f"{field} must be an object {{pattern: value}}, got {type(patterns).__name__}")
    out = {}
    for pattern, value in patterns.items():
        try:
            re.compile(pattern)
        except re.error as e:
            raise _config_error(f"{field} key {pattern!r} is not a valid regular expression ({e})") from None
        out[pattern] = check_value(f"{field}[{pattern!r}]", value)
    return out


def _recorded_model_type(raw: dict) -> tuple[Optional[str], str]:
    """The base's model_type as the folder records it, without network: PEFT's ``auto_mapping.parent_library``
    (``transformers.models.<name>.modeling_...``: the modeling module's name, mostly the model_type), else ``config.json`` of a local
    ``base_model_name_or_path``. ``(None, "")`` when the folder does not say."""
    mapping = raw.get("auto_mapping")
    library = mapping.get("parent_library") if isinstance(mapping, dict) else None
    match = _PARENT_LIBRARY_RE.match(library) if isinstance(library, str) else None
    if match:
        return match["model_type"], f"auto_mapping.parent_library {library!r}"
    base = raw.get("base_model_name_or_path")
    config_path = os.path.join(base, "config.json") if isinstance(base, str) and base else None
    if config_path and os.path.isfile(config_path):
        try:
            with open(config_path) as f:
                model_type = json.load(f).get("model_type")
        except (OSError, ValueError, AttributeError):
            return None, ""
        if isinstance(model_type, str):
            return model_type, f"base_model_name_or_path {base!r} (its config.json)"
    return None, ""


def read_adapter_config(path: str) -> AdapterConfig:
    """Parse and check ``adapter_config.json``; ValueError naming the folder, the file and the problem for a
    malformed config or features this library does not serve."""
    try:
        return _read_adapter_config(path)
    except AdapterFileError as e:
        raise ValueError(f"path: adapter folder {path!r}, {e}") from None


def _init_changes_base(init) -> bool:
    """Whether PEFT's ``init_lora_weights`` subtracts the initial factors from the base weights. Matched as PEFT's
    LoraLayer.update_layer dispatches it: PiSSA and CorDA by prefix ("pissa_niter_4", "corda_..."), OLoRA in any
    case ("OLoRA"), LoftQ and LoRA-GA exactly."""
    if not isinstance(init, str):
        return False
    return init.startswith(("pissa", "corda")) or init.lower() == "olora" or init in ("loftq", "lora_ga")


def _read_adapter_config(path: str) -> AdapterConfig:
    config_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(config_path):
        if not os.path.exists(path):
            raise FileNotFoundError(f"path: adapter folder {path!r} does not exist")
        if not os.path.isdir(path):
            raise FileNotFoundError(f"path: {path!r} is a file, not an adapter folder (give the folder that holds "
                                    f"{CONFIG_NAME})")
        raise FileNotFoundError(f"path: no {CONFIG_NAME} in adapter folder {path!r}")
    try:
        with open(config_path) as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise _config_error(f"cannot be read as JSON ({e})") from None
    if not isinstance(raw, dict):
        raise _config_error(f"must hold a JSON object, got {type(raw).__name__}")
    if raw.get("peft_type", "LORA") != "LORA":
        raise _config_error(f"a {raw.get('peft_type')!r} adapter; only LoRA is supported")
    unsupported = {
        "use_dora": bool(raw.get("use_dora")),
        "lora_bias": bool(raw.get("lora_bias")),
        "bias": raw.get("bias", "none") != "none",
        "modules_to_save": bool(raw.get("modules_to_save")),
        "trainable_token_indices": bool(raw.get("trainable_token_indices")),
        "layer_replication": bool(raw.get("layer_replication")),
        "use_qalora": bool(raw.get("use_qalora")),
        # LoRA variants whose forward is not x A^T B^T * scale on every token
        "alora_invocation_tokens": bool(raw.get("alora_invocation_tokens")),
        "use_bdlora": bool(raw.get("use_bdlora")),
        **{key: bool(raw.get(key)) for key in ("arrow_config", "velora_config", "monteclora_config", "kasa_config")},
    }
    bad = [name for name, used in unsupported.items() if used]
    if bad:
        raise _config_error(f"uses unsupported PEFT feature(s) {bad}; only plain LoRA is served")
    init = raw.get("init_lora_weights", True)
    if _init_changes_base(init) or raw.get("loftq_config"):
        raise _config_error(
            f"was initialized with init_lora_weights={init!r}{' and a loftq_config' if raw.get('loftq_config') else ''}"
            ", which changes the base model's weights: its factors are only valid on that modified base. Convert it "
            "to a plain LoRA of the original base first (PEFT: save_pretrained(..., "
            "path_initial_model_for_weight_conversion=...)) and load the converted folder")
    if "r" not in raw:
        raise _config_error("has no 'r' (the LoRA rank)")
    use_rslora = raw.get("use_rslora") or False
    if not isinstance(use_rslora, bool):
        raise _config_error(f"use_rslora must be true or false, got {use_rslora!r}")
    peft_version = raw.get("peft_version")
    if peft_version is not None and not isinstance(peft_version, str):
        raise _config_error(f"peft_version must be a string, got {peft_version!r}")
    model_type, source = _recorded_model_type(raw)
    return AdapterConfig(
        **_target_limits(raw),
        target_modules=_names("target_modules", raw.get("target_modules"), regex_ok=True),
        target_parameters=_names("target_parameters", raw.get("target_parameters"), regex_ok=False) or (),
        r=_positive_int("r", raw["r"]),
        lora_alpha=_finite_number("lora_alpha", raw.get("lora_alpha", _PEFT_DEFAULT_ALPHA)),
        use_rslora=use_rslora,
        rank_pattern=_patterns("rank_pattern", raw, _positive_int),
        alpha_pattern=_patterns("alpha_pattern", raw, _finite_number),
        peft_version=peft_version, base_model_type=model_type, base_model_source=source,
    )


def _target_limits(raw: dict) -> dict:
    """``layers_to_transform`` / ``layers_pattern`` / ``exclude_modules`` as :class:`AdapterConfig` holds them.
    They only decide which modules must have weights: a value of another type than PEFT writes leaves the limit
    unknown, read as "adapts nothing", so no module is reported missing (the weights are what is served)."""
    layers, pattern, exclude = (raw.get(k) for k in ("layers_to_transform", "layers_pattern", "exclude_modules"))

    def ints(v):
        return isinstance(v, int) and not isinstance(v, bool)

    def strs(v):
        return isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)

    unknown = {"layers_to_transform": ()}
    if layers is None or layers == []:  # PEFT: an empty list limits nothing
        layers = None
    elif ints(layers):
        layers = (layers,)
    elif isinstance(layers, (list, tuple)) and all(ints(i) for i in layers):
        layers = tuple(layers)
    else:
        return unknown
    if pattern is None or pattern == "":
        pattern = ()
    elif isinstance(pattern, str):
        pattern = (pattern,)
    elif strs(pattern):
        pattern = tuple(pattern)
    else:
        return unknown
    if exclude is not None and not isinstance(exclude, str):
        if not strs(exclude):
            return unknown
        exclude = tuple(exclude)
    if isinstance(exclude, str):
        try:
            re.compile(exclude)
        except re.error:
            return unknown
    for p in pattern:
        try:
            re.compile(p)
        except re.error:
            return unknown
    return {"layers_to_transform": layers, "layers_pattern": pattern, "exclude_modules": exclude}


def read_adapter_weights(path: str, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """``{key without 'base_model.model.': tensor in dtype}`` from ``adapter_model.safetensors``; ValueError naming
    the folder, the file and the problem for an unreadable (corrupt, truncated) file, a non-float tensor or NaN/Inf."""
    try:
        return _read_adapter_weights(path, dtype)
    except AdapterFileError as e:
        raise ValueError(f"path: adapter folder {path!r}, {e}") from None


def _read_adapter_weights(path: str, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    weights_path = os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(weights_path):
        if os.path.isfile(os.path.join(path, PICKLE_WEIGHTS_NAME)):
            raise FileNotFoundError(
                f"path: no {WEIGHTS_NAME} in adapter folder {path!r}, only {PICKLE_WEIGHTS_NAME}: pickle (.bin) "
                f"checkpoints are not supported (loading one can run arbitrary code); save the adapter with "
                f"save_pretrained(..., safe_serialization=True), PEFT's default, or convert it to safetensors")
        raise FileNotFoundError(f"path: no {WEIGHTS_NAME} in adapter folder {path!r}")
    try:
        raw = load_file(weights_path)
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError, ValueError) for bad files
        raise _weights_error(f"cannot be read, corrupt or truncated? ({type(e).__name__}: {e})") from None
    tensors = {}
    for key, value in raw.items():
        if value.dtype not in _FLOAT_DTYPES:
            raise _weights_error(f"adapter weight {key!r} is {value.dtype}; LoRA weights must be floating "
                                 f"({', '.join(str(d).removeprefix('torch.') for d in _FLOAT_DTYPES)})")
        if not torch.isfinite(value).all():
            raise _weights_error(f"adapter weight {key!r} contains NaN or Inf")
        tensors[key.removeprefix(_PEFT_PREFIX)] = value.to(dtype)
    return tensors


def _pair_keys(tensors: dict[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """``{module path: (A, B)}``; ValueError for keys that are not plain LoRA weights or lack a partner."""
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, value in tensors.items():
        match = _KEY_RE.match(key)
        if match is None:
            raise _weights_error(f"unsupported adapter weight {key!r} ({_unsupported_why(key)})")
        pairs.setdefault(match["module"], {})[match["ab"]] = value
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise _weights_error(f"module {module!r} has lora_{next(iter(ab))} but no partner weight")
    return {module: (ab["A"], ab["B"]) for module, ab in pairs.items()}


def _unsupported_why(key: str) -> str:
    """Why a weight that is no ``lora_A`` / ``lora_B`` pair cannot be served, in the words of what PEFT saved."""
    module, _, leaf = key.rpartition(".")
    if re.fullmatch(r"lora_embedding_[AB]", leaf) or module.endswith("embed_tokens.base_layer") \
            or module.endswith("lm_head.base_layer"):
        part = module.removesuffix(".base_layer").rpartition(".")[2] or module
        return (f"LoRA on {part} (embeddings, output layer) is not supported; PEFT saved {part}'s full base weight "
                f"with its LoRA: adapt the decoder layers only, leaving {part} out of target_modules")
    if module.endswith(".base_layer"):
        return (f"a full copy of base weight {module.removesuffix('.base_layer')!r}, saved by PEFT for embedding "
                f"layers: not a LoRA factor; only lora_A/lora_B weights are served")
    if leaf == "weight" and module.rpartition(".")[2] in ("embed_tokens", "lm_head", "embed_out", "wte"):
        return (f"a full {module.rpartition('.')[2]} weight, saved by PEFT with save_embedding_layers=True (it "
                f"would replace the base model's): not a LoRA factor; save the adapter with "
                f"save_embedding_layers=False, only lora_A/lora_B weights are served")
    return "only lora_A/lora_B weights are served"


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
    dtype: Union[torch.dtype, Mapping[str, torch.dtype]] = torch.float32,
    model_type: Optional[str] = None,
    model_module: Optional[str] = None,
    dropped: frozenset = frozenset(),
) -> dict[str, ModuleLoRA]:
    """Read and fully validate the adapter at ``path`` against the base model's targets.

    ``experts_targets`` / ``linear_targets`` map module names (as in ``model.named_modules()``) to their geometry;
    ``aliases`` renames module path segments of older checkpoints (``{"block_sparse_moe": "mlp"}``); ``dtype``: the
    slot dtype (one, or per module name) the factors are returned in and validated for; ``model_type``: the base
    model's ``config.model_type`` and ``model_module`` its class's module (``transformers.models.<name>.modeling_<name>``,
what PEFT records), compared with the base the folder records (:func:`check_base_model`); ``dropped``: module
    names whose LoRA pairs are skipped (linears of zero width, whose delta is empty or zero). Raises
    FileNotFoundError / ValueError naming the folder, the file and the problem; returns
    ``{module name: ExpertsLoRA | LinearLoRA}``.
    """
    try:
        config = _read_adapter_config(path)
        dtypes = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype.values())
        # float32 holds any float16 / bfloat16 / float32 slot's result of the scaling exactly enough; float64 slots
        # get float64 factors, scaled in float64 (parsed in float32, they were 1e-7 off PEFT's float64 model)
        parse_dtype = torch.float64 if torch.float64 in dtypes else torch.float32
        result = _load_modules(path, config, experts_targets, linear_targets, max_rank, aliases or {}, parse_dtype,
                               dropped)
        if model_type is not None:
            check_base_model(config, model_type, model_module=model_module, has_experts=any(isinstance(m, ExpertsLoRA) for m in result.values()),
                             experts_layout=next((t.layout for t in experts_targets.values()), None))
        return {name: _final(name, lora, dtype if isinstance(dtype, torch.dtype) else dtype[name])
                for name, lora in result.items()}
    except AdapterFileError as e:
        raise ValueError(f"path: adapter folder {path!r}, {e}") from None


def _final(name: str, lora: ModuleLoRA, dtype: torch.dtype) -> ModuleLoRA:
    """``lora``'s factors cast to the slot ``dtype``; every value must stay finite (scaling included).
    AdapterFileError otherwise (:func:`recast_parsed` adds the folder, as :func:`load_peft_adapter` does)."""
    out = {}
    for factor, t in vars(lora).items():
        if t is None:
            out[factor] = None
            continue
        cast = t.to(dtype)
        if not torch.isfinite(cast).all():
            largest = t.abs().max().item() if torch.isfinite(t).all() else float("inf")
            raise _weights_error(
                f"{name!r} {factor} is not finite after the scaling by lora_alpha / r (largest |value| "
                f"{largest:.3g}) and the cast to the slot dtype {dtype} (max {torch.finfo(dtype).max:.3g}): weights "
                f"or lora_alpha too large for this model")
        out[factor] = cast
    return type(lora)(**out)


def recast_parsed(path: str, weights: Mapping[str, ModuleLoRA], dtypes: Mapping[str, torch.dtype]
                  ) -> dict[str, ModuleLoRA]:
    """Factors :func:`load_peft_adapter` read from ``path``, cast to new slot ``dtypes`` (``{module name: dtype}``;
    the model was cast after the parse): the same cast and finiteness check, the same ValueError as a fresh load
    of the folder in those dtypes."""
    try:
        return {name: _final(name, lora, dtypes[name]) for name, lora in weights.items()}
    except AdapterFileError as e:
        raise ValueError(f"path: adapter folder {path!r}, {e}") from None


def check_base_model(config: AdapterConfig, model_type: str, *, has_experts: bool,
                     experts_layout: Optional[str], model_module: Optional[str] = None) -> None:
    """Compare the base the folder records (``config.base_model_type``) with this model's ``model_type``.

    ValueError when the adapter has expert weights and the recorded family orders gate/up otherwise (GPT-OSS's
    interleaved 2I axis vs everyone else's concatenated one: same shapes, scrambled gate/up); a warning for any other
    family difference; nothing when the folder does not say (hub ids are not looked up: no network)."""
    recorded = config.base_model_type
    match = _PARENT_LIBRARY_RE.match(model_module or "")
    if recorded is None or recorded in (model_type, match and match["model_type"]):  # Llama-4: llama4 / llama4_text
        return
    from ..models.families import FAMILIES  # the family table lives with the models (imported lazily: no cycle)

    family_of = {t: f for f in FAMILIES for t in f.model_types}
    ours, theirs = family_of.get(model_type), family_of.get(recorded)
    if ours is not None and ours is theirs and ours.layout is not None:  # one MoE family's names (llama4 / _text);
        return                                                           # the dense row spans distinct models
    what = f"adapter made for a {recorded!r} base ({config.base_model_source}), loaded into a {model_type!r} model"
    if has_experts and theirs is not None and theirs.layout is not None and experts_layout is not None \
            and is_interleaved(theirs.layout) != is_interleaved(experts_layout):
        raise _config_error(f"{what}: its expert gate/up axis is {theirs.layout!r}, this model's {experts_layout!r}; "
                            f"the expert weights would be read with gate and up mixed up")
    warnings.warn(f"{what}; loading it because its names and shapes fit", stacklevel=3)


def _load_modules(path, config, experts_targets, linear_targets, max_rank, aliases,
                  parse_dtype: torch.dtype = torch.float32, dropped: frozenset = frozenset()) -> dict[str, ModuleLoRA]:
    """The body of :func:`load_peft_adapter`: factors in ``parse_dtype``, scaled, checked against the targets."""
    pairs = _pair_keys(_read_adapter_weights(path, parse_dtype))
    if not pairs:  # loading it would serve the base model under the adapter's name, silently
        raise _weights_error("holds no LoRA weights (no lora_A / lora_B tensors): an adapter saved without its "
                             "trained weights, or an empty file?")
    result: dict[str, ModuleLoRA] = {}
    per_expert: dict[str, dict[str, dict[int, tuple[str, Tensor, Tensor]]]] = {}
    three_d: dict[str, list[tuple[str, Tensor, Tensor]]] = {}

    renamed_from: dict[str, str] = {}
    for module, (a, b) in sorted(pairs.items()):
        name = _renamed(module, aliases)
        if name in renamed_from:  # a legacy name and the current one (or two legacy ones) for one module
            raise _weights_error(
                f"adapter weights {renamed_from[name]!r} and {module!r} are both LoRA pairs of module {name!r} (legacy "
                f"names read as {', '.join(f'{old!r} -> {new!r}' for old, new in aliases.items())}); "
                f"one would silently replace the other: keep one of them")
        renamed_from[name] = module
        if name in dropped:
            continue
        if name in linear_targets:
            result[name] = _linear_lora(module, a, b, linear_targets[name], config)
            continue
        base = _without_base_layers(name)
        if base in experts_targets:
            three_d.setdefault(base, []).append((module, a, b))
            continue
        match = _PER_EXPERT_RE.match(name)
        if match and match["experts"] in experts_targets:
            target = experts_targets[match["experts"]]
            if match["leaf"] not in target.per_expert_names:
                raise _weights_error(f"unknown expert projection {match['leaf']!r} in {module!r}; expected one "
                                     f"of {list(target.per_expert_names)}")
            index = int(match["index"])
            if index >= target.num_experts:
                raise _weights_error(f"{module!r} names expert {index} but the base model has "
                                     f"{target.num_experts} experts (adapter made for another base model?)")
            per_expert.setdefault(match["experts"], {}).setdefault(match["leaf"], {})[index] = (module, a, b)
            continue
        router = (" (an MoE router or shared-expert gate: LoRA on routers is not supported; PEFT's "
                  "target_modules='all-linear' adapts them too, and with transformers 5 it puts the routers' "
                  "'gate.weight' into target_parameters, where exclude_modules does not remove it: list the "
                  "target modules (q_proj, k_proj, ...) and the experts' target_parameters by name instead)"
                  if name.rpartition(".")[2] in _ROUTER_LEAVES else "")
        raise _weights_error(f"adapter targets {module!r}, which is not a LoRA target of this model{router} "
                             f"(experts modules and dense targets: {_summary(experts_targets, linear_targets)})"
                             f"{_prefix_hint(name, [*experts_targets, *linear_targets])}")

    for name in sorted(set(three_d) & set(per_expert)):
        raise _weights_error(f"experts module {name!r} has both 3-D and per-expert LoRA weights")
    for name, entries in three_d.items():
        result[name] = _experts_from_3d(entries, experts_targets[name], config, name)
    for name, leaves in per_expert.items():
        result[name] = _experts_from_per_expert(leaves, experts_targets[name], config)
    _warn_per_expert_patterns(config, per_expert)

    _warn_untouched_targets(config, result, experts_targets, linear_targets)
    for name, lora in result.items():
        for factor in ("a", "a13", "a2"):
            t = getattr(lora, factor, None)
            if t is not None and t.shape[-2] > max_rank:
                stacked = (" (per-expert gate and up LoRA with different A's are served as one of rank r_gate + "
                           "r_up, their A's stacked)" if factor == "a13" and name in per_expert else "")
                part = {"a13": " (its gate/up projection)", "a2": " (its down projection)"}.get(factor, "")
                raise _weights_error(f"rank {t.shape[-2]} of {name!r}{part}{stacked} exceeds max_rank={max_rank} "
                                     f"(attach with a larger max_rank)")
    return result


def _warn_per_expert_patterns(config: AdapterConfig, per_expert: dict) -> None:
    """Warn when ``rank_pattern`` / ``alpha_pattern`` give the experts of one projection different ranks or
    scalings (keys naming single experts, e.g. ``experts.3.w3``, in a transformers-4 per-expert folder): applied
    here per expert, as the adapter was trained; PEFT (0.21, 0.22) loads such folders into its 3-D expert
    wrapper, one rank and scaling per projection, and drops those keys (its warning: they matched no module), so its
    outputs differ from ours on those experts."""
    varied = set()  # projection names (w1, gate_proj, ...)
    for leaves in per_expert.values():  # {leaf: {expert index: (module, A, B)}}
        for leaf, experts in leaves.items():
            if len({(config.rank_of(m), config.scaling_of(m)) for m, _, _ in experts.values()}) > 1:
                varied.add(leaf)
    varied = sorted(varied)
    if varied:
        warnings.warn(f"adapter_config.json's rank_pattern / alpha_pattern give single experts their own rank or "
                      f"scaling (projections {varied}): applied per expert, as the adapter was trained; PEFT loads "
                      f"per-expert folders into its 3-D expert weights with one rank and scaling per projection and "
                      f"drops such keys, so PEFT's outputs differ from these on those experts", stacklevel=4)


def _warn_untouched_targets(config: AdapterConfig, result: dict[str, ModuleLoRA], experts_targets, linear_targets
                            ) -> None:
    """Warn when the config adapts a module of this base model (PEFT's matching: :meth:`AdapterConfig.adapts` for
    ``target_modules``, suffixes for ``target_parameters``) but the weights hold no LoRA pair for it: those modules
    would run without the adapter's delta (PEFT's "missing adapter keys" warning), e.g. an incomplete file or an
    adapter saved from a model with fewer layers. Targets this base does not have are not named: PEFT skips them."""
    factor_of = {"gate_up_proj": "a13", "down_proj": "a2"}
    experts = {n: lora for n, lora in result.items() if isinstance(lora, ExpertsLoRA)}
    missing = []
    for t in config.target_modules or ():
        matched = [n for n in linear_targets if _suffix_match(n, t)]
        if matched:
            missing += [n for n in matched if config.adapts(n) and not isinstance(result.get(n), LinearLoRA)]
            continue
        # a per-expert projection (gate_proj, w1, ...) of experts of this base, named by a path that can reach one
        leaf = t.rpartition(".")[2]
        names = next((target.per_expert_names for name, target in experts_targets.items()
                      if target.per_expert_targets and leaf in target.per_expert_names
                      and any(_suffix_match(f"{name}.{e}.{leaf}", t) for e in range(target.num_experts))), None)
        if names is not None:
            factor = "a2" if leaf == names[2] else "a13"
            if not any(getattr(lora, factor) is not None for lora in experts.values()):
                missing.append(t)
    for t in config.target_parameters:
        missing += [f"{n}.{p}" for n in experts_targets for p, factor in factor_of.items()
                    if _suffix_match(f"{n}.{p}", t) and getattr(experts.get(n), factor, None) is None]
    if missing:
        missing = sorted(set(missing))
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        warnings.warn(f"adapter_config.json adapts {len(missing)} module(s) of this base model that "
                      f"{WEIGHTS_NAME} holds no LoRA weights for ({shown}): they run without this adapter's delta "
                      f"(an incomplete file, or an adapter saved from a model with fewer layers?)", stacklevel=4)


def _prefix_hint(name: str, targets: list[str]) -> str:
    """Where the adapter's module ``name`` and a target of this model differ by a leading prefix (an adapter of the
    causal LM loaded into its inner model, of a multimodal model into its text model, a model attached after
    torch.compile), a sentence saying so; else ''."""
    base = _without_base_layers(name)
    for target in targets:
        if target.endswith("." + base):
            return (f"; this model names it {target!r}: the model attached has the extra prefix "
                    f"{target[:-len(base)]!r} (attach the module the adapter was trained on)")
        if base.endswith("." + target):
            return (f"; this model has {target!r}: the adapter was trained on a model with the extra prefix "
                    f"{base[:-len(target)]!r} (e.g. the causal LM or a multimodal model around the module "
                    f"attached here): attach that model")
    return ""


def _summary(experts_targets, linear_targets) -> str:
    names = list(experts_targets) + list(linear_targets)
    leaves = sorted({n.rpartition(".")[2] for n in names})
    return f"{len(names)} modules with leaf names {leaves}"


def _check_rank(module: str, config_name: str, rank: int, config: AdapterConfig) -> None:
    expected = config.rank_of(config_name)
    if rank != expected:
        raise _weights_error(f"{module!r} has rank {rank} but adapter_config.json gives rank {expected} "
                         f"for {config_name!r} (adapter made for another base model, e.g. another expert count?)")


def _linear_lora(module: str, a: Tensor, b: Tensor, target: LinearTarget, config: AdapterConfig) -> LinearLoRA:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != target.in_features or b.shape[0] != target.out_features \
            or a.shape[0] != b.shape[1]:
        raise _weights_error(
            f"{module!r} has lora_A {list(a.shape)} / lora_B {list(b.shape)}, expected [r, "
            f"{target.in_features}] / [{target.out_features}, r] (adapter made for another base model?)"
        )
    # a linear adapted through target_parameters ("self_attn.q_proj.weight"): PEFT matches rank_pattern /
    # alpha_pattern against the parameter's name, "<module>.weight"; through target_modules, against the module's
    key = f"{module}.weight" if any(_suffix_match(f"{module}.weight", t) for t in config.target_parameters) else module
    _check_rank(module, key, a.shape[0], config)
    return LinearLoRA(a=a, b=b * config.scaling_of(key))


def _without_base_layers(module: str) -> str:
    """``<experts>.base_layer(.base_layer...)`` -> ``<experts>`` (PEFT nests one wrapper per targeted parameter)."""
    while module.endswith(".base_layer"):
        module = module.removesuffix(".base_layer")
    return module


def _experts_from_3d(entries, target: ExpertsTarget, config: AdapterConfig, name: str) -> ExpertsLoRA:
    """3-D ``target_parameters`` pairs of one experts module -> :class:`ExpertsLoRA`."""
    E, H, I = target.num_experts, target.hidden, target.intermediate
    sides = {"gate_up_proj": (H, 2 * I), "down_proj": (I, H)}  # (input, output) of each projection
    out = ExpertsLoRA()
    for module, a, b in entries:
        d_a, d_b = (a.shape[1], b.shape[0]) if a.dim() == 2 and b.dim() == 2 else (None, None)
        param = next((p for p, (n_in, n_out) in sides.items() if {d_a, d_b} == {n_in, n_out}), None)
        if param is None or a.shape[0] % E or b.shape[1] % E or a.shape[0] != b.shape[1]:
            raise _weights_error(
                f"{module!r} has lora_A {list(a.shape)} / lora_B {list(b.shape)}, which match neither "
                f"gate_up_proj nor down_proj of a base with E={E}, H={H}, I={I} (adapter made for another base "
                f"model?)"
            )
        experts_names = {name, _without_base_layers(module)}
        targeted = [p for p in sides if any(_suffix_match(f"{n}.{p}", t) for n in experts_names
                                            for t in config.target_parameters)]
        if targeted and param not in targeted:  # the shapes of the other projection of another geometry
            raise _weights_error(
                f"{module!r} has lora_A {list(a.shape)} / lora_B {list(b.shape)}: the shapes of {param} of this "
                f"base (E={E}, H={H}, I={I}), but adapter_config.json's target_parameters adapt only {targeted} "
                f"here (adapter made for another base model, e.g. another hidden or intermediate size?)")
        n_in, n_out = sides[param]
        r = a.shape[0] // E
        _check_rank(module, f"{name}.{param}", r, config)
        a_r = a.reshape(E, r, d_a)                       # expert-major rows
        b_r = b.reshape(d_b, r, E).permute(2, 0, 1)      # expert-minor columns -> [E, d_b, r]
        if n_in != n_out:
            a_on_output = d_a == n_out
        else:
            rule = config.peft_3d_rule()
            if rule == "dim1":  # weight dim 1 is the output for [E, out, in] (concat), the input if transposed
                a_on_output = not is_transposed(target.layout)
            else:
                a_on_output = target.peft_a_on_output != (rule == "0.19.0")
        if a_on_output:  # delta = A^T B^T per expert: our A is PEFT's B^T, our B is PEFT's A^T
            a_r, b_r = b_r.transpose(1, 2), a_r.transpose(1, 2)
        b_r = b_r * config.scaling_of(f"{name}.{param}")
        if param == "gate_up_proj":
            if out.a13 is not None:
                raise _weights_error(f"two gate_up_proj LoRA pairs for {name!r}")
            out.a13, out.b13 = a_r.contiguous(), b_r.contiguous()
        else:
            if out.a2 is not None:
                raise _weights_error(f"two down_proj LoRA pairs for {name!r}")
            out.a2, out.b2 = a_r.contiguous(), b_r.contiguous()
    return out


def _stack_experts(experts: dict[int, tuple[str, Tensor, Tensor]], E: int, n_in: int, n_out: int,
                   config: AdapterConfig) -> tuple[Tensor, Tensor]:
    """Per-expert pairs of one projection -> ``A [E,r,in]``, scaled ``B [E,out,r]`` (zeros for absent experts).

    Experts may have ranks of their own (a per-expert ``rank_pattern`` such as ``{"experts.1.w2": 4}``, and
    ``alpha_pattern``: each expert's ``alpha / r`` is folded into its B): ``r`` is the largest, the others'
    factors zero-padded to it (their extra rows of A / columns of B are zero, so ``B A`` is unchanged)."""
    r = 0
    for module, a, b in experts.values():
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != n_in or b.shape[0] != n_out or a.shape[0] != b.shape[1]:
            raise _weights_error(f"{module!r} has lora_A {list(a.shape)} / lora_B {list(b.shape)}, expected "
                                 f"[r, {n_in}] / [{n_out}, r] (adapter made for another base model?)")
        _check_rank(module, module, a.shape[0], config)
        r = max(r, a.shape[0])
    dtype = next(iter(experts.values()))[1].dtype  # the parse dtype
    a_all, b_all = torch.zeros(E, r, n_in, dtype=dtype), torch.zeros(E, n_out, r, dtype=dtype)
    for e, (module, a, b) in experts.items():
        r_e = a.shape[0]
        a_all[e, :r_e], b_all[e, :, :r_e] = a, b * config.scaling_of(module)
    return a_all, b_all


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
        out.b13 = merge_gate_up(gate[1], up[1], target.layout, dim=1)  # [E, I, r] x 2 -> [E, 2I, r]
        return out
    # Separate A's: stack them and make B block-diagonal, so gate rows only see gate's rank and up rows up's.
    parts = [p for p in (gate, up) if p is not None]
    out.a13 = torch.cat([a for a, _ in parts], dim=1)
    r_total = out.a13.shape[1]
    r_gate = gate[0].shape[1] if gate is not None else 0
    gate_b = torch.zeros(E, I, r_total, dtype=out.a13.dtype)
    up_b = torch.zeros(E, I, r_total, dtype=out.a13.dtype)
    if gate is not None:
        gate_b[:, :, :r_gate] = gate[1]
    if up is not None:
        up_b[:, :, r_gate:] = up[1]
    out.b13 = merge_gate_up(gate_b, up_b, target.layout, dim=1)
    return out
