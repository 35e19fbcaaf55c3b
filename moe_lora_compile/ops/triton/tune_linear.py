"""Tune ``lora_linear`` (the dense multi-LoRA projection) at decode sizes on this GPU and write its configs table.

    python -m moe_lora_compile.ops.triton.tune_linear [--out /tmp/NVIDIA_H200_linear.json] [--budget-s 170]

Shapes: the fused q/k/v and the o projection of each ``--models`` entry (:data:`moe_lora_compile.shapes.DECODE_MODELS`;
GPT-OSS with its attention biases), T in ``--tokens``, rank ``--rank`` with ``--slots`` adapter slots, tokens of
distinct adapters. Candidates: the GEMV path (BLOCK_N x BLOCK_K x split-K to about 1, 2, 4, 8 programs per SM) and
the GEMM path (BLOCK_N x BLOCK_K x split-K), then num_warps/num_stages, the shrink's split-K and PDL around the best
``--top``. A candidate is timed in a realistic mode: ONE CUDA graph of ``--layers`` calls over as many distinct weight
sets (the weights do not fit in L2, the replay overhead is amortised), ``triton.testing.do_bench`` median over
replays, once with every token on an adapter and once with every token ``-1``; the score is the sum of the two (one
entry serves both: whether a token has an adapter is data). Candidates are compiled first by ``--jobs`` worker
processes in parallel (Triton's disk cache then serves the timing process); a config that fails to compile or run
is skipped, and one whose output is off the float32 reference by more than ``configs.MAX_REL_ERROR`` is rejected before
it is timed.

Output: progress lines, a summary (us per call, GB/s, % of ``--hbm-tbs``, against the heuristic and the GEMM path),
and the winners merged into the package's table (``configs/<gpu>_linear.json``, :func:`.configs.read_linear_table`)
and into ``--out`` when given, after each phase.
"""

from __future__ import annotations

import concurrent.futures as futures
import dataclasses
import multiprocessing
import os
import pathlib
import sys
import time

import torch

from ...shapes import DECODE_MODELS

PROG = "python -m moe_lora_compile.ops.triton.tune_linear"
# GEMV W tiles [BLOCK_N, BLOCK_K], most promising first (the budget cuts the tail): at 4 warps a thread holds
# BLOCK_N * BLOCK_K / 128 weights a K step (16 = two 16-byte loads); narrow column tiles give enough programs
# without split-K (no partials, no arrival tail), wide K steps and the one-step-ahead prefetch (num_stages 2)
# put more bytes in flight (sm_90 SASS, T=1: N16 K128 = 2 LDG.128 of W a step at 48 registers, 10 programs/SM;
# N4 K512 with prefetch = 4 in flight at 45 registers, 11 programs/SM).
GEMV_TILES = [(4, 512), (8, 256), (2, 1024), (4, 1024), (8, 512), (16, 256), (16, 128), (2, 512), (4, 256),
              (8, 128), (32, 128), (32, 64), (16, 64), (8, 64)]
GEMM_TILES = [(32, 64), (64, 64), (32, 128), (64, 128), (128, 64)]
PROGRAMS_PER_SM = (1, 2, 4, 8)
GEMV_PROGRAMS_PER_SM = 4  # the GEMV's split-K candidate: about this many programs per SM (and split 1)
WARPS_STAGES = {True: ((2, 1), (4, 1), (4, 2), (8, 1), (8, 2)),  # GEMV: num_stages >= 2 = loads one step ahead
                False: ((4, 2), (4, 3), (4, 4), (8, 3))}  # GEMM: Triton's software pipeline depth
EXPAND_SLOTS = (1, 4, 8)  # the GEMM's grouped B expand, tried around the best GEMM configs
ACC_PER_THREAD = 64  # GEMV tiles whose fp32 accumulator [BLOCK_T, BLOCK_N, BLOCK_K] needs more registers are skipped


@dataclasses.dataclass(frozen=True)
class Shape:
    model: str
    proj: str
    n_in: int
    n_out: int
    bias: bool


def decode_shapes(models, projs) -> list[Shape]:
    """Fused q/k/v (``attach(fuse_qkv=True)``) and o of each model's attention."""
    out = []
    for name in models:
        m = DECODE_MODELS[name]
        H, q, kv = m.moe.H, m.heads * m.head_dim, m.kv_heads * m.head_dim
        dims = {"qkv": (H, q + 2 * kv), "o": (q, H)}
        for proj in projs:
            out.append(Shape(name, proj, *dims[proj], bias=m.model_type == "gpt_oss"))  # GPT-OSS: attention_bias
    return out


