"""The example runs end to end as a user would run it (a subprocess) and reports every row matching PEFT."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "multi_adapter_generate.py"


@pytest.mark.parametrize("family", [
    "llama4",  # the swapped (non-decorated) MoE block; the default family is covered by the parity tests
])
def test_example_runs_and_matches_peft(family):
    result = subprocess.run([sys.executable, str(EXAMPLE), "--family", family, "--max-new-tokens", "4"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{family}: all rows match PEFT" in result.stdout
    assert result.stdout.count("matches PEFT: True") == 3
