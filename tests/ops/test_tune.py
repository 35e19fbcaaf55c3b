"""The MoE kernel tuner (:mod:`moe_lora_compile.ops.triton.tune`) on the CPU: the kernels run for real in Triton's
interpreter (float32, a tiny geometry, 16/32-wide tiles), the GPU timing is replaced by a made-up cost. A candidate
whose outputs are wrong (here: made wrong on purpose, as a miscompiled tile shape would be) is never kept, however
fast it times; a starting config that is wrong stops the run."""

from __future__ import annotations

import pytest
import torch

from moe_lora_compile.ops.layout import CONCAT, TRANSPOSED_INTERLEAVED
from moe_lora_compile.ops.triton import tune as TU
from moe_lora_compile.ops.triton.configs import GemmConfig, MoEKernelConfig, ShrinkConfig
from moe_lora_compile.shapes import MoEGeometry

# H=32, I=16: two / one 16-wide column tiles; E=4, k=2 at T=4: 8 pairs over 4 experts
TINY = MoEGeometry("tiny", H=32, I=16, E=4, k=2, layers=1, layout=CONCAT, activation="silu", bias=False)
# MXFP4 needs K a multiple of the 32-value scale group: GPT-OSS's transposed, interleaved layout with biases
TINY_MXFP4 = MoEGeometry("tiny-mxfp4", H=64, I=64, E=4, k=2, layers=1, layout=TRANSPOSED_INTERLEAVED,
                         activation="gptoss_swiglu", bias=True)


def _start(block_k: int = 16) -> MoEKernelConfig:
    gemm = GemmConfig(BLOCK_N=16, BLOCK_K=block_k, GROUP_SIZE_M=1, num_warps=4, num_stages=1)
    return MoEKernelConfig(per_pair=True, fuse_shrink2=True, fuse_topk_sum=True, BLOCK_M=16, w13=gemm, w2=gemm,
                           shrink=ShrinkConfig(BLOCK_K=16, SPLIT_K=1, num_warps=4, num_stages=1))


def _fake_tuner(monkeypatch, cost: dict, wrong=lambda cfg: False):
    """The tuner with ``_time`` -> ``cost[w13.BLOCK_N]`` and the launch scaled by 1.5 where ``wrong(cfg)``."""
    timed = []

    def fake_time(args_sets, cfg, mxfp4=False):
        timed.append(cfg.w13.BLOCK_N)
        return cost[cfg.w13.BLOCK_N]

    def corrupt(launch):
        return lambda *args, config, **kwargs: launch(*args, config=config, **kwargs) * (1.5 if wrong(config) else 1)

    monkeypatch.setitem(TU.GEMM_CHOICES, "BLOCK_N", (16, 32, 64))  # (128-wide tiles: slow in the interpreter)
    monkeypatch.setattr(TU, "_time", fake_time)
    monkeypatch.setattr(TU, "fused_moe_lora_triton", corrupt(TU.fused_moe_lora_triton))
    monkeypatch.setattr(TU, "fused_moe_lora_mxfp4_triton", corrupt(TU.fused_moe_lora_mxfp4_triton))
    return timed


@pytest.mark.parametrize("geometry, mxfp4, block_k", [
    (TINY, False, 16),         # bf16 path's kernels (float32 here), concatenated gate/up
    (TINY_MXFP4, True, 32),    # MXFP4 blocks decoded in the GEMMs; the reference dequantizes first
])
def test_a_wrong_candidate_is_never_kept(monkeypatch, capsys, geometry, mxfp4, block_k):
    # BLOCK_N=32 times fastest but gives wrong outputs: the next fastest correct one (64) wins
    timed = _fake_tuner(monkeypatch, {16: 10.0, 32: 1.0, 64: 5.0}, wrong=lambda c: c.w13.BLOCK_N == 32)
    best, best_us, start_us = TU.tune_one(geometry, 2 if mxfp4 else 4, 16, L=2, start=_start(block_k), groups=("w13.BLOCK_N",),
                                          mxfp4=mxfp4, device="cpu", dtype=torch.float32)
    assert (best.w13.BLOCK_N, best_us, start_us) == (64, 5.0, 10.0)
    assert timed == [16, 64]  # 32 rejected before it is timed
    assert "w13.BLOCK_N: rejected, outputs 0.5 off the float32 reference" in capsys.readouterr().out


def test_a_wrong_start_stops_the_run(monkeypatch):
    _fake_tuner(monkeypatch, {16: 1.0}, wrong=lambda c: True)
    with pytest.raises(RuntimeError, match=r"tiny T=4 R=16: the starting config's outputs are 0\.5 off"):
        TU.tune_one(TINY, 4, 16, L=2, start=_start(), groups=("w13.BLOCK_N",), device="cpu", dtype=torch.float32)
