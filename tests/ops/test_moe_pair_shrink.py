"""The per-pair LoRA shrink of ``fused_moe_lora`` (config ``per_pair_shrink``,
:func:`moe_lora_compile.ops.triton.moe_kernels.lora_shrink_pairs_kernel`) against the block shrink and the float64
oracle.

CPU: Triton's interpreter, float32, tiny shapes (16-wide tiles). The other kernel tests take the heuristic
(``per_pair_shrink`` unset: on in sorted mode at these sizes, off in per-pair mode); here each row runs both.
GPU (``-m gpu``): bf16 at the real shapes, on vs off, and the heuristic's choice.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moe_lora_compile import settings
from support.cases import MoECase
from support.oracle import moe_lora_oracle
from test_split_b13_and_out import split_problem

from moe_lora_compile.ops.triton import moe_kernels as K
from moe_lora_compile.ops.triton.configs import (PAIR_SHRINK_MAX_PAIRS, GemmConfig, MoEKernelConfig, ShrinkConfig,
                                                 default_config, default_per_pair_shrink)
from moe_lora_compile.ops.triton.launch import _launch_shrink, fused_moe_lora_triton
from moe_lora_compile.ops.triton.routing import sort_pairs
from moe_lora_compile.shapes import GPT_OSS_20B, QWEN3_30B_A3B

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_GEMM = GemmConfig(BLOCK_N=16, BLOCK_K=16, GROUP_SIZE_M=2, num_warps=4, num_stages=1)


def config(per_pair: bool, pair_shrink: bool, shrink_split: int = 2, split13: int = 1,
           fuse_shrink2: bool = False) -> MoEKernelConfig:
    """Tiny tiles; the w2 shrink a launch of its own by default (so both shrinks take the switch)."""
    return MoEKernelConfig(per_pair=per_pair, BLOCK_M=16, w13=replace(_GEMM, SPLIT_K=split13), w2=_GEMM,
                           shrink=ShrinkConfig(BLOCK_K=16, SPLIT_K=shrink_split, num_warps=4, num_stages=1),
                           fuse_shrink2=fuse_shrink2, per_pair_shrink=pair_shrink)


def case(**fields) -> MoECase:
    return MoECase(**{**dict(H=32, I=16, L=3, R=8, lora="mixed", topk_dtype=torch.int32), **fields})


# (case, per_pair mode, config changes)
ROWS = [
    # one token, one slot, top_k 1, sorted mode
    pytest.param(case(T=1, k=1, L=1, lora="all"), False, {}, id="T1-k1-one-slot"),
    # -1 tokens and every slot mixed in the blocks, k=2, K in 2 slices of 16
    pytest.param(case(T=7, k=2), False, {}, id="mixed-slots-minus-one"),
    # no token has an adapter: every pair program exits at once, base result
    pytest.param(case(T=5, lora="none"), False, {}, id="all-minus-one"),
    # experts 1 and 3 get no pair (empty experts); 3 shrink slices of uneven K (H=40: 16+16+8)
    pytest.param(case(T=5, E=6, H=40, experts=(0, 2, 4, 5)), False, {"shrink_split": 3}, id="empty-experts-split3"),
    # every pair on expert 2 (k=1), 20 pairs: two blocks of one expert; one shrink slice
    pytest.param(case(T=20, k=1, E=4, experts=(2,)), False, {"shrink_split": 1}, id="one-expert-split1"),
    # GPT-OSS: transposed interleaved, biases, clamped swiglu; w13 split-K (its counters zeroed by the pair shrink)
    pytest.param(case(T=5, layout="transposed_interleaved", activation="gptoss_swiglu", bias=True, limit=0.5,
                      lora="alternate"), False, {"split13": 2}, id="gptoss-bias-split13"),
    # Llama-4: routing weight on the input (the shrink scales s13 by it), transposed concat
    pytest.param(case(T=5, layout="transposed_concat", routing_weight_on_input=True), False, {},
                 id="llama4-weight-on-input"),
    # sorted, w2 shrink fused into w13: only shrink13 takes the switch
    pytest.param(case(T=6, k=3, E=5, L=2), False, {"fuse_shrink2": True}, id="sorted-fused-shrink2"),
    # per-pair mode (row = pair * 16), k=3: shrink13 zeroes the w2 top-k-sum counters; separate w2 shrink
    pytest.param(case(T=3, k=3, E=8), True, {}, id="per-pair-mode-k3"),
    # per-pair mode, weight on input, k=1
    pytest.param(case(T=2, k=1, routing_weight_on_input=True, layout="transposed_concat"), True, {},
                 id="per-pair-mode-k1-weight-on-input"),
]


@pytest.mark.parametrize("c, per_pair, changes", ROWS)
def test_pair_shrink_on_off_match_oracle(c, per_pair, changes):
    """The op with the per-pair shrink on and off: both equal the float64 oracle, and each other up to fp32
    summation order (an elementwise sum over K against a ``tl.dot``)."""
    args, kwargs = c.make(DEVICE)
    ref = moe_lora_oracle(*args, **kwargs).cpu()
    y_on = fused_moe_lora_triton(*args, **kwargs, config=config(per_pair, True, **changes)).cpu().double()
    y_off = fused_moe_lora_triton(*args, **kwargs, config=config(per_pair, False, **changes)).cpu().double()
    torch.testing.assert_close(y_on, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y_off, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y_on, y_off, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("per_pair", [False, True], ids=["sorted", "per-pair-mode"])
def test_pair_shrink_split_b13_and_out(per_pair):
    """The split gate/up B13 (``lora_b13_split``, w2 rank R2 != R) written into ``out=``: the per-pair shrink's
    rows feed the masked expand as the block shrink's do."""
    c = case(T=6, k=2, L=3, R=8, layout="interleaved", activation="gptoss_swiglu", bias=True, limit=0.5)
    split, kwargs, full, full_kwargs = split_problem(c, 4, DEVICE)
    ref = moe_lora_oracle(*full, **full_kwargs).cpu()
    for pair_shrink in (True, False):
        out = torch.full((c.T, c.H), float("nan"), device=DEVICE)
        y = fused_moe_lora_triton(*split, **kwargs, out=out, config=config(per_pair, pair_shrink))
        assert y is out
        torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode, by_token, scale", [
    (K.SORTED, True, False),    # shrink13: x by token, rows of the sorted order (pair_row)
    (K.SORTED, False, False),   # shrink2: act by row
    (K.SORTED, True, True),     # routing weight on input: s scaled by the pair's weight
    (K.PER_PAIR, True, False),  # per-pair mode: pair p at row p*16
], ids=["sorted-x", "sorted-act", "sorted-weighted", "per-pair-mode"])
def test_pair_shrink_writes_the_block_shrinks_rows(mode, by_token, scale):
    """Kernel level: the per-pair shrink writes, at every row with LoRA, the block shrink's values (= the float64
    ``in @ A[l, e]^T``, times the weight), in every split-K slice; it zeroes the counters it is given, from a grid
    smaller than the counter array (the strided loop)."""
    T, k, E, L, R, K_dim = 6, 2, 4, 3, 8, 40
    g = torch.Generator().manual_seed(5)
    topk = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
    lora = torch.tensor([0, -1, 2, 1, 2, -1], dtype=torch.int32)
    weights = torch.rand(T * k, generator=g)
    a = torch.randn(L, E, R, K_dim, generator=g)
    if mode == K.SORTED:
        routing = sort_pairs(topk.to(DEVICE), lora.to(DEVICE), E, L, 16)
        row_pair, block_expert, num_blocks, grid_m = (routing.row_pair, routing.block_expert, routing.num_blocks,
                                                      routing.grid_m)
        pair_row = routing.pair_row.cpu().long()
        assert torch.equal(routing.row_pair.cpu()[pair_row], torch.arange(T * k, dtype=torch.int32))
    else:
        row_pair = block_expert = num_blocks = None
        grid_m, pair_row = T * k, torch.arange(T * k) * 16
    rows = grid_m * 16
    inp = torch.randn(T if by_token else rows, K_dim, generator=g)
    meta = (row_pair, block_expert, topk.reshape(-1).to(DEVICE), num_blocks, T * k, grid_m)
    shrink = ShrinkConfig(BLOCK_K=16, SPLIT_K=2, num_warps=4, num_stages=1)
    s = {}
    for on in (True, False):
        # more than 128 counters per program (12 pairs x 2 slices): the loop strides over the whole grid
        counters = torch.full((24 * 128 + 300,), 7, dtype=torch.int32, device=DEVICE)
        s[on] = _launch_shrink(inp.to(DEVICE), a.to(DEVICE), weights.to(DEVICE), lora.to(DEVICE), meta, K_dim=K_dim,
                               R=R, top_k=k, mode=mode, block_m=16, input_by_token=by_token, scale_by_weight=scale,
                               cfg=shrink, dtype=torch.float32, launch={}, counters=counters,
                               pair_row=routing.pair_row if mode == K.SORTED else None, per_pair_shrink=on).cpu()
        assert (counters == 0).all()
    pairs = torch.nonzero(lora.repeat_interleave(k) >= 0).flatten()
    for p in pairs.tolist():
        row = int(pair_row[p])
        x = inp[p // k] if by_token else inp[row]
        want = a[lora[p // k], topk.reshape(-1)[p]].double() @ x.double() * (weights[p].double() if scale else 1)
        torch.testing.assert_close(s[True][:, row].sum(0).double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s[True][:, row], s[False][:, row], rtol=1e-5, atol=1e-5)


def test_heuristic_is_on_unless_switched_off(set_switch):
    """The heuristic runs the per-pair shrink in sorted mode at decode sizes (batch 8 of GPT-OSS-20B: 32 pairs) by
    default, as measured on the H100; MOE_LORA_PAIR_SHRINK=0 keeps the block shrink."""
    g = GPT_OSS_20B
    set_switch(settings.PAIR_SHRINK, None)
    assert default_per_pair_shrink(False, 32)
    assert default_config(g.E, g.H, g.I, 32, 8, g.k).per_pair_shrink is True
    set_switch(settings.PAIR_SHRINK, "0")
    assert not default_per_pair_shrink(False, 32)
    assert default_config(g.E, g.H, g.I, 32, 8, g.k).per_pair_shrink is False


def test_heuristic_and_config_field(set_switch):
    """With the switch on: on in sorted mode up to PAIR_SHRINK_MAX_PAIRS pairs, off above and in per-pair mode; an
    entry without the field (tuned before it existed) parses, round-trips, and takes the heuristic of the call."""
    set_switch(settings.PAIR_SHRINK, "1")
    assert default_per_pair_shrink(False, 32) and default_per_pair_shrink(False, PAIR_SHRINK_MAX_PAIRS)
    assert not default_per_pair_shrink(False, PAIR_SHRINK_MAX_PAIRS + 1) and not default_per_pair_shrink(True, 4)
    g = GPT_OSS_20B
    assert default_config(g.E, g.H, g.I, 32, 8, g.k).per_pair_shrink is True  # batch 8: sorted, 32 pairs
    assert default_config(g.E, g.H, g.I, 32, 1, g.k).per_pair_shrink is False  # batch 1: per-pair mode
    assert default_config(g.E, g.H, g.I, 32, 2048, g.k).per_pair_shrink is False  # prefill
    legacy = {k: v for k, v in config(False, True).to_dict().items() if k != "per_pair_shrink"}
    cfg = MoEKernelConfig.from_dict(legacy)
    assert cfg.per_pair_shrink is None and MoEKernelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.uses_per_pair_shrink(64) and not cfg.uses_per_pair_shrink(PAIR_SHRINK_MAX_PAIRS + 1)
    assert not cfg.replace(per_pair_shrink=False).uses_per_pair_shrink(64)
    from moe_lora_compile.ops.triton import tune  # the tuner's coordinate: the other kernel, nothing else changed
    sorted_cfg = default_config(g.E, g.H, g.I, 32, 8, g.k)
    assert list(tune._candidates(sorted_cfg, 8, g, "per_pair_shrink")) == [sorted_cfg.replace(per_pair_shrink=False)]
    assert "per_pair_shrink" in tune.GROUPS


def _rel_err(y, ref):
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("geometry", [GPT_OSS_20B, QWEN3_30B_A3B], ids=lambda g: g.name)
@pytest.mark.parametrize("T,L,R,lora", [
    (8, 8, 32, "all"),         # the measured decode case: 8 tokens of 8 adapters
    (32, 8, 32, "alternate"),  # half the tokens without adapter
    (64, 4, 64, "all"),        # up to the threshold on Qwen3 (512 pairs), R=64
])
def test_gpu_pair_shrink_on_off_agree(geometry, T, L, R, lora):
    """bf16, real shapes, sorted mode: per-pair shrink on and off both match the fp32 reference (the LoRA delta
    too), agree closely with each other, and repeat bit for bit; with PDL on and off alike."""
    from moe_lora_compile.ops.triton.configs import get_config
    c = MoECase.of_geometry(geometry, T, L, R, lora)
    args, kwargs = c.make("cuda", dtype=torch.bfloat16)
    no_lora = list(args)
    no_lora[3] = torch.full_like(args[3], -1)
    ref, ref0 = moe_lora_oracle(*args, **kwargs), moe_lora_oracle(*no_lora, **kwargs)
    base = get_config(args[0].device, c.E, c.H, c.I, c.R, T, c.k).replace(per_pair=False)
    ys = {}
    for on in (True, False):
        for pdl in (False, True):
            cfg = base.replace(per_pair_shrink=on, pdl=pdl)
            y = fused_moe_lora_triton(*args, **kwargs, config=cfg)
            assert torch.equal(y, fused_moe_lora_triton(*args, **kwargs, config=cfg)), cfg
            assert _rel_err(y, ref) < 1e-2, cfg
            y0 = fused_moe_lora_triton(*no_lora, **kwargs, config=cfg)
            assert _rel_err(y.float() - y0.float(), ref - ref0) < 5e-2, cfg
            ys[on, pdl] = y
    assert torch.equal(ys[True, False], ys[True, True])
    assert _rel_err(ys[True, False], ys[False, False]) < 5e-3


@pytest.mark.gpu
def test_gpu_pair_shrink_is_the_default_at_decode_batches(set_switch):
    """With MOE_LORA_PAIR_SHRINK=1 the op's own config (tuned entry or heuristic) runs the per-pair shrink at batch
    8 on GPT-OSS-20B (sorted mode), and its result matches the reference."""
    set_switch(settings.PAIR_SHRINK, "1")
    from moe_lora_compile.ops.triton.configs import get_config
    g = GPT_OSS_20B
    cfg = get_config(torch.device("cuda"), g.E, g.H, g.I, 32, 8, g.k)
    assert cfg.per_pair or cfg.per_pair_shrink
    c = MoECase.of_geometry(g, 8, 8, 32, "all")
    args, kwargs = c.make("cuda", dtype=torch.bfloat16)
    assert _rel_err(torch.ops.moe_lora.fused_moe_lora(*args, **kwargs), moe_lora_oracle(*args, **kwargs)) < 1e-2
