"""02_rope_fwd.py: the feature matrix against rope_reference, thd per sequence, q/k in one
launch, every bad input's error. CPU runs small shapes in the interpreter; a GPU
adds large shapes and tensors of more than 2**31 elements."""

import pytest
import torch

from conftest import (
    DEVICE,
    ON_GPU,
    THD_PACKINGS,
    all_pairs,
    load,
    logical_shape,
    make_view,
    random_cu_seqlens,
)

rope = load("02_rope_fwd.py")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
B, S, H = (3, 300, 7) if ON_GPU else (2, 13, 3)
S_FEW = S if ON_GPU else 5  # the tests that launch many times: fewer tokens to interpret


@pytest.mark.parametrize(
    "fmt, interleaved, dims, dtype, view, with_start",
    all_pairs(
        ["sbhd", "bshd", "thd"],
        [False, True],
        [(64, 64), (80, 48)],  # full; partial with non-power-of-2 halves
        DTYPES,
        ["contiguous", "packed", "permuted", "strided_d"],
        [False, True],
    ),
    ids=str,
)
def test_matches_reference(fmt, interleaved, dims, dtype, view, with_start):
    d, d2 = dims
    t = make_view(logical_shape(fmt, B, S, H, d), dtype, view)
    max_len = B * S if fmt == "thd" else S  # one random thd sequence may hold every token
    freqs = torch.randn(max_len + 5, 1, 1, d2, device=DEVICE)  # arbitrary angles: halves differ
    kwargs = dict(tensor_format=fmt, interleaved=interleaved)
    if fmt == "thd":
        kwargs["cu_seqlens"] = random_cu_seqlens(B, B * S)
    if with_start:
        kwargs["start_positions"] = torch.randint(0, 6, (B,), device=DEVICE)
    out = rope.rope_fwd(t, freqs, **kwargs)
    torch.testing.assert_close(out, rope.rope_reference(t, freqs, **kwargs))
    if dtype == torch.float32:  # and close to float64 math, not only to the float32 reference
        exact = rope.rope_reference(t.double(), freqs, compute_dtype=torch.float64, **kwargs)
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("h", [1, 5, 12])
def test_head_dims_and_head_counts(d, h):
    t = torch.randn(S, 2, h, d, device=DEVICE, dtype=torch.bfloat16)
    freqs = torch.randn(S, 1, 1, d, device=DEVICE)
    torch.testing.assert_close(rope.rope_fwd(t, freqs), rope.rope_reference(t, freqs))


@pytest.mark.parametrize("interleaved", [False, True])
def test_thd_equals_per_sequence_application(interleaved):
    h, d, d2 = 3, 64, 32
    cu = random_cu_seqlens(4, 4 * S, with_empty=True)
    start = torch.randint(0, 5, (4,), device=DEVICE)
    freqs = torch.randn(4 * S + 5, 1, 1, d2, device=DEVICE)
    t = torch.randn(4 * S, h, d, device=DEVICE)
    out = rope.rope_fwd(t, freqs, "thd", interleaved, cu_seqlens=cu, start_positions=start)
    bounds, starts = cu.tolist(), start.tolist()
    for i in range(4):  # each sequence alone, as sbhd with b = 1, its angles from row start[i]
        seq = t[bounds[i] : bounds[i + 1]].unsqueeze(1)
        expected = rope.rope_reference(seq, freqs[starts[i] :], "sbhd", interleaved).squeeze(1)
        torch.testing.assert_close(out[bounds[i] : bounds[i + 1]], expected)


