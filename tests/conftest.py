"""Shared test setup.

- Without a CUDA device, Triton kernels run in its interpreter (``TRITON_INTERPRET=1`` must be set before any
  ``@triton.jit`` module is imported, hence here, before the package is imported by any test module).
- ``@pytest.mark.gpu`` tests are skipped without CUDA; on the H200 run them with ``pytest -m gpu``.
- ``tests/`` itself is on ``sys.path`` (pytest puts a rootdir conftest's folder there), so test modules import the
  shared support as ``from support.cases import MoECase`` (:mod:`support`: the float64 oracle and the case builders).
- ``set_switch``: set or unset an environment switch of :mod:`moe_lora_compile.settings` for one test (the hot-path
  switches are read once, so it makes them be read again, and again after the test).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run `pytest -m gpu` on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def set_switch(monkeypatch):
    """``set_switch(switch, value)``: ``value`` (str) into the environment for this test, or None to unset it."""
    from moe_lora_compile import settings

    def set_(switch, value):
        if value is None:
            monkeypatch.delenv(switch.name, raising=False)
        else:
            monkeypatch.setenv(switch.name, value)
        settings.reload()

    yield set_
    settings.reload()  # monkeypatch restores the environment after this; the next use reads it again


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
