"""Kernel configs of the fused MoE layer: the typed config, its defaults, the PDL precedence, the tuned entries
shipped as JSON (``moe_lora_compile/configs/<gpu>.json``) and the heuristic fallback.

A JSON file (one per GPU name) maps a shape key ``E=..,H=..,I=..,R=..`` (R = the padded rank BLOCK_R; with a
``,W=mxfp4`` suffix for MXFP4 experts, tuned apart: ``tune --mxfp4``) to token buckets ``{"T": config}``; the
entry of the largest bucket <= T is used (:func:`pick_bucket`: the smallest if T is below all; from twice the largest
on, the heuristic); a missing rank bucket takes the nearest tuned rank of the same layer shape and weight format. An
entry is the JSON form of :class:`MoEKernelConfig` (:meth:`~MoEKernelConfig.to_dict` /
:meth:`~MoEKernelConfig.from_dict`); keys with a default may be left out::

    {"per_pair": bool, "BLOCK_M": int,
     "w13": {"BLOCK_N", "BLOCK_K", "GROUP_SIZE_M", "num_warps", "num_stages", "SPLIT_K" (default 1)},
     "w2":  {same keys; SPLIT_K only acts in per-pair mode with the fused top-k sum},
     "shrink": {"BLOCK_K", "SPLIT_K", "num_warps", "num_stages"},
     "fuse_shrink2": bool (default: per_pair), "fuse_topk_sum": bool (default true), "w13_overlap": bool
     (default true), "pdl": false | true | "early" | "late" (default: none, see :func:`requested_pdl`),
     "per_pair_shrink": bool (default: none = :func:`default_per_pair_shrink` for the call's T*k)}

Field names are the Triton meta-parameter names (``BLOCK_N``...), so a config reads like the launch it makes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import re
from typing import Any, Optional, Union

import torch
import triton

from ... import settings
from .moe_kernels import PDL_EARLY, PDL_LATE, PDL_OFF

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"
# The tuners (tune.py, tune_linear.py) reject a candidate config whose outputs differ more than this from the float32
# reference, however fast (bf16 layers of their inputs measure 2-4e-3; a wrong config, e.g. a miscompiled tile shape,
# is off by O(1)): :func:`output_error`.
MAX_REL_ERROR = 2e-2


def output_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative error (Frobenius norm) of a candidate config's ``out`` against the float32 ``expected``; inf where
    ``out`` is not finite."""
    out = out.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - expected).norm() / expected.norm().clamp_min(1e-30))

PdlSetting = Union[None, bool, str]  # a config's "pdl" or MOE_LORA_PDL: off / on (= late) / "early" / "late"


