"""Config tables for an A/B run: the configs this GPU reads now (its tuned tables, else the heuristics), with some
coordinates changed, written under a name of their own that ``MOE_LORA_CONFIGS=<name>`` then selects.

    python benchmarks/variant_tables.py --name EXP_SHRINK4 --models gpt-oss-20b --set shrink.SPLIT_K=4
    MOE_LORA_CONFIGS=EXP_SHRINK4 python benchmarks/bench_decode.py ...       # the variant
    python benchmarks/bench_decode.py ...                                     # the baseline

Covers each model's fused q/k/v and o projections (``lora_linear``) and its MoE layer, at every power-of-two T up
to ``--max-t`` (so prefill keeps the configs it had); ``--set`` applies at the T of ``--tokens`` only. Writes
``moe_lora_compile/configs/<name>.json`` and ``<name>_linear.json`` (the ``--set`` coordinates a config lacks are
skipped for that kind: ``gemm.*`` is the linear configs', ``w13.*`` / ``w2.*`` the MoE's). Delete them after.
"""

from __future__ import annotations

import argparse
import sys

import torch

from moe_lora_compile.ops.triton import configs as C
from moe_lora_compile.ops.triton.tune_linear import decode_shapes
from moe_lora_compile.shapes import DECODE_MODELS


def _value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return int(text)
    except ValueError:
        return text


def _apply(cfg, changes: dict):
    """``cfg`` with those of ``changes`` whose first name part it has."""
    fields = {f for f in type(cfg).__dataclass_fields__}
    mine = {k: v for k, v in changes.items() if k.split(".", 1)[0] in fields}
    return cfg.replace(**mine) if mine else cfg


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", required=True, help="the table name (MOE_LORA_CONFIGS=<name> selects it)")
    p.add_argument("--models", nargs="+", default=["gpt-oss-20b"], choices=sorted(DECODE_MODELS))
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8], help="T buckets that get --set")
    p.add_argument("--max-t", type=int, default=4096)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="config coordinates, e.g. shrink.SPLIT_K=4 pdl=early per_pair_shrink=false")
    args = p.parse_args(argv)
    changes = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--set {item!r}: use KEY=VALUE")
        changes[key] = _value(value)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    buckets = [1 << i for i in range(args.max_t.bit_length()) if 1 << i <= args.max_t]
    linear, moe = {}, {}
    for shape in decode_shapes(args.models, ("qkv", "o")):
        key = C.linear_shape_key(shape.n_in, shape.n_out, args.rank)
        # (the lookup hands a GEMV entry past GEMV_MAX_T to the heuristic: keep those buckets out, as it would)
        linear[key] = {str(T): _apply(cfg, changes) if T in args.tokens else cfg for T in buckets
                       for cfg in [C.get_linear_config(device, T, shape.n_in, shape.n_out, args.rank, num_sms)]}
    for name in args.models:
        g = DECODE_MODELS[name].moe
        key = C.shape_key(g.E, g.H, g.I, args.rank)
        moe[key] = {str(T): _apply(cfg, changes) if T in args.tokens else cfg for T in buckets
                    for cfg in [C.get_config(device, g.E, g.H, g.I, args.rank, T, g.k)]}
    C.write_table(C.CONFIG_DIR / C.gpu_file_name(args.name), moe)
    C.write_linear_table(C.CONFIG_DIR / C.linear_file_name(args.name), linear)
    print(f"wrote {C.gpu_file_name(args.name)} and {C.linear_file_name(args.name)} in {C.CONFIG_DIR}: "
          f"{len(linear)} linear shapes, {len(moe)} MoE shapes, {len(buckets)} T buckets, set {changes} at "
          f"T in {args.tokens}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
