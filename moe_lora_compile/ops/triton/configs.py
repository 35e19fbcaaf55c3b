"""Kernel configs: tuned entries shipped as JSON (``moe_lora_compile/configs/<gpu>.json``), heuristic fallback.

A JSON file (one per GPU name) maps a shape key ``E=..,H=..,I=..,R=..`` (R = the padded rank BLOCK_R) to token
buckets ``{"T": config}``; the entry of the largest bucket <= T is used (the smallest if T is below all); a
missing rank bucket takes the nearest tuned rank of the same layer shape. A config::

    {"per_pair": bool, "BLOCK_M": int, "fuse_shrink2": bool (optional, default per_pair),
     "w13": {"BLOCK_N", "BLOCK_K", "GROUP_SIZE_M", "num_warps", "num_stages", "SPLIT_K" (optional, default 1)},
     "w2":  {same keys; SPLIT_K only acts in per-pair mode with the fused top-k sum},
     "shrink": {"BLOCK_K", "SPLIT_K", "num_warps", "num_stages"},
     optional, per-pair mode with k > 1 only:
     "fuse_topk_sum": bool (default true: the w2 kernel also does the top-k sum, no separate sum launch),
     optional anywhere:
     "w13_overlap": bool (default true: with PDL, w13 streams its weights before waiting for shrink13),
     "pdl": false | true | "early" | "late" (programmatic dependent launch, see :mod:`.pdl`; without it: env
            ``MOE_LORA_PDL``, default late; in a tuned entry it yields to ``MOE_LORA_PDL`` when that is set)}
"""

from __future__ import annotations

import functools
import json
import pathlib
import re

import torch
import triton

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"


def gpu_file_name(device_name: str) -> str:
    """'NVIDIA H200' -> 'NVIDIA_H200.json'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", device_name).strip("_") + ".json"


def shape_key(E: int, H: int, I: int, R: int) -> str:
    return f"E={E},H={H},I={I},R={triton.next_power_of_2(max(R, 16))}"


@functools.lru_cache(maxsize=None)
def _load(device_name: str) -> dict:
    path = CONFIG_DIR / gpu_file_name(device_name)
    if not path.exists():
        return {}
    return json.loads(path.read_text())


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device)


def _even_block_k(K: int) -> int:
    """The largest of 128/64/32 that divides K (no K masks), else 64."""
    return next((b for b in (128, 64, 32) if K % b == 0), 64)


def default_config(E: int, H: int, I: int, R: int, T: int, k: int) -> dict:
    """Heuristic config when no tuned entry exists: per-pair blocks for tiny batches, BLOCK_M grows with the
    average number of pairs per expert, split-K for the shrink when there are few blocks. No split-K for the base
    GEMMs: on the H200 the tuner found none that paid at decode (2026-12-03, BENCHMARKS.md)."""
    pairs = T * k
    per_pair = pairs * pairs <= 2 * E
    per_expert = pairs / E
    block_m = 16 if per_pair or per_expert <= 16 else 32 if per_expert <= 64 else 64 if per_expert <= 256 else 128
    small = per_pair or per_expert <= 16
    split_k = max(1, min(16, H // (4 * 128)))  # at most 4 K steps of 128 per shrink program

    def gemm(K: int) -> dict:
        return {"BLOCK_N": 64, "BLOCK_K": _even_block_k(K), "GROUP_SIZE_M": 1 if small else 8,
                "num_warps": 4, "num_stages": 4 if small else 3}

    return {"per_pair": per_pair, "fuse_shrink2": per_pair, "BLOCK_M": block_m, "w13": gemm(H), "w2": gemm(I),
            "shrink": {"BLOCK_K": 128, "SPLIT_K": split_k, "num_warps": 4, "num_stages": 3}}


def get_config(device: torch.device, E: int, H: int, I: int, R: int, T: int, k: int) -> dict:
    """The tuned config for this GPU and shape bucket, else :func:`default_config`."""
    table = _load(device_name(device))
    buckets = table.get(shape_key(E, H, I, R))
    if not buckets:  # the nearest tuned rank of the same layer shape
        prefix = shape_key(E, H, I, R).rsplit(",R=", 1)[0] + ",R="
        ranks = sorted(int(key.rsplit("=", 1)[1]) for key in table if key.startswith(prefix))
        if ranks:
            buckets = table[prefix + str(min(ranks, key=lambda r: abs(r - R)))]
    if not buckets:
        return default_config(E, H, I, R, T, k)
    sizes = sorted(int(t) for t in buckets)
    below = [t for t in sizes if t <= T]
    return buckets[str(below[-1] if below else sizes[0])]
