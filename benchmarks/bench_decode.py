"""Whole-model decode benchmark (a script, not a test): tokens/s, time to first token, ms/step and % of the HBM floor
of a full-size MoE model with random bf16 weights and 8 real PEFT adapters, against the plain Hugging Face paths.

Per model (``--models``, geometries in :data:`moe_lora_compile.shapes.DECODE_MODELS`) it builds the model on the GPU
(random weights: speed does not depend on their values), makes ``--adapters`` PEFT adapters of rank ``--rank`` on
q/k/v/o and on the experts with PEFT's own API and saves them as adapter folders, then, per batch size, in one run:

- ``hf_eager``: ``model.generate`` (transformers' default experts path, dynamic cache), no LoRA;
- ``hf_compiled``: transformers' fastest plain path (static cache, ``generate(compile_config=CompileConfig(
  fullgraph=True, mode="reduce-overhead"))``), no LoRA (``--hf-compiled``; its compile takes minutes);
- ``hf_peft``: eager ``PeftModel.generate`` with one adapter (PEFT cannot mix adapters on experts);
- ``ours_none``: ``attach(use_ops=True)`` + ``DecodeGraphs(compile=True).capture()``, ``adapters=None``;
- ``ours_lora``: the same with the 8 adapters mixed over the batch's rows (row ``i`` gets adapter ``i % 8``).

Decode tok/s = batch x steps / decode time (prefill excluded); TTFT = prefill of the batch to its first token;
floor = bytes a step must read (active experts of the batch, attention, router, norms, ``lm_head``, the KV cache,
the rows' LoRA factors) at the device-to-device copy bandwidth measured at the start of the run. ``--profile`` adds a
``torch.profiler`` breakdown of one compiled step (kernels grouped by the op that launched them).

    python benchmarks/bench_decode.py --models gpt-oss-20b --batches 1 8 32 64 --json out.json --md out.md
    python benchmarks/bench_decode.py --tiny   # CPU smoke test of the script itself (tiny model, no timing claims)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
import warnings
from collections import defaultdict

import torch

import moe_lora_compile as mlc
from moe_lora_compile import settings
from moe_lora_compile.graphs import DecodeGraphs
from moe_lora_compile.shapes import DECODE_MODELS

COLUMNS = ("hf_eager", "hf_compiled", "hf_peft", "ours_none", "ours_lora")


@dataclasses.dataclass(frozen=True)
class Workload:
    """One timed generation: ``batch`` prompts of ``prompt`` tokens, ``new`` tokens each (greedy)."""

    batch: int
    prompt: int
    new: int


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------------------------
# model and adapters


def build_model(name: str, device, dtype, tiny: bool):
    from transformers import AutoModelForCausalLM

    if tiny:
        from moe_lora_compile.models.tiny import tiny_config
        config = tiny_config(name)
    else:
        config = DECODE_MODELS[name].hf_config()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def make_adapters(model, folder: str, count: int, rank: int, tiny_family: str | None) -> list[str]:
    """``count`` PEFT adapter folders (q/k/v/o + experts, rank ``rank``) made with PEFT's API; returns paths.
    The base model is unwrapped again afterwards (``unload``)."""
    from peft import LoraConfig, get_peft_model

    from moe_lora_compile.models import FAMILIES

    fam = next(f for f in FAMILIES if model.config.model_type in f.model_types)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        target_parameters=[f"{fam.block_attr}.experts.gate_up_proj",
                                           f"{fam.block_attr}.experts.down_proj"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, config)
    paths = []
    for i in range(count):
        gen = torch.Generator(device=model.device).manual_seed(100 + i)
        with torch.no_grad():
            for pname, param in peft_model.named_parameters():
                if ".lora_A." in pname or ".lora_B." in pname:
                    param.normal_(0.0, 0.02, generator=gen)
        path = os.path.join(folder, f"adapter{i}")
        peft_model.save_pretrained(path)
        paths.append(path)
    return paths, peft_model


# --------------------------------------------------------------------------------------------------------------
# bytes of one decode step (the floor)


def step_bytes(model, batch: int, context: int, adapters_in_batch: int, rank: int) -> float:
    """Bytes one decode step reads at least once: every weight except the experts and the embedding table, the
    batch's expected distinct experts per layer (uniform routing), the KV cache of ``batch`` rows at ``context``
    tokens (a sliding-window layer: at most its window), and, with LoRA, ``adapters_in_batch`` adapters' factors on
    q/k/v/o and, for each adapter, on the experts its rows reach (the batch's rows dealt evenly over the
    adapters, uniform routing)."""
    cfg = model.config
    from moe_lora_compile.models import FAMILIES
    from moe_lora_compile.models.experts import experts_geometry
    fam = next(f for f in FAMILIES if cfg.model_type in f.model_types)
    elem = next(model.parameters()).element_size()
    total = 0.0
    expert_bytes, n_layers = 0, 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            continue
        if "embed_tokens" in name:
            total += batch * p.shape[1] * elem
            continue
        total += p.numel() * elem
    for name, module in model.named_modules():
        if name.endswith(".experts") and hasattr(module, "gate_up_proj"):
            E, H, I = experts_geometry(module, fam.layout)
            k = cfg.num_experts_per_tok
            distinct = E * (1 - (1 - k / E) ** batch)
            per_expert = sum(p[0].numel() for p in module.parameters()) * elem
            expert_bytes += distinct * per_expert
            n_layers += 1
            if adapters_in_batch:  # each adapter's factors on the experts its own rows reach (rows dealt evenly)
                lora_per_expert = rank * (H + 2 * I + I + H) * elem
                rows = [batch // adapters_in_batch + (a < batch % adapters_in_batch) for a in range(adapters_in_batch)]
                total += sum(E * (1 - (1 - k / E) ** n) for n in rows) * lora_per_expert
    total += expert_bytes
    kv_heads, head_dim = cfg.num_key_value_heads, getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    # a sliding-window layer reads at most its window of the cache (GPT-OSS: every other layer, 128 tokens)
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None) or context
    kv_tokens = sum(min(context, window) if t == "sliding_attention" else context for t in layer_types)
    total += batch * kv_tokens * 2 * kv_heads * head_dim * elem
    if adapters_in_batch:
        H = cfg.hidden_size
        q = cfg.num_attention_heads * head_dim
        kv = kv_heads * head_dim
        attn = rank * ((H + q) * 2 + (H + kv) * 2)  # q, o and k, v
        total += adapters_in_batch * cfg.num_hidden_layers * attn * elem
    return total


# --------------------------------------------------------------------------------------------------------------
# timed paths


_GPU_LOCK = None  # path of a lock file held around every timed section (--gpu-lock)


@contextlib.contextmanager
def timed_section():
    """Hold ``--gpu-lock`` (an exclusive ``flock``) while timing, so that two benchmark processes sharing the GPU
    (one compiling while the other times) never time at the same moment; a no-op without ``--gpu-lock``."""
    if _GPU_LOCK is None:
        yield
        return
    import fcntl

    with open(_GPU_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def time_hf(model, input_ids, new: int, **generate_kwargs) -> dict:
    """TTFT (one prefill forward + first token) and decode tok/s of ``model.generate`` (greedy, no EOS stop)."""
    with timed_section():
        return _time_hf(model, input_ids, new, **generate_kwargs)


def _time_hf(model, input_ids, new: int, **generate_kwargs) -> dict:
    device = input_ids.device
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, **generate_kwargs)
    model.generate(input_ids, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm (allocator, compile)
    sync(device)
    t0 = time.perf_counter()
    model.generate(input_ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
    sync(device)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(input_ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
    sync(device)
    total = time.perf_counter() - t0
    steps = out.shape[1] - input_ids.shape[1] - 1
    decode = max(total - ttft, 1e-9)
    return dict(ttft_ms=1e3 * ttft, ms_per_step=1e3 * decode / steps, tok_s=input_ids.shape[0] * steps / decode)


def time_ours(graphs: DecodeGraphs, input_ids, new: int, adapters) -> dict:
    """TTFT (compiled prefill) and decode tok/s of the captured steps, greedy."""
    with timed_section():
        return _time_ours(graphs, input_ids, new, adapters)


def _time_ours(graphs: DecodeGraphs, input_ids, new: int, adapters) -> dict:
    device = input_ids.device
    sync(device)
    t0 = time.perf_counter()
    state, logits = graphs.prefill(input_ids, adapters=adapters)
    token = logits.argmax(-1)
    sync(device)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(new - 1):
        token = graphs.step(state, token[:, None])[:, -1].argmax(-1)
    sync(device)
    decode = time.perf_counter() - t0
    return dict(ttft_ms=1e3 * ttft, ms_per_step=1e3 * decode / (new - 1),
                tok_s=input_ids.shape[0] * (new - 1) / decode)


_CATEGORIES = ("moe", "dense_lora_linear", "attention", "norms_elementwise", "router", "lm_head", "other")


def _category(name: str, parent_ops: list[str], shapes) -> str:
    ops = " ".join(parent_ops)
    if "moe_lora::fused_moe_lora" in ops:
        return "moe"
    if "moe_lora::lora_linear" in ops:
        return "dense_lora_linear"
    if "moe_lora::route" in ops:
        return "router"
    low = name.lower()
    if any(s in low for s in ("flash", "fmha", "attention", "softmax", "sdpa")):
        return "attention"
    return "other"


def profile_step(graphs: DecodeGraphs, input_ids, adapters, model, steps: int = 5) -> dict:
    """Kernel time per step (ms) by category, from a profile of ``steps`` compiled steps run outside the CUDA graph
    (kernels attributed to the op that launched them; Inductor's generated kernels by their names), with the ops'
    id checks off as in the captured graph; plus the 25 costliest kernels and the launches per step."""
    from torch.profiler import ProfilerActivity, profile

    cfg = model.config
    vocab, experts = cfg.vocab_size, getattr(cfg, "num_experts", getattr(cfg, "num_local_experts", None))
    state, logits = graphs.prefill(input_ids, adapters=adapters)
    token = logits.argmax(-1)
    use_graphs = graphs.use_graphs
    graphs.use_graphs = False  # the same compiled step, launched op by op so kernels map to their ops
    # the ops' id checks are off while a graph is captured: turn them off here too, so the profile is the graph's
    checks = os.environ.get(settings.CHECK_IDS.name)
    os.environ[settings.CHECK_IDS.name] = "0"
    settings.reload()
    try:
        token = graphs.step(state, token[:, None])[:, -1].argmax(-1)  # warm
        sync(input_ids.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            for _ in range(steps):
                token = graphs.step(state, token[:, None])[:, -1].argmax(-1)
            sync(input_ids.device)
    finally:
        graphs.use_graphs = use_graphs
        if checks is None:
            del os.environ[settings.CHECK_IDS.name]
        else:
            os.environ[settings.CHECK_IDS.name] = checks
        settings.reload()
    times = defaultdict(float)
    per_kernel = defaultdict(lambda: [0, 0.0])  # name -> [launches, us] over the profiled steps
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CPU:
            continue
        own_kernels = [k for k in evt.kernels]
        if not own_kernels:
            continue
        chain, p = [evt.name], evt.cpu_parent
        while p is not None:
            chain.append(p.name)
            p = p.cpu_parent
        shapes = evt.input_shapes or []
        for k in own_kernels:
            kname = k.name
            cat = _category(kname, chain, shapes)
            if cat == "other":
                low = kname.lower()
                if evt.name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul"):
                    out = [s for s in shapes if s]
                    last = [s[-1] for s in out if len(s) >= 2]
                    if vocab in last:
                        cat = "lm_head"
                    elif experts in last:
                        cat = "router"
                    else:
                        cat = "attention"
                elif "rsqrt" in low or "mean" in low:
                    cat = "norms_elementwise"
                elif "topk" in low or "sort" in low:
                    cat = "router"
                elif "exp" in low or "amax" in low:
                    cat = "attention"
                elif low.startswith("triton_") or "elementwise" in low or "vectorized" in low:
                    cat = "norms_elementwise"
            times[cat] += k.duration / 1e3  # us -> ms
            per_kernel[(cat, kname[:80])][0] += 1
            per_kernel[(cat, kname[:80])][1] += k.duration
    out = {c: round(times.get(c, 0.0) / steps, 3) for c in _CATEGORIES}
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:25]
    out["top_kernels"] = [dict(category=c, kernel=n, launches_per_step=v[0] / steps, us_per_step=round(v[1] / steps, 1))
                          for (c, n), v in top]
    out["kernels_per_step"] = sum(v[0] for v in per_kernel.values()) / steps
    return out


# --------------------------------------------------------------------------------------------------------------


class Rows(list):
    """Result rows, written to ``--json`` after every one (a run cut short by a time limit keeps what it measured)."""

    def __init__(self, path, env):
        super().__init__()
        self.path, self.env = path, env

    def append(self, row):
        super().append(row)
        if self.path:
            with open(self.path, "w") as f:
                json.dump(dict(env=self.env, rows=list(self)), f, indent=1)


def run_model(name: str, args, device, dtype, bandwidth: float, rows: Rows) -> None:
    tiny = args.tiny
    t0 = time.perf_counter()
    model = build_model(name, device, dtype, tiny)
    log(f"{name}: built ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params) in "
        f"{time.perf_counter() - t0:.1f} s")
    vocab = model.config.vocab_size
    workloads = [Workload(b, args.prompt, args.new) for b in args.batches]
    if args.chat:
        workloads.append(Workload(args.chat[0], args.chat[1], args.chat[2]))
    max_cache = max(w.prompt + w.new for w in workloads) + 8
    gen = torch.Generator().manual_seed(0)
    prompts = {w: torch.randint(3, vocab, (w.batch, w.prompt), generator=gen).to(device) for w in workloads}

    if "hf_eager" in args.columns:
        for w in workloads:
            if w.batch > args.hf_max_batch:
                continue
            new = min(w.new, args.hf_new)
            r = time_hf(model, prompts[w], new)
            rows.append(dict(model=name, column="hf_eager", **dataclasses.asdict(w), measured_new=new, **r))
            log(f"{name} hf_eager b={w.batch}: {r['tok_s']:.1f} tok/s, ttft {r['ttft_ms']:.0f} ms")
    if "hf_compiled" in args.columns:
        from transformers import CompileConfig
        for w in workloads:
            if w.batch > args.hf_max_batch or (args.hf_compiled_batches and w.batch not in args.hf_compiled_batches):
                continue
            new = min(w.new, args.hf_new)
            cc = CompileConfig(fullgraph=True, mode="reduce-overhead")
            t0 = time.perf_counter()
            _time_hf(model, prompts[w], 4, cache_implementation="static", compile_config=cc)  # compile (no lock)
            compile_s = time.perf_counter() - t0
            r = time_hf(model, prompts[w], new, cache_implementation="static", compile_config=cc)
            rows.append(dict(model=name, column="hf_compiled", **dataclasses.asdict(w), measured_new=new,
                             compile_s=compile_s, **r))
            log(f"{name} hf_compiled b={w.batch}: {r['tok_s']:.1f} tok/s (compile {compile_s:.0f} s)")
        torch._dynamo.reset()
    if not {"hf_peft", "ours_none", "ours_lora"} & set(args.columns):  # HF columns only: no adapters, no capture
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return

    with tempfile.TemporaryDirectory() as folder:
        t0 = time.perf_counter()
        paths, peft_model = make_adapters(model, folder, args.adapters, args.rank, name if tiny else None)
        log(f"{name}: {len(paths)} PEFT adapters of rank {args.rank} made and saved in {time.perf_counter() - t0:.1f} s")
        if "hf_peft" in args.columns:
            peft_model.set_adapter("default")
            for w in workloads:
                if w.batch > args.hf_max_batch:
                    continue
                new = min(w.new, args.hf_new)
                r = time_hf(peft_model, prompts[w], new)
                rows.append(dict(model=name, column="hf_peft", **dataclasses.asdict(w), measured_new=new, **r))
                log(f"{name} hf_peft b={w.batch}: {r['tok_s']:.1f} tok/s")
        model = peft_model.unload()
        del peft_model
        t0 = time.perf_counter()
        mm = mlc.attach(model, max_loras=args.adapters, max_rank=args.rank, use_ops=True,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], fuse_qkv=args.fuse_qkv)
        for i, path in enumerate(paths):
            mm.load_adapter(f"a{i}", path)
        log(f"{name}: attached, {len(paths)} adapters loaded in {time.perf_counter() - t0:.1f} s")

    buckets = sorted({w.batch for w in workloads})
    graphs = DecodeGraphs(mm, batch_sizes=buckets, max_cache_len=max_cache, capture=device.type == "cuda",
                          compile=not args.no_compile, compile_prefill=not args.eager_prefill, log=log,
                          fold_gqa=args.fold_gqa, attention=args.attention)
    impl = mm.model.config._attn_implementation
    log(f"{name}: fold_gqa={args.fold_gqa!r}: attention {impl!r}"
        + (" (decode steps folded)" if args.fold_gqa == "all" and impl == "sdpa" else "")
        + (" (decode steps: moe_lora.decode_attention)" if args.attention == "triton" else ""))
    t0 = time.perf_counter()
    graphs.capture()
    capture_s = time.perf_counter() - t0
    log(f"{name}: compiled + captured {len(buckets)} buckets in {capture_s:.1f} s")
    names = [f"a{i}" for i in range(args.adapters)]
    for w in workloads:
        mix = [names[i % len(names)] for i in range(w.batch)]
        for column, adapters in (("ours_none", None), ("ours_lora", mix)):
            if column not in args.columns:
                continue
            time_ours(graphs, prompts[w], min(w.new, 8), adapters)  # warm the prefill shapes
            r = time_ours(graphs, prompts[w], w.new, adapters)
            context = w.prompt + w.new // 2
            n_adapters = 0 if adapters is None else len(set(mix))
            floor_s = step_bytes(model, w.batch, context, n_adapters, args.rank) / bandwidth
            r["floor_ms"] = 1e3 * floor_s
            r["pct_floor"] = 100 * floor_s / (r["ms_per_step"] / 1e3)
            rows.append(dict(model=name, column=column, **dataclasses.asdict(w), measured_new=w.new,
                             capture_s=capture_s, **r))
            log(f"{name} {column} b={w.batch} p={w.prompt}: {r['tok_s']:.1f} tok/s, {r['ms_per_step']:.2f} ms/step "
                f"({r['pct_floor']:.0f}% of floor {r['floor_ms']:.2f} ms), ttft {r['ttft_ms']:.0f} ms")
    if args.check:  # the captured compiled step against the eager model, bf16
        w = workloads[0]
        mix = [names[i % len(names)] for i in range(w.batch)]
        state, logits = graphs.prefill(prompts[w], adapters=mix)
        with torch.no_grad():
            want = mm(prompts[w], adapters=mix, use_cache=False).logits[:, -1].float()
        err = ((logits.float() - want).norm() / want.norm()).item()
        rows.append(dict(model=name, column="check_prefill_rel_err", batch=w.batch, value=err))
        log(f"{name}: compiled prefill vs eager forward, relative error {err:.2e}")
    if args.profile and device.type == "cuda":
        for b in args.profile:
            if b not in buckets:
                continue
            w = next(x for x in workloads if x.batch == b)
            mix = [names[i % len(names)] for i in range(b)]
            for column, adapters in (("ours_none", None), ("ours_lora", mix)):
                try:
                    with timed_section():
                        prof = profile_step(graphs, prompts[w], adapters, model)
                except Exception as e:  # the profile is an extra: never lose the timings for it
                    log(f"{name} profile {column} b={b} failed: {e!r}")
                    continue
                rows.append(dict(model=name, column=f"profile_{column}", batch=b, **prof))
                log(f"{name} profile {column} b={b}: {prof}")
    del graphs, mm, model
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def to_markdown(rows: list[dict]) -> str:
    out = []
    timed = [r for r in rows if r["column"] in COLUMNS]
    keys = sorted({(r["model"], r["batch"], r["prompt"], r["new"]) for r in timed})
    out.append("| model | batch | prompt+new | " + " | ".join(COLUMNS) + " | ours_lora ms/step | floor ms | % floor "
               "| TTFT ms (ours_lora) |")
    out.append("|" + "---|" * (len(COLUMNS) + 7))
    for key in keys:
        cells = {r["column"]: r for r in timed if (r["model"], r["batch"], r["prompt"], r["new"]) == key}
        lora = cells.get("ours_lora", {})
        vals = [f"{cells[c]['tok_s']:.1f}" if c in cells else "-" for c in COLUMNS]
        out.append(f"| {key[0]} | {key[1]} | {key[2]}+{key[3]} | " + " | ".join(vals) +
                   f" | {lora.get('ms_per_step', float('nan')):.2f} | {lora.get('floor_ms', float('nan')):.2f} | "
                   f"{lora.get('pct_floor', float('nan')):.0f} | {lora.get('ttft_ms', float('nan')):.0f} |")
    profiles = [r for r in rows if r["column"].startswith("profile_")]
    if profiles:
        out.append("")
        out.append("| model | batch | step | " + " | ".join(_CATEGORIES) + " | sum |")
        out.append("|" + "---|" * (len(_CATEGORIES) + 4))
        for r in profiles:
            out.append(f"| {r['model']} | {r['batch']} | {r['column'][8:]} | " +
                       " | ".join(f"{r[c]:.2f}" for c in _CATEGORIES) + f" | {sum(r[c] for c in _CATEGORIES):.2f} |")
    return "\n".join(out) + "\n"


def render(paths: list[str], md_path=None, png_path=None) -> int:
    """Merge the rows of several ``--json`` files into one table (``--md``) and plot (``--png``)."""
    docs = [json.load(open(p)) for p in paths]
    rows = [r for d in docs for r in d["rows"]]
    env = docs[0]["env"]
    md = to_markdown(rows)
    print(md)
    if md_path:
        with open(md_path, "w") as f:
            f.write(f"Measured {env['date']} on {env['device']} (torch {env['torch']}, transformers "
                    f"{env.get('transformers')}; copy bandwidth {env['bandwidth_tbs']:.2f} TB/s; rows of "
                    f"{len(paths)} runs: {', '.join(' '.join(d['env']['argv']) for d in docs)})\n\n" + md)
    if png_path:
        plot(rows, png_path)
    return 0


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows if r["column"] in COLUMNS})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        for column in COLUMNS:
            pts = sorted((r["batch"], r["tok_s"]) for r in rows
                         if r["model"] == model and r["column"] == column and r["prompt"] == rows_prompt(rows))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=column)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (sequences)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{model}, H200, bf16")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def rows_prompt(rows):
    prompts = [r["prompt"] for r in rows if r["column"] in COLUMNS]
    return max(set(prompts), key=prompts.count)


def main(argv=None) -> int:
    warnings.filterwarnings("ignore", message=".*Online softmax is disabled.*")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(DECODE_MODELS), choices=list(DECODE_MODELS) + ["qwen3_moe",
                                                                                                       "gpt_oss"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--chat", nargs=3, type=int, metavar=("BATCH", "PROMPT", "NEW"), default=None,
                   help="one more workload shaped like a chat request, e.g. 1 1600 600")
    p.add_argument("--columns", nargs="+", default=["hf_eager", "hf_peft", "ours_none", "ours_lora"], choices=COLUMNS)
    p.add_argument("--hf-compiled", action="store_true", help="add the hf_compiled column (minutes of compile)")
    p.add_argument("--hf-compiled-batches", type=int, nargs="+", default=None,
                   help="batches of the hf_compiled column (default: all; each batch is a compile of minutes)")
    p.add_argument("--hf-new", type=int, default=32, help="new tokens timed for the HF columns (steady state)")
    p.add_argument("--hf-max-batch", type=int, default=64)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--no-compile", action="store_true", help="capture the eager step (DecodeGraphs(compile=False))")
    p.add_argument("--eager-prefill", action="store_true",
                   help="DecodeGraphs(compile_prefill=False): no prefill compile (TTFT then is the eager prefill's)")
    p.add_argument("--fuse-qkv", action="store_true", help="attach(fuse_qkv=True): q/k/v in one lora_linear call")
    p.add_argument("--fold-gqa", choices=["off", "eager", "all"], default="eager",
                   help="DecodeGraphs(fold_gqa=...): eager (default) folds eager-attention models (GPT-OSS); all also "
                        "runs SDPA models' decode steps (Qwen3) through the folded attention; off folds nothing")
    p.add_argument("--attention", choices=["default", "triton"], default="default",
                   help="DecodeGraphs(attention=...): triton runs every decode step's attention through the "
                        "flash-decoding kernel moe_lora.decode_attention; default: the model's (folded) attention")
    p.add_argument("--profile", nargs="*", type=int, default=[1, 8],
                   help="batches to profile (default 1 8; the flag alone: every batch of --batches)")
    p.add_argument("--no-profile", action="store_true", help="no torch.profiler breakdown")
    p.add_argument("--check", action="store_true", help="compare the compiled prefill with the eager model")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny qwen3_moe, fp32, few tokens")
    p.add_argument("--gpu-lock", help="lock file held around every timed section: lets a second benchmark process "
                   "(e.g. the hf_compiled column) compile while this one times, and never time at the same moment")
    p.add_argument("--json"), p.add_argument("--md"), p.add_argument("--png")
    p.add_argument("--render", nargs="+", metavar="JSON",
                   help="measure nothing: merge the rows of these --json files (e.g. two processes of one run) "
                        "into --md / --png")
    args = p.parse_args(argv)
    if args.no_profile:
        args.profile = []
    elif args.profile == []:  # a bare --profile once meant "none" and silently dropped the profile a run asked for
        args.profile = list(args.batches)
    if args.render:
        return render(args.render, args.md, args.png)
    global _GPU_LOCK
    _GPU_LOCK = args.gpu_lock
    if args.hf_compiled and "hf_compiled" not in args.columns:
        args.columns.append("hf_compiled")
    if not args.tiny and not torch.cuda.is_available():  # full-size models in fp32 on a CPU: tens of GB, no figure
        p.error("the full-size models need a CUDA device; --tiny runs the script's CPU smoke test")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        args.models = ["qwen3_moe"]
        args.batches, args.prompt, args.new, args.hf_new = [1, 2], 8, 5, 4
    with timed_section():
        bandwidth = 4.3e12  # the CPU smoke test's stand-in
        if device.type == "cuda":
            from moe_layer import copy_bandwidth  # beside this script (it imports triton)

            bandwidth = copy_bandwidth(device)
    env = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               torch=torch.__version__, bandwidth_tbs=bandwidth / 1e12, argv=sys.argv[1:], fold_gqa=args.fold_gqa,
               attention=args.attention)
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    log(f"env: {env}")
    rows = Rows(args.json, env)
    for name in args.models:
        run_model(name, args, device, dtype, bandwidth, rows)
    md = to_markdown(rows)
    print(md)
    if args.md:
        with open(args.md, "w") as f:
            f.write(f"Measured {env['date']} on {env['device']} (torch {env['torch']}, transformers "
                    f"{env.get('transformers')}; copy bandwidth {env['bandwidth_tbs']:.2f} TB/s)\n\n" + md)
    if args.png:
        try:
            plot(rows, args.png)
        except ImportError as e:
            log(f"no plot: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
