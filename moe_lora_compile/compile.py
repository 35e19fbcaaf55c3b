"""``compile(model)``: ``torch.compile`` with :class:`~moe_lora_compile.passes.MoELoRAPass` as Inductor's post-grad
pass. The other two ways to use the pass: ``torch.compile(m, options={"post_grad_custom_post_pass": MoELoRAPass()})``
and, inside vLLM, :mod:`moe_lora_compile.passes.vllm`."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

import torch

from . import progress
from .passes import MoELoRAPass

_PASS_KEY = "post_grad_custom_post_pass"
# Inductor options compile() sets unless the caller does. shape_padding: Inductor's pad_mm pass asks whether a matmul
# is compute-bound from its sizes, which with a dynamic token dimension becomes a guard on that size (seen on the
# H200, bf16: "4 <= x.size()[0] <= 15 # pad_mm.py:292 in is_mm_compute_bound"), so a new batch size recompiles; the
# matmuls it pads (routers, attention, lm_head at decode sizes) are memory-bound anyway.
DEFAULT_INDUCTOR_OPTIONS = {"shape_padding": False}
_ORIGINAL_FORWARD = "_moe_lora_uncompiled_forward"  # on a MultiLoRAModel's inner model, once compile() ran


@contextlib.contextmanager
def pass_runs() -> Iterator[None]:
    """Inductor's FX-graph cache and the AOT autograd cache off: a cache hit skips the post-grad pass, so compiles
    inside this context really run it (its ``counts`` are real, depyf dumps show its output)."""
    import torch._functorch.config as functorch_config

    with torch._inductor.config.patch(fx_graph_cache=False, fx_graph_remote_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        yield


def inductor_options(options: Optional[dict] = None, mode: Optional[str] = None,
                     custom_pass: Optional[MoELoRAPass] = None) -> dict:
    """Inductor ``options`` with the pass added, :data:`DEFAULT_INDUCTOR_OPTIONS` under the caller's and ``mode``'s
    options folded in (``torch.compile`` takes one of the two). Refuses a different post-grad pass in ``options``."""
    options = {**DEFAULT_INDUCTOR_OPTIONS, **(options or {})}
    if mode is not None:
        options = {**torch._inductor.list_mode_options(mode), **options}
    existing = options.get(_PASS_KEY)
    if existing is not None and not isinstance(existing, MoELoRAPass):
        raise ValueError(f"options[{_PASS_KEY!r}] is already set to {existing!r}; compile() installs MoELoRAPass "
                         "there (chain your pass in your own CustomGraphPass instead)")
    options[_PASS_KEY] = existing or custom_pass or MoELoRAPass()
    return options


def compile(model: Any, *, pass_options: Optional[dict] = None, **torch_compile_kwargs) -> Any:
    """``torch.compile(model, **torch_compile_kwargs)`` with the moe_lora post-grad pass (Inductor backend).

    ``pass_options`` go to :class:`MoELoRAPass` (``moe``, ``hf_experts``, ``linear``). A
    :class:`~moe_lora_compile.models.MultiLoRAModel` is compiled in place (its wrapped model's ``forward``; the
    pre-hook that fills the per-token adapter ids stays eager) and returned, so ``forward``, ``generate`` and
    adapter loading keep working; anything else is returned as ``torch.compile`` returns it.
    """
    kwargs = _torch_compile_kwargs(pass_options, torch_compile_kwargs)  # (checked before a model is changed)
    from .models import MultiLoRAModel

    if isinstance(model, MultiLoRAModel):
        # forward only: the pre-hook that writes token_lora_ids stays eager, outside the graph. Compiling again
        # replaces the earlier compile (from the model's own forward), rather than compiling a compiled function.
        inner = model.model
        original = inner.__dict__.get(_ORIGINAL_FORWARD, inner.forward)
        inner.__dict__[_ORIGINAL_FORWARD] = original
        inner.forward = CompiledForward(original, pass_options, torch_compile_kwargs)
        return model
    return torch.compile(model, **kwargs)


def _torch_compile_kwargs(pass_options: Optional[dict], torch_compile_kwargs: dict) -> dict:
    """:func:`compile`'s arguments checked, as ``torch.compile``'s keyword arguments (the pass in its options)."""
    backend = torch_compile_kwargs.get("backend", "inductor")
    if backend != "inductor":
        raise ValueError(f"backend must be 'inductor' (the pass is an Inductor post-grad pass), got {backend!r}")
    given = (torch_compile_kwargs.get("options") or {}).get(_PASS_KEY)
    if pass_options is not None and isinstance(given, MoELoRAPass):
        raise ValueError(f"pass_options: options[{_PASS_KEY!r}] already holds a MoELoRAPass, which would be used "
                         f"as it is; give its options to that pass (MoELoRAPass(**pass_options)) or leave it out")
    custom_pass = MoELoRAPass(**(pass_options or {}))
    kwargs = dict(torch_compile_kwargs)
    kwargs["options"] = inductor_options(kwargs.pop("options", None), kwargs.pop("mode", None), custom_pass)
    return kwargs


class CompiledForward:
    """The compiled ``forward`` of a MultiLoRAModel's wrapped model: ``original`` (its own forward, bound to it)
    compiled with :func:`compile`'s ``pass_options`` and ``torch_compile_kwargs``. A copy (``copy.deepcopy``,
    pickle, ``torch.save``) compiles the copy's own forward with the same arguments: a plain function attribute was
    shared by the copy, which then ran the original model's modules, slots and ids (and failed to pickle)."""

    def __init__(self, original: Callable, pass_options: Optional[dict], torch_compile_kwargs: dict):
        self.original, self.pass_options, self.torch_compile_kwargs = original, pass_options, torch_compile_kwargs
        compiled = torch.compile(original, **_torch_compile_kwargs(pass_options, torch_compile_kwargs))
        # (inspect.signature follows __wrapped__: transformers reads the forward's parameters)
        self.__wrapped__ = _announce_first_call(without_duck_sizing(_with_stable_layouts(compiled)))

    def __call__(self, *args, **kwargs):
        return self.__wrapped__(*args, **kwargs)

    def __reduce__(self):
        return CompiledForward, (self.original, self.pass_options, self.torch_compile_kwargs)


