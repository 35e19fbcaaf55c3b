"""What ``dynamic=True`` really compiles (Dynamo level, no Inductor): batch sizes and lengths >= 2 share one graph,
but a size of 1 is specialised (Dynamo's 0/1 specialisation of backed sizes), so batch 1 and one-token steps add
graphs: at most four in all ({batch >= 2, 1} x {tokens >= 2, 1}), each compiled once.

Not avoidable from here with torch 2.13 + transformers 5.24: ``mark_dynamic(..., min=1)`` still specialises a size
that is 1 at run time (ConstraintViolationError), and ``backed_size_oblivious`` breaks the graph in transformers'
SDPA integration (``is_causal = q_len > 1`` becomes a SymBool that ``scaled_dot_product_attention`` refuses).
"""

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from transformers import AutoModelForCausalLM

from moe_lora_compile.models import attach
from moe_lora_compile.models.tiny import tiny_config
from support.factors import random_adapter


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



def test_generate_under_mlc_compile_keeps_one_decode_graph():
    """``mm.generate`` on ``mlc.compile(mm, dynamic=True)`` (Inductor, the pass): the prefill leaves transformers'
    dynamic KV cache as the attention's transposed views, later steps as concatenated tensors; the compiled forward
    makes them contiguous first, so the decode steps share one graph (their strides were a guard: a second decode
    graph per batch class). Tokens equal the eager model's."""
    import moe_lora_compile as mlc

    torch.manual_seed(0)
    mm = attach(AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")).eval(), max_loras=2, max_rank=4,
                max_tokens=64)
    prompts = [torch.randint(3, 128, shape, generator=torch.Generator().manual_seed(i))
               for i, shape in enumerate([(3, 6), (2, 9)])]

    def run():
        return [mm.generate(p, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0) for p in prompts]

    eager = run()
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    try:
        mlc.compile(mm, dynamic=True)
        with mlc.pass_runs():
            compiled = run()
            graphs = counters["stats"]["unique_graphs"]
            # a batch past max_tokens grows the id buffers: a new graph the user caused, and told of
            with pytest.warns(RuntimeWarning, match="exceeds max_tokens: .* grow from 64 to 128, and every graph "
                                                    "compiled for the old size compiles again"), torch.no_grad():
                mm(torch.randint(3, 128, (9, 8)), use_cache=False)
    finally:
        torch._dynamo.reset()
    assert graphs == 2  # the prefill and the decode step
    for ours, theirs in zip(compiled, eager):
        assert torch.equal(ours, theirs)


def test_compiled_forward_runs_with_the_raised_recompile_limit():
    """The same wrapper raises Dynamo's recompile limit during the call (GPT-OSS's sliding layers under the dynamic
    cache need 7 graphs per batch class with Inductor; at the default 8 the rest ran eagerly) and leaves it as it was
    after."""
    from moe_lora_compile.compile import GENERATE_RECOMPILE_LIMIT, _with_stable_layouts

    seen = []
    before = torch._dynamo.config.recompile_limit
    _with_stable_layouts(lambda: seen.append(torch._dynamo.config.recompile_limit))()
    assert seen == [max(before, GENERATE_RECOMPILE_LIMIT)] and seen[0] > 8
    assert torch._dynamo.config.recompile_limit == before


