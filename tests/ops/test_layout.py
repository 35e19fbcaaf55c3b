"""``ops/layout.py``: each layout's shapes, geometry, strides and gate/up order, checked against the layout table
written out by hand (concat: gate rows ``[0, I)``; interleaved: gate ``0::2``)."""

from __future__ import annotations

import pytest
import torch

from moe_lora_compile.ops import layout as lay

E, H, I = 3, 5, 4


@pytest.mark.parametrize("layout, w13, w2", [
    (lay.CONCAT, (E, 2 * I, H), (E, H, I)),                   # [E, out, in]
    (lay.INTERLEAVED, (E, 2 * I, H), (E, H, I)),              # vLLM's GPT-OSS: [E, out, in]
    (lay.TRANSPOSED_CONCAT, (E, H, 2 * I), (E, I, H)),        # Llama-4: [E, in, out]
    (lay.TRANSPOSED_INTERLEAVED, (E, H, 2 * I), (E, I, H)),   # GPT-OSS: [E, in, out]
])
def test_shapes_and_geometry(layout, w13, w2):
    assert lay.w13_shape(layout, E, H, I) == w13 and lay.w2_shape(layout, E, H, I) == w2
    assert lay.expert_geometry(layout, torch.Size(w13), torch.Size(w2)) == (E, H, I)


@pytest.mark.parametrize("layout", lay.LAYOUTS)
def test_in_out_strides_address_element_e_in_out(layout):
    for shape, n_in, n_out in ((lay.w13_shape(layout, E, H, I), H, 2 * I), (lay.w2_shape(layout, E, H, I), I, H)):
        w = torch.randn(shape)
        as_in_out = w if lay.is_transposed(layout) else w.transpose(1, 2)  # [E, in, out] by definition
        se, si, so = lay.in_out_strides(w, layout)
        e, i, o = torch.meshgrid(torch.arange(E), torch.arange(n_in), torch.arange(n_out), indexing="ij")
        assert torch.equal(w.flatten()[e * se + i * si + o * so], as_in_out)


@pytest.mark.parametrize("layout, gate_index", [
    (lay.CONCAT, list(range(I))),                         # gate first, up second
    (lay.INTERLEAVED, list(range(0, 2 * I, 2))),          # vLLM's GPT-OSS: gate on even positions, [E, 2I, H]
    (lay.TRANSPOSED_CONCAT, list(range(I))),
    (lay.TRANSPOSED_INTERLEAVED, list(range(0, 2 * I, 2))),  # gate on even positions
])
@pytest.mark.parametrize("dim", [-1, 1])
def test_split_and_merge_gate_up(layout, gate_index, dim):
    h = torch.randn(2, 2 * I, 3) if dim == 1 else torch.randn(2, 3, 2 * I)
    up_index = sorted(set(range(2 * I)) - set(gate_index))
    gate, up = lay.split_gate_up(h, layout, dim=dim)
    assert torch.equal(gate, h.index_select(dim, torch.tensor(gate_index)))
    assert torch.equal(up, h.index_select(dim, torch.tensor(up_index)))
    assert torch.equal(lay.merge_gate_up(gate, up, layout, dim=dim), h)


def test_layout_of_and_check_layout():
    assert lay.layout_of(transposed=False, interleaved=False) == lay.CONCAT
    assert lay.layout_of(transposed=True, interleaved=False) == lay.TRANSPOSED_CONCAT
    assert lay.layout_of(transposed=True, interleaved=True) == lay.TRANSPOSED_INTERLEAVED
    assert lay.layout_of(transposed=False, interleaved=True) == lay.INTERLEAVED
    for layout in lay.LAYOUTS:
        lay.check_layout(layout)
        assert lay.is_interleaved(layout) == (layout in ("interleaved", "transposed_interleaved"))
        assert lay.is_transposed(layout) == layout.startswith("transposed_")
    with pytest.raises(ValueError, match="layout must be one of"):
        lay.check_layout("rows")