# Graphs one compiled MultiLoRAModel forward may need under mm.generate with transformers' dynamic KV cache: prefill
# and decode, for batch 1 and the others (Dynamo specializes a size of 1), times the states of a sliding-window
# layer (GPT-OSS: within the window, crossing it, past it). Dynamo's default limit, 8, would send the rest eager.
GENERATE_RECOMPILE_LIMIT = 16


# The forward's tensor inputs a caller may pass as a slice (ids[:, :n]) or a transposed view: their strides are
# guarded, so each layout would be another graph
_INPUT_NAMES = ("input_ids", "attention_mask", "position_ids", "inputs_embeds", "cache_position")


def canonical_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` if it is a tensor of its own with the strides a new tensor of its shape has, else a copy that is.
    Dynamo guards strides, including a size-1 dim's, which ``is_contiguous()`` / ``contiguous()`` ignore (``w[:, :5]``
    of a ``[1, 8]`` tensor is "contiguous" with row stride 8), and a view's base (``p[0][None]`` of a ``[1, 6]``
    prompt): either compiled a second graph of a shape already served."""
    expected, step = [], 1
    for size in reversed(t.shape):
        expected.append(step)
        step *= max(size, 1)
    if t._base is None and t.stride() == tuple(reversed(expected)):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _with_stable_layouts(fn: Callable) -> Callable:
    """``fn`` (the compiled forward of a MultiLoRAModel's inner model) with its inputs' and the KV cache's tensors
    made contiguous before each call, and Dynamo's recompile limit at least :data:`GENERATE_RECOMPILE_LIMIT` during
    it. Dynamo guards strides: a sliced ``input_ids`` (``ids[:3, :5]``, row stride 8 for 5 columns) compiled a second
    graph of a shape the first already served. transformers' dynamic cache keeps the prefill's keys/values as the
    attention's transposed views and a sliding layer's as slices, whose strides differ from the concatenated tensors
    of later steps: each layout was a new graph (a stride guard), two more per batch class. A copy of the cache when
    its layout is not contiguous (once per generate for full layers; each step for a sliding layer past its window)
    keeps one decode graph. Only transformers' ``DynamicLayer`` s are touched (they replace their tensors every
    update); a static layer, whose tensors are written in place, never is."""

    try:  # only transformers' dynamic layers: they replace their tensors each step (torch.cat), never write into
        from transformers.cache_utils import DynamicLayer  # them; a static layer's tensors are written in place
    except ImportError:  # (a copy would detach it from its storage: DecodeGraphs' and the engine's caches)
        DynamicLayer = ()  # an older transformers: no layer is touched

    @functools.wraps(fn)
    def stable_layouts(*args, **kwargs):
        args = tuple(canonical_layout(a) if isinstance(a, torch.Tensor) else a for a in args)
        for name in _INPUT_NAMES:
            if isinstance(kwargs.get(name), torch.Tensor):
                kwargs[name] = canonical_layout(kwargs[name])
        for key in ("past_key_values", "cache"):
            for layer in getattr(kwargs.get(key), "layers", None) or ():
                if not isinstance(layer, DynamicLayer):
                    continue
                for attr in ("keys", "values"):
                    tensor = getattr(layer, attr, None)
                    if isinstance(tensor, torch.Tensor):
                        setattr(layer, attr, canonical_layout(tensor))
        limit = max(torch._dynamo.config.recompile_limit, GENERATE_RECOMPILE_LIMIT)
        with torch._dynamo.config.patch(recompile_limit=limit):
            return fn(*args, **kwargs)

    return stable_layouts


def is_compiled(mm: Any) -> bool:
    """Whether :func:`compile` compiled this MultiLoRAModel's forward."""
    return _ORIGINAL_FORWARD in getattr(mm, "model", mm).__dict__


def without_duck_sizing(fn: Callable) -> Callable:
    """``fn`` (a compiled function) called with Dynamo's duck sizing off. Duck sizing gives sizes equal at the first
    trace one symbol, so a first call of batch 2 x length 2 guards ``batch == length`` and every other shape
    recompiles once; with it off, each dynamic dimension gets its own symbol. Compiles inside ``fn`` read the
    setting when they start; the caller's other compiles keep theirs."""
    from torch.fx.experimental import _config as fx_config

    @functools.wraps(fn)
    def distinct_sizes(*args, **kwargs):
        with fx_config.patch(use_duck_shape=False):
            return fn(*args, **kwargs)

    return distinct_sizes


def _announce_first_call(fn: Callable) -> Callable:
    """``fn`` with a progress line around its first call (the compile), when progress lines are on
    (:mod:`.progress`: stderr is a terminal, or ``MOE_LORA_PROGRESS=1``); ``fn`` itself otherwise."""
    if not progress.enabled():
        return fn
    pending = [True]

    @functools.wraps(fn)
    def first_call_announced(*args, **kwargs):
        if pending:
            pending.clear()
            with progress.step("compiling the model (first call; 10-40 s for a tiny model on a CPU)"):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return first_call_announced
