"""Tune the fused MoE multi-LoRA kernels for one model on this GPU and write the configs JSON.

    python -m moe_lora_compile tune --model qwen3-30b-a3b --tokens 1 8 32 128 512 2048 --ranks 16 \
        [--out moe_lora_compile/configs/NVIDIA_H200.json]

Coordinate descent from the heuristic default (:func:`.configs.default_config`), or with
``--start shipped`` from the entry already in the file: routing mode and BLOCK_M, whether the w2 shrink is fused
into w13, then the w13 tiles and split-K, the w2 tiles and split-K, the shrink's kind (per pair or per row block,
``per_pair_shrink``) and split-K, w2 summing the rank-vector slices in its main loop (``w2_sum_in_loop``), then
PDL (off / late / early); ``--groups`` limits the search to some of these
coordinates (names in ``GROUPS``). Each candidate is timed as the median of ``triton.testing.do_bench`` over a
CUDA-graph replay of the whole layer (bf16, L=4 slots, every token with an adapter), once its outputs are checked
against the float32 reference (a candidate off by more than ``configs.MAX_REL_ERROR`` is rejected). Entries are merged into the
output file under the GPU name and ``E=..,H=..,I=..,R=..`` shape key, after every (T, R), so a run cut short keeps
what it tuned.

``--mxfp4`` tunes the MXFP4-expert path (``fused_moe_lora_mxfp4``: random weights quantized with
:func:`..mxfp4.quantize_mxfp4`; a transposed-layout model such as gpt-oss-20b) from
:func:`.configs.default_mxfp4_config`, GEMM coordinates first and K tiles up to 256 (a byte holds two values), into
entries of their own (shape key ``...,W=mxfp4``). ``--budget-s SECONDS`` bounds the whole run: each (T, R) gets an
equal share of the time left and stops its descent when that is spent, keeping its best config so far (a candidate's
first call compiles its kernels, a few seconds each; the run may overshoot by one candidate)::

    python -m moe_lora_compile tune --model gpt-oss-20b --mxfp4 --tokens 1 8 32 --ranks 16 --budget-s 100
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import torch

from ...__main__ import OneLineParser, positive_int
from ...shapes import MODELS, MoEGeometry
from ..layout import is_transposed, w13_shape, w2_shape

try:  # triton comes with CUDA builds of torch; a CPU install may lack it (main() says so in one line)
    import triton

    from .configs import (CONFIG_DIR, MAX_REL_ERROR, MoEKernelConfig, default_config, default_mxfp4_config,
                          device_name, gpu_file_name, output_error, read_table, shape_key, write_table)
    from .launch import fused_moe_lora_mxfp4_triton, fused_moe_lora_triton
    from ..reference import fused_moe_lora_reference
except ImportError as _error:
    triton = None
    _TRITON_ERROR = str(_error)

PROG = "moe-lora-compile tune"
GEMM_CHOICES = {"BLOCK_N": (16, 32, 64, 128), "BLOCK_K": (64, 128), "warps_stages": ((4, 3), (4, 4), (8, 3), (4, 2)),
                "GROUP_SIZE_M": (1, 8), "SPLIT_K": (1, 2, 3, 4, 6, 8)}
SPLIT_K_CHOICES = (1, 4, 8, 16, 32)
PDL_CHOICES = (False, "late", "early")
MXFP4_BLOCK_K_CHOICES = (64, 128, 256)  # MXFP4 K tiles: 32 bytes of a weight row per 64 inputs


def _inputs(g: MoEGeometry, T: int, L: int, R: int, seed: int, mxfp4: bool = False, device: str = "cuda",
            dtype: torch.dtype = torch.bfloat16):
    """(args, kwargs) of :func:`.launch.fused_moe_lora_triton`, or with ``mxfp4`` of
    :func:`.launch.fused_moe_lora_mxfp4_triton` (the weights quantized: blocks, scales in place of each)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device=device, generator=gen, dtype=dtype) * 0.05
    w13, w2 = rnd(*w13_shape(g.layout, g.E, g.H, g.I)), rnd(*w2_shape(g.layout, g.E, g.H, g.I))
    weights_args = (w13, w2)
    if mxfp4:
        from ..mxfp4 import quantize_mxfp4

        q13, q2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
        weights_args = (q13.blocks, q13.scales, q2.blocks, q2.scales)
    lora = (rnd(L, g.E, R, g.H), rnd(L, g.E, 2 * g.I, R), rnd(L, g.E, R, g.I), rnd(L, g.E, g.H, R))
    x = rnd(T, g.H) * 20
    weights, ids = torch.topk(torch.rand(T, g.E, device=device, generator=gen), g.k, dim=-1)
    lora_ids = torch.randint(0, L, (T,), device=device, generator=gen, dtype=torch.int32)
    bias = dict(w13_bias=rnd(g.E, 2 * g.I), w2_bias=rnd(g.E, g.H)) if g.bias else {}
    return (x, ids.to(torch.int32), weights.to(dtype), lora_ids, *weights_args, *lora), dict(
        layout=g.layout, activation=g.activation, **bias)


