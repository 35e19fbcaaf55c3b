"""What ``dynamic=True`` really compiles (Dynamo level, no Inductor): batch sizes and lengths >= 2 share one graph,
but a size of 1 is specialised (Dynamo's 0/1 specialisation of backed sizes), so batch 1 and one-token steps add
graphs: at most four in all ({batch >= 2, 1} x {tokens >= 2, 1}), each compiled once.

Not avoidable from here with torch 2.13 + transformers 5.24: ``mark_dynamic(..., min=1)`` still specialises a size
that is 1 at run time (ConstraintViolationError), and ``backed_size_oblivious`` breaks the graph in transformers'
SDPA integration (``is_causal = q_len > 1`` becomes a SymBool that ``scaled_dot_product_attention`` refuses).
"""

import torch
from torch._dynamo.testing import CompileCounter
from transformers import AutoModelForCausalLM

from moe_lora_compile.models import attach
from moe_lora_compile.models.tiny import tiny_config


def test_dynamic_true_compiles_at_most_four_graphs():
    mm = attach(AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")).eval(), max_loras=2, max_rank=4)
    counter = CompileCounter()
    torch._dynamo.reset()
    try:
        mm.model.forward = torch.compile(mm.model.forward, backend=counter, dynamic=True, fullgraph=True)
        expected = {(3, 5): 1, (2, 4): 1, (6, 2): 1,  # batch >= 2, tokens >= 2: one graph
                    (1, 5): 2, (1, 3): 2,              # batch 1: a second graph
                    (3, 1): 3, (7, 1): 3,              # one token per sequence (a decode step): a third
                    (1, 1): 4}                         # both
        with torch.no_grad():
            for shape, graphs in expected.items():
                mm(torch.randint(3, 128, shape), adapters=None, use_cache=False)
                assert counter.frame_count == graphs, shape
            with torch._dynamo.config.patch(error_on_recompile=True):  # from here on, nothing new
                for shape in [(4, 7), (1, 9), (5, 1), (1, 1), (2, 2)]:
                    mm(torch.randint(3, 128, shape), use_cache=False)
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 4
