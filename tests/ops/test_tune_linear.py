"""The ``lora_linear`` tuner (:mod:`moe_lora_compile.ops.triton.tune_linear`) on the CPU: its candidates, and a whole
run with the GPU timing replaced by a made-up cost (which config wins, a failing config skipped, the table written)."""

from __future__ import annotations

import pytest
import torch

from moe_lora_compile.ops.triton import configs as C
from moe_lora_compile.ops.triton import tune_linear as TL


def test_decode_shapes():
    shapes = {(s.model, s.proj): s for s in TL.decode_shapes(["gpt-oss-20b", "qwen3-30b-a3b"], ["qkv", "o"])}
    assert (shapes["gpt-oss-20b", "qkv"].n_in, shapes["gpt-oss-20b", "qkv"].n_out) == (2880, 5120)
    assert (shapes["gpt-oss-20b", "o"].n_in, shapes["gpt-oss-20b", "o"].n_out) == (4096, 2880)
    assert (shapes["qwen3-30b-a3b", "qkv"].n_in, shapes["qwen3-30b-a3b", "qkv"].n_out) == (2048, 5120)
    assert (shapes["qwen3-30b-a3b", "o"].n_in, shapes["qwen3-30b-a3b", "o"].n_out) == (4096, 2048)
    assert shapes["gpt-oss-20b", "o"].bias and not shapes["qwen3-30b-a3b", "o"].bias


@pytest.mark.parametrize("T", [1, 4, 8])
def test_stage1_candidates(T):
    s = TL.Shape("m", "qkv", 2880, 5120, True)
    cands = TL.stage1(T, s, 132)
    assert cands[0] == ("heuristic", C.default_linear_config(T, 2880, 5120, 132))
    assert len({c for _, c in cands}) == len(cands)  # no config twice
    block_t = 1 << (T - 1).bit_length()
    gemv = [c for label, c in cands if label == "gemv"]
    assert bool(gemv) == (T <= C.GEMV_DEFAULT_MAX_T)  # past the heuristic's GEMV range only GEMM tiles are timed
    assert all(c.gemv for c in gemv)
    assert all(block_t * c.gemm.BLOCK_N * c.gemm.BLOCK_K <= TL.ACC_PER_THREAD * 128 for c in gemv)
    assert all(1 <= c.gemm.SPLIT_K <= -(-2880 // c.gemm.BLOCK_K) for _, c in cands)
    gemm = [c for label, c in cands if label == "gemm"]
    assert gemm and not any(c.gemv for c in gemm)
    for best, labels in ((gemv[:1], {"warps", "shrink", "pdl"}), (gemm[:1], {"expand", "warps", "shrink", "pdl"})):
        if best:  # around a GEMV: no grouped expand to try; around a GEMM: expand_slots too
            around = TL.stage2(best)
            assert all(c != best[0] for _, c in around) and {label for label, _ in around} == labels


def test_whole_run_writes_the_winners(monkeypatch, tmp_path, capsys):
    """Made-up costs: the GEMV with 32 columns wins at T=1, the GEMM at T=8; one config raises and is skipped; the
    configs made wrong (outputs off the float32 reference) are rejected untimed, the fastest of them included."""
    def fake_time(layers, xs, ids_lora, ids_none, cfg):
        assert len(layers) == len(xs) == 2 and ids_lora.tolist() == list(range(len(ids_lora)))
        assert (ids_none == -1).all()
        assert not (cfg.gemv and cfg.gemm.BLOCK_N == 4), "a rejected config was timed"
        if cfg.gemv and cfg.gemm.BLOCK_N == 2 and len(ids_lora) == 1:
            return 0.0, 0.0  # fastest of all, and wrong (below): never kept
        if cfg.gemv and cfg.gemm.BLOCK_N == 16:
            raise RuntimeError("out of resources")
        T = len(ids_lora)
        cost = 10 + abs(cfg.gemm.BLOCK_N - 32) / 8 + (cfg.gemm.SPLIT_K != 4) + (cfg.gemm.num_warps != 4)
        cost += (0 if cfg.gemv else 5) if T == 1 else (5 if cfg.gemv else 0)
        return cost, cost - 1

    monkeypatch.setattr(TL, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(TL, "time_config", fake_time)

    def fake_output_error(layer, x, ids, expected, cfg):  # GEMV configs with 2 or 4 columns made wrong
        assert expected.dtype == torch.float32 and expected.shape == (len(ids), layer["w"].shape[0])
        return 0.5 if cfg.gemv and cfg.gemm.BLOCK_N in (2, 4) else 1e-3

    monkeypatch.setattr(TL, "output_error", fake_output_error)
    out = tmp_path / "table.json"
    assert TL.main(["--models", "qwen3-30b-a3b", "--projs", "o", "--tokens", "1", "8", "--layers", "2",
                    "--jobs", "0", "--out", str(out), "--no-package"]) == 0
    table = C.read_linear_table(out)
    buckets = table[C.linear_shape_key(4096, 2048, 32)]
    assert set(buckets) == {"1", "8"}
    assert buckets["1"].gemv and buckets["1"].gemm.BLOCK_N == 32 and buckets["1"].gemm.num_warps == 4
    assert not buckets["8"].gemv and buckets["8"].gemm.BLOCK_N == 32
    printed = capsys.readouterr().out
    assert "rejected gemv N2 K1024" in printed and "rejected gemv N4 K512" in printed
    assert "skipped gemv N16" in printed and "| qwen3-30b-a3b | o | 4096->2048 | 1 |" in printed


def test_output_error_runs_the_kernel():
    """The check itself, the kernel run for real (interpreter, float32, tiny): ~0 against the float32 reference,
    and the relative distance to a wrong expectation (half as large again: 1/3)."""
    gen = torch.Generator().manual_seed(0)
    layer = dict(w=torch.randn(24, 32, generator=gen), a=torch.randn(2, 8, 32, generator=gen),
                 b=torch.randn(2, 24, 8, generator=gen), bias=torch.randn(24, generator=gen))
    x, ids = torch.randn(3, 32, generator=gen), torch.tensor([0, -1, 1], dtype=torch.int32)
    cfg = C.default_linear_config(3, 32, 24)
    expected = TL.reference(layer, x, ids)
    assert TL.output_error(layer, x, ids, expected, cfg) < 1e-5
    assert TL.output_error(layer, x, ids, expected * 1.5, cfg) == pytest.approx(1 / 3, rel=1e-4)
