"""Model geometries and the benchmark grid: the one place for these numbers (from the models' public config.json).

H hidden, I expert intermediate, E routed experts, k experts per token. Layout names are those of :mod:`moe_lora_compile.ops.layout`,
activation names those of :mod:`moe_lora_compile.ops.contract`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ops.layout import CONCAT, TRANSPOSED_INTERLEAVED


@dataclass(frozen=True)
class MoEGeometry:
    """One MoE layer's shape: ``w13`` holds ``2I`` gate/up rows of width ``H``; ``w2`` maps ``I`` back to ``H``."""

    name: str
    H: int
    I: int
    E: int
    k: int
    layers: int
    layout: str
    activation: str
    bias: bool


@dataclass(frozen=True)
class BenchmarkGrid:
    """Token counts, adapter-slot counts, slot ranks and fractions of tokens without an adapter (id -1)."""

    tokens: tuple[int, ...]
    adapters: tuple[int, ...]
    ranks: tuple[int, ...]
    no_lora_fraction: tuple[float, ...]


GPT_OSS_20B = MoEGeometry("gpt-oss-20b", H=2880, I=2880, E=32, k=4, layers=24,
                          layout=TRANSPOSED_INTERLEAVED, activation="gptoss_swiglu", bias=True)
QWEN3_30B_A3B = MoEGeometry("qwen3-30b-a3b", H=2048, I=768, E=128, k=8, layers=48,
                            layout=CONCAT, activation="silu", bias=False)
MIXTRAL_8X7B = MoEGeometry("mixtral-8x7b", H=4096, I=14336, E=8, k=2, layers=32,
                           layout=CONCAT, activation="silu", bias=False)

MODELS: dict[str, MoEGeometry] = {m.name: m for m in (GPT_OSS_20B, QWEN3_30B_A3B, MIXTRAL_8X7B)}

BENCHMARK_GRID = BenchmarkGrid(
    tokens=(1, 2, 4, 8, 16, 32, 64, 128, 512, 2048),
    adapters=(1, 4, 16),
    ranks=(16, 32, 64),
    no_lora_fraction=(0.0, 0.5),
)


@dataclass(frozen=True)
class DecodeModel:
    """A whole model for the decode benchmark: its MoE geometry plus attention and vocabulary (public config.json;
    random weights stand in for the checkpoint). ``extra``: further config fields as ``(name, value)`` pairs."""

    moe: MoEGeometry
    model_type: str
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    extra: tuple = ()

    def hf_config(self):
        """The transformers config of this model: every field a shape or the routing depends on spelled out
        (defaults differ across 5.x); the rest are the config class's defaults (Qwen3-30B-A3B's rope_theta 1e6 and
        40960 positions are not set: they change no shape, so no timing). No dtype: the caller builds in bf16."""
        import transformers

        g = self.moe
        common = dict(hidden_size=g.H, num_hidden_layers=g.layers, num_attention_heads=self.heads,
                      num_key_value_heads=self.kv_heads, head_dim=self.head_dim, vocab_size=self.vocab,
                      num_experts_per_tok=g.k, tie_word_embeddings=False,
                      **{k: list(v) if isinstance(v, tuple) else v for k, v in self.extra})
        if self.model_type == "gpt_oss":
            return transformers.GptOssConfig(intermediate_size=g.I, num_local_experts=g.E, **common)
        if self.model_type == "qwen3_moe":
            return transformers.Qwen3MoeConfig(moe_intermediate_size=g.I, num_experts=g.E, **common)
        raise ValueError(f"no decode-benchmark config for model_type {self.model_type!r}")


DECODE_MODELS: dict[str, DecodeModel] = {
    "gpt-oss-20b": DecodeModel(GPT_OSS_20B, "gpt_oss", heads=64, kv_heads=8, head_dim=64, vocab=201088,
                               extra=(("sliding_window", 128),
                                      ("layer_types", ("sliding_attention", "full_attention") * 12))),
    "qwen3-30b-a3b": DecodeModel(QWEN3_30B_A3B, "qwen3_moe", heads=32, kv_heads=4, head_dim=128, vocab=151936,
                                 extra=(("intermediate_size", 6144), ("norm_topk_prob", True),
                                        ("decoder_sparse_step", 1), ("mlp_only_layers", []))),
}


def get_model(name: str) -> MoEGeometry:
    """Geometry by name (``gpt-oss-20b``, ``qwen3-30b-a3b``, ``mixtral-8x7b``); ValueError names the choices."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    return MODELS[name]
