"""The HBM floor of ``benchmarks/bench_decode.py`` (``step_bytes``): the bytes a decode step must read, checked by
differences that isolate one term each on a tiny GPT-OSS (one sliding-window layer of window 16, one full layer;
4 experts, top-2) built on the meta device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from moe_lora_compile.models.tiny import tiny_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_decode import step_bytes  # noqa: E402


@pytest.fixture(scope="module")
def model():
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config("gpt_oss"), dtype=torch.bfloat16)


def _kv_token_bytes(cfg) -> int:
    return 2 * cfg.num_key_value_heads * cfg.head_dim * 2  # K and V of one token, one layer, bf16


def test_sliding_layers_read_at_most_their_window(model):
    cfg = model.config
    assert cfg.layer_types == ["sliding_attention", "full_attention"] and cfg.sliding_window == 16
    per_token = _kv_token_bytes(cfg)
    # below the window both layers read every token; past it only the full layer's read grows
    assert step_bytes(model, 3, 11, 0, 4) - step_bytes(model, 3, 10, 0, 4) == pytest.approx(3 * 2 * per_token)
    assert step_bytes(model, 3, 41, 0, 4) - step_bytes(model, 3, 40, 0, 4) == pytest.approx(3 * 1 * per_token)


@pytest.mark.parametrize("batch, adapters", [
    (1, 1),  # one row: its adapter on its k experts
    (8, 2),  # 4 rows per adapter: each reaches fewer experts than the whole batch does
    (7, 3),  # rows 3 / 2 / 2: uneven
])
def test_lora_factors_of_the_experts_each_adapters_rows_reach(model, batch, adapters):
    cfg = model.config
    E, k, H, I, r = cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size, 4
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    rows = [batch // adapters + (a < batch % adapters) for a in range(adapters)]
    experts_reached = sum(E * (1 - (1 - k / E) ** n) for n in rows)  # expected, uniform routing
    per_layer = experts_reached * r * (2 * H + 3 * I) + adapters * r * (2 * (H + q) + 2 * (H + kv))
    want = cfg.num_hidden_layers * per_layer * 2  # bf16
    got = step_bytes(model, batch, 20, adapters, r) - step_bytes(model, batch, 20, 0, r)
    assert got == pytest.approx(want)