@pytest.mark.parametrize("lengths", THD_PACKINGS.values(), ids=THD_PACKINGS)
def test_thd_packings_eager_and_compiled(lengths):
    """Every sequence rotated as if alone, from its own position 0 (plus its start position), and
    the compiled call writes what the eager call writes, bit for bit."""
    torch._dynamo.reset()
    lengths = torch.tensor(lengths)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32).to(DEVICE)
    start = torch.randint(0, 3, lengths.shape, device=DEVICE)
    freqs = torch.randn(int(lengths.max()) + 3, 1, 1, 16, device=DEVICE)
    q = torch.randn(int(cu[-1]), 2, 16, device=DEVICE)
    k = torch.randn(int(cu[-1]), 1, 16, device=DEVICE)
    kwargs = dict(tensor_format="thd", cu_seqlens=cu, start_positions=start)
    eager = rope.rope_fwd_qk(q, k, freqs, **kwargs)
    backend = "inductor" if ON_GPU else "aot_eager"
    compiled = torch.compile(rope.rope_fwd_qk, fullgraph=True, backend=backend)
    assert all(a.equal(b) for a, b in zip(compiled(q, k, freqs, **kwargs), eager))
    bounds = cu.tolist()
    for i, first in enumerate(start.tolist()):  # each sequence alone, as sbhd with b = 1
        for x, y in zip((q, k), eager):
            seq = x[bounds[i] : bounds[i + 1]].unsqueeze(1)
            expected = rope.rope_reference(seq, freqs[first:], "sbhd").squeeze(1)
            torch.testing.assert_close(y[bounds[i] : bounds[i + 1]], expected)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("k_heads", [1, 2, 3])
def test_qk_in_one_launch_with_fewer_k_heads(fmt, k_heads, monkeypatch):
    q = make_view(logical_shape(fmt, B, S, 6, 64), torch.bfloat16, "packed")
    k = make_view(logical_shape(fmt, B, S, k_heads, 64), torch.bfloat16, "contiguous")
    freqs = torch.randn(B * S, 1, 1, 64, device=DEVICE)
    kwargs = dict(tensor_format=fmt, interleaved=True)
    if fmt == "thd":
        kwargs["cu_seqlens"] = random_cu_seqlens(B, B * S)
    launches = []
    kernel = rope.rope_fwd_kernel

    class CountingKernel:
        arg_names = kernel.arg_names

        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(rope, "rope_fwd_kernel", CountingKernel())
    q_out, k_out = rope.rope_fwd_qk(q, k, freqs, **kwargs)
    assert len(launches) == 1
    torch.testing.assert_close(q_out, rope.rope_reference(q, freqs, **kwargs))
    torch.testing.assert_close(k_out, rope.rope_reference(k, freqs, **kwargs))


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
def test_torch_compile_fullgraph(fmt):
    """rope_fwd_qk and rope_fwd compile without a graph break (fullgraph=True raises on one) and
    write what eager writes, from q and k views of one packed tensor, bit for bit.
    Inductor on a GPU; on the CPU Inductor cannot run interpreted kernels, so aot_eager there."""
    torch._dynamo.reset()
    qkv = make_view(logical_shape(fmt, B, S_FEW, 3 * 4, 80), torch.bfloat16, "contiguous")
    q, k = qkv[..., :4, :], qkv[..., 4:6, :]  # strided views; k with fewer heads
    freqs = torch.randn(B * S_FEW + 5, 1, 1, 48, device=DEVICE)  # partial rotary, halves differ
    kwargs = dict(
        tensor_format=fmt,
        interleaved=True,
        start_positions=torch.randint(0, 5, (B,), device=DEVICE),
    )
    if fmt == "thd":
        kwargs["cu_seqlens"] = random_cu_seqlens(B, B * S_FEW)
    expected = rope.rope_reference(q, freqs, **kwargs), rope.rope_reference(k, freqs, **kwargs)
    backend = "inductor" if ON_GPU else "aot_eager"
    one = torch.compile(
        lambda t: rope.rope_fwd(t, freqs, **kwargs) * 1, fullgraph=True, backend=backend
    )
    torch.testing.assert_close(one(q), expected[0])
    both = torch.compile(
        lambda q, k: rope.rope_fwd_qk(q, k, freqs, **kwargs), fullgraph=True, backend=backend
    )
    torch.testing.assert_close(both(q, k), expected)
    assert all(
        a.equal(b) for a, b in zip(both(q, k), rope.rope_fwd_qk(q, k, freqs, **kwargs))
    )  # bit for bit
    # the registration itself: schema (what it writes), fake outputs, and the op against its launch
    q2, k2 = q.detach().clone(), k.detach().clone()
    torch.library.opcheck(
        rope._rope_op,
        (
            q2,
            torch.empty_like(q2),
            k2,
            torch.empty_like(k2),
            freqs,
            None,
            rope._angles_shared((freqs,), True),
            kwargs.get("cu_seqlens"),
            kwargs["start_positions"],
            fmt,
            True,
        ),
    )


