"""Each script, run as a user runs it, checks itself and benchmarks without error; the README's
code runs as written, its links lead somewhere, and CI does what it says.

On a CPU-only machine this exercises the whole __main__ path in the interpreter (small sizes).
On a GPU the benchmarks are long and write results/, so they are run on purpose, not here.
"""

import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from conftest import ON_GPU, ROOT


@pytest.mark.skipif(ON_GPU, reason="on a GPU the scripts run full benchmarks; run them by hand")
@pytest.mark.parametrize(
    "script", ["01_rotate_half.py", "02_rope_fwd.py", "03_rope_bwd.py", "04_rope_attention.py"]
)
def test_script_runs(script, tmp_path):
    command = [sys.executable, str(ROOT / script), "--results", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "self-check passed" in result.stdout
    assert "they say nothing about speed" in result.stdout  # the interpreter warning is printed
    assert "%)" not in result.stdout  # and no interpreter timing as a fraction of the copy's
    lines = result.stdout.splitlines()
    starts = [
        i for i, line in enumerate(lines) if line.startswith("|") and not lines[i - 1][:1] == "|"
    ]
    assert starts, "no timing table printed"
    for i in starts:  # every table printed: its header, then the separator, then rows
        assert lines[i + 1].startswith("|---"), lines[i : i + 2]
    rows = [line for line in lines if line.startswith("| ")]
    assert len(rows) == len(set(rows)), "two rows printed alike"


def readme_blocks(language, path="README.md"):
    text = (ROOT / path).read_text()
    blocks = text.split("```")[1::2]
    return [block.split("\n", 1)[1] for block in blocks if block.startswith(language + "\n")]


def test_readme_python_runs_and_rotates():
    """The README's Python, pasted as it is into a fresh interpreter at the repository root (on a
    CPU in Triton's interpreter), gives what 03's PyTorch reference gives for the same input, and
    its module works under torch.compile: the loader registers it in sys.modules."""
    example = "\n".join(readme_blocks("python"))
    check = (
        "torch.manual_seed(0)\n"
        "t = torch.randn(out.shape, device=freqs.device)  # the example's input, drawn again\n"
        "assert torch.allclose(out, rope03.rope_reference(t, freqs, 'sbhd'), atol=1e-5)\n"
        "def model(t):  # user code that calls the loaded module, as a model's forward does\n"
        "    return rope03.apply_rotary_pos_emb(t, freqs, 'sbhd')\n"
        "compiled = torch.compile(model, backend='aot_eager', fullgraph=True)\n"
        "y = compiled(t.requires_grad_())\n"
        "assert torch.allclose(y, out, atol=1e-5)\n"
        "y.sum().backward()\n"
        "print('ok')\n"
    )
    script = "import torch\ntorch.manual_seed(0)\n" + example + "\n" + check
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0 and result.stdout == "ok\n", result.stdout + result.stderr


def test_readme_installs_the_cpu_build_first_as_ci_does():
    """Run top-down on a machine without a GPU, the README's block installs torch's CPU build
    before the requirements (which would otherwise pull the CUDA build); .ci/run does the same
    with the torch it names, checks with the ruff that pyproject.toml pins and the README names,
    then runs the README's test command."""
    setup = readme_blocks("bash")[0].splitlines()
    pips = [line for line in setup if line.startswith("pip install")]
    assert "--index-url https://download.pytorch.org/whl/cpu" in pips[0]
    assert "-r requirements.txt" in pips[1]
    ci_text = (ROOT / ".ci" / "run").read_text()
    ci = [line.split("#")[0].strip() for line in ci_text.splitlines()]
    torch_pin = next(word for line in ci for word in line.split() if word.startswith("torch=="))
    assert torch_pin in pips[0]  # the README names the version CI installs
    torch_line = next(i for i, line in enumerate(ci) if torch_pin in line)
    requirements_line = next(i for i, line in enumerate(ci) if "-r requirements.txt" in line)
    assert torch_line < requirements_line
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    ruff_pin = "ruff" + pyproject["tool"]["ruff"]["required-version"]
    assert any(ruff_pin in line for line in ci)
    assert (
        f"pip install {ruff_pin} && ruff format --check . && ruff check ."
        in (ROOT / "README.md").read_text()
    )
    assert "ruff format --check ." in ci and "ruff check ." in ci
    commands = [line.split("#")[0].strip() for line in setup]
    readme_test = next(command for command in commands if "pytest" in command)
    assert ci[-1].split(None, 1)[1] == readme_test.split(None, 1)[1]  # (python3 there, python here)


@pytest.mark.parametrize("page", ["README.md", "results/README.md"])
def test_links_lead_to_files(page):
    text = (ROOT / page).read_text()
    folder = (ROOT / page).parent
    targets = re.findall(r"\]\(([^)#]+)\)", text)
    assert targets
    for target in targets:
        if not target.startswith("http"):
            assert (folder / target).exists(), f"{page} links to {target}, which is missing"


def test_readme_steps_table_one_short_headline_a_row():
    """The steps table: one row per numbered script, each headline at most 120 characters."""
    text = (ROOT / "README.md").read_text()
    rows = [line for line in text.splitlines() if re.match(r"\| `0\d_", line)]
    assert [row.split("`")[1][:2] for row in rows] == ["01", "02", "03", "04", "05"]
    for row in rows:
        headline = row.strip("|").split("|")[-1].strip()
        assert len(headline) <= 120, f"headline over 120 characters: {headline}"


def test_05s_default_out_is_ignored_by_git():
    if shutil.which("git") is None:
        pytest.skip("no git")
    result = subprocess.run(["git", "check-ignore", "-q", "out-roformer/ckpt.pt"], cwd=ROOT)
    if result.returncode == 128:
        pytest.skip("not a git checkout")
    assert result.returncode == 0
