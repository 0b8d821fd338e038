"""Each script, run as a user runs it, checks itself and benchmarks without error.

On a CPU-only machine this exercises the whole __main__ path in the interpreter (small sizes).
On a GPU the benchmarks are long and write results/, so they are run on purpose, not here.
"""
import re
import shutil
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
    assert "%)" not in result.stdout  # and no interpreter timing as a fraction of the copy's


def _readme_blocks(language):
    text = (ROOT / "README.md").read_text()
    return [block.split("\n", 1)[1] for block in text.split("```")[1::2] if block.startswith(language + "\n")]


def test_readme_api_example_runs_and_rotates():
    """The README's first Python block, five lines run as a user pastes them (from the repository root; on
    a CPU in the interpreter), gives what 03's PyTorch reference gives for the same input."""
    example = _readme_blocks("python")[0]
    script = ("import torch\ntorch.manual_seed(0)\n" + example + "\ntorch.manual_seed(0)\n"
              "t = torch.randn(out.shape, device=freqs.device)  # the example's input, drawn again\n"
              "assert torch.allclose(out, rope03.rope_reference(t, freqs, 'sbhd'), atol=1e-5)\nprint('ok')\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout == "ok\n", result.stdout + result.stderr
    assert len(example.splitlines()) == 5


def test_readme_installs_the_cpu_build_first_as_ci_does():
    """Run top-down on a machine without a GPU, the README's block installs torch's CPU build before the
    requirements (which would otherwise pull the CUDA build); .ci/run does the same with the torch it
    names, then runs the README's test command."""
    setup = _readme_blocks("bash")[0].splitlines()
    pips = [line for line in setup if line.startswith("pip install")]
    assert "--index-url https://download.pytorch.org/whl/cpu" in pips[0] and "-r requirements.txt" in pips[1]
    ci = [line.split("#")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    torch_pin = next(word for line in ci for word in line.split() if word.startswith("torch=="))
    assert torch_pin in pips[0]  # the README names the version CI installs
    assert ci.index(next(line for line in ci if torch_pin in line)) < ci.index(
        next(line for line in ci if "-r requirements.txt" in line))
    readme_test = next(cmd for cmd in (line.split("#")[0].strip() for line in setup) if "pytest" in cmd)
    assert ci[-1].split(None, 1)[1] == readme_test.split(None, 1)[1]  # (python3 there, python here)


def test_readme_pictures_exist_and_it_fits_its_budget():
    text = (ROOT / "README.md").read_text()
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert pictures and all((ROOT / path).is_file() for path in pictures)
    assert len(text.encode()) <= 12288


def test_05s_default_out_is_ignored_by_git():
    if shutil.which("git") is None:
        pytest.skip("no git")
    result = subprocess.run(["git", "check-ignore", "-q", "out-roformer/ckpt.pt"], cwd=ROOT)
    if result.returncode == 128:
        pytest.skip("not a git checkout")
    assert result.returncode == 0