# --- candidates ------------------------------------------------------------------------------------------------

def _splits(n_in: int, block_k: int, tiles: int, num_sms: int) -> list[int]:
    """split-K counts giving about PROGRAMS_PER_SM programs per SM, each slice at least one K step."""
    steps = -(-n_in // block_k)
    return sorted({max(1, min(-(-m * num_sms // tiles), steps)) for m in PROGRAMS_PER_SM})


def stage1(T: int, s: Shape, num_sms: int):
    """-> [(label, config)]: the heuristic, the GEMM path of the heuristic, then the GEMV and GEMM grids."""
    from .configs import GEMV_DEFAULT_MAX_T, GEMV_MAX_T, default_linear_config

    base = default_linear_config(T, s.n_in, s.n_out, num_sms)
    gemm_base = base.replace(gemv=False, gemm=default_linear_config(max(T, GEMV_DEFAULT_MAX_T + 1), s.n_in, s.n_out,
                                                                    num_sms).gemm)
    out = [("heuristic", base), ("gemm-heuristic", gemm_base)]
    block_t = 1 << (T - 1).bit_length()
    if T <= min(GEMV_MAX_T, GEMV_DEFAULT_MAX_T):  # past 4 tokens the GEMV's FMAs and registers lose to tl.dot
        for prefetch in (True, False):
            for bn, bk in GEMV_TILES:
                if block_t * bn * bk * (3 if prefetch else 2) > 2 * ACC_PER_THREAD * 32 * 4:
                    continue
                tiles = -(-s.n_out // bn)
                steps = -(-s.n_in // bk)
                split_sm = max(1, min(-(-GEMV_PROGRAMS_PER_SM * num_sms // tiles), steps))
                for split in sorted({1, split_sm}):
                    out.append(("gemv", base.replace(gemv=True, **{
                        "gemm.BLOCK_N": bn, "gemm.BLOCK_K": bk, "gemm.SPLIT_K": split, "gemm.num_warps": 4,
                        "gemm.num_stages": 2 if prefetch else 1})))
    tiles = GEMM_TILES if T > GEMV_DEFAULT_MAX_T // 2 else [(32, 128), (64, 128)]
    for bn, bk in tiles:
        for split in _splits(s.n_in, bk, -(-s.n_out // bn), num_sms)[:3]:
            out.append(("gemm", gemm_base.replace(**{"gemm.BLOCK_N": bn, "gemm.BLOCK_K": bk, "gemm.SPLIT_K": split})))
    return _dedupe(out)


def stage2(best: list) -> list:
    """Around each of the best configs: the GEMM's grouped expand (``expand_slots``) and, with split-K, its
    expand spread over the slices (``spread_expand``), num_warps/num_stages, the shrink's split-K halved/doubled,
    PDL off/early."""
    out = []
    for cfg in best:
        if not cfg.gemv:
            out += [("expand", cfg.replace(expand_slots=n)) for n in EXPAND_SLOTS]
            if cfg.gemm.SPLIT_K > 1:  # the slots' expand spread over the K slices
                out.append(("spread", cfg.replace(spread_expand=not cfg.spread_expand)))
        for warps, stages in WARPS_STAGES[cfg.gemv]:
            out.append(("warps", cfg.replace(**{"gemm.num_warps": warps, "gemm.num_stages": stages})))
        for factor in (0.5, 2):
            out.append(("shrink", cfg.replace(**{"shrink.SPLIT_K": max(1, int(cfg.shrink.SPLIT_K * factor))})))
        for pdl in (False, "early"):
            out.append(("pdl", cfg.replace(pdl=pdl)))
    return _dedupe([(label, c) for label, c in out if c not in best])


def _dedupe(items):
    seen, out = set(), []
    for label, cfg in items:
        if cfg not in seen:
            seen.add(cfg)
            out.append((label, cfg))
    return out


# --- inputs, compiling, timing ---------------------------------------------------------------------------------

DEVICE = "cuda"


def _layer(s: Shape, R: int, slots: int, seed: int) -> dict:
    """One layer's bf16 weight [out, in], LoRA stacks A [slots, R, in], B [slots, out, R] and bias (or None)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    return dict(w=rnd(s.n_out, s.n_in) * s.n_in ** -0.5, a=rnd(slots, R, s.n_in) * s.n_in ** -0.5,
                b=rnd(slots, s.n_out, R) * R ** -0.5, bias=rnd(s.n_out) if s.bias else None)


def _x(T: int, n_in: int) -> torch.Tensor:
    return torch.randn(T, n_in, device=DEVICE, dtype=torch.bfloat16)


def _ids(T: int, slots: int, lora: bool) -> torch.Tensor:
    """Tokens of distinct adapters (slot t % slots), or every token -1."""
    ids = torch.arange(T, device=DEVICE, dtype=torch.int32) % slots
    return ids if lora else torch.full_like(ids, -1)


def _compile_task(task) -> list[int]:
    """Worker: run each config once on one layer (compiles into Triton's disk cache) -> indices that failed."""
    s, T, R, slots, cfgs = task
    from .launch import lora_linear_triton

    layer, x = _layer(s, R, slots, 0), _x(T, s.n_in)
    failed = []
    for i, cfg in enumerate(cfgs):
        try:
            lora_linear_triton(x, layer["w"], layer["a"], layer["b"], _ids(T, slots, True), bias=layer["bias"],
                               config=cfg)
            torch.cuda.synchronize()
        except Exception:  # out of shared memory / registers, a lowering error: the timing pass skips it too
            failed.append(i)
    return failed


def precompile(pool, work: list, chunk: int = 3) -> set:
    """Compile every (shape, T, config) of ``work`` in the worker pool -> the set of (shape, T, config) that failed
    there (the timing process skips them: a config that faults on the GPU would spoil its CUDA context). No pool:
    nothing (the timing process compiles)."""
    if pool is None or not work:
        return set()
    tasks = []
    for s, T, R, slots, cfgs in work:
        for i in range(0, len(cfgs), chunk):
            tasks.append((s, T, R, slots, cfgs[i:i + chunk]))
    t0 = time.time()
    failed, errors = set(), []
    try:
        jobs = [pool.submit(_compile_task, task) for task in tasks]
    except Exception as exc:  # a broken pool: the timing process compiles what is missing
        jobs, errors = [], [exc]
    for (s, T, _, _, cfgs), job in zip(tasks, jobs):
        try:
            failed.update((s, T, cfgs[i]) for i in job.result())
        except Exception as exc:  # a worker that died or could not start: its configs compile while timing
            errors.append(exc)
    if errors:
        print(f"  precompile: {len(errors)} of {len(tasks)} tasks failed ({type(errors[0]).__name__}: "
              f"{str(errors[0])[:200]}); their configs compile while timing", flush=True)
    print(f"  compiled {sum(len(w[4]) for w in work)} candidates in {time.time() - t0:.0f} s"
          f"{f', {len(failed)} failed (skipped)' if failed else ''}", flush=True)
    return failed


def reference(layer: dict, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """One call of ``layer`` (:func:`_layer`) in float32 PyTorch (:func:`..reference.lora_linear_reference`)."""
    from ..reference import lora_linear_reference

    bias = None if layer["bias"] is None else layer["bias"].float()
    return lora_linear_reference(x.float(), layer["w"].float(), layer["a"].float(), layer["b"].float(), ids,
                                 bias=bias)


def output_error(layer: dict, x: torch.Tensor, ids: torch.Tensor, expected: torch.Tensor, cfg) -> float:
    """:func:`.configs.output_error` of ``cfg``'s output against ``expected`` (:func:`reference`)."""
    from . import configs
    from .launch import lora_linear_triton

    out = lora_linear_triton(x, layer["w"], layer["a"], layer["b"], ids, bias=layer["bias"], config=cfg)
    return configs.output_error(out, expected)


def time_config(layers, xs, ids_lora, ids_none, cfg) -> tuple[float, float]:
    """(us per call with every token on an adapter, us per call with every token -1): one CUDA graph of one call
    per layer each, median over replays."""
    import triton

    from .launch import lora_linear_triton

    result = []
    for ids in (ids_lora, ids_none):
        calls = [lambda layer=layer, x=x: lora_linear_triton(x, layer["w"], layer["a"], layer["b"], ids,
                                                             bias=layer["bias"], config=cfg)
                 for layer, x in zip(layers, xs)]
        for fn in calls:
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in calls:
                fn()
        ms = triton.testing.do_bench(graph.replay, warmup=3, rep=12, return_mode="median")
        result.append(ms * 1e3 / len(calls))
        del graph
    return result[0], result[1]


def nbytes(s: Shape, T: int, R: int, slots: int, lora: bool) -> int:
    """HBM bytes of one call: the weight (+ bias), the distinct adapters' A and B, x and y (bf16)."""
    adapters = min(T, slots) if lora else 0
    return 2 * (s.n_in * s.n_out + (s.n_out if s.bias else 0) + adapters * R * (s.n_in + s.n_out)
                + T * (s.n_in + s.n_out))


def describe(cfg) -> str:
    g = cfg.gemm
    path = "gemv" if cfg.gemv else f"gemm(M{cfg.BLOCK_M})"
    pdl = "" if cfg.pdl is None else f" pdl={cfg.pdl}"
    expand = "" if cfg.gemv else f" expand{cfg.expand_slots}" + (" spread" if cfg.spread_expand else "")
    return (f"{path} N{g.BLOCK_N} K{g.BLOCK_K} split{g.SPLIT_K} w{g.num_warps}s{g.num_stages} "
            f"shrink-split{cfg.shrink.SPLIT_K}{expand}{pdl}")


# --- main ------------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    from ...__main__ import OneLineParser, positive_int

    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(DECODE_MODELS), choices=sorted(DECODE_MODELS))
    p.add_argument("--projs", nargs="+", default=["qkv", "o"], choices=["qkv", "o"])
    p.add_argument("--tokens", nargs="+", type=positive_int, default=[1, 2, 4, 8])
    p.add_argument("--rank", type=positive_int, default=32)
    p.add_argument("--slots", type=positive_int, default=8)
    p.add_argument("--layers", type=positive_int, default=24, help="distinct weight sets (calls) per CUDA graph")
    p.add_argument("--top", type=positive_int, default=2, help="configs of stage 1 refined in stage 2")
    p.add_argument("--jobs", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 1)),
                   help="compile worker processes (0: compile while timing)")
    p.add_argument("--budget-s", type=float, default=170.0,
                   help="stop timing new candidates after this many seconds (the best so far is written)")
    p.add_argument("--hbm-tbs", type=float, default=4.8)
    p.add_argument("--out", help="also write the table to this file (a copy of the package's)")
    p.add_argument("--no-package", action="store_true", help="write only --out, not the package's table")
    a = p.parse_args(argv)
    if a.jobs < 0 or not a.budget_s > 0 or not a.hbm_tbs > 0:
        p.error(f"--jobs must be >= 0, --budget-s and --hbm-tbs > 0 (got {a.jobs}, {a.budget_s}, {a.hbm_tbs})")
    if a.out is not None and not os.access(os.path.dirname(os.path.abspath(a.out)) or ".", os.W_OK):
        p.error(f"--out {a.out}: its folder is not writable")
    if not torch.cuda.is_available():
        print(f"{PROG}: error: tuning times the Triton kernels on a CUDA GPU, and CUDA is not available",
              file=sys.stderr)
        return 2
    from .configs import (CONFIG_DIR, MAX_REL_ERROR, device_name, linear_file_name, linear_shape_key, read_linear_table,
                          write_linear_table)
    from .launch import _num_sms

    t_start = time.time()
    dev = torch.device(DEVICE)
    sms = _num_sms(dev)
    package_path = CONFIG_DIR / linear_file_name(device_name(dev))
    paths = ([] if a.no_package else [package_path]) + ([pathlib.Path(a.out)] if a.out else [])
    if not paths:
        p.error("--no-package needs --out")
    table = read_linear_table(package_path)
    shapes = decode_shapes(a.models, a.projs)
    combos = [(s, T) for s in shapes for T in a.tokens]
    print(f"{device_name(dev)} ({sms} SMs): {len(combos)} (shape, T) combos, {a.layers} layers a graph, "
          f"rank {a.rank}, {a.slots} slots; writing {', '.join(map(str, paths))}", flush=True)

    pool = None
    if a.jobs > 0:
        pool = futures.ProcessPoolExecutor(a.jobs, mp_context=multiprocessing.get_context("spawn"))
    layers = {s: [_layer(s, a.rank, a.slots, seed) for seed in range(a.layers)] for s in shapes}
    results = {}  # (shape, T) -> {config: (label, lora_us, none_us)}
    cands1 = {(s, T): stage1(T, s, sms) for s, T in combos}
    print(f"[phase 1/4] compiling stage 1 ({time.time() - t_start:.0f} s)", flush=True)
    failed = precompile(pool, [(s, T, a.rank, a.slots, [c for _, c in cands1[s, T]]) for s, T in combos])

    def run(stage: str, cands: dict) -> None:
        for i, (s, T) in enumerate(combos, 1):
            xs = [_x(T, s.n_in) for _ in range(a.layers)]
            ids_lora, ids_none = _ids(T, a.slots, True), _ids(T, a.slots, False)
            expected = reference(layers[s][0], xs[0], ids_lora)
            done = results.setdefault((s, T), {})
            t0, skipped, timed = time.time(), 0, 0
            for label, cfg in cands[s, T]:
                if cfg in done or (s, T, cfg) in failed:
                    continue
                if time.time() - t_start > a.budget_s and done:
                    skipped += 1
                    continue
                try:
                    error = output_error(layers[s][0], xs[0], ids_lora, expected, cfg)
                    if not error <= MAX_REL_ERROR:  # never kept, however fast (configs.MAX_REL_ERROR)
                        failed.add((s, T, cfg))
                        print(f"    rejected {describe(cfg)}: outputs {error:.3g} off the float32 reference "
                              f"(relative)", flush=True)
                        continue
                    done[cfg] = (label, *time_config(layers[s], xs, ids_lora, ids_none, cfg))
                    timed += 1
                except Exception as exc:  # noqa: BLE001  (a config that does not compile or launch)
                    print(f"    skipped {describe(cfg)}: {type(exc).__name__}", flush=True)
            torch.cuda.empty_cache()  # the graphs' private pools
            if not done:  # every candidate failed or was rejected: the table keeps what it had for this shape
                print(f"  [{stage} {i}/{len(combos)}] {s.model} {s.proj} {s.n_in}->{s.n_out} T={T}: no candidate "
                      f"ran correctly; not written", flush=True)
                continue
            best = min(done, key=lambda c: done[c][1] + done[c][2])
            label, lora_us, none_us = done[best]
            print(f"  [{stage} {i}/{len(combos)}] {s.model} {s.proj} {s.n_in}->{s.n_out} T={T}: {timed} timed"
                  f"{f', {skipped} over budget' if skipped else ''} in {time.time() - t0:.1f} s; best {label} "
                  f"{lora_us:.1f} us LoRA / {none_us:.1f} us -1: {describe(best)}", flush=True)

    def write() -> None:
        for (s, T), done in results.items():
            if not done:
                continue
            best = min(done, key=lambda c: done[c][1] + done[c][2])
            table.setdefault(linear_shape_key(s.n_in, s.n_out, a.rank), {})[str(T)] = best
        for path in paths:
            write_linear_table(path, table)

    print(f"[phase 2/4] timing stage 1 ({time.time() - t_start:.0f} s)", flush=True)
    run("stage 1", cands1)
    write()
    cands2 = {}
    for key, done in results.items():
        ranked = sorted(done, key=lambda c: done[c][1] + done[c][2])
        cands2[key] = stage2(ranked[:a.top])
    print(f"[phase 3/4] compiling stage 2 ({time.time() - t_start:.0f} s)", flush=True)
    if time.time() - t_start < a.budget_s:
        failed |= precompile(pool, [(s, T, a.rank, a.slots, [c for _, c in cands2[s, T]]) for s, T in combos])
    print(f"[phase 4/4] timing stage 2 ({time.time() - t_start:.0f} s)", flush=True)
    run("stage 2", cands2)
    write()
    if pool is not None:
        pool.shutdown(cancel_futures=True)

    peak = a.hbm_tbs * 1e12
    print(f"\n| model | proj | in->out | T | best config | LoRA us | GB/s | % of {a.hbm_tbs} TB/s | -1 us | GB/s | "
          "% | heuristic LoRA us | GEMM-heuristic LoRA us | best GEMM LoRA us |")
    print("|" + "---|" * 14)
    for (s, T), done in results.items():
        if not done:
            print(f"| {s.model} | {s.proj} | {s.n_in}->{s.n_out} | {T} | none ran correctly |" + " - |" * 9)
            continue
        best = min(done, key=lambda c: done[c][1] + done[c][2])
        _, lora_us, none_us = done[best]
        by_label = lambda lab: min((v[1] for v in done.values() if v[0] == lab), default=float("nan"))
        gemm_best = min((v[1] for c, v in done.items() if not c.gemv), default=float("nan"))
        b_lora, b_none = nbytes(s, T, a.rank, a.slots, True), nbytes(s, T, a.rank, a.slots, False)
        print(f"| {s.model} | {s.proj} | {s.n_in}->{s.n_out} | {T} | {describe(best)} | {lora_us:.1f} | "
              f"{b_lora / lora_us / 1e3:.0f} | {100 * b_lora / (lora_us * 1e-6) / peak:.0f} | {none_us:.1f} | "
              f"{b_none / none_us / 1e3:.0f} | {100 * b_none / (none_us * 1e-6) / peak:.0f} | "
              f"{by_label('heuristic'):.1f} | {by_label('gemm-heuristic'):.1f} | {gemm_best:.1f} |")
    print(f"\nwrote {', '.join(map(str, paths))} in {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":  # run from the package's module, so that worker processes unpickle its functions
    from moe_lora_compile.ops.triton.tune_linear import main as _main

    sys.exit(_main())
