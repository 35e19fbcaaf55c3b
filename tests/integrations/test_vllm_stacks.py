"""The vLLM plugin's tensor side (:mod:`moe_lora_compile.integrations.vllm.stacks`) without vLLM: stacks shaped and
written the way vLLM 0.32's ``FusedMoEWithLoRA`` (2-D) and ``FusedMoE3DWithLoRA`` (3-D) shape and write them, built
here, run through :func:`experts_forward` and compared with a float64 reference computed from vLLM's own factors,
and with the op called on freshly built stacks (parity). Three of vLLM's activations: ``silu`` (Qwen3-MoE),
``swigluoai`` (GPT-OSS: w13 rows and B13 rows gate/up interleaved, expert biases) and ``swigluoai_uninterleave``
(the same clamped swiglu on concatenated rows, alpha / limit from vLLM's activation config); the reference writes
each out as vLLM defines it. Runs on the CPU (the op's reference impl) and, marked gpu,
on CUDA (the Triton kernels; the H200 image has no vLLM), there also under CUDA-graph replay.

What only the vLLM venv exercises (``test_vllm_plugin.py``, ``test_vllm_stack_parity.py``): vLLM's own loader and
``set_lora`` writing these stacks, its punica wrapper, and the modular kernel handing ``output`` to the experts.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from moe_lora_compile.integrations.vllm.stacks import (SILU, SWIGLUOAI, OpActivation, experts_forward,
                                                       keep_unmapped_rows_unadapted, op_activation, op_stacks,
                                                       slot_ids)

HAS_CUDA = torch.cuda.is_available()
# (E, H, I, k, L, r): CPU tiny (2I != H); GPU a few hundred wide, several experts per token
CPU_GEOMETRY = (4, 32, 24, 2, 3, 4)
GPU_GEOMETRY = (16, 256, 128, 4, 4, 16)
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}  # vs float64, per
# element (bf16's is also the floor of "the adapters matter")
# bf16 vs float64, scaled to the whole output (see _assert_close_to_reference): relative norm, largest element
BF16_REL, BF16_MAX = 1e-2, 2e-2
PARITY_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}  # same op
# vLLM's activation -> (its name, ApplyMoEActivationConfig fields clamp_limit / alpha / beta, expert biases, input
# scale: large enough that swigluoai's fixed limit 7 clamps some entries)
ACTIVATIONS = {
    "silu": ("silu", dict(), False, 1.0),
    "swigluoai": ("swigluoai", dict(), True, 6.0),
    "uninterleave": ("swigluoai_uninterleave", dict(clamp_limit=0.8, alpha=1.5, beta=1.0), True, 1.0),
}


def _vllm_stacks(fmt, L, E, H, I, r, dtype, device):
    """Zero stacks as vLLM allocates them: ``(w13_a, w13_b, w2_a, w2_b)`` tuples (2 w13 slices in 2-D)."""
    z = dict(dtype=dtype, device=device)
    n13 = 2 if fmt == "2d" else 1
    w13_a = tuple(torch.zeros(L, E, r, H, **z) for _ in range(n13))
    w13_b = tuple(torch.zeros(L, E, I if fmt == "2d" else 2 * I, r, **z) for _ in range(n13))
    return w13_a, w13_b, (torch.zeros(L, E, r, I, **z),), (torch.zeros(L, E, H, r, **z),)


def _set_lora(stacks, slot, rank, gen):
    """What vLLM's ``set_lora`` does: zero the slot, then copy an adapter of ``rank`` into its first rows/columns
    through vLLM's own tensor objects (views of the op's stacks once re-seated). Entries of B @ A come out about
    H^-1/2, like the base weights'."""
    _, _, max_rank, H = stacks[0][0].shape
    scale = (H * max_rank) ** -0.25
    for index, group in enumerate(stacks):  # A stacks (0, 2) hold the rank on dim 2, B stacks (1, 3) on dim 3
        for t in group:
            t[slot] = 0
            part = t[slot, :, :rank] if index in (0, 2) else t[slot, :, :, :rank]
            part.copy_(torch.randn(part.shape, generator=gen).to(t) * scale)


