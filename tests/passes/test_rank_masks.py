"""The pass on the references *with per-slot ranks* (``lora_ranks``): the rank masks ``where(keep, factor, 0)`` are
read back as the op's ``lora_ranks`` (no masked copy of the factors left in the graph), and entries past a slot's
rank, NaN here, never reach a result. A mask that is not a rank mask is kept (the op reads the masked factors).
One compile covers every row (compiles are the expensive part on 2 CPU cores)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moe_lora_compile.ops.reference import fused_moe_lora_reference, lora_linear_reference, rank_keep

from pass_helpers import RecordingPass, pass_always_runs

H, I, E, K, L, R = 16, 12, 4, 2, 3, 8
TOKEN_IDS = [0, 1, -1, 2, 0, -1, 2, 1] * 2  # mixed slots and -1 (no adapter)


def _rand(*s):
    return nn.Parameter(torch.randn(*s) / s[-1] ** 0.5, requires_grad=False)


def _nan_past_rank(factor: torch.Tensor, ranks: torch.Tensor, rank_dim: int, block: int) -> None:
    """Fill every entry past its slot's rank with NaN (slot axis 0): what the kernels must never read."""
    keep = rank_keep(ranks, factor.shape[rank_dim], block)  # [L, R]
    shape = [1] * factor.dim()
    shape[0], shape[rank_dim] = keep.shape
    factor.data.masked_fill_(~keep.view(shape).expand_as(factor), float("nan"))


class RankedModel(nn.Module):
    """Rows (one output each): MoE with per-slot w13/w2 ranks; linear with [L] ranks; fused q/k-style linear with
    [2, L] ranks (two rank blocks); a linear whose factors carry some other mask (stays a masked read)."""

    def __init__(self):
        super().__init__()
        self.router = _rand(H, E)
        self.w13, self.w2 = _rand(E, 2 * I, H), _rand(E, H, I)
        self.a13, self.b13, self.a2, self.b2 = _rand(L, E, R, H), _rand(L, E, 2 * I, R), _rand(L, E, R, I), \
            _rand(L, E, H, R)
        self.register_buffer("moe_ranks", torch.tensor([[8, 3, 0], [5, 8, 2]], dtype=torch.int32))
        for t, dim in ((self.a13, 2), (self.b13, 3), (self.a2, 2), (self.b2, 3)):
            row = 0 if t is self.a13 or t is self.b13 else 1
            _nan_past_rank(t, self.moe_ranks[row], dim, R)
        self.w, self.bias, self.a, self.b = _rand(H, H), _rand(H), _rand(L, R, H), _rand(L, H, R)
        self.register_buffer("lin_ranks", torch.tensor([2, 8, 5], dtype=torch.int32))
        _nan_past_rank(self.a, self.lin_ranks, 1, R)
        _nan_past_rank(self.b, self.lin_ranks, 2, R)
        self.fa, self.fb = _rand(L, R, H), _rand(L, 2 * H, R)  # two members, rank blocks of R/2
        self.register_buffer("fused_ranks", torch.tensor([[4, 1, 0], [2, 4, 3]], dtype=torch.int32))
        _nan_past_rank(self.fa, self.fused_ranks, 1, R // 2)
        _nan_past_rank(self.fb, self.fused_ranks, 2, R // 2)
        self.ma, self.mb = _rand(L, R, H), _rand(L, H, R)
        self.register_buffer("other_mask", torch.rand(L, R) > 0.5)
        self.register_buffer("token_lora_ids", torch.tensor(TOKEN_IDS, dtype=torch.int32))

    def forward(self, x):
        ids = self.token_lora_ids[: x.shape[0]]
        weights, experts = torch.topk((x @ self.router).softmax(-1), K)
        moe = fused_moe_lora_reference(x, experts, weights, ids, self.w13, self.w2, self.a13, self.b13, self.a2,
                                       self.b2, lora_ranks=self.moe_ranks)
        lin = lora_linear_reference(x, self.w, self.a, self.b, ids, bias=self.bias, lora_ranks=self.lin_ranks)
        fused = lora_linear_reference(x, self.w.repeat(2, 1), self.fa, self.fb, ids, lora_ranks=self.fused_ranks)
        keep = self.other_mask
        other = lora_linear_reference(x, self.w, torch.where(keep.unsqueeze(-1), self.ma, 0.0),
                                      torch.where(keep.unsqueeze(1), self.mb, 0.0), ids)
        return moe, lin, fused, other


class FusedOpRecorder(RecordingPass):
    """Also records, per fused op call, whether it got ``lora_ranks``."""

    def __init__(self):
        super().__init__()
        self.with_ranks: list[tuple[str, bool]] = []

    def __call__(self, graph):
        super().__call__(graph)
        for node in graph.nodes:
            if node.op == "call_function" and str(node.target).startswith("moe_lora."):
                self.with_ranks.append((str(node.target).split(".")[1], node.kwargs.get("lora_ranks") is not None))


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    model = RankedModel()
    recorder = FusedOpRecorder()
    fn = torch.compile(model, fullgraph=True, options={"post_grad_custom_post_pass": recorder})
    x = torch.randn(len(TOKEN_IDS), H)
    with pass_always_runs(recorder), torch.no_grad():
        return recorder, fn(x), model(x)


def test_rank_masks_become_lora_ranks(compiled):
    recorder, _, _ = compiled
    (graph,) = recorder.graphs
    assert graph["fused_moe_lora"] == 1 and graph["lora_linear"] == 3
    assert graph["leftover_matmuls"] == 0
    # MoE, [L]-ranked and [2, L]-ranked linears pass their ranks; the foreign mask's linear does not
    assert sorted(recorder.with_ranks) == sorted([("fused_moe_lora", True), ("lora_linear", True),
                                                  ("lora_linear", True), ("lora_linear", False)])
    assert graph["aten.lt.Tensor"] == 0  # no rank mask left computed


def test_compiled_equals_reference(compiled):
    _, got, want = compiled
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.isfinite(w).all()  # the reference drops the NaN padding ...
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=lambda m: f"output {i}: {m}")  # ... and so do we