def _from_dict(cls, d: dict, what: str):
    """``cls(**d)`` with a ValueError naming unknown and missing keys."""
    if not isinstance(d, dict):
        raise TypeError(f"{what} must be a dict or a {cls.__name__}, got {type(d).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    unknown, missing = sorted(d.keys() - names), sorted(required - d.keys())
    if unknown or missing:
        raise ValueError(f"{what}: unknown keys {unknown}, missing keys {missing} (fields of {cls.__name__}: "
                         f"{sorted(names)})")
    return cls(**d)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tiles of one grouped GEMM kernel (w13 or w2). ``SPLIT_K``: slices of the K loop (the last program to
    arrive at a tile sums them, see :mod:`.launch`); 1 = no split."""

    BLOCK_N: int
    BLOCK_K: int
    GROUP_SIZE_M: int
    num_warps: int
    num_stages: int
    SPLIT_K: int = 1

    @classmethod
    def of(cls, value: Union["GemmConfig", dict], what: str = "gemm config") -> "GemmConfig":
        return value if isinstance(value, cls) else _from_dict(cls, value, what)


@dataclasses.dataclass(frozen=True)
class ShrinkConfig:
    """The LoRA shrink kernel: K tile and split-K slices (one fp32 partial per slice, summed by the consumer)."""

    BLOCK_K: int
    SPLIT_K: int
    num_warps: int
    num_stages: int

    @classmethod
    def of(cls, value: Union["ShrinkConfig", dict], what: str = "shrink config") -> "ShrinkConfig":
        return value if isinstance(value, cls) else _from_dict(cls, value, what)


@dataclasses.dataclass(frozen=True)
class MoEKernelConfig:
    """How ``fused_moe_lora_triton`` launches one layer (see :mod:`.launch` for what each switch does).

    ``per_pair``: one (token, expert) pair per row block, no routing (tiny batches); else pairs sorted per expert
    and slot into blocks of ``BLOCK_M`` rows. ``fuse_shrink2`` (default: ``per_pair``): the w2 LoRA shrink runs in
    the w13 kernel's epilogue. ``fuse_topk_sum`` (per-pair mode): the w2 kernel also sums a token's top-k rows.
    ``w13_overlap`` (with PDL): w13 streams its weights before waiting for shrink13. ``pdl``: see
    :func:`requested_pdl`. ``per_pair_shrink``: the LoRA shrinks run one program per (token, expert) pair
    (:func:`.moe_kernels.lora_shrink_pairs_kernel`) instead of one per row block; None (an entry tuned before the
    field existed, or a config that leaves it out) = :func:`default_per_pair_shrink` of the call.
    ``w2_sum_in_loop``: the w2 kernel sums the w2 shrink's rank-vector slices (one per w13 column tile with the
    fused shrink2) one slice a K step inside its main loop, instead of in a chain of loads after it (bf16 experts,
    w2 without split-K; True, the default since the H100 whole-step A/Bs of 2026-12-06: GPT-OSS-20B decode at
    batch 1 with 8 adapters 4.00 -> 3.94 ms a step on one H100, 3.95 both ways on a second, batch 8 unchanged on
    both; not measured on the H200)."""

    per_pair: bool
    BLOCK_M: int
    w13: GemmConfig
    w2: GemmConfig
    shrink: ShrinkConfig
    fuse_shrink2: Optional[bool] = None
    fuse_topk_sum: bool = True
    w13_overlap: bool = True
    pdl: PdlSetting = None
    per_pair_shrink: Optional[bool] = None
    w2_sum_in_loop: bool = True

    def __post_init__(self):
        if self.fuse_shrink2 is None:
            object.__setattr__(self, "fuse_shrink2", self.per_pair)
        if self.pdl is not None:
            parse_pdl(self.pdl)  # a bad value is an error now, not at the first launch
        if not isinstance(self.w2_sum_in_loop, bool):
            raise ValueError(f"w2_sum_in_loop must be true or false, got {self.w2_sum_in_loop!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "MoEKernelConfig":
        """The JSON form (see the module docstring) -> config; ValueError naming unknown or missing keys."""
        if not isinstance(d, dict):
            raise TypeError(f"config must be a dict or a MoEKernelConfig, got {type(d).__name__}")
        fields = dict(d)
        for key in ("w13", "w2"):
            if key in fields:
                fields[key] = GemmConfig.of(fields[key], f"config[{key!r}]")
        if "shrink" in fields:
            fields["shrink"] = ShrinkConfig.of(fields["shrink"], "config['shrink']")
        return _from_dict(cls, fields, "config")

    @classmethod
    def of(cls, value: Union["MoEKernelConfig", dict]) -> "MoEKernelConfig":
        return value if isinstance(value, cls) else cls.from_dict(value)

    def to_dict(self) -> dict:
        """The JSON form (``pdl`` and ``per_pair_shrink`` left out when unset, ``w2_sum_in_loop`` when True, its
        default)."""
        d = dataclasses.asdict(self)
        for key in ("pdl", "per_pair_shrink"):
            if d[key] is None:
                del d[key]
        if d["w2_sum_in_loop"]:
            del d["w2_sum_in_loop"]
        return d

    def uses_per_pair_shrink(self, num_pairs: int) -> bool:
        """Whether a call with ``num_pairs`` = T*k pairs runs the per-pair shrink (``per_pair_shrink``, or the
        heuristic where it is None)."""
        if self.per_pair_shrink is None:
            return default_per_pair_shrink(self.per_pair, num_pairs)
        return self.per_pair_shrink

    def replace(self, **changes: Any) -> "MoEKernelConfig":
        """A copy with ``changes``; a dotted name changes one field of a kernel's config:
        ``cfg.replace(**{"w13.SPLIT_K": 4, "pdl": False})``. ``fuse_shrink2`` keeps its value (pass it too when
        changing ``per_pair``)."""
        top = {k: v for k, v in changes.items() if "." not in k}
        for key, value in changes.items():
            if "." in key:
                kernel, field = key.split(".", 1)
                inner = top.get(kernel, getattr(self, kernel))
                top[kernel] = dataclasses.replace(inner, **{field: value})
        return dataclasses.replace(self, **top)


@dataclasses.dataclass(frozen=True)
class LinearKernelConfig:
    """How ``lora_linear_triton`` launches (see :func:`.launch.lora_linear_triton`): ``BLOCK_M`` token rows per
    program; ``gemm``: the GEMM with the LoRA expand in its epilogue (``SPLIT_K`` > 1: K slices, the last program of
    a tile sums them); ``shrink``: the LoRA shrink; ``per_token``: the per-token shrink (decode-sized batches,
    :mod:`.dense_kernels`) instead of the block shrink; ``gemv``: the GEMV kernel instead of the GEMM (a handful of
    tokens, at most :data:`GEMV_MAX_T`; it reads ``gemm``'s BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, not
    ``BLOCK_M`` or GROUP_SIZE_M, and always takes the per-token shrink; its ``num_stages`` >= 2 means loads one K
    step ahead, in registers); ``pdl``: see :func:`requested_pdl`; ``expand_slots`` (GEMM): the epilogue loads the
    B tiles of up to this many distinct adapter slots of a row block at once (one gathered load, one batched
    ``tl.dot``; capped by a register budget, :func:`.launch._expand_slots`), 1 (default) = one slot at a time (a B
    round trip per slot); ``spread_expand`` (split-K GEMM): the i-th distinct adapter slot of a row block is
    expanded by K slice ``i % SPLIT_K`` (each slice's program walks a share of the slots; the last arriver sums the
    slices as before) instead of every slot by slice 0 (True, the default; False: slice 0 expands them all).

    Dict form: ``{"BLOCK_M", "gemm": {...}, "shrink": {...}, "per_token", "gemv", "pdl", "expand_slots",
    "spread_expand"}`` (``per_token`` may also sit in ``shrink``, as older configs have it)."""

    BLOCK_M: int
    gemm: GemmConfig
    shrink: ShrinkConfig
    per_token: bool = False
    pdl: PdlSetting = None
    gemv: bool = False
    expand_slots: int = 1  # 8 (the grouped expand, 143-192 registers) ran GPT-OSS decode at batch 8 slower in
    # the whole model (H200, 2026-12-04: 9.67 against 8.85 ms a step before it, with the MoE rank masks in the
    # same tree): off until the tuner picks it for a shape (its stage 2 tries 1, 4, 8)
    spread_expand: bool = True  # H100 whole-step A/Bs (2026-12-06): GPT-OSS-20B decode at batch 8 with 8 adapters
    # 11.85 -> 11.65 ms a step on one H100, 11.66 both ways on a second; batch 1 takes the GEMV; H200 not measured

    def __post_init__(self):
        if self.pdl is not None:
            parse_pdl(self.pdl)
        if self.expand_slots not in EXPAND_SLOTS:
            raise ValueError(f"expand_slots must be one of {EXPAND_SLOTS}, got {self.expand_slots!r}")
        if not isinstance(self.spread_expand, bool):
            raise ValueError(f"spread_expand must be true or false, got {self.spread_expand!r}")

    @classmethod
    def of(cls, value: Union["LinearKernelConfig", dict]) -> "LinearKernelConfig":
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"config must be a dict or a LinearKernelConfig, got {type(value).__name__}")
        fields = dict(value)
        shrink = dict(fields.get("shrink", {}))
        if "per_token" in shrink:
            fields.setdefault("per_token", shrink.pop("per_token"))
        if "gemm" in fields:
            fields["gemm"] = GemmConfig.of(fields["gemm"], "config['gemm']")
        if "shrink" in fields:
            fields["shrink"] = ShrinkConfig.of(shrink, "config['shrink']")
        return _from_dict(cls, fields, "config")

    def to_dict(self) -> dict:
        """The JSON form (``pdl`` left out when unset, ``spread_expand`` when True, its default)."""
        d = dataclasses.asdict(self)
        if d["pdl"] is None:
            del d["pdl"]
        if d["spread_expand"]:
            del d["spread_expand"]
        return d

    def replace(self, **changes: Any) -> "LinearKernelConfig":
        """A copy with ``changes``; dotted names change one kernel's field: ``cfg.replace(**{"gemm.SPLIT_K": 4})``."""
        top = {k: v for k, v in changes.items() if "." not in k}
        for key, value in changes.items():
            if "." in key:
                kernel, field = key.split(".", 1)
                top[kernel] = dataclasses.replace(top.get(kernel, getattr(self, kernel)), **{field: value})
        return dataclasses.replace(self, **top)