def _deltas(stacks, kind="silu"):
    """Dense per-slot deltas from vLLM's factors, float64: dW13 ``[L,E,2I,H]`` (rows in the base w13's order: gate
    and up interleaved for swigluoai), dW2 ``[L,E,H,I]``."""
    w13_a, w13_b, (a2,), (b2,) = [[t.double() for t in g] for g in stacks]
    parts = [b @ a for a, b in zip(w13_a, w13_b)]
    if len(parts) == 1:  # 3-D: vLLM's B13 rows are already in the base weight's order
        d13 = parts[0]
    elif kind == "swigluoai":  # 2-D gate / up deltas, row j of each to rows 2j / 2j+1
        d13 = torch.stack(parts, dim=3).flatten(2, 3)
    else:
        d13 = torch.cat(parts, dim=2)
    return d13, b2 @ a2


def _block_diagonal(b13, layout):
    """Split-form B13 ``[L,E,2I,r]`` -> ``[L,E,2I,2r]``: gate rows (even ones for ``interleaved``, else the first I)
    on rank columns ``[0,r)``, up rows on ``[r,2r)``."""
    L, E, two_i, r = b13.shape
    full = b13.new_zeros(L, E, two_i, 2 * r)
    gate, up = (slice(0, None, 2), slice(1, None, 2)) if layout == "interleaved" else (slice(0, two_i // 2),
                                                                                       slice(two_i // 2, None))
    full[:, :, gate, :r], full[:, :, up, r:] = b13[:, :, gate], b13[:, :, up]
    return full


def _activate(h, kind):
    """vLLM's activations on ``h [..., 2I]``, float64, as vLLM 0.32 defines them."""
    name, cfg, _, _ = ACTIVATIONS[kind]
    if name == "silu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    if name == "swigluoai":  # SwigluOAIAndMul: alpha 1.702, limit 7, gate even rows, up odd rows
        gate, up = h[..., ::2].clamp(max=7.0), h[..., 1::2].clamp(-7.0, 7.0)
        return (up + 1) * gate * torch.sigmoid(1.702 * gate)
    gate, up = h.chunk(2, dim=-1)  # SiluAndMulWithClamp: gate * sigmoid(alpha gate) * (up + beta), clamped
    limit = cfg["clamp_limit"]
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(cfg["alpha"] * gate) * (up + cfg["beta"])


def _reference(x, w13, w2, topk_weights, topk_ids, ids, d13, d2, kind="silu", b13=None, b2=None):
    """float64 MoE layer, each token's delta from its own slot (-1 = none), vLLM's activation ``kind``, biases
    added to each expert's projections before the routing weight."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    has = (ids >= 0).double()[:, None, None, None]
    slot = ids.clamp(min=0).long()[:, None].expand_as(topk_ids).long()
    e = topk_ids.long()
    W13 = w13[e] + has * d13[slot, e]            # [T, k, 2I, H]
    W2 = w2[e] + has * d2[slot, e]               # [T, k, H, I]
    h = torch.einsum("tkoh,th->tko", W13, x)
    if b13 is not None:
        h = h + b13.double()[e]
    out = torch.einsum("tkhi,tki->tkh", W2, _activate(h, kind))
    if b2 is not None:
        out = out + b2.double()[e]
    return (topk_weights.double()[..., None] * out).sum(1)


def _assert_close_to_reference(got, want):
    """``got`` (the op's output) against the float64 ``want``. float32: elementwise (:data:`TOL`). bf16: the kernels
    round the activation and the rank vectors to bf16 on the way, so an element's error scales with the layer's
    output, not with that element (swigluoai at x_scale 6 reaches |y| ~ 50, whose rounding alone exceeds an
    elementwise 3e-2 near zero): relative error of the whole output under 1e-2 and every element within 2e-2 of
    the largest |want| (a CPU emulation of those roundings at GPU_GEOMETRY gives ~3e-3 and ~4e-3)."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, **TOL[torch.float32])
        return
    error = got.double() - want
    assert error.norm() / want.norm() < BF16_REL, (error.norm() / want.norm()).item()
    assert error.abs().max() < BF16_MAX * want.abs().max(), (error.abs().max() / want.abs().max()).item()


def _problem(fmt, device, dtype, T, geometry, seed=0, x_scale=1.0):
    E, H, I, k, L, r = geometry
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape, s=1.0: (torch.randn(shape, generator=gen) * s).to(device=device, dtype=dtype)  # noqa: E731
    x = rand(T, H, s=x_scale)
    w13, w2 = rand(E, 2 * I, H, s=H ** -0.5), rand(E, H, I, s=I ** -0.5)
    topk_ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(device, torch.int32)
    topk_weights = torch.rand(T, k, generator=gen).softmax(-1).to(device)
    ids = torch.tensor([(t + 1) % (L + 1) - 1 for t in range(T)], device=device)  # 0, .., L-1 (free), -1, 0, ..
    stacks = _vllm_stacks(fmt, L, E, H, I, r, dtype, device)
    return x, w13, w2, topk_weights, topk_ids, ids, stacks, gen


class _CountingOp:
    """The op's out= form, counting calls and keeping each call's ``out``."""

    def __init__(self):
        self.calls, self.outs = 0, []

    def __call__(self, out, *args, **kwargs):
        self.calls += 1
        self.outs.append(out)
        return torch.ops.moe_lora.fused_moe_lora_out(out, *args, **kwargs)


def _check_forward(fmt, device, dtype, T, geometry, kind="silu"):
    name, cfg, biased, x_scale = ACTIVATIONS[kind]
    activation = op_activation(name, **cfg)
    x, w13, w2, topk_weights, topk_ids, ids, stacks, gen = _problem(fmt, device, dtype, T, geometry, x_scale=x_scale)
    E, H, I = geometry[:3]
    b13, b2 = ((torch.randn(E, 2 * I, generator=gen).to(device, dtype), torch.randn(E, H, generator=gen).to(device,
               dtype)) if biased else (None, None))
    r = geometry[5]
    _set_lora(stacks, 0, r, gen)             # before re-seating: its values must be carried over
    packed = op_stacks(*stacks, layout=activation.layout)
    _set_lora(stacks, 1, r // 2, gen)        # after: a lower-rank adapter written through vLLM's tensors
    _set_lora(stacks, 0, r, gen)             # and a hot swap of slot 0; slot L-1 stays free (zeros)
    op = _CountingOp()
    workspace = torch.full((T + 1, H), float("nan"), dtype=dtype, device=device)
    output = workspace[1:]  # a view into a workspace, as vLLM's modular kernel may hand over
    assert experts_forward(output, x, w13, w2, topk_weights, topk_ids, ids, packed, activation=activation,
                           w13_bias=b13, w2_bias=b2, op=op) is output
    assert op.calls == 1 and op.outs[0] is output  # one call of the out= form, straight into vLLM's buffer
    assert workspace[0].isnan().all()               # and nothing outside it
    assert packed.lora_b13_split == (fmt == "2d")
    want = _reference(x, w13, w2, topk_weights, topk_ids, ids, *_deltas(stacks, kind), kind, b13, b2)
    _assert_close_to_reference(output, want)
    fresh = [t.clone() for t in packed.tensors]  # parity: the op on stacks that were never views of anything
    again = torch.ops.moe_lora.fused_moe_lora(x, topk_ids, topk_weights, ids, w13, w2, *fresh, w13_bias=b13,
                                              w2_bias=b2, lora_b13_split=packed.lora_b13_split,
                                              **activation._asdict())
    torch.testing.assert_close(output, again, **PARITY_TOL[dtype])
    if packed.lora_b13_split:  # and the op on the rank-2r block-diagonal B13 the split form stands for
        full = _block_diagonal(packed.lora_b13, activation.layout)
        again = torch.ops.moe_lora.fused_moe_lora(x, topk_ids, topk_weights, ids, w13, w2, packed.lora_a13, full,
                                                  packed.lora_a2, packed.lora_b2, w13_bias=b13, w2_bias=b2,
                                                  **activation._asdict())
        torch.testing.assert_close(output, again, **PARITY_TOL[dtype])
    base = _reference(x, w13, w2, topk_weights, topk_ids, torch.full_like(ids, -1), *_deltas(stacks, kind), kind,
                      b13, b2)
    assert (want - base).abs().max() > 10 * TOL[dtype]["atol"]  # the adapters matter at this tolerance


@pytest.mark.parametrize("fmt", [
    "2d",  # FusedMoEWithLoRA: gate/up stacks apart, re-seated as views of the op's split gate/up form
    "3d",  # FusedMoE3DWithLoRA: read as they are
])
@pytest.mark.parametrize("T", [
    1,  # one decode token (slot 0)
    9,  # every slot and base rows mixed
])
@pytest.mark.parametrize("kind", [
    "silu",          # Qwen3-MoE: gate rows first, SiLU
    "swigluoai",     # GPT-OSS: interleaved gate/up rows (w13, B13, bias), clamped swiglu, expert biases
    "uninterleave",  # concatenated rows, clamped swiglu with vLLM's alpha / limit, expert biases
])
def test_experts_forward_cpu_matches_reference_from_vllms_factors(fmt, T, kind):
    _check_forward(fmt, "cpu", torch.float32, T, CPU_GEOMETRY, kind)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["2d", "3d"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [
    1,    # decode, batch 1
    8,    # small decode batch
    200,  # prefill-sized (sorted path)
])
@pytest.mark.parametrize("kind", ["silu", "swigluoai"])  # Qwen3-MoE, GPT-OSS (interleaved layout, biases)
def test_experts_forward_cuda_matches_reference_from_vllms_factors(fmt, dtype, T, kind):
    _check_forward(fmt, "cuda", dtype, T, GPU_GEOMETRY, kind)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["2d", "3d"])
def test_cuda_graph_replay_reads_vllms_current_stacks_and_slot_buffer(fmt):
    """Captured once; then an adapter is written through vLLM's tensors and the slot buffer and input change in
    place: the replay (no Python) must see all of it."""
    T, dtype = 8, torch.bfloat16
    E, H, I, k, L, r = GPU_GEOMETRY
    x, w13, w2, topk_weights, topk_ids, ids, stacks, gen = _problem(fmt, "cuda", dtype, T, GPU_GEOMETRY)
    _set_lora(stacks, 0, r, gen)
    packed = op_stacks(*stacks)
    assert packed.lora_b13_split == (fmt == "2d")
    slot_buffer = torch.full((64,), -1, dtype=torch.int64, device="cuda")  # vLLM's persistent per-token buffer
    slot_buffer[:T] = ids

    def step():
        out = torch.empty(T, H, dtype=dtype, device="cuda")
        return experts_forward(out, x, w13, w2, topk_weights, topk_ids, slot_ids(slot_buffer, T), packed)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = step()
    _set_lora(stacks, 1, r // 2, gen)                         # load an adapter into slot 1
    _set_lora(stacks, 0, r, gen)                              # hot-swap slot 0
    new_ids = torch.tensor([1, 0, -1, 1, 2, 0, 1, -1], device="cuda")
    slot_buffer[:T] = new_ids
    x.copy_(torch.randn(x.shape, generator=gen).to(x))
    graph.replay()
    torch.cuda.synchronize()
    want = _reference(x, w13, w2, topk_weights, topk_ids, new_ids, *_deltas(stacks))
    _assert_close_to_reference(output, want)
    base = _reference(x, w13, w2, topk_weights, topk_ids, torch.full_like(new_ids, -1), *_deltas(stacks))
    assert (want - base).abs().max() > 10 * TOL[dtype]["atol"]  # the replay had adapters to get right


@pytest.mark.parametrize("shapes, why", [
    # (w13_a, w13_b, w2_a, w2_b) shapes as tuples per slice; L=2, E=3, r=4, H=8, I=5
    ((((2, 3, 4, 8),), ((2, 3, 5, 4),), ((2, 3, 4, 5),), ((2, 3, 8, 4),)), "non-gated: one w13 slice of I rows"),
    ((((2, 1, 4, 8),) * 2, ((2, 3, 5, 4),) * 2, ((2, 3, 4, 5),), ((2, 1, 8, 4),)), "A shared across experts"),
    ((((2, 3, 2, 8),) * 2, ((2, 3, 5, 4),) * 2, ((2, 3, 4, 5),), ((2, 3, 8, 4),)), "A sharded on the rank"),
    ((((2, 3, 4, 8),) * 3, ((2, 3, 5, 4),) * 3, ((2, 3, 4, 5),), ((2, 3, 8, 4),)), "three w13 slices"),
    ((((2, 3, 4, 8),), ((2, 3, 10, 4),), ((2, 3, 4, 5),), ((2, 3, 7, 4),)), "w2 B of another hidden size"),
])
def test_op_stacks_none_for_layouts_the_op_does_not_read(shapes, why):
    stacks = [tuple(torch.zeros(s) for s in group) for group in shapes]
    assert op_stacks(*stacks) is None, why


def test_op_stacks_reseats_2d_once_and_frees_vllms_buffers():
    """2-D: the four w13 tensors become views of the op's split gate/up stacks (exactly their size: no zero
    padding), vLLM's old w13 buffers are freed, w2's tensors are the op's as they are."""
    L, E, H, I, r = 2, 3, 8, 5, 4
    stacks = _vllm_stacks("2d", L, E, H, I, r, torch.float32, "cpu")
    for group in stacks:
        for t in group:
            t.normal_()  # values set before the re-seat must be carried over
    before = [[t.clone() for t in group] for group in stacks]
    kept_views = [t[0][1] for group in stacks[:2] for t in group]  # vLLM keeps such views (lora_a_stacked)
    kept_shapes = [v.shape for v in kept_views]
    packed = op_stacks(*stacks)
    assert packed.lora_b13_split
    assert [tuple(t.shape) for t in packed.tensors] == [(L, E, 2 * r, H), (L, E, 2 * I, r), (L, E, r, I),
                                                        (L, E, H, r)]
    assert (sum(t.numel() for t in packed.tensors) == sum(t.numel() for group in stacks for t in group))
    assert packed.lora_a2 is stacks[2][0] and packed.lora_b2 is stacks[3][0]
    assert op_stacks(*stacks) is packed  # set_lora_context again: same stacks, nothing re-seated
    storages = {t.untyped_storage().data_ptr() for t in packed.tensors}
    assert all(t.untyped_storage().data_ptr() in storages for group in stacks for t in group)
    assert all(v.untyped_storage().nbytes() == 0 for v in kept_views)  # vLLM's old buffers are freed
    assert [v.shape for v in kept_views] == kept_shapes                 # and their views keep their shapes
    (a_g, a_u), (b_g, b_u) = before[:2]
    assert torch.equal(packed.lora_a13, torch.cat([a_g, a_u], dim=2))
    assert torch.equal(packed.lora_b13, torch.cat([b_g, b_u], dim=2))
    stacks[0][1][1, 2, 3, 4] = 7.0  # vLLM writes up's A: lands in A13's rows r..2r
    assert packed.lora_a13[1, 2, r + 3, 4] == 7.0
    stacks[1][0][1] = 0             # vLLM's reset_lora of one slice (gate's B)
    assert not packed.lora_b13[1, :, :I].any() and packed.lora_b13[1, :, I:].all()


def test_op_stacks_2d_interleaved_puts_gate_rows_on_even_rows():
    """GPT-OSS (``swigluoai``): vLLM's 2-D gate / up B rows land on B13's even / odd rows (the base w13's order)."""
    L, E, H, I, r = 2, 3, 8, 5, 4
    stacks = _vllm_stacks("2d", L, E, H, I, r, torch.float32, "cpu")
    packed = op_stacks(*stacks, layout=SWIGLUOAI.layout)
    assert packed.lora_b13_split and packed.lora_b13.shape == (L, E, 2 * I, r)
    stacks[1][0][1, 2, 3, 1] = 5.0  # gate B, row 3, rank 1
    stacks[1][1][1, 2, 3, 1] = 6.0  # up B, row 3, rank 1
    assert packed.lora_b13[1, 2, 6, 1] == 5.0 and packed.lora_b13[1, 2, 7, 1] == 6.0
    assert packed.lora_b13.count_nonzero() == 2


@pytest.mark.parametrize("name, cfg, expected", [
    ("silu", dict(), SILU),                                                    # plain SiLU, concatenated rows
    ("silu", dict(clamp_limit=7.0), "clamped / scaled activation"),            # SiLU with a clamp: not the op's
    ("swigluoai", dict(), SWIGLUOAI),                                          # GPT-OSS: interleaved, 1.702 / 7
    ("swigluoai", dict(clamp_limit=3.0, alpha=2.0), SWIGLUOAI),                # vLLM's swigluoai ignores the config
    ("swigluoai_uninterleave", dict(clamp_limit=5.0, alpha=1.5, beta=1.0),     # concatenated, config's alpha/limit
     OpActivation("concat", "gptoss_swiglu", 1.5, 5.0)),
    ("swigluoai_uninterleave", dict(clamp_limit=5.0, alpha=1.0, beta=0.0),     # beta 0: up not shifted, not ours
     "activation swigluoai_uninterleave with beta 0.0"),
    ("swigluoai_uninterleave", dict(beta=1.0), "without a clamp limit"),       # vLLM asserts a limit here
    ("gelu", dict(), "activation gelu"),                                       # another activation
    ("silu", dict(situ_betas=(0.5, None)), "situ betas"),                      # situ's extra parameters
])
def test_op_activation(name, cfg, expected):
    got = op_activation(name, **cfg)
    if isinstance(expected, str):
        assert isinstance(got, str) and expected in got
    else:
        assert got == expected


def test_op_stacks_3d_are_vllms_tensors():
    stacks = _vllm_stacks("3d", 2, 3, 8, 5, 4, torch.float32, "cpu")
    packed = op_stacks(*stacks)
    assert all(p is t for p, (t,) in zip(packed.tensors, stacks)) and not packed.lora_b13_split


@pytest.mark.parametrize("length, T", [
    (16, 5),  # vLLM's buffer longer than the batch: a view, later writes seen
    (3, 5),   # shorter (no persistent buffer): the extra rows get -1
])
def test_slot_ids(length, T):
    buffer = torch.arange(length, dtype=torch.int64)
    ids = slot_ids(buffer, T)
    assert ids.tolist() == [i if i < length else -1 for i in range(T)]
    buffer[0] = 42
    assert (ids[0] == 42) == (length >= T)


def test_keep_unmapped_rows_unadapted():
    calls = []
    wrapper = SimpleNamespace(_token_lora_indices=torch.full((8,), 5), indices_len=[None] * 4)

    def update_metadata(n):  # vLLM 0.32: writes the first n rows and records n
        wrapper._token_lora_indices[:n] = 1
        wrapper.indices_len[0] = n
        calls.append(n)

    wrapper.update_metadata = update_metadata
    keep_unmapped_rows_unadapted(wrapper)
    assert wrapper._token_lora_indices.tolist() == [-1] * 8  # before any mapping: no adapter anywhere
    wrapper.update_metadata(6)
    wrapper.update_metadata(3)  # a smaller step: rows 3.. must not keep the previous step's slot
    assert wrapper._token_lora_indices.tolist() == [1, 1, 1] + [-1] * 5 and calls == [6, 3]
    keep_unmapped_rows_unadapted(wrapper)  # idempotent: not wrapped twice
    wrapper.update_metadata(2)
    assert calls == [6, 3, 2]
