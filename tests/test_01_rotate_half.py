"""01_rotate_half.py: both kernels against PyTorch, and the naive RoPE's values and gradients."""

import pytest
import torch

from conftest import DEVICE, ON_GPU, all_pairs, load, make_view

m = load("01_rotate_half.py")
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
ROWS = 1000 if ON_GPU else 7  # odd row counts exercise the masks


@pytest.mark.parametrize(
    "dtype, interleaved, d, view",
    all_pairs(DTYPES, [False, True], [2, 8, 80, 128], ["contiguous", "packed", "strided_d"]),
    ids=str,
)
def test_rotate_half_kernels_equal_torch(dtype, interleaved, d, view):
    x = make_view((ROWS, 3, 5, d), dtype, view)
    expected = m.rotate_half_torch(x, interleaved)
    # Rotate-half only moves and negates: the kernels must be exact, in every dtype.
    assert torch.equal(m.rotate_half(x, interleaved), expected)
    assert torch.equal(m.rotate_half_rows(x, interleaved), expected)
    assert torch.equal(m.rotate_half(x, interleaved, transpose=True), -expected)


@pytest.mark.parametrize("shape", [(0, 8), (3, 0, 8)])
def test_empty_tensors_launch_no_program(shape):
    x = torch.randn(shape, device=DEVICE)
    for interleaved in (False, True):
        assert m.rotate_half(x, interleaved).shape == shape
        assert m.rotate_half_rows(x, interleaved).shape == shape


def test_rotate_half_is_a_quarter_turn():
    x = torch.randn(3, 16, device=DEVICE)
    for interleaved in (False, True):
        twice = m.rotate_half(m.rotate_half(x, interleaved), interleaved)
        assert torch.equal(twice, -x)  # R(R(x)) = -x, so R^T = R^-1 = -R


def _rope_eager(t, freqs, fmt, interleaved):
    s = t.shape[0 if fmt == "sbhd" else 1]
    angles = freqs[:s] if fmt == "sbhd" else freqs[:s].transpose(0, 1)
    d2 = freqs.shape[-1]
    x = t[..., :d2]
    y = x * angles.cos().to(t.dtype) + m.rotate_half_torch(x, interleaved) * angles.sin().to(
        t.dtype
    )
    return torch.cat((y, t[..., d2:]), dim=-1)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("d, d2", [(64, 64), (80, 48)])
def test_apply_rope_naive_values_and_gradients(fmt, interleaved, d, d2):
    s, b, h = (300, 3, 4) if ON_GPU else (9, 2, 3)
    shape = (s, b, h, d) if fmt == "sbhd" else (b, s, h, d)
    t = torch.randn(shape, device=DEVICE, requires_grad=True)
    freqs = torch.randn(s + 3, 1, 1, d2, device=DEVICE)  # random angles: the two halves differ
    grad_out = torch.randn(shape, device=DEVICE)
    y = m.apply_rope_naive(t, freqs, fmt, interleaved)
    (dt,) = torch.autograd.grad(y, t, grad_out)
    y_ref = _rope_eager(t, freqs, fmt, interleaved)
    (dt_ref,) = torch.autograd.grad(y_ref, t, grad_out)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(dt, dt_ref)


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rope_naive_gradcheck(interleaved):
    t = torch.randn(4, 2, 1, 12, device=DEVICE, dtype=torch.float64, requires_grad=True)
    freqs = torch.randn(5, 1, 1, 8, device=DEVICE)
    assert torch.autograd.gradcheck(
        lambda t: m.apply_rope_naive(t, freqs, "sbhd", interleaved), (t,)
    )


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rope_naive_under_torch_compile(interleaved):
    """fullgraph: R is an opaque torch.library op, forward and backward (Inductor on a GPU,
    aot_eager on the CPU)."""
    # float32: Inductor fuses bf16 ops without rounding between them
    t = torch.randn(2, 8, 2, 16, device=DEVICE, requires_grad=True)
    freqs = torch.randn(8, 1, 1, 12, device=DEVICE)
    rope = torch.compile(
        lambda t: m.apply_rope_naive(t, freqs, "bshd", interleaved),
        fullgraph=True,
        backend="inductor" if ON_GPU else "aot_eager",
    )
    y = rope(t)
    expected = m.apply_rope_naive(t, freqs, "bshd", interleaved)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(
        torch.autograd.grad(y.float().square().sum(), t)[0],
        torch.autograd.grad(expected.float().square().sum(), t)[0],
    )
    torch.library.opcheck(
        m.rotate_half_op, (torch.randn(3, 8, device=DEVICE, requires_grad=True), interleaved, False)
    )


@pytest.mark.parametrize("interleaved", [False, True])
def test_kernels_under_torch_compile(interleaved):
    """rotate_half and rotate_half_rows compile with fullgraph=True (each an opaque op) and match
    eager."""
    torch._dynamo.reset()
    x = torch.randn(5, 3, 24, device=DEVICE)[:, 1:]  # a strided view
    backend = "inductor" if ON_GPU else "aot_eager"
    for fn in (
        lambda x: m.rotate_half(x, interleaved),
        lambda x: m.rotate_half(x, interleaved, transpose=True),
        lambda x: m.rotate_half_rows(x, interleaved),
    ):
        torch.testing.assert_close(torch.compile(fn, fullgraph=True, backend=backend)(x), fn(x))
    torch.library.opcheck(m.rotate_half_rows_op, (torch.randn(3, 8, device=DEVICE), interleaved))


def test_errors():
    with pytest.raises(ValueError, match="x's last dim must be even"):
        m.rotate_half(torch.randn(2, 5, device=DEVICE))
    with pytest.raises(TypeError, match="x must be a floating-point"):
        m.rotate_half(torch.ones(2, 4, dtype=torch.int32, device=DEVICE))
    t, freqs = torch.randn(4, 1, 2, 8, device=DEVICE), torch.randn(4, 1, 1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="tensor_format"):
        m.apply_rope_naive(t, freqs, "thd")
    with pytest.raises(ValueError, match="sequence length 4"):
        m.apply_rope_naive(t, freqs[:3])
    with pytest.raises(ValueError, match="d2 = 6"):
        m.apply_rope_naive(torch.randn(4, 1, 2, 4, device=DEVICE), freqs[..., :6])
    with pytest.raises(TypeError, match="freqs must be a float32"):
        m.apply_rope_naive(t, freqs.double())


def test_write_page(tmp_path, monkeypatch):
    """The page writer runs only on a GPU: check its file name and sections with a stand-in device
    name."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H100 80GB HBM3")
    stem = m.write_page(str(tmp_path), "| provider |\n|---|")
    page = (tmp_path / "01_rotate_half_H100.md").read_text()
    assert stem == str(tmp_path / "01_rotate_half_H100")
    for part in (
        "device: NVIDIA H100",
        "01_rotate_half.py md5 ",
        "Command: `python ",
        "do_bench_cudagraph",
        "| provider |",
        "Raw log: `01_rotate_half_H100.log`",
    ):
        assert part in page