def test_rope_freqs_is_a_rotation():
    # TE's table: angles pos * base^(-2i/d2), halves (or pairs) equal, so every pair keeps its norm.
    freqs = rope.rope_freqs(S, 32, device=DEVICE)
    inv = 10000.0 ** (-torch.arange(0, 32, 2, device=DEVICE).double() / 32)
    torch.testing.assert_close(
        freqs[:, 0, 0, :16].double(), torch.arange(S, device=DEVICE).double()[:, None] * inv
    )
    torch.testing.assert_close(freqs[..., :16], freqs[..., 16:])
    assert torch.equal(
        rope.rope_freqs(S, 32, interleaved=True, device=DEVICE)[..., ::2], freqs[..., :16]
    )
    t = torch.randn(S, 2, 3, 32, device=DEVICE, dtype=torch.float64).float()
    y = rope.rope_fwd(t, freqs)
    torch.testing.assert_close(
        y[..., :16] ** 2 + y[..., 16:] ** 2, t[..., :16] ** 2 + t[..., 16:] ** 2
    )
    torch.testing.assert_close(y[0], t[0])  # position 0: angle 0


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("d2", [64, 32])
def test_rotation_tables_read_half_the_angles(fmt, interleaved, d2):
    # A model's table has equal halves (or pairs): the kernel then skips loading f_b. Same answer.
    freqs = rope.rope_freqs(B * S, d2, interleaved=interleaved, device=DEVICE)
    assert rope._angles_shared((freqs,), interleaved).item() == 1
    assert (
        rope._angles_shared((freqs,), not interleaved).item() == 0
    )  # the other layout's pairs differ
    t = make_view(logical_shape(fmt, B, S, H, 64), torch.bfloat16, "packed")
    kwargs = dict(tensor_format=fmt, interleaved=interleaved)
    if fmt == "thd":
        kwargs["cu_seqlens"] = random_cu_seqlens(B, B * S)
    torch.testing.assert_close(
        rope.rope_fwd(t, freqs, **kwargs), rope.rope_reference(t, freqs, **kwargs)
    )


def test_shared_angle_flag_follows_in_place_edits_of_freqs():
    t, freqs = torch.randn(S, 2, 3, 32, device=DEVICE), rope.rope_freqs(S, 32, device=DEVICE)
    torch.testing.assert_close(
        rope.rope_fwd(t, freqs), rope.rope_reference(t, freqs)
    )  # halves equal
    freqs[..., 16:] += 0.5  # now they differ; a stale flag would reuse the first half's angles
    torch.testing.assert_close(rope.rope_fwd(t, freqs), rope.rope_reference(t, freqs))


def test_empty_input():
    t = torch.randn(0, 2, 3, 16, device=DEVICE)
    assert rope.rope_fwd(t, torch.randn(4, 1, 1, 16, device=DEVICE)).shape == t.shape


def test_value_checks_rerun_after_in_place_change():
    t, freqs = torch.randn(10, 2, 16, device=DEVICE), torch.randn(10, 1, 1, 16, device=DEVICE)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE)
    rope.rope_fwd(t, freqs, "thd", cu_seqlens=cu)  # checked once and remembered ...
    cu[1] = 11  # ... but an in-place write bumps the version counter, so the next call checks again
    with pytest.raises(ValueError, match="non-decreasing"):
        rope.rope_fwd(t, freqs, "thd", cu_seqlens=cu)


