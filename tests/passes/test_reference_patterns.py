"""The pass on small modules that call the references (every MoE variant, both linear forms) and on PEFT's own
LoRA linear: one compile per dtype covers all variants (compiles are the expensive part on 2 CPU cores)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moe_lora_compile.ops.reference import fused_moe_lora_reference, lora_linear_reference

from pass_helpers import RecordingPass, pass_always_runs

H, I, E, K, L, R = 16, 12, 4, 2, 3, 4

# One MoE layer per row; each row names the edge case it covers.
MOE_VARIANTS = [
    # Qwen3-MoE / Mixtral / OLMoE: [E,2I,H] weights, silu-GLU, routing weight on the output
    dict(layout="concat", activation="silu"),
    # Llama-4: transposed concat weights, routing weight scales the expert input
    dict(layout="transposed_concat", activation="silu", routing_weight_on_input=True),
    # GPT-OSS: transposed interleaved weights, clamped swiglu, both biases
    dict(layout="transposed_interleaved", activation="gptoss_swiglu", w13_bias=True, w2_bias=True),
    # non-default swiglu constants read from the graph; only the gate/up bias
    dict(layout="concat", activation="gptoss_swiglu", alpha=1.5, limit=5.0, w13_bias=True),
    # only the down bias, transposed concat
    dict(layout="transposed_concat", activation="silu", w2_bias=True),
]
# token_lora_ids pattern: mixed slots and -1 (no adapter)
TOKEN_IDS = [0, 1, -1, 2, 0, -1, 2, 1] * 4


class MoELayer(nn.Module):
    """One MoE layer through the reference, with its own router and LoRA slots."""

    def __init__(self, dtype, layout, activation, w13_bias=False, w2_bias=False, **attrs):
        super().__init__()
        transposed = layout.startswith("transposed")
        rand = lambda *s: nn.Parameter(torch.randn(*s, dtype=dtype) / s[-1] ** 0.5, requires_grad=False)
        self.router = rand(H, E)
        self.w13 = rand(E, H, 2 * I) if transposed else rand(E, 2 * I, H)
        self.w2 = rand(E, I, H) if transposed else rand(E, H, I)
        self.a13, self.b13 = rand(L, E, R, H), rand(L, E, 2 * I, R)
        self.a2, self.b2 = rand(L, E, R, I), rand(L, E, H, R)
        self.w13_bias = rand(E, 2 * I) if w13_bias else None
        self.w2_bias = rand(E, H) if w2_bias else None
        self.attrs = dict(layout=layout, activation=activation, **attrs)

    def forward(self, x, ids):
        weights, experts = torch.topk((x @ self.router).softmax(-1), K)
        return fused_moe_lora_reference(
            x, experts, weights.to(x.dtype), ids, self.w13, self.w2, self.a13, self.b13, self.a2, self.b2,
            w13_bias=self.w13_bias, w2_bias=self.w2_bias, **self.attrs)


class PeftStyleLinear(nn.Module):
    """PEFT's single-adapter form ``base(x) + lora_B(lora_A(x)) * s`` on a 3-D input, written out by hand."""

    def __init__(self, dtype):
        super().__init__()
        self.base = nn.Linear(H, H, dtype=dtype)
        self.lora_A = nn.Linear(H, R, bias=False, dtype=dtype)
        self.lora_B = nn.Linear(R, H, bias=False, dtype=dtype)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x)) * 0.5


def _peft_model(dtype):
    """A real PEFT LoRA linear (``get_peft_model``), B initialised non-zero."""
    from peft import LoraConfig, get_peft_model

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(H, H, bias=False, dtype=dtype)

        def forward(self, x):
            return self.proj(x)

    cfg = LoraConfig(r=R, lora_alpha=2 * R, target_modules=["proj"], init_lora_weights=False)
    return get_peft_model(Tiny(), cfg).eval()


class Zoo(nn.Module):
    """Every variant in one forward: each output is checked separately."""

    def __init__(self, dtype):
        super().__init__()
        self.moe = nn.ModuleList(MoELayer(dtype, **v) for v in MOE_VARIANTS)
        rand = lambda *s: nn.Parameter(torch.randn(*s, dtype=dtype) / s[-1] ** 0.5, requires_grad=False)
        self.lin_w, self.lin_b, self.lin_a, self.lin_bb = rand(H, H), rand(H), rand(L, R, H), rand(L, H, R)
        self.peft_style = PeftStyleLinear(dtype).requires_grad_(False)
        self.peft = _peft_model(dtype).requires_grad_(False)
        self.register_buffer("token_lora_ids", torch.tensor(TOKEN_IDS, dtype=torch.int32))

    def forward(self, x):
        ids = self.token_lora_ids[: x.shape[0]]
        outs = [layer(x, ids) for layer in self.moe]
        outs.append(lora_linear_reference(x, self.lin_w, self.lin_a, self.lin_bb, ids, bias=self.lin_b))
        outs.append(lora_linear_reference(x, self.lin_w, self.lin_a, self.lin_bb, ids))
        outs.append(self.peft_style(x.unsqueeze(0)))
        outs.append(self.peft(x.unsqueeze(0)))
        return outs


N_LINEAR = 4  # two reference lora_linear (with / without bias), one PEFT-style, one real PEFT


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def compiled_zoo(request):
    torch.manual_seed(0)
    dtype = request.param
    model = Zoo(dtype)
    recorder = RecordingPass()
    # the plain torch.compile entry point
    compiled = torch.compile(model, fullgraph=True, options={"post_grad_custom_post_pass": recorder})
    results = []
    with pass_always_runs(recorder):
        for T in (5, 7):  # second size within the dynamic range: no recompile
            x = torch.randn(T, H, dtype=dtype)
            torch._dynamo.mark_dynamic(x, 0)
            results.append((compiled(x), model(x)))
    return dtype, recorder, results


def test_every_variant_is_rewritten(compiled_zoo):
    _, recorder, _ = compiled_zoo
    assert len(recorder.graphs) == 1, "one graph, the second size reuses it"
    graph = recorder.graphs[0]
    assert graph["fused_moe_lora"] == len(MOE_VARIANTS)
    assert graph["lora_linear"] == N_LINEAR
    assert recorder.counts["fused_moe_lora[pairwise]"] == len(MOE_VARIANTS)
    assert recorder.counts["lora_linear[multi]"] == 2 and recorder.counts["lora_linear[peft]"] == 2
    # no unfused expert or LoRA matmuls left: the only mm left is the routers' (one per MoE layer)
    assert graph["aten.bmm.default"] == 0
    assert graph["aten.mm.default"] + graph["aten.addmm.default"] == len(MOE_VARIANTS)


def test_compiled_equals_eager(compiled_zoo):
    dtype, _, results = compiled_zoo
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for got_all, want_all in results:
        for i, (got, want) in enumerate(zip(got_all, want_all)):
            torch.testing.assert_close(got, want, **tol, msg=lambda m: f"output {i}: {m}")