def _reference(args: tuple, kwargs: dict, mxfp4: bool = False) -> torch.Tensor:
    """The layer of ``_inputs``' (args, kwargs) in float32 PyTorch (:func:`..reference.fused_moe_lora_reference`;
    MXFP4 weights dequantized first): y [T, H] float32."""
    if mxfp4:
        from ..mxfp4 import dequantize_mxfp4

        x, ids, weights, lora_ids, b13, s13, b2, s2, *lora = args
        args = (x, ids, weights, lora_ids, dequantize_mxfp4(b13, s13, torch.float32),
                dequantize_mxfp4(b2, s2, torch.float32), *lora)
    up = lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    return fused_moe_lora_reference(*map(up, args), **{key: up(value) for key, value in kwargs.items()})


def _output_error(args_sets, expected, cfg, mxfp4: bool = False) -> float:
    """The largest :func:`.configs.output_error` of ``cfg``'s outputs against ``expected`` (:func:`_reference` of
    each input set)."""
    launch = fused_moe_lora_mxfp4_triton if mxfp4 else fused_moe_lora_triton
    return max(output_error(launch(*args, **kwargs, config=cfg), ref) for (args, kwargs), ref in zip(args_sets, expected))


def _time(args_sets, cfg, mxfp4: bool = False) -> float:
    """us per layer call, median over CUDA-graph replays of one call per input set."""
    launch = fused_moe_lora_mxfp4_triton if mxfp4 else fused_moe_lora_triton
    calls = [lambda a=a, kw=kw: launch(*a, **kw, config=cfg) for a, kw in args_sets]
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    ms = triton.testing.do_bench(graph.replay, warmup=3, rep=20, return_mode="median")
    return ms * 1e3 / len(calls)


GROUPS = ("mode", "fuse_shrink2", "w13.BLOCK_N", "w13.BLOCK_K", "w13.warps_stages", "w13.GROUP_SIZE_M",
          "w13.SPLIT_K", "w2.BLOCK_N", "w2.BLOCK_K", "w2.warps_stages", "w2.GROUP_SIZE_M", "w2.SPLIT_K",
          "per_pair_shrink", "shrink.SPLIT_K", "w2_sum_in_loop", "pdl")
# MXFP4: the decode-bound GEMMs first (a --budget-s cut drops the least likely wins, at the end)
MXFP4_GROUPS = ("mode", "w13.BLOCK_N", "w13.BLOCK_K", "w13.warps_stages", "w13.SPLIT_K", "w2.BLOCK_N", "w2.BLOCK_K",
                "w2.warps_stages", "w2.SPLIT_K", "fuse_shrink2", "w13.GROUP_SIZE_M", "w2.GROUP_SIZE_M",
                "per_pair_shrink", "shrink.SPLIT_K", "w2_sum_in_loop", "pdl")