def _bad_inputs():
    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=DEVICE, dtype=dtype)

    def f(s=8, d2=16):
        return torch.randn(s, 1, 1, d2, device=DEVICE)

    def cu(*values):
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    def start(*values):
        return torch.tensor(values, device=DEVICE)

    return [
        ("odd d2", dict(t=t(8, 2, 3, 16), freqs=f(d2=15)), ValueError, "d2 = 15 must be even"),
        ("d2 > d", dict(t=t(8, 2, 3, 16), freqs=f(d2=18)), ValueError, "d2 = 18"),
        ("s > s2", dict(t=t(9, 2, 3, 16), freqs=f()), ValueError, "sequence length 9"),
        (
            "s > s2 bshd",
            dict(t=t(2, 9, 3, 16), freqs=f(), tensor_format="bshd"),
            ValueError,
            "sequence length 9",
        ),
        (
            "freqs fp16",
            dict(t=t(8, 2, 3, 16), freqs=f().half()),
            TypeError,
            "freqs must be float32",
        ),
        (
            "freqs rank",
            dict(t=t(8, 2, 3, 16), freqs=f()[:, 0]),
            ValueError,
            r"freqs must have shape \[s2, 1, 1, d2\]",
        ),
        (
            "freqs not tensor",
            dict(t=t(8, 2, 3, 16), freqs=[1.0]),
            TypeError,
            "freqs must be a torch.Tensor",
        ),
        (
            "bad format",
            dict(t=t(8, 2, 3, 16), freqs=f(), tensor_format="bhsd"),
            ValueError,
            "tensor_format",
        ),
        ("t rank", dict(t=t(8, 3, 16), freqs=f()), ValueError, "t must have 4 dims"),
        (
            "t dtype",
            dict(t=t(8, 2, 3, 16, dtype=torch.float64), freqs=f()),
            TypeError,
            "t must be float32",
        ),
        (
            "t int",
            dict(t=torch.ones(8, 2, 3, 16, dtype=torch.int32, device=DEVICE), freqs=f()),
            TypeError,
            "t must be float32",
        ),
        ("head dim > 256", dict(t=t(8, 1, 1, 258), freqs=f(d2=16)), ValueError, "head dim 258"),
        (
            "thd no cu",
            dict(t=t(8, 3, 16), freqs=f(), tensor_format="thd"),
            ValueError,
            "cu_seqlens is required",
        ),
        (
            "cu int64",
            dict(t=t(8, 3, 16), freqs=f(), tensor_format="thd", cu_seqlens=cu(0, 8).long()),
            TypeError,
            "cu_seqlens must be an int32",
        ),
        (
            "cu decreasing",
            dict(t=t(8, 3, 16), freqs=f(), tensor_format="thd", cu_seqlens=cu(0, 5, 3, 8)),
            ValueError,
            "non-decreasing",
        ),
        (
            "cu not from 0",
            dict(t=t(8, 3, 16), freqs=f(), tensor_format="thd", cu_seqlens=cu(1, 8)),
            ValueError,
            "start at 0",
        ),
        (
            "cu last",
            dict(t=t(8, 3, 16), freqs=f(), tensor_format="thd", cu_seqlens=cu(0, 3, 7)),
            ValueError,
            r"cu_seqlens\[-1\] = 7",
        ),
        (
            "cu shape",
            dict(t=t(8, 3, 16), freqs=f(), tensor_format="thd", cu_seqlens=cu(8)),
            ValueError,
            r"cu_seqlens must have shape \[b \+ 1\]",
        ),
        (
            "cu for sbhd",
            dict(t=t(8, 2, 3, 16), freqs=f(), cu_seqlens=cu(0, 8)),
            ValueError,
            "cu_seqlens is only for tensor_format='thd'",
        ),
        (
            "thd seq > s2",
            dict(t=t(12, 3, 16), freqs=f(), tensor_format="thd", cu_seqlens=cu(0, 3, 12)),
            ValueError,
            "positions up to 8",
        ),
        (
            "start float",
            dict(t=t(8, 2, 3, 16), freqs=f(), start_positions=start(0.0, 1.0)),
            TypeError,
            "start_positions must be an int32 or int64",
        ),
        (
            "start shape",
            dict(t=t(8, 2, 3, 16), freqs=f(), start_positions=start(0, 1, 2)),
            ValueError,
            r"start_positions must have shape \[b\] = \[2\]",
        ),
        (
            "start negative",
            dict(t=t(4, 2, 3, 16), freqs=f(), start_positions=start(0, -1)),
            ValueError,
            "start_positions must be >= 0",
        ),
        (
            "start too far",
            dict(t=t(4, 2, 3, 16), freqs=f(), start_positions=start(0, 5)),
            ValueError,
            "positions up to 8",
        ),
    ]


