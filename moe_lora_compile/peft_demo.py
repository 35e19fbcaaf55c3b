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

import copy
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


def _logits_and_router_ties(model, input_ids, rel_margin: float = 2.0 ** -5):
    """-> (logits [B, S, V], near_tie [B, S] bool): a token is at a near-tie when, in some MoE layer, its k-th and
    (k+1)-th router logits differ by less than ``rel_margin`` of that layer's largest |logit| (bf16 keeps 8 bits:
    about 4x its rounding step). Router outputs are found by hooks on the ``gate`` / ``router`` modules."""
    import torch

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    top_k = getattr(config, "num_experts_per_tok", None)
    num_experts = next((getattr(config, a) for a in ("num_experts", "num_local_experts", "n_routed_experts")
                        if getattr(config, a, None)), None)
    margins = []

    def hook(module, args, out):
        t = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(t, torch.Tensor) and t.shape[-1] == num_experts and top_k and top_k < num_experts:
            top = t.float().reshape(-1, num_experts).topk(top_k + 1, dim=-1).values
            margins.append((top[:, -2] - top[:, -1]) / top.abs().max().clamp_min(1e-30))

    handles = [m.register_forward_hook(hook) for name, m in model.named_modules()
               if name.rsplit(".", 1)[-1] in ("gate", "router")]
    try:
        logits = model(input_ids).logits
    finally:
        for h in handles:
            h.remove()
    near_tie = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    for m in margins:
        if m.numel() == input_ids.numel():
            near_tie |= (m < rel_margin).view(input_ids.shape)
    return logits, near_tie


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
        # the truth: the same PEFT model in float32 (PEFT's own bf16 eager rounds W + B@A to bf16 per forward, so
        # in bf16 both sides carry rounding error; each is measured against float32)
        truth, tied = [], []
        reference = model if dtype == torch.float32 else copy.deepcopy(model).float()
        for ids in [input_ids] + later:
            logits, near_tie = _logits_and_router_ties(reference, ids)
            truth.append(logits)
            tied.append(near_tie)
        del reference
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
    # bf16: a token whose k-th and (k+1)-th router logits are within bf16 rounding may pick another expert in any
    # bf16 computation (Inductor's rounding differs from eager's); such tokens are counted and left out
    keep = [~t if dtype != torch.float32 else torch.ones_like(t) for t in tied]
    excluded = sum(int((~k).sum()) for k in keep)

    def max_err(outs):
        return max(((got.float() - want.float()).abs().amax(-1) * k).max().item()
                   for got, want, k in zip(outs, truth, keep))

    err, peft_err = max_err(logits), max_err(eager)
    top = max(want.float().abs().max().item() for want in truth)
    # float32: equal to PEFT eager up to summation order; bf16: no further from float32 than twice PEFT's own
    # bf16 eager, plus 1 % of the largest logit
    tol = 1e-3 if dtype == torch.float32 else 2 * peft_err + 1e-2 * max(1.0, top)
    counts = dict(custom_pass.counts)
    fused_moe = sum(v for k, v in counts.items() if k.startswith("fused_moe_lora["))
    fused_linear = sum(v for k, v in counts.items() if k.startswith("lora_linear["))
    return dict(family=family, graphs=graphs, graph_breaks=breaks, recompiles=recompiles, fused_ops=counts,
                moe_layers=n_moe, adapted_linears=n_linear, max_abs_err=err, peft_eager_err=peft_err, tol=tol,
                compile_s=compile_s, dtype=str(dtype).replace("torch.", ""),
                tokens=sum(k.numel() for k in keep), near_tie_tokens=excluded,
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
        (f"  compiled vs PEFT eager: max |diff| {r['max_abs_err']:.2e}" if r["dtype"] == "float32" else
         f"  vs the float32 PEFT model: compiled max |diff| {r['max_abs_err']:.2e}, PEFT {r['dtype']} eager "
         f"{r['peft_eager_err']:.2e} (tolerance {r['tol']:.2e}; {r['near_tie_tokens']} of {r['tokens']} tokens at a "
         "router near-tie left out)")
        + f" -> {'OK' if r['ok'] else 'MISMATCH'}; first compile {r['compile_s']:.1f} s",
    ])


def demo_section(family: str, *, dtype: str, device, batch: int, seq_len: int, out=None) -> dict:
    """Run and print the PEFT section (``dtype`` by name); returns its report."""
    import sys

    import torch

    report = run_peft_demo(family, dtype=getattr(torch, dtype), device=device, batch=batch, seq_len=seq_len)
    print(format_peft(report), file=out or sys.stdout)
    return report