def _candidates(cfg: MoEKernelConfig, T: int, g: MoEGeometry, group: str, mxfp4: bool = False):
    """Variants of ``cfg`` along one coordinate ``group`` (``mxfp4``: MXFP4 K tiles)."""
    if group == "mode":
        pairs = T * g.k
        if pairs <= 64:
            yield cfg.replace(per_pair=True, BLOCK_M=16)
        for bm in (16, 32, 64, 128):
            if bm == 16 or pairs / g.E >= bm / 4:
                yield cfg.replace(per_pair=False, BLOCK_M=bm)
        return
    if group == "pdl":
        for value in PDL_CHOICES:
            yield cfg.replace(pdl=value)
        return
    if group == "w2.SPLIT_K" and not cfg.per_pair:
        return  # w2 split-K acts only on the per-pair path (inside the fused top-k sum)
    if group == "fuse_shrink2":
        yield cfg.replace(fuse_shrink2=not cfg.fuse_shrink2)
        return
    if group == "w2_sum_in_loop":  # (it acts on bf16 experts, w2 without split-K: an MXFP4 run times it as is)
        yield cfg.replace(w2_sum_in_loop=not cfg.w2_sum_in_loop)
        return
    if group == "per_pair_shrink":  # the other shrink kernel (cfg's own choice resolved for these T*k pairs)
        yield cfg.replace(per_pair_shrink=not cfg.uses_per_pair_shrink(T * g.k))
        return
    if group == "shrink.SPLIT_K":
        for split in SPLIT_K_CHOICES:
            yield cfg.replace(**{"shrink.SPLIT_K": split})
        return
    kernel, key = group.split(".")
    for value in MXFP4_BLOCK_K_CHOICES if mxfp4 and key == "BLOCK_K" else GEMM_CHOICES[key]:
        if key == "warps_stages":
            yield cfg.replace(**{f"{kernel}.num_warps": value[0], f"{kernel}.num_stages": value[1]})
        else:
            yield cfg.replace(**{group: value})


def tune_one(g: MoEGeometry, T: int, R: int, L: int = 4, start: MoEKernelConfig | None = None,
             groups: tuple = GROUPS, mxfp4: bool = False,
             budget_s: float | None = None, device: str = "cuda",
             dtype: torch.dtype = torch.bfloat16) -> tuple[MoEKernelConfig, float, float]:
    """-> (best config, its us, the starting config's us) for T tokens, rank R; ``start`` defaults to the
    heuristic config (of the MXFP4 path with ``mxfp4``). ``budget_s``: no new candidate after that many seconds.
    ``device`` / ``dtype``: of the inputs (the tests run the CPU interpreter in float32)."""
    t0 = time.time()
    args_sets = [_inputs(g, T, L, R, seed, mxfp4, device, dtype) for seed in (1, 2)]
    best = start or (default_mxfp4_config if mxfp4 else default_config)(g.E, g.H, g.I, R, T, g.k)
    if best.per_pair_shrink is None:  # a shipped entry from before the field: the heuristic, made explicit
        best = best.replace(per_pair_shrink=best.uses_per_pair_shrink(T * g.k))
    expected = [_reference(args, kwargs, mxfp4) for args, kwargs in args_sets]
    error = _output_error(args_sets, expected, best, mxfp4)
    if not error <= MAX_REL_ERROR:
        raise RuntimeError(f"{g.name} T={T} R={R}: the starting config's outputs are {error:.3g} off the float32 "
                           f"reference (relative; the limit is {MAX_REL_ERROR}): {best.to_dict()}")
    best_us = default_us = _time(args_sets, best, mxfp4)
    for group in groups:  # coordinate descent: each group varies the best config so far
        for cfg in _candidates(best, T, g, group, mxfp4):
            if cfg == best:
                continue
            if budget_s is not None and time.time() - t0 > budget_s:
                print(f"    budget of {budget_s:.0f} s spent: stopped before {group}", flush=True)
                return best, best_us, default_us
            try:
                error = _output_error(args_sets, expected, cfg, mxfp4)
                if not error <= MAX_REL_ERROR:  # checked before it is timed: a wrong config is never kept
                    print(f"    {group}: rejected, outputs {error:.3g} off the float32 reference (relative): "
                          f"{json.dumps(cfg.to_dict())}", flush=True)
                    continue
                us = _time(args_sets, cfg, mxfp4)
            except Exception as exc:  # e.g. out of shared memory for a tile/stage combination
                print(f"    {group}: skipped ({type(exc).__name__})", flush=True)
                continue
            if us < best_us:
                best, best_us = cfg, us
                print(f"    {group}: {us:.1f} us (better)", flush=True)
    return best, best_us, default_us