@pytest.mark.parametrize("case", _bad_inputs(), ids=lambda c: c[0])
def test_bad_inputs_raise_clear_errors(case):
    _, kwargs, error, match = case
    with pytest.raises(error, match=match):
        rope.rope_fwd(**kwargs)


def test_qk_mismatch_errors():
    q = torch.randn(8, 2, 4, 16, device=DEVICE)
    freqs = torch.randn(8, 1, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="k must match q"):
        rope.rope_fwd_qk(q, torch.randn(8, 3, 2, 16, device=DEVICE), freqs)
    with pytest.raises(ValueError, match="k must match q"):
        rope.rope_fwd_qk(q, torch.randn(8, 2, 2, 16, device=DEVICE).half(), freqs)


def test_device_mismatch_errors():
    t = torch.randn(8, 2, 3, 16, device=DEVICE)
    with pytest.raises(ValueError, match="freqs is on meta"):  # "meta" differs from any real device
        rope.rope_fwd(t, torch.randn(8, 1, 1, 16, device="meta"))
    if ON_GPU:
        with pytest.raises(ValueError, match="start_positions is on cpu"):
            rope.rope_fwd(
                t,
                torch.randn(8, 1, 1, 16, device=DEVICE),
                start_positions=torch.zeros(2, dtype=torch.int32),
            )


@pytest.mark.skipif(
    not ON_GPU, reason="GPU only: a tensor of more than 2**31 elements (4.3 GB in bf16)"
)
def test_offsets_past_2_31_elements():
    h, d = 8, 128
    s = 2**31 // (h * d) + 300  # the last 300 tokens live past element 2**31
    t = torch.randn(1, s, h, d, device=DEVICE, dtype=torch.bfloat16)
    freqs = torch.randn(s, 1, 1, d, device=DEVICE)
    out = rope.rope_fwd(t, freqs, "bshd")
    tail = slice(s - 400, s)  # compare the tail against the reference on that slice's own angles
    expected = rope.rope_reference(t[:, tail], freqs[tail], "bshd")
    torch.testing.assert_close(out[:, tail], expected)
    del t, out
    torch.cuda.empty_cache()


