"""The environment switches (:mod:`moe_lora_compile.settings`): on and off words, a typo refused naming the
variable (it must not turn a switch on), Triton's own variable read as Triton reads it, ``MOE_LORA_PDL`` and
``MOE_LORA_PROGRESS`` through the same rules."""

import pytest

from moe_lora_compile import progress, settings
from moe_lora_compile.ops.triton.configs import PDL_EARLY, PDL_LATE, PDL_OFF, requested_pdl


@pytest.mark.parametrize("value,on", [
    (None, True),      # unset: the default (1)
    ("", True),        # set but empty: as unset, the default (an empty substitution must not turn it off)
    ("  ", True),      # blank likewise
    ("1", True), ("yes", True), (" ON ", True), ("True", True),  # on words, any case, spaces
    ("0", False), ("no", False), ("Off", False), ("false", False),  # off words
])
def test_on_and_off_words(set_switch, value, on):
    set_switch(settings.PAIR_SHRINK, value)
    assert settings.PAIR_SHRINK.enabled() is on


def test_empty_is_the_default_of_each_switch(set_switch):
    set_switch(settings.CHECK_IDS, "")  # default on
    set_switch(settings.PASS_LOG, "")   # default off
    assert settings.CHECK_IDS.enabled() is True and settings.PASS_LOG.enabled() is False


@pytest.mark.parametrize("switch", [settings.PAIR_SHRINK, settings.CHECK_IDS, settings.PASS_LOG])
def test_a_typo_is_refused_naming_the_variable(set_switch, switch):
    set_switch(switch, "banana")
    with pytest.raises(ValueError, match=f"{switch.name}='banana'"):
        switch.enabled()


@pytest.mark.parametrize("value", ["1", "TRUE", "yes", "on", "0", "", "anything", "2", " 1 "])
def test_triton_interpret_reads_as_triton_does(set_switch, value):
    """Not ours: on exactly when Triton's own knob is ("anything", "2" and " 1 " were on for us and off for Triton,
    so the CPU impls went down interpreter paths with no interpreter)."""
    triton = pytest.importorskip("triton")
    set_switch(settings.TRITON_INTERPRET, value)
    assert settings.TRITON_INTERPRET.enabled() is bool(triton.knobs.runtime.interpret)


@pytest.mark.parametrize("value,mode", [
    (None, PDL_LATE),    # unset: late
    ("", PDL_LATE),      # set but empty: as unset
    ("0", PDL_OFF), ("early", PDL_EARLY),
])
def test_pdl_variable(set_switch, value, mode):
    set_switch(settings.PDL, value)
    assert requested_pdl(None, passed_by_caller=False) == mode


def test_pdl_typo_names_the_variable(set_switch):
    set_switch(settings.PDL, "banana")
    with pytest.raises(ValueError, match="MOE_LORA_PDL='banana'"):
        requested_pdl(None, passed_by_caller=False)


@pytest.mark.parametrize("value,on", [("1", True), ("on", True), ("true", True), ("0", False), ("off", False),
                                      ("false", False)])  # every on/off word, not only 1 and 0
def test_progress_words(set_switch, value, on):
    set_switch(settings.PROGRESS, value)
    assert progress.enabled() is on


def test_progress_typo_is_refused(set_switch):
    set_switch(settings.PROGRESS, "loud")
    with pytest.raises(ValueError, match="MOE_LORA_PROGRESS='loud'"):
        progress.enabled()