# --- PDL: what is requested (whether it can run is :mod:`.pdl`'s business) -----------------------------------

_PDL_VALUES = {"0": PDL_OFF, "false": PDL_OFF, "off": PDL_OFF, "no": PDL_OFF, "1": PDL_LATE, "true": PDL_LATE,
               "on": PDL_LATE, "yes": PDL_LATE, "late": PDL_LATE, "early": PDL_EARLY}


def parse_pdl(value: Union[bool, str]) -> int:
    """A ``pdl`` setting (bool, or one of the strings of ``MOE_LORA_PDL``) -> PDL_OFF / PDL_EARLY / PDL_LATE."""
    if isinstance(value, bool):
        return PDL_LATE if value else PDL_OFF
    key = str(value).strip().lower()
    if key not in _PDL_VALUES:
        raise ValueError(f"PDL setting must be one of {sorted(_PDL_VALUES)} (or a bool), got {value!r}")
    return _PDL_VALUES[key]


def requested_pdl(config_pdl: PdlSetting, *, passed_by_caller: bool) -> int:
    """The PDL mode asked for, by precedence (the one place this is decided):

    1. the ``pdl`` of a config the caller passed to the launcher (a benchmark's on/off ablation);
    2. ``MOE_LORA_PDL``, when set (so the variable turns PDL off whatever the shipped tuning says);
    3. the ``pdl`` of the tuned entry (a config the launcher looked up itself: ``passed_by_caller=False``);
    4. late (:data:`PDL_LATE`).

    Whether the device can run it: :func:`.pdl.supported_mode`."""
    env = settings.PDL.raw()
    if passed_by_caller and config_pdl is not None:
        return parse_pdl(config_pdl)
    if env is not None and env.strip():  # (set but empty: as unset)
        try:
            return parse_pdl(env)
        except ValueError:
            raise ValueError(f"{settings.PDL.name}={env!r}: use one of {sorted(_PDL_VALUES)}") from None
    if config_pdl is not None:
        return parse_pdl(config_pdl)
    return PDL_LATE