def main(argv=None):
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, choices=sorted(MODELS), help="the model geometry to tune for")
    p.add_argument("--tokens", nargs="+", type=positive_int, default=[1, 8, 32, 128, 512, 2048], metavar="T",
                   help="token counts (default 1 8 32 128 512 2048)")
    p.add_argument("--ranks", nargs="+", type=positive_int, default=[16, 64], metavar="R",
                   help="LoRA ranks (default 16 64)")
    p.add_argument("--out", help="JSON file to merge into (default: the package's file for this GPU)")
    p.add_argument("--start", choices=("default", "shipped"), default="default",
                   help="start from the heuristic config, or from the entry already in the file for this T")
    p.add_argument("--groups", nargs="+", choices=GROUPS, default=None, metavar="GROUP",
                   help=f"coordinates to search, in order (default all: {' '.join(GROUPS)}; with --mxfp4: "
                        f"{' '.join(MXFP4_GROUPS)})")
    p.add_argument("--mxfp4", action="store_true",
                   help="tune the MXFP4-expert path (fused_moe_lora_mxfp4; entries under the ',W=mxfp4' shape key)")
    p.add_argument("--budget-s", type=float, default=None, metavar="SECONDS",
                   help="time for the whole run: each (T, R) gets an equal share of what is left and keeps its best "
                        "config so far when it is spent (default: no limit)")
    a = p.parse_args(argv)
    if a.budget_s is not None and not a.budget_s > 0:
        p.error(f"--budget-s must be > 0, got {a.budget_s}")
    if a.out is not None:  # written after the first shape is tuned: an unusable path would cost that time
        folder = os.path.dirname(os.path.abspath(a.out))
        if os.path.isdir(a.out):
            p.error(f"--out {a.out}: a folder; name the JSON file to merge into (e.g. {os.path.join(a.out, 'x.json')})")
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            p.error(f"--out {a.out}: {folder} is not a writable folder")
    groups = tuple(a.groups or (MXFP4_GROUPS if a.mxfp4 else GROUPS))
    if not torch.cuda.is_available():
        build = "this torch is a CPU build" if torch.version.cuda is None else "no CUDA device is visible"
        print(f"{PROG}: error: tuning times the Triton kernels on a CUDA GPU, and CUDA is not "
              f"available ({build})", file=sys.stderr)
        return 2
    if triton is None:
        print(f"{PROG}: error: triton is not installed ({_TRITON_ERROR}); "
              "pip install 'triton>=3.6'", file=sys.stderr)
        return 2
    g = MODELS[a.model]
    if a.mxfp4 and not is_transposed(g.layout):
        print(f"{PROG}: error: --mxfp4 needs a model whose experts are stored [E, in, out] (MXFP4 blocks are "
              f"GPT-OSS's layout), got {g.name} ({g.layout})", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    name = device_name(device)
    out = pathlib.Path(a.out) if a.out else CONFIG_DIR / gpu_file_name(name)
    table = read_table(out)
    total = len(a.tokens) * len(a.ranks)
    step = 0
    run_start = time.time()
    for R in a.ranks:
        entries = table.setdefault(shape_key(g.E, g.H, g.I, R, a.mxfp4), {})
        for T in a.tokens:
            step += 1
            t0 = time.time()
            print(f"[{step}/{total}] {name} {g.name}{' MXFP4' if a.mxfp4 else ''} T={T} R={R}", flush=True)
            start = entries.get(str(T)) if a.start == "shipped" else None
            share = None if a.budget_s is None else max(0.0, a.budget_s - (t0 - run_start)) / (total - step + 1)
            cfg, us, default_us = tune_one(g, T, R, start=start, groups=groups, mxfp4=a.mxfp4, budget_s=share)
            entries[str(T)] = cfg
            print(f"[{step}/{total}] T={T} R={R}: {us:.1f} us ({'shipped' if start else 'default'} "
                  f"{default_us:.1f} us) "
                  f"in {time.time() - t0:.0f} s: {json.dumps(cfg.to_dict())}", flush=True)
            write_table(out, table)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
