"""Each script, run as a user runs it, checks itself and benchmarks without error.

On a CPU-only machine this exercises the whole __main__ path in the interpreter (small sizes).
On a GPU the benchmarks are long and write results/, so they are run on purpose, not here.
"""
import subprocess
import sys

import pytest

from conftest import ON_GPU, ROOT


@pytest.mark.skipif(ON_GPU, reason="on a GPU the scripts run full benchmarks; run them by hand")
@pytest.mark.parametrize("script", ["01_rotate_half.py", "02_rope_fwd.py", "03_rope_bwd.py", "04_rope_attention.py"])
def test_script_runs(script, tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / script), "--results", str(tmp_path)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "self-check passed" in result.stdout
    assert "they say nothing about speed" in result.stdout  # the interpreter warning is printed
