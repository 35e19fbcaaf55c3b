"""Test support shared by the test modules (importable as ``support`` from any test: ``tests/`` is on ``sys.path``
through ``tests/conftest.py``):

- :mod:`.oracle`: the float64 oracle of both ops, written from the op contract, independent of
  ``moe_lora_compile`` (no import of it);
- :mod:`.cases`: the one builder of random op inputs (:class:`~.cases.MoECase`, :func:`~.cases.make_linear`) and the
  per-dtype tolerances against the oracle.
- :mod:`.factors`: random adapters of an attached model as parsed factors (no PEFT folder).

Fixtures shared by every test live in ``tests/conftest.py``; the pass tests' helpers in ``tests/passes``.
"""
