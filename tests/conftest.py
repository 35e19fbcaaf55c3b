"""Shared test setup.

- Without a CUDA device, Triton kernels run in its interpreter (``TRITON_INTERPRET=1`` must be set before any
  ``@triton.jit`` module is imported, hence here, before the package is imported by any test module).
- ``@pytest.mark.gpu`` tests are skipped without CUDA; on the H200 run them with ``pytest -m gpu``.
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


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
