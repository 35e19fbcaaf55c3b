"""Decode a mixed-adapter batch with one CUDA-graph replay per step, then speculative decoding, then a hot swap.

    python examples/cuda_graph_decode.py [--family qwen3_moe] [--dtype bfloat16] [--max-new-tokens 16]
        [--sliding-window N]

Builds the demo's tiny random MoE model with three PEFT adapters (``python -m moe_lora_compile demo``), attaches it
again (``attach``'s default ``use_ops=True``: the ops, so the Triton kernels on a GPU), captures decode graphs for
batch buckets 1, 2, 4 and 8, and checks greedy generation against ``mm.generate``. Without CUDA it says so and runs
the same static-buffer steps eagerly (``capture=False``).

GPT-OSS has sliding-window attention; the tiny config's window defaults to prompt + 3 x new tokens here, so the
speculative run stays inside it. ``--sliding-window 16`` shows the documented limit instead: once a context is
longer than the window, speculative decoding can differ from greedy (the example then reports a mismatch there).
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time

import torch

from moe_lora_compile.__main__ import ADAPTERS, build, positive_int
from moe_lora_compile.family_names import describe_choices, family_arg
from moe_lora_compile.graphs import DecodeGraphs
from moe_lora_compile.models import attach


def _timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


@torch.no_grad()
def agree(mm, ours, theirs, adapters, dtype) -> str:
    """``"identical"``; in bfloat16 also ``"same up to a bf16 near-tie at token t"`` when each row is identical up to
    a token where the reference's own two best logits are within bf16 rounding of each other and ours took the
    other one (two computations of one bf16 model legitimately part there, and their continuations then differ);
    else ``"DIFFERENT"``."""
    if torch.equal(ours, theirs):
        return "identical"
    if dtype != torch.bfloat16 or ours.shape != theirs.shape:
        return "DIFFERENT"
    ties = []
    for row in (ours != theirs).any(1).nonzero().flatten().tolist():
        t = int((ours[row] != theirs[row]).nonzero()[0])
        logits = mm(theirs[row:row + 1, :t], adapters=[adapters[row]]).logits[0, -1].float()
        best = logits.topk(2)
        gap = float(best.values[0] - best.values[1])
        if int(ours[row, t]) not in best.indices.tolist() or gap > 2 ** -7 * max(1.0, abs(float(best.values[0]))):
            return "DIFFERENT"
        ties.append(t)
    return f"same up to a bf16 near-tie at token {min(ties)}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen3_moe", type=family_arg, metavar="F",
                        help=f"model family (default qwen3_moe): {describe_choices()}")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--max-new-tokens", type=positive_int, default=16)
    parser.add_argument("--sliding-window", type=positive_int, default=None,
                        help="GPT-OSS's window in the tiny config (default: prompt + 3 x new tokens, enough for "
                             "speculative decoding with 2 drafts; 16 shows the documented limit)")
    args = parser.parse_args(argv)
    prompt_len, n_drafts = 8, 2
    overrides = {}
    if args.family == "gpt_oss":
        default_window = prompt_len + (1 + n_drafts) * args.max_new_tokens
        overrides["sliding_window"] = default_window if args.sliding_window is None else args.sliding_window

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        print("no CUDA device: running the decode steps eagerly (capture=False), same buffers and logic, no graphs")
    with tempfile.TemporaryDirectory() as workdir:
        setup = build(args.family, dtype=getattr(torch, args.dtype), device=device, batch=3, seq_len=prompt_len,
                      workdir=workdir, config_overrides=overrides)
        if overrides:
            print(f"tiny {args.family}: sliding window {overrides['sliding_window']} tokens")
        mm = attach(copy.deepcopy(setup.base), max_loras=4, max_rank=8)
        for name in ADAPTERS:
            mm.load_adapter(name, f"{workdir}/{name}")
        prompt, adapters = setup.input_ids, ["alpha", None, "gamma"]
        n = args.max_new_tokens

        graphs = DecodeGraphs(mm, batch_sizes=(1, 2, 4, 8), max_cache_len=prompt_len + 3 * n, capture=cuda)
        graphs.capture()
        ours, t_graphs = _timed(lambda: graphs.generate(prompt, adapters=adapters, max_new_tokens=n))
        ours, t_graphs = _timed(lambda: graphs.generate(prompt, adapters=adapters, max_new_tokens=n))
        theirs, t_eager = _timed(lambda: mm.generate(prompt, adapters=adapters, max_new_tokens=n, do_sample=False))
        same = agree(mm, ours, theirs, adapters, getattr(torch, args.dtype))
        label = "graph replay" if cuda else "static steps, eager"
        print(f"{args.family} {args.dtype} on {device}: batch {len(adapters)} (bucket {graphs.bucket_for(3)}), "
              f"adapters {adapters}, {ours.shape[1] - prompt.shape[1]} new tokens")
        print(f"  {label}: {t_graphs * 1e3:.1f} ms; mm.generate: {t_eager * 1e3:.1f} ms; "
              f"tokens: {same}")

        # speculative decoding: 2 draft tokens per step from a toy drafter (repeat the last token); the verify step
        # keeps what greedy decoding agrees with, so the tokens are the same whatever the drafts
        spec = DecodeGraphs(mm, batch_sizes=(4,), max_cache_len=prompt_len + 3 * n, num_speculative_tokens=n_drafts,
                            capture=cuda)
        spec.capture()
        drafter = lambda seqs: torch.stack([s[-1:].repeat(n_drafts) for s in seqs])
        spec_out = spec.generate(prompt, adapters=adapters, max_new_tokens=n, draft=drafter)
        spec_same = agree(mm, spec_out, theirs, adapters, getattr(torch, args.dtype))
        print(f"  speculative (k=2, repeat-last drafter): tokens: {spec_same}")

        # hot swap: new weights in alpha's slot, same graphs
        mm.load_adapter("alpha", f"{workdir}/beta", replace=True)
        swapped = graphs.generate(prompt, adapters=adapters, max_new_tokens=n)
        check = mm.generate(prompt, adapters=adapters, max_new_tokens=n, do_sample=False)
        swap_same = agree(mm, swapped, check, adapters, getattr(torch, args.dtype))
        print(f"  after hot-swapping 'alpha': tokens: {swap_same}; "
              f"graphs captured in all: {graphs.num_captures + spec.num_captures}")
        ok = "DIFFERENT" not in (same, spec_same, swap_same)
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