def test_sliced_inputs_share_the_graph_of_their_shape():
    """A sliced ``input_ids`` (``ids[:3, :5]`` of a [3, 8] tensor: row stride 8) or mask has the shape of a batch the
    graph already served but other strides, which Dynamo guards: the wrapper makes them contiguous, so they reuse
    the graph (they compiled a second one), positional or by name; outputs equal the contiguous call's."""
    from moe_lora_compile.compile import _with_stable_layouts

    mm = attach(AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")).eval(), max_loras=2, max_rank=4)
    counter = CompileCounter()
    torch._dynamo.reset()
    try:
        mm.model.forward = _with_stable_layouts(torch.compile(mm.model.forward, backend=counter, dynamic=True))
        wide = torch.randint(3, 128, (3, 8))
        ids, mask = wide[:, :5].contiguous(), torch.ones(3, 5, dtype=torch.long)
        with torch.no_grad():
            first = mm(ids, use_cache=False).logits
            first_masked = mm(ids, attention_mask=mask, use_cache=False).logits  # another signature: a graph
            with torch._dynamo.config.patch(error_on_recompile=True):
                positional = mm(wide[:, :5], use_cache=False).logits
                by_name = mm(input_ids=wide[:, :5], use_cache=False).logits
                masked = mm(wide[:, :5], attention_mask=torch.ones(3, 8, dtype=torch.long)[:, :5],
                            use_cache=False).logits
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 2
    assert torch.equal(positional, first) and torch.equal(by_name, first) and torch.equal(masked, first_masked)


def test_only_dynamic_cache_layers_are_made_contiguous():
    """A dynamic layer's transposed tensors are replaced by contiguous copies (it replaces them itself every step);
    any other layer (a static one, or DecodeGraphs' rows of a shared storage) is written in place and is left as
    it is: a copy would detach it from its storage."""
    import types

    from transformers.cache_utils import DynamicLayer

    from moe_lora_compile.compile import _with_stable_layouts

    base = torch.randn(2, 5, 3, 4)
    dynamic = DynamicLayer()
    dynamic.keys, dynamic.values = base.transpose(1, 2), base.transpose(1, 2)
    static = types.SimpleNamespace(keys=base.transpose(1, 2), values=base.transpose(1, 2))
    cache = types.SimpleNamespace(layers=[dynamic, static])
    _with_stable_layouts(lambda **kwargs: None)(cache=cache)
    assert dynamic.keys.is_contiguous() and torch.equal(dynamic.keys, base.transpose(1, 2))
    assert static.keys._base is base and not static.keys.is_contiguous()


def test_views_of_a_batch_already_compiled_add_no_graph():
    """The compiled forward's wrapper (``mlc.compile``'s, here on a CompileCounter) gives its inputs a layout of
    their own: ``w[:, :5]`` of a ``[1, 8]`` tensor (row stride 8, "contiguous" to torch), a decode-like
    ``x[:, -1:]`` and a row ``big[1:2]`` are shapes already compiled. Each was another graph (a stride guard, or a
    guard on the view's base)."""
    from moe_lora_compile.compile import _with_stable_layouts, without_duck_sizing

    mm = attach(AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")).eval(), max_loras=2, max_rank=4)
    counter = CompileCounter()
    torch._dynamo.reset()
    try:
        mm.model.forward = _with_stable_layouts(without_duck_sizing(torch.compile(mm.model.forward, backend=counter,
                                                                                  dynamic=True)))
        ids = lambda *shape: torch.randint(3, 128, shape)  # noqa: E731
        with torch.no_grad():
            for shape in [(3, 5), (1, 5), (3, 1), (1, 1)]:  # the four classes of the test above
                mm(ids(*shape), use_cache=False)
            assert counter.frame_count == 4
            with torch._dynamo.config.patch(error_on_recompile=True):
                for view in (ids(1, 8)[:, :5], ids(1, 8)[:, -1:], ids(3, 8)[:, -1:], ids(4, 5)[1:2], ids(4, 5)[0:2],
                             ids(3, 8)[:, :5]):
                    mm(view, use_cache=False)
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 4


def test_a_copy_of_a_compiled_model_runs_its_own_modules(tmp_path):
    """``copy.deepcopy`` / pickle of an ``mlc.compile``'d model compile the copy's own forward: the compiled forward
    was a function attribute the copy shared, so the copy ran the original's modules, slots and ids (a hot swap in
    the copy was silently ignored, or the original's adapter served), and pickle / torch.save failed."""
    import pickle

    import moe_lora_compile as mlc

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")).eval()
    mm = attach(copy.deepcopy(base), max_loras=2, max_rank=4)
    mm.load_adapter_weights("a", random_adapter(mm, 1))
    mlc.compile(mm, dynamic=True)
    cp = copy.deepcopy(mm)
    assert cp.model.forward is not mm.model.forward and cp.model.forward.original.__self__ is cp.model
    cp.load_adapter_weights("a", random_adapter(cp, 2), replace=True)  # a hot swap in the copy only
    eager = attach(copy.deepcopy(base), max_loras=2, max_rank=4)
    eager.load_adapter_weights("a", random_adapter(eager, 2))
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.testing.assert_close(cp(ids, adapters=["a", None]).logits, eager(ids, adapters=["a", None]).logits,
                                       rtol=1e-5, atol=1e-5)
    finally:
        torch._dynamo.reset()
    for loaded in (pickle.loads(pickle.dumps(mm)), torch.load(_saved(mm), weights_only=False)):
        forward = loaded.model.forward
        assert forward.original.__self__ is loaded.model and forward.original.__func__ is type(loaded.model).forward
        assert forward.torch_compile_kwargs == {"dynamic": True}


def _saved(module):
    import io

    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return buffer