# --- lookup --------------------------------------------------------------------------------------------------

def gpu_file_name(device_name: str) -> str:
    """'NVIDIA H200' -> 'NVIDIA_H200.json'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", device_name).strip("_") + ".json"


MXFP4_KEY_SUFFIX = ",W=mxfp4"  # shape keys of the MXFP4-expert entries (``fused_moe_lora_mxfp4``)


def shape_key(E: int, H: int, I: int, R: int, mxfp4: bool = False) -> str:
    """The table key of a layer shape at the padded rank; MXFP4 experts get their own entries (suffix
    :data:`MXFP4_KEY_SUFFIX`): their GEMMs decode 4-bit weights and want other tiles than bf16 ones."""
    return f"E={E},H={H},I={I},R={triton.next_power_of_2(max(R, 16))}" + (MXFP4_KEY_SUFFIX if mxfp4 else "")


def read_table(path: pathlib.Path) -> dict[str, dict[str, MoEKernelConfig]]:
    """A configs JSON file -> ``{shape key: {T bucket: config}}`` (empty when the file does not exist)."""
    if not path.exists():
        return {}
    raw = json.loads(path.read_text())
    try:
        return {shape: {T: MoEKernelConfig.from_dict(entry) for T, entry in buckets.items()}
                for shape, buckets in raw.items()}
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from error


def write_table(path: pathlib.Path, table: dict[str, dict[str, MoEKernelConfig]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = {shape: {T: cfg.to_dict() for T, cfg in buckets.items()} for shape, buckets in table.items()}
    path.write_text(json.dumps(raw, indent=1, sort_keys=True) + "\n")


@functools.lru_cache(maxsize=None)
def _load(device_name: Optional[str]) -> dict[str, dict[str, MoEKernelConfig]]:
    return {} if device_name is None else read_table(CONFIG_DIR / gpu_file_name(device_name))


def table_gpu(device: torch.device) -> Optional[str]:
    """The GPU whose tuned tables the ops read on ``device`` (``MOE_LORA_CONFIGS``): this device's own name
    (``auto``), None (``0``: the heuristics only), or the name it gives, which must have a table in
    :data:`CONFIG_DIR`."""
    value = settings.CONFIGS.value().strip()
    if value.lower() in ("", "auto"):
        return device_name(device)
    if value.lower() in ("0", "false", "off", "no"):
        return None
    if not any((CONFIG_DIR / f(value)).exists() for f in (gpu_file_name, linear_file_name)):
        have = sorted(p.name for p in CONFIG_DIR.glob("*.json"))
        raise ValueError(f"MOE_LORA_CONFIGS={value!r}: no table {gpu_file_name(value)} or "
                         f"{linear_file_name(value)} in {CONFIG_DIR} (there: {', '.join(have) or 'none'}); "
                         "use auto, 0 or one of those GPUs' names")
    return value


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device)


PAIR_SHRINK_MAX_PAIRS = 512  # the heuristic's per-pair shrink: sorted mode up to this many (token, expert) pairs


def per_pair_shrink_applies(per_pair: bool, num_pairs: int) -> bool:
    """Where the per-pair shrink is meant to run: sorted mode up to :data:`PAIR_SHRINK_MAX_PAIRS` pairs
    (decode-sized batches: blocks of few pairs and many slots, where the block shrink walks the slots serially;
    lora_linear's per-token shrink won ~37 us -> a few us in that case on the H200), not above, not in per-pair mode
    (one pair per block there: one slot, one dot)."""
    return not per_pair and num_pairs <= PAIR_SHRINK_MAX_PAIRS


def default_per_pair_shrink(per_pair: bool, num_pairs: int) -> bool:
    """The heuristic: :func:`per_pair_shrink_applies` (``MOE_LORA_PAIR_SHRINK=0``: the block shrink everywhere).
    Measured (H100, 2026-12-05, GPT-OSS-20B whole-model decode at batch 8, 32 pairs a layer, 8 adapters mixed, one
    process per value): 13.08 against 13.35 ms a step with adapters, the same 11.98 ms without; batch 1 (per-pair
    mode) unchanged; both runs had a router variant that was then removed (BENCHMARKS.md). Not timed between 64 and
    512 pairs."""
    return settings.PAIR_SHRINK.enabled() and per_pair_shrink_applies(per_pair, num_pairs)


def _even_block_k(K: int) -> int:
    """The largest of 128/64/32 that divides K (no K masks), else 64."""
    return next((b for b in (128, 64, 32) if K % b == 0), 64)


def default_config(E: int, H: int, I: int, R: int, T: int, k: int) -> MoEKernelConfig:
    """Heuristic config when no tuned entry exists: per-pair blocks for tiny batches, BLOCK_M grows with the
    average number of pairs per expert, split-K for the shrink when there are few blocks. No split-K for the base
    GEMMs: on the H200 the tuner found none that paid at decode (2026-12-03, BENCHMARKS.md)."""
    pairs = T * k
    per_pair = pairs * pairs <= 2 * E
    per_expert = pairs / E
    block_m = 16 if per_pair or per_expert <= 16 else 32 if per_expert <= 64 else 64 if per_expert <= 256 else 128
    small = per_pair or per_expert <= 16
    split_k = max(1, min(16, H // (4 * 128)))  # at most 4 K steps of 128 per shrink program

    def gemm(K: int) -> GemmConfig:
        return GemmConfig(BLOCK_N=64, BLOCK_K=_even_block_k(K), GROUP_SIZE_M=1 if small else 8, num_warps=4,
                          num_stages=4 if small else 3)

    return MoEKernelConfig(per_pair=per_pair, BLOCK_M=block_m, w13=gemm(H), w2=gemm(I),
                           shrink=ShrinkConfig(BLOCK_K=128, SPLIT_K=split_k, num_warps=4, num_stages=3),
                           per_pair_shrink=default_per_pair_shrink(per_pair, pairs))


def default_mxfp4_config(E: int, H: int, I: int, R: int, T: int, k: int) -> MoEKernelConfig:
    """Heuristic for MXFP4 experts without a tuned entry: :func:`default_config`'s routing and shrink, GEMM tiles
    for a decode-bound loop (sm_90 SASS: ~5 instructions per weight value, so the tiles that keep registers low
    and programs many): w13 32 gate/up column pairs x 128 inputs (64 weight rows), w2 64 x 128, K steps of 128
    where K allows it without a mask, else of 64."""
    cfg = default_config(E, H, I, R, T, k)
    block_k13, block_k2 = (128 if K % 128 == 0 else _even_block_k(K) for K in (H, I))
    return cfg.replace(**{"w13.BLOCK_N": 32, "w13.BLOCK_K": block_k13, "w2.BLOCK_K": block_k2})


def _rank_buckets(table: dict, E: int, H: int, I: int, R: int, mxfp4: bool) -> Optional[dict]:
    """The T buckets of ``table`` for this shape at the padded rank R, else at the nearest tuned rank of the same
    shape and weight format; None if neither."""
    key = shape_key(E, H, I, R, mxfp4)
    if key in table:
        return table[key]
    prefix = shape_key(E, H, I, R).rsplit(",R=", 1)[0] + ",R="
    suffix = MXFP4_KEY_SUFFIX if mxfp4 else ""
    ranks = sorted(int(rest[: len(rest) - len(suffix)]) for rest in
                   (key[len(prefix):] for key in table if key.startswith(prefix))
                   if rest.endswith(suffix) and rest[: len(rest) - len(suffix)].isdigit())
    if not ranks:
        return None
    return table[prefix + str(min(ranks, key=lambda r: abs(r - R))) + suffix]


def pick_bucket(buckets: Optional[dict], T: int):
    """The entry of ``buckets`` (``{"T": config}``) for T tokens: the largest tuned T <= T (the smallest for T below
    all), or None (the heuristic) for T at twice the largest tuned T or more: an entry tuned for far fewer tokens
    has the tiles of a smaller GEMM (H100, MXFP4 GPT-OSS-20B layer at T=512, one process: the T=32 entry took 1120 us,
    the heuristic 838; at T=128 402 against 418, where an entry of that T now exists; BENCHMARKS.md, 2026-12-07)."""
    if not buckets:
        return None
    sizes = sorted(int(t) for t in buckets)
    if T >= 2 * sizes[-1]:
        return None
    below = [t for t in sizes if t <= T]
    return buckets[str(below[-1] if below else sizes[0])]


def get_config(device: torch.device, E: int, H: int, I: int, R: int, T: int, k: int,
               mxfp4: bool = False) -> MoEKernelConfig:
    """The tuned config for this GPU and shape bucket (``per_pair_shrink`` filled in by
    :func:`default_per_pair_shrink` where the entry lacks it), else :func:`default_config`
    (:func:`default_mxfp4_config` for MXFP4 experts, whose entries are their own: ``mxfp4``)."""
    found = pick_bucket(_rank_buckets(_load(table_gpu(device)), E, H, I, R, mxfp4), T)
    if found is None:
        return (default_mxfp4_config if mxfp4 else default_config)(E, H, I, R, T, k)
    if found.per_pair_shrink is None:
        found = _with_per_pair_shrink(found, default_per_pair_shrink(found.per_pair, T * k))
    return found


@functools.lru_cache(maxsize=256)
def _with_per_pair_shrink(cfg: MoEKernelConfig, value: bool) -> MoEKernelConfig:
    return cfg.replace(per_pair_shrink=value)  # cached: get_config runs on every eager call of the op


# --- lora_linear: heuristic, tuned table, lookup ------------------------------------------------------------
#
# The tuned table is its own JSON file per GPU, ``configs/<gpu>_linear.json`` (written by :mod:`.tune_linear`):
# ``{"N=..,K=..,R=..": {"T": config}}`` (N = out features, K = in features, R = the padded rank BLOCK_R), an entry
# the dict form of :class:`LinearKernelConfig`. Whether tokens have an adapter is data (ids of -1), so one entry
# serves both; the tuner picks it on the time with and without LoRA together.

EXPAND_SLOTS = (1, 2, 4, 8, 16)  # LinearKernelConfig.expand_slots: slots per gathered B load (a power of 2)
ROWS_SHRINK_MAX_T = 64  # up to this many tokens lora_linear's shrink runs per token (dense_kernels), else per block
GEMV_MAX_T = 8  # a ``gemv`` config is honoured up to this many tokens (its registers grow with T); else the GEMM
GEMV_DEFAULT_MAX_T = 4  # the heuristic picks the GEMV up to this many tokens
# The heuristic's per-token shrink splits K at most this many ways: the consumer's epilogue sums one slice per split
# after its main loop, and with the shrink overlapping that loop (MOE_LORA_EARLY_SHRINK) a longer shrink program
# costs nothing. H200, GPT-OSS-20B whole step with 8 adapters (2026-12-06, tables): 8 slices instead of the tuned
# 11-32 (and 8 instead of 16 for the MoE shrink) took 0.13 / 0.17 ms off the batch-1 / batch-8 step, 4 slices
# less (BENCHMARKS.md). The H100 was not measured.
ROWS_SHRINK_MAX_SPLIT = 8


def default_linear_config(T: int, n_in: int = 4096, n_out: int = 4096, num_sms: int = 132) -> LinearKernelConfig:
    """Heuristic ``lora_linear`` config. T <= :data:`GEMV_DEFAULT_MAX_T`: the GEMV (32 columns x 128 K steps a
    program for T <= 2, 16 columns for more tokens, so its [T, BLOCK_N, BLOCK_K] fp32 accumulator stays at 32 per
    thread; split-K to about 4 programs per SM; no register prefetch: occupancy keeps the loads in flight). Other
    decode sizes (T <= 64) are a skinny GEMM that streams the
    weight once: 64-wide column tiles (32 for outputs under 1024), K steps of 128, and split-K so that about two
    programs per SM stream the weight (each slice at least 2 K steps); the per-token shrink splits K the same way, in
    at most :data:`ROWS_SHRINK_MAX_SPLIT` slices.
    Larger batches: 64x64 tiles, block shrink, no split."""
    small = T <= ROWS_SHRINK_MAX_T
    gemv = T <= GEMV_DEFAULT_MAX_T
    block_m = 16 if small else 64
    grid_m = triton.cdiv(T, block_m)
    if gemv:
        block_n = 32 if T <= 2 else 16
    else:
        block_n = 64 if (not small or n_out >= 1024) else 32
    block_k = 128 if small else 64
    split_k = 1
    if small:
        tiles = (1 if gemv else grid_m) * triton.cdiv(n_out, block_n)
        split_k = max(1, min(triton.cdiv((4 if gemv else 2) * num_sms, tiles), triton.cdiv(n_in, 2 * block_k)))
    rows_split = max(1, min(triton.cdiv(n_in, 128), triton.cdiv(2 * num_sms, max(T, 1)), ROWS_SHRINK_MAX_SPLIT))
    return LinearKernelConfig(
        BLOCK_M=block_m, per_token=small, gemv=gemv,
        gemm=GemmConfig(BLOCK_N=block_n, BLOCK_K=block_k, GROUP_SIZE_M=8, num_warps=4,
                        num_stages=1 if gemv else 4 if small else 3, SPLIT_K=split_k),
        shrink=ShrinkConfig(BLOCK_K=128 if small else 64, SPLIT_K=rows_split if small else 1, num_warps=4,
                            num_stages=2))


def linear_file_name(device_name: str) -> str:
    """'NVIDIA H200' -> 'NVIDIA_H200_linear.json'."""
    return gpu_file_name(device_name)[: -len(".json")] + "_linear.json"


def linear_shape_key(n_in: int, n_out: int, R: int) -> str:
    return f"N={n_out},K={n_in},R={triton.next_power_of_2(max(R, 16))}"


def read_linear_table(path: pathlib.Path) -> dict[str, dict[str, LinearKernelConfig]]:
    """A linear configs JSON file -> ``{shape key: {T bucket: config}}`` (empty when the file does not exist)."""
    if not path.exists():
        return {}
    raw = json.loads(path.read_text())
    try:
        return {shape: {T: LinearKernelConfig.of(entry) for T, entry in buckets.items()}
                for shape, buckets in raw.items()}
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from error


def write_linear_table(path: pathlib.Path, table: dict[str, dict[str, LinearKernelConfig]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = {shape: {T: cfg.to_dict() for T, cfg in sorted(buckets.items(), key=lambda kv: int(kv[0]))}
           for shape, buckets in table.items()}
    path.write_text(json.dumps(raw, indent=1, sort_keys=True) + "\n")


@functools.lru_cache(maxsize=None)
def _load_linear(device_name: Optional[str]) -> dict[str, dict[str, LinearKernelConfig]]:
    return {} if device_name is None else read_linear_table(CONFIG_DIR / linear_file_name(device_name))


def lookup_linear(table: dict[str, dict[str, LinearKernelConfig]], T: int, n_in: int, n_out: int,
                  R: int) -> Optional[LinearKernelConfig]:
    """The entry of ``table`` for T tokens, or None. Shape: ``(n_out, n_in)`` at the padded rank R, else the nearest
    tuned rank of that shape. Bucket: :func:`pick_bucket`. None (the heuristic) also for a GEMV entry at
    T > :data:`GEMV_MAX_T`."""
    key = linear_shape_key(n_in, n_out, R)
    buckets = table.get(key)
    if not buckets:
        prefix = key.rsplit(",R=", 1)[0] + ",R="
        ranks = sorted(int(k.rsplit("=", 1)[1]) for k in table if k.startswith(prefix))
        if ranks:
            buckets = table[prefix + str(min(ranks, key=lambda r: abs(r - R)))]
    found = pick_bucket(buckets, T)
    return None if found is not None and found.gemv and T > GEMV_MAX_T else found  # a GEMV entry past its sizes


def get_linear_config(device: torch.device, T: int, n_in: int, n_out: int, R: int,
                      num_sms: int = 132) -> LinearKernelConfig:
    """The tuned ``lora_linear`` config for this GPU, shape and T bucket (:func:`lookup_linear`), else
    :func:`default_linear_config`."""
    found = lookup_linear(_load_linear(table_gpu(device)), T, n_in, n_out, R)
    return found if found is not None else default_linear_config(T, n_in, n_out, num_sms)
