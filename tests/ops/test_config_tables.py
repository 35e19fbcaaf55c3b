"""Which tuned tables the ops read (``MOE_LORA_CONFIGS``): this GPU's own (auto), none (0: the heuristics, the
baseline of a tuning A/B), or another GPU's by name; a name without a table is refused with the names there are.
Checked on the CPU device, whose name ('cpu') has no table of its own."""

import pytest
import torch

from moe_lora_compile import settings
from moe_lora_compile.ops.triton import configs
from moe_lora_compile.shapes import GPT_OSS_20B

CPU = torch.device("cpu")
g = GPT_OSS_20B
SHIPPED = configs.read_table(configs.CONFIG_DIR / configs.gpu_file_name("NVIDIA H200"))
SHIPPED_LINEAR = configs.read_linear_table(configs.CONFIG_DIR / configs.linear_file_name("NVIDIA H200"))


def moe(T):
    return configs.get_config(CPU, g.E, g.H, g.I, 16, T, g.k)


def linear(T):
    return configs.get_linear_config(CPU, T, g.H, 5120, 32)


@pytest.mark.parametrize("value", [None, "auto", "0"])  # unset / auto on a GPU without a table / heuristics only
def test_no_table_gives_the_heuristics(set_switch, value):
    set_switch(settings.CONFIGS, value)
    assert moe(1) == configs.default_config(g.E, g.H, g.I, 16, 1, g.k)
    assert linear(1) == configs.default_linear_config(1, g.H, 5120)


def test_another_gpus_tables_by_name(set_switch):
    """The H200's entries (both tables) are what a card without its own reads with MOE_LORA_CONFIGS='NVIDIA H200'."""
    set_switch(settings.CONFIGS, "NVIDIA H200")
    shape = SHIPPED[configs.shape_key(g.E, g.H, g.I, 16)]
    assert moe(1).w13 == shape["1"].w13 and moe(8).shrink == shape["8"].shrink
    assert moe(1) != configs.default_config(g.E, g.H, g.I, 16, 1, g.k)  # (else the test above tells nothing)
    assert linear(1) == SHIPPED_LINEAR[configs.linear_shape_key(g.H, 5120, 32)]["1"]
    assert linear(1) != configs.default_linear_config(1, g.H, 5120)


@pytest.mark.parametrize("value", ["NVIDIA H900", "H200"])  # a GPU we have no table of / a name that is not a file's
def test_unknown_gpu_name_is_refused(set_switch, value):
    set_switch(settings.CONFIGS, value)
    with pytest.raises(ValueError, match=r"MOE_LORA_CONFIGS=.*NVIDIA_H200\.json"):
        moe(1)


def test_variant_tables_change_only_what_they_set(set_switch, tmp_path, monkeypatch):
    """benchmarks/variant_tables.py (the A/B helper): the tables it writes, selected by name, give the configs read
    before with the --set coordinates changed at the --tokens buckets only (the others, prefill included, as they
    were), for both the dense and the MoE op."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "benchmarks" / "variant_tables.py"
    spec = importlib.util.spec_from_file_location("variant_tables", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    set_switch(settings.CONFIGS, None)
    before = {T: (moe(T), linear(T)) for T in (1, 8, 64, 512)}
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    assert tool.main(["--name", "VARIANT_TEST", "--tokens", "1", "8", "--set", "shrink.SPLIT_K=3",
                      "gemm.BLOCK_N=8", "pdl=early"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["VARIANT_TEST.json", "VARIANT_TEST_linear.json"]
    set_switch(settings.CONFIGS, "VARIANT_TEST")
    for T, (moe_before, linear_before) in before.items():
        if T in (1, 8):
            assert moe(T) == moe_before.replace(**{"shrink.SPLIT_K": 3, "pdl": "early"})  # (no gemm in MoE configs)
            assert linear(T) == linear_before.replace(**{"shrink.SPLIT_K": 3, "gemm.BLOCK_N": 8, "pdl": "early"})
        else:
            assert (moe(T), linear(T)) == (moe_before, linear_before)
    with pytest.raises(SystemExit):  # a coordinate without a value
        tool.main(["--name", "VARIANT_TEST", "--set", "shrink.SPLIT_K"])