def test_write_page(tmp_path, monkeypatch):
    """The page writer runs only on a GPU: check its file name and sections with a stand-in device
    name."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H200")
    rope.write_page(str(tmp_path), "| shape (b, s, h, d) |\n|---|")
    page = (tmp_path / "02_rope_fwd_H200.md").read_text()
    for part in (
        "device: NVIDIA H200",
        "02_rope_fwd.py md5 ",
        "Command: `python ",
        "do_bench_cudagraph",
        "| shape (b, s, h, d) |",
        "Raw log: `02_rope_fwd_H200.log`",
    ):
        assert part in page


def test_an_input_requiring_grad_is_refused_unless_no_grad():
    """02 has no backward: its output could not carry a gradient to the layers before it, so it
    refuses rather than stop their training silently, and points at 03."""
    t = torch.randn(4, 2, 3, 16, device=DEVICE, requires_grad=True)
    freqs = rope.rope_freqs(4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="t requires grad.*03's apply_rotary_pos_emb"):
        rope.rope_fwd(t, freqs)
    with pytest.raises(ValueError, match="k requires grad"):
        rope.rope_fwd_qk(t.detach(), t, freqs)
    with torch.no_grad():
        torch.testing.assert_close(rope.rope_fwd(t, freqs), rope.rope_reference(t, freqs))


def test_eager_calls_remember_by_signature_alignment_included():
    """Eager calls keep their checks and compiled launches per signature (shapes, strides, dtype,
    device, 16-byte alignment): a view 2 bytes off, of the same shape and strides, gets a launch of
    its own; a call that must be refused still is, after good calls of the same signature."""
    base = torch.randn(2, 8, 3, 65, device=DEVICE, dtype=torch.bfloat16)
    freqs = rope.rope_freqs(8, 64, device=DEVICE)
    for t in (base[..., :64], base[..., 1:]):
        for _ in range(2):  # the second call takes the remembered launch
            torch.testing.assert_close(
                rope.rope_fwd(t, freqs, "bshd"), rope.rope_reference(t, freqs, "bshd")
            )
    t = base[..., :64].clone()
    rope.rope_fwd(t, freqs, "bshd")
    with pytest.raises(ValueError, match="requires grad"):
        rope.rope_fwd(t.requires_grad_(), freqs, "bshd")


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
def test_plain_launcher_equals_the_public_call(fmt):
    """Part 1's launch_rope_fwd (both angles of a pair read) writes what rope_fwd_qk writes, bit
    for bit, with a model's table and with any table."""
    q = make_view(logical_shape(fmt, B, S_FEW, 4, 80), torch.bfloat16, "packed")
    k = make_view(logical_shape(fmt, B, S_FEW, 2, 80), torch.bfloat16, "contiguous")
    kwargs = dict(tensor_format=fmt, interleaved=True)
    if fmt == "thd":
        kwargs["cu_seqlens"] = random_cu_seqlens(B, B * S_FEW, with_empty=True)
    for freqs in (
        rope.rope_freqs(B * S_FEW, 48, True, device=DEVICE),
        torch.randn(B * S_FEW, 1, 1, 48),
    ):
        freqs = freqs.to(DEVICE)
        plain = rope.launch_rope_fwd(q, k, freqs, **kwargs)
        for got, want in zip(plain, rope.rope_fwd_qk(q, k, freqs, **kwargs)):
            assert got.equal(want)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
def test_tokens_a_program_change_no_bit(fmt, monkeypatch):
    """Tokens a program are a launch choice only: one (a GPU's) and 16 (the interpreter's) write
    the same bits, with blocks that end inside a sequence and past its end, with angles and with
    Hugging Face's cache and position_ids."""
    q = make_view(logical_shape(fmt, 1, 18, 2, 16), torch.float32, "packed")
    k = make_view(logical_shape(fmt, 1, 18, 1, 16), torch.float32, "contiguous")
    freqs = torch.randn(24, 1, 1, 12, device=DEVICE)
    kwargs = dict(tensor_format=fmt, start_positions=torch.tensor([3], device=DEVICE))
    if fmt == "thd":
        kwargs["cu_seqlens"] = torch.tensor([0, 5, 18], dtype=torch.int32, device=DEVICE)
        kwargs["start_positions"] = torch.tensor([3, 1], device=DEVICE)
    cache = torch.randn(2, 24, 12, device=DEVICE)
    position_ids = torch.randint(0, 24, (1, 18), device=DEVICE)

    def outputs(tokens):
        monkeypatch.setattr(rope, "TOKENS_A_PROGRAM", tokens)
        monkeypatch.setattr(rope, "_launches", {})  # no launch remembered from the other count
        outs = rope.rope_fwd_qk(q, k, freqs, **kwargs)
        if fmt == "bshd":  # Hugging Face's: q and k as [b, h, s, d] views
            views = (q.transpose(1, 2), k.transpose(1, 2))
            outs += rope.hf_rope_fwd(*views, *cache, position_ids=position_ids)
        return outs

    assert all(a.equal(b) for a, b in zip(outputs(1), outputs(16), strict=True))


