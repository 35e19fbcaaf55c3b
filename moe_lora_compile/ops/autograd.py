"""Autograd helpers shared by the ``moe_lora`` ops."""

from __future__ import annotations

import contextlib

import torch


def frozen_input_error(op: str, name: str) -> ValueError:
    return ValueError(
        f"moe_lora.{op}: {name} requires grad, but base weights are frozen in this op; gradients flow to the "
        f"activations, routing weights and LoRA stacks only (call {name}.requires_grad_(False))"
    )


def save_for_backward(ctx, op: str, inputs, core_args: tuple, frozen_positions: tuple) -> None:
    """An op's ``setup_context``: refuse frozen base weights that require grad, then save every input for the
    backward, ``token_lora_ids`` as a copy: it is usually a view of ``MultiLoRAModel``'s id buffer, which every
    forward rewrites in place, so a second forward before ``backward()`` (a reference pass, two summed losses)
    would otherwise make autograd refuse the saved view (int32 ``[T]``: a few bytes a token)."""
    for pos in frozen_positions:
        if inputs[pos] is not None and inputs[pos].requires_grad:
            raise frozen_input_error(op, core_args[pos])
    inputs = list(inputs)
    ids = core_args.index("token_lora_ids")
    inputs[ids] = inputs[ids].clone()
    ctx.save_for_backward(*inputs)


@contextlib.contextmanager
def _autograd_enabled():
    """Re-enable autograd inside a custom op's backend impl, which runs with the Autograd dispatch keys excluded."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


_AUTOGRAD_KEYS = [getattr(torch._C.DispatchKey, name) for name in (
    "AutogradCPU", "AutogradCUDA", "AutogradOther", "AutogradFunctionality", "ADInplaceOrView",
) if hasattr(torch._C.DispatchKey, name)]


def recompute_grads(reference, grad_y, args, kwargs, grad_positions):
    """Gradients of ``reference(*args, **kwargs)`` w.r.t. ``args[i]`` for ``i in grad_positions``, by recompute.

    Runs the pure-PyTorch reference under autograd; returns one contiguous tensor per position.
    """
    with _autograd_enabled():
        inputs = list(args)
        leaves = []
        for i in grad_positions:
            inputs[i] = args[i].detach().requires_grad_(True)
            leaves.append(inputs[i])
        y = reference(*inputs, **kwargs)
        grads = torch.autograd.grad(y, leaves, grad_y, allow_unused=True)
    return [torch.zeros_like(leaf) if g is None else g.contiguous() for g, leaf in zip(grads, leaves)]


def recompute_grads_by_slot(reference, grad_y, args, kwargs, grad_positions, *, row_positions, stack_positions,
                            ids_position):
    """:func:`recompute_grads` one adapter slot at a time, so gradients keep tenants apart as the forward does.

    The ops' outputs are row-wise (token t's row depends on its own rows of ``args[p]``, ``p`` in ``row_positions``,
    and on its own slot of each LoRA stack, ``stack_positions``, ``[L, ...]``). A single recompute over the whole
    batch multiplies other slots' factors by exact zeros on its way back (a NaN in one slot made every token's
    ``x`` gradient NaN); here each group of tokens (one slot, or ``-1``) is recomputed with only its own slot
    (``-1`` tokens: a zero slot), and the gradients are put back by row and by slot. ``kwargs["lora_ranks"]``
    (``[..., L]``) is sliced the same way. Unused slots get zero gradients."""
    ids = args[ids_position]
    out = [torch.zeros_like(args[p], memory_format=torch.contiguous_format) for p in grad_positions]
    ranks = kwargs.get("lora_ranks")
    for slot in torch.unique(ids).tolist():  # eager only: the ops' backward is opaque to the compiler
        rows = (ids == slot).nonzero().squeeze(1)
        sub = list(args)
        for p in row_positions:
            sub[p] = args[p].index_select(0, rows)
        for p in stack_positions:
            sub[p] = args[p][slot:slot + 1] if slot >= 0 else torch.zeros_like(args[p][:1])
        sub[ids_position] = torch.full_like(sub[ids_position], 0 if slot >= 0 else -1)
        sub_kwargs = dict(kwargs)
        if ranks is not None:
            sub_kwargs["lora_ranks"] = ranks[..., max(slot, 0):max(slot, 0) + 1]
        grads = recompute_grads(reference, grad_y.index_select(0, rows), sub, sub_kwargs, grad_positions)
        for i, (p, g) in enumerate(zip(grad_positions, grads)):
            if p in row_positions:
                out[i].index_copy_(0, rows, g)
            elif slot >= 0:
                out[i][slot] = g[0]
    return out
