"""The demo's second way in: a plain PEFT model (what a user already has) compiled with ``torch.compile(...,
options={"post_grad_custom_post_pass": MoELoRAPass()})``, checked against PEFT eager.

The model is the demo family's tiny config with one decoder layer (DeepSeek-V3: its first layer made MoE), one
PEFT adapter on the experts (``target_parameters``) and the family's dense targets, random non-zero LoRA weights.
:func:`~moe_lora_compile.peft_compat.functional_expert_lora` runs PEFT's expert wrapper without its per-forward
parametrization (which would break the graph and recompile the experts on every call); the pass then fuses each
MoE layer into one ``fused_moe_lora`` over ``W`` and the adapter's factors, and each adapted linear into one
``lora_linear``.
"""

from __future__ import annotations

import time
import warnings

from . import progress


def _peft_model(family: str, dtype, device):
    import torch
    from peft import get_peft_model
    from peft.tuners.lora import Linear as LoraLinear
    from transformers import AutoModelForCausalLM

    from .models.tiny import randomize_lora_, tiny_config, tiny_lora_config

    overrides = dict(num_hidden_layers=1)
    if family == "deepseek_v3":
        overrides["first_k_dense_replace"] = 0  # its dense first layer would leave no MoE layer
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).eval()
    n_moe = sum(name.endswith(".experts") for name, _ in base.named_modules())
    with warnings.catch_warnings():  # PEFT 0.21 calls a property transformers 5.x deprecated; not ours
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = get_peft_model(base, tiny_lora_config(family))
    randomize_lora_(model)
    n_linear = sum(isinstance(m, LoraLinear) for m in model.modules())
    return model.eval().to(device=device, dtype=dtype), n_moe, n_linear


def run_peft_demo(family: str, *, dtype, device, batch: int, seq_len: int) -> dict:
    """Compile a tiny PEFT model of ``family`` with the pass; returns the report (see :func:`format_peft`)."""
    import torch

    from .compile import pass_runs
    from .passes import MoELoRAPass
    from .peft_compat import functional_expert_lora

    progress.say(f"building a tiny {family} PEFT model (experts via target_parameters + dense targets)")
    model, n_moe, n_linear = _peft_model(family, dtype, device)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, vocab, (batch, seq_len), generator=generator).to(device)
    # what must not recompile: new tokens, a smaller batch
    later = [torch.randint(3, vocab, (batch, seq_len), generator=generator).to(device), input_ids[: max(2, batch // 2)]]
    with torch.no_grad():
        eager = [model(ids).logits for ids in [input_ids] + later]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    custom_pass = MoELoRAPass()
    compiled = torch.compile(functional_expert_lora(model),
                             options={"post_grad_custom_post_pass": custom_pass, "shape_padding": False})
    torch._dynamo.mark_dynamic(input_ids, 0)
    started = time.perf_counter()
    with progress.step("compiling the PEFT model (first call)"), pass_runs(), torch.no_grad():
        logits = [compiled(input_ids).logits]
    compile_s = time.perf_counter() - started
    counters = torch._dynamo.utils.counters
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    with torch.no_grad():
        logits += [compiled(ids).logits for ids in later]
    recompiles = counters["stats"]["unique_graphs"] - graphs
    torch._dynamo.reset()
    functional_expert_lora(model, enable=False)
    err = max((got.float() - want.float()).abs().max().item() for got, want in zip(logits, eager))
    top = max(want.float().abs().max().item() for want in eager)
    tol = 1e-3 if dtype == torch.float32 else 5e-2 * max(1.0, top)
    counts = dict(custom_pass.counts)
    fused_moe = sum(v for k, v in counts.items() if k.startswith("fused_moe_lora["))
    fused_linear = sum(v for k, v in counts.items() if k.startswith("lora_linear["))
    return dict(family=family, graphs=graphs, graph_breaks=breaks, recompiles=recompiles, fused_ops=counts,
                moe_layers=n_moe, adapted_linears=n_linear, max_abs_err=err, compile_s=compile_s,
                ok=err <= tol and (fused_moe, fused_linear) == (n_moe, n_linear) and (graphs, breaks) == (1, 0)
                and recompiles == 0)


def format_peft(r: dict) -> str:
    fused = ", ".join(f"{k} x{v}" for k, v in sorted(r["fused_ops"].items()) if "[" in k) or "none"
    return "\n".join([
        f"moe_lora_compile demo, the PEFT way: {r['family']} (tiny, 1 layer) as a PeftModel, one adapter on "
        + ("the experts (target_parameters) and " if r["moe_layers"] else "") + f"{r['adapted_linears']} linears",
        "  torch.compile(functional_expert_lora(peft_model), options={'post_grad_custom_post_pass': MoELoRAPass()})",
        f"  graphs {r['graphs']}, graph breaks {r['graph_breaks']}, recompiles {r['recompiles']} "
        "(after: new tokens, smaller batch)",
        f"  fused ops: {fused}",
        f"  compiled vs PEFT eager: max |diff| {r['max_abs_err']:.2e} -> {'OK' if r['ok'] else 'MISMATCH'}; "
        f"first compile {r['compile_s']:.1f} s",
    ])


def demo_section(family: str, *, dtype: str, device, batch: int, seq_len: int, out=None) -> dict:
    """Run and print the PEFT section (``dtype`` by name); returns its report."""
    import sys

    import torch

    report = run_peft_demo(family, dtype=getattr(torch, dtype), device=device, batch=batch, seq_len=seq_len)
    print(format_peft(report), file=out or sys.stdout)
    return report
