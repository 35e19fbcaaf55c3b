"""The consumers' sum of the shrink's split-K slices (:func:`moe_lora_compile.ops.triton.moe_kernels.sum_split_slices`):
the GEMV's and the dense GEMM's epilogue, and the MoE w13 / w2 kernels, load SPLIT_CHUNK slices at a time
(:func:`moe_lora_compile.ops.triton.launch.split_chunk`). Each row below runs one slice at a time, chunks of 2 with a
partial last chunk (5 slices = 2 + 2 + 1) and the default (one chunk, its padding slices masked), in Triton's
interpreter, float32, against the float64 oracle."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from support.cases import MoECase
from support.oracle import lora_linear_oracle, moe_lora_oracle

from moe_lora_compile import settings
from moe_lora_compile.ops.triton import launch
from moe_lora_compile.ops.triton.configs import GemmConfig, LinearKernelConfig, MoEKernelConfig, ShrinkConfig
from moe_lora_compile.ops.triton.launch import fused_moe_lora_triton, lora_linear_triton, split_chunk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SLICES = 5  # shrink split-K of every row: 80 inputs in K steps of 16
GEMM = GemmConfig(BLOCK_N=16, BLOCK_K=16, GROUP_SIZE_M=1, num_warps=4, num_stages=1)
SHRINK = ShrinkConfig(BLOCK_K=16, SPLIT_K=SLICES, num_warps=4, num_stages=1)

# SPLIT_SUM_ELEMS per row of the chunking: a [rows, BLOCK_R] tile is 16 x 16 in the GEMM/MoE kernels
CHUNKINGS = [
    pytest.param(256, 1, id="one-slice-at-a-time"),  # the loop of single loads
    pytest.param(512, 2, id="chunks-of-2"),          # three chunks, the last one with a single slice
    pytest.param(launch.SPLIT_SUM_ELEMS, 8, id="default"),  # one chunk of 8, slices 5..7 masked
]


def test_split_chunk_switch(set_switch):
    """MOE_LORA_SPLIT_CHUNK=0: one slice at a time everywhere (the A/B baseline)."""
    set_switch(settings.SPLIT_CHUNK, "0")
    assert split_chunk(23, 1, 32) == 1
    set_switch(settings.SPLIT_CHUNK, None)
    assert split_chunk(23, 1, 32) == 32


def test_split_chunk_rule():
    assert split_chunk(1, 16, 32) == 1  # a single slice: nothing to sum
    assert split_chunk(23, 1, 32) == 32  # the GEMV at batch 1: every slice in one load
    assert split_chunk(23, 8, 32) == 16  # batch 8: capped by the register budget (power of 2)
    assert split_chunk(45, 16, 32) == 8  # the MoE w2 at GPT-OSS's fused shrink2 slices
    assert split_chunk(5, 64, 128) == 1  # a tile too large for any chunk


@pytest.mark.parametrize("elems,chunk", CHUNKINGS)
@pytest.mark.parametrize("T,gemv,ids", [
    (1, True, [2]),                  # the GEMV at batch 1 (one token row; elems scaled to its 1-row tile below)
    (3, True, [0, -1, 2]),           # the GEMV, a token without adapter
    (5, False, [1, 0, -1, 1, 2]),    # the dense GEMM path (per-token shrink, 16-row block)
])
def test_lora_linear_split_sums(monkeypatch, elems, chunk, T, gemv, ids):
    rows = triton_rows(T) if gemv else 16
    monkeypatch.setattr(launch, "SPLIT_SUM_ELEMS", elems * rows // 16)
    assert split_chunk(SLICES, rows, 16) == chunk
    g = torch.Generator().manual_seed(T)
    L, R, n_in, n_out = 3, 8, 16 * SLICES, 24
    x = torch.randn(T, n_in, generator=g)
    w = torch.randn(n_out, n_in, generator=g) * n_in ** -0.5
    a = torch.randn(L, R, n_in, generator=g) * n_in ** -0.5
    b = torch.randn(L, n_out, R, generator=g)
    lora = torch.tensor(ids, dtype=torch.int32)
    cfg = LinearKernelConfig(BLOCK_M=16, per_token=True, gemv=gemv, gemm=GEMM, shrink=SHRINK)
    y = lora_linear_triton(*(t.to(DEVICE) for t in (x, w, a, b, lora)), config=cfg)
    torch.testing.assert_close(y.cpu().double(), lora_linear_oracle(x, w, a, b, lora), rtol=1e-4, atol=1e-4)


def triton_rows(T: int) -> int:
    return 1 << (T - 1).bit_length()


@pytest.mark.parametrize("elems,chunk", CHUNKINGS)
@pytest.mark.parametrize("per_pair", [False, True], ids=["sorted", "per-pair"])  # w13's s13, w2's fused s2
def test_moe_split_sums(monkeypatch, elems, chunk, per_pair):
    """w13 sums the shrink13's 5 slices (H = 80); w2 sums shrink2's, fused into w13: one per 16-wide I tile
    (I = 80: 5 slices)."""
    monkeypatch.setattr(launch, "SPLIT_SUM_ELEMS", elems)
    assert split_chunk(SLICES, 16, 16) == chunk
    case = MoECase(T=4, H=16 * SLICES, I=16 * SLICES, E=4, k=2, L=3, R=16, lora="alternate",
                   topk_dtype=torch.int32)
    args, kwargs = case.make(DEVICE)
    cfg = MoEKernelConfig(per_pair=per_pair, fuse_shrink2=True, BLOCK_M=16, w13=GEMM, w2=replace(GEMM),
                          shrink=SHRINK)
    y = fused_moe_lora_triton(*args, **kwargs, config=cfg)
    torch.testing.assert_close(y.cpu().double(), moe_lora_oracle(*args, **kwargs).cpu(), rtol=1e-4, atol=1e-4)
