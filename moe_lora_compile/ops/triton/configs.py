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
     "pdl": false | true | "early" | "late" (programmatic dependent launch, see :mod:`.pdl`; default: env
            ``MOE_LORA_PDL``)}
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


def _gemm_split_k(programs: int, K: int, block_k: int, num_sms: int) -> int:
    """Split-K for a base GEMM whose tiles alone are ``programs``: enough slices for about two programs per SM,
    each slice at least 4 BLOCK_K steps, at most 8 (1 when the SM count is unknown)."""
    if num_sms <= 0 or programs >= 2 * num_sms:
        return 1
    return max(1, min(8, -(-2 * num_sms // programs), K // (4 * block_k)))


def default_config(E: int, H: int, I: int, R: int, T: int, k: int, num_sms: int = 0) -> dict:
    """Heuristic config when no tuned entry exists: per-pair blocks for tiny batches, BLOCK_M grows with the
    average number of pairs per expert, split-K for the shrink when there are few blocks, and (per-pair mode,
    ``num_sms`` known) split-K for the base GEMMs whose tiles are fewer than two per SM."""
    pairs = T * k
    per_pair = pairs * pairs <= 2 * E
    per_expert = pairs / E
    block_m = 16 if per_pair or per_expert <= 16 else 32 if per_expert <= 64 else 64 if per_expert <= 256 else 128
    small = per_pair or per_expert <= 16
    split_k = max(1, min(16, H // (4 * 128)))  # at most 4 K steps of 128 per shrink program

    def gemm(K: int) -> dict:
        return {"BLOCK_N": 64, "BLOCK_K": _even_block_k(K), "GROUP_SIZE_M": 1 if small else 8,
                "num_warps": 4, "num_stages": 4 if small else 3}

    w13, w2 = gemm(H), gemm(I)
    if per_pair:
        w13["SPLIT_K"] = _gemm_split_k(pairs * -(-I // 64), H, w13["BLOCK_K"], num_sms)
        w2["SPLIT_K"] = _gemm_split_k(pairs * -(-H // 64), I, w2["BLOCK_K"], num_sms)
    return {"per_pair": per_pair, "fuse_shrink2": per_pair, "BLOCK_M": block_m, "w13": w13, "w2": w2,
            "shrink": {"BLOCK_K": 128, "SPLIT_K": split_k, "num_warps": 4, "num_stages": 3}}


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (0 elsewhere)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


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
        return default_config(E, H, I, R, T, k, num_sms(device))
    sizes = sorted(int(t) for t in buckets)
    below = [t for t in sizes if t <= T]
    return buckets[str(below[-1] if below else sizes[0])]
