"""Autograd helpers shared by the ``moe_lora`` ops."""

from __future__ import annotations

import contextlib

import torch


def frozen_input_error(op: str, name: str) -> ValueError:
    return ValueError(
        f"moe_lora.{op}: {name} requires grad, but base weights are frozen in this op; gradients flow to the "
        f"activations, routing weights and LoRA stacks only (call {name}.requires_grad_(False))"
    )


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