def test_remembered_launch_gets_every_argument_in_order(monkeypatch):
    """On a GPU a signature's later calls skip Triton's launcher: the compiled kernel gets the
    tensors, then the scalars and constexprs remembered from the first call, all in order. Here a
    stand-in for the compiled kernel takes them by position and runs the interpreter by name: t,
    and q and k, in every layout, and Hugging Face's tables and position_ids, each called
    twice."""
    run = rope.rope_fwd_kernel.run
    remembered_launches = []

    class Compiled:  # stands in for triton.compiler.CompiledKernel
        def __getitem__(self, grid):
            def launch(*args):
                remembered_launches.append(grid)
                kwargs = dict(zip(rope.rope_fwd_kernel.arg_names, args, strict=True))
                run(grid=grid, warmup=False, **kwargs)

            return launch

    def first_launch(*args, **kwargs):
        run(*args, **kwargs)
        return Compiled()

    monkeypatch.setattr(rope.rope_fwd_kernel, "run", first_launch)
    monkeypatch.setattr(rope.triton.compiler, "CompiledKernel", Compiled)
    monkeypatch.setattr(rope, "_launches", {})
    freqs = torch.randn(12, 1, 1, 16, device=DEVICE)  # partial rotary: 16 of 32 channels
    for fmt in ("sbhd", "bshd", "thd"):
        q = make_view(logical_shape(fmt, 2, 5, 4, 32), torch.float32, "packed")
        k = make_view(logical_shape(fmt, 2, 5, 2, 32), torch.float32, "contiguous")
        kwargs = dict(tensor_format=fmt, start_positions=torch.tensor([1, 0], device=DEVICE))
        if fmt == "thd":
            kwargs["cu_seqlens"] = torch.tensor([0, 3, 10], dtype=torch.int32, device=DEVICE)
        for _ in range(2):
            torch.testing.assert_close(
                rope.rope_fwd(q, freqs, **kwargs), rope.rope_reference(q, freqs, **kwargs)
            )
            outs = rope.rope_fwd_qk(q, k, freqs, **kwargs)
            for x, y in zip((q, k), outs):
                torch.testing.assert_close(y, rope.rope_reference(x, freqs, **kwargs))
    # Hugging Face's tables, passed as they are, per batch row; and a cache with position_ids
    q, k = torch.randn(2, 2, 5, 4, 32, device=DEVICE).transpose(2, 3)  # [b, h, s, d] views
    cos, sin = torch.randn(2, 2, 5, 16, device=DEVICE)
    cache = torch.randn(2, 9, 16, device=DEVICE)
    ids = torch.tensor([[8, 0, 3, 3, 1]], device=DEVICE)
    for _ in range(2):
        got = rope.hf_rope_fwd(q, k, cos, sin)
        torch.testing.assert_close(got, tuple(rope._hf_formula(q, k, cos, sin)))
        got = rope.hf_rope_fwd(q, k, *cache, position_ids=ids)
        rows = (cache[0][ids], cache[1][ids])
        torch.testing.assert_close(got, tuple(rope._hf_formula(q, k, *rows)))
    assert len(rope._launches) == 8 and len(remembered_launches) == 8


def test_inference_mode():
    """Under torch.inference_mode (tensors with no version counter) the call works and equals the
    normal one, in thd with a model's table (halves equal); a table first seen there keeps a flag
    usable outside it."""
    t = torch.randn(S_FEW * 2, H, 64, device=DEVICE)
    cu_seqlens = torch.tensor([0, S_FEW, 2 * S_FEW], device=DEVICE, dtype=torch.int32)
    freqs = rope.rope_freqs(S_FEW, 64, device=DEVICE)
    want = rope.rope_fwd(t, freqs, "thd", cu_seqlens=cu_seqlens)
    with torch.inference_mode():
        inference_t = t.clone()
        inference_cu = cu_seqlens.clone()
        inference_freqs = freqs.clone()
        got = rope.rope_fwd(inference_t, inference_freqs, "thd", cu_seqlens=inference_cu)
        seen_here = rope.rope_fwd(t, freqs, "thd", cu_seqlens=cu_seqlens)
    assert got.is_inference() and got.equal(want) and seen_here.equal(want)
    assert not rope._angles_shared((freqs,), False).is_inference()
    with torch.inference_mode():
        flag = rope._angles_shared((inference_freqs,), False)
        assert flag.item() == 0 and rope._angles_shared((inference_freqs,), False) is flag
