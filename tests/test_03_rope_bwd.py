"""03_rope_bwd.py: gradients against autograd through rope_reference over the feature matrix,
gradcheck in float64, q/k in one launch each way, a model-level check, torch.compile without
graph breaks, autocast, and the errors. CPU runs small shapes in the interpreter."""

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

rope = load("03_rope_bwd.py")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
B, S, H = (3, 300, 7) if ON_GPU else (2, 9, 3)


def make_inputs(fmt, d, d2, dtype, view, with_start, b=B, s=S, h=H):
    t = make_view(logical_shape(fmt, b, s, h, d), dtype, view).requires_grad_()
    max_len = b * s if fmt == "thd" else s
    freqs = torch.randn(max_len + 5, 1, 1, d2, device=DEVICE)  # arbitrary angles: halves differ
    kwargs = dict(tensor_format=fmt)
    if fmt == "thd":
        kwargs["cu_seqlens"] = random_cu_seqlens(b, b * s, with_empty=True)
    if with_start:
        kwargs["start_positions"] = torch.randint(0, 6, (b,), device=DEVICE)
    return t, freqs, kwargs


def rope_bwd(dy, freqs, tensor_format="sbhd", **kwargs):
    """RoPE's gradient with respect to its input, given the output's (a tuple: q's and k's),
    through 03's autograd Function; it keeps requiring grad if dy does (double backward)."""
    dys = dy if isinstance(dy, tuple) else (dy,)
    xs = [torch.zeros_like(g).requires_grad_() for g in dys]
    if len(xs) == 2:
        ys = rope.apply_rotary_pos_emb_qk(*xs, freqs, tensor_format, **kwargs)
    else:
        ys = rope.apply_rotary_pos_emb(*xs, freqs, tensor_format, **kwargs)
    grads = torch.autograd.grad(ys, xs, dys, create_graph=any(g.requires_grad for g in dys))
    return grads if len(grads) == 2 else grads[0]


def reference_grad(t, freqs, dy, interleaved, **kwargs):
    y = rope.rope_reference(t, freqs, interleaved=interleaved, **kwargs)
    return y, torch.autograd.grad(y, t, dy)[0]


@pytest.mark.parametrize(
    "fmt, interleaved, dims, dtype, view, with_start",
    all_pairs(
        ["sbhd", "bshd", "thd"],
        [False, True],
        [(64, 64), (80, 48)],  # full; partial with non-power-of-2 halves
        DTYPES,
        ["contiguous", "packed", "strided_d"],
        [False, True],
    ),
    ids=str,
)
def test_gradients_match_autograd_of_reference(fmt, interleaved, dims, dtype, view, with_start):
    d, d2 = dims
    t, freqs, kwargs = make_inputs(fmt, d, d2, dtype, view, with_start)
    y = rope.apply_rotary_pos_emb(t, freqs, interleaved=interleaved, **kwargs)
    strided = "permuted" if fmt != "thd" else "strided_d"
    dy = make_view(y.shape, dtype, strided)  # a strided gradient
    (dt,) = torch.autograd.grad(y, t, dy)
    y_ref, dt_ref = reference_grad(t, freqs, dy, interleaved, **kwargs)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(dt, dt_ref)
    # rope_bwd alone gives the same gradient
    torch.testing.assert_close(rope_bwd(dy, freqs, interleaved=interleaved, **kwargs), dt_ref)


def test_backward_is_not_the_negated_angle_for_arbitrary_tables():
    """The derivation's point: with f_a != f_b the sines trade halves. Negating the angle instead
    gives a different answer, and the kernel must not."""
    t, freqs, kwargs = make_inputs("bshd", 16, 16, torch.float32, "contiguous", False)
    dy = torch.randn_like(t)
    dt = rope_bwd(dy, freqs, **kwargs)
    _, dt_ref = reference_grad(t, freqs, dy, False, **kwargs)
    torch.testing.assert_close(dt, dt_ref)
    negated = rope.rope_reference(dy, -freqs, **kwargs)
    assert (negated - dt_ref).abs().max() > 1e-2  # the check above can tell the two apart
    # ... while for a true rotation table the two agree
    table = rope.rope_freqs(freqs.shape[0], 16, device=DEVICE)
    torch.testing.assert_close(
        rope_bwd(dy, table, **kwargs), rope.rope_reference(dy, -table, **kwargs)
    )


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_gradcheck_float64(fmt, interleaved):
    full = fmt == "bshd" and not interleaved  # one full Jacobian (slow in the interpreter)
    s = 2 if full else 3
    h = 1 if full else 2
    t, freqs, kwargs = make_inputs(fmt, 12, 8, torch.float64, "contiguous", True, b=2, s=s, h=h)

    def fn(x):
        return rope.apply_rotary_pos_emb(x, freqs, interleaved=interleaved, **kwargs)

    assert torch.autograd.gradcheck(fn, (t,), fast_mode=not full)
    assert torch.autograd.gradgradcheck(fn, (t,), fast_mode=True)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("k_heads", [1, 3])
def test_qk_one_launch_each_way_with_fewer_k_heads(fmt, k_heads, monkeypatch):
    q = make_view(logical_shape(fmt, B, S, 6, 64), torch.bfloat16, "packed").requires_grad_()
    k = make_view(
        logical_shape(fmt, B, S, k_heads, 64), torch.bfloat16, "contiguous"
    ).requires_grad_()
    freqs = torch.randn(B * S, 1, 1, 64, device=DEVICE)
    kwargs = dict(tensor_format=fmt, interleaved=True)
    if fmt == "thd":
        kwargs["cu_seqlens"] = random_cu_seqlens(B, B * S)
    launches = count_launches(monkeypatch)
    q_out, k_out = rope.apply_rotary_pos_emb_qk(q, k, freqs, **kwargs)
    assert len(launches) == 1
    dq_out, dk_out = torch.randn_like(q_out), torch.randn_like(k_out)
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (dq_out, dk_out))
    assert len(launches) == 2
    for x, y, dy, dx in ((q, q_out, dq_out, dq), (k, k_out, dk_out, dk)):
        y_ref, dx_ref = reference_grad(x, freqs, dy, **kwargs)
        torch.testing.assert_close(y, y_ref)
        torch.testing.assert_close(dx, dx_ref)
    torch.testing.assert_close(rope_bwd((dq_out, dk_out), freqs, **kwargs), (dq, dk))


def count_launches(monkeypatch):
    """The list that every kernel launch of 03 appends to (q's shape), from now on."""
    launches = []
    launch = rope._launch

    def counted(kernel, q, *args, **kwargs):
        launches.append(q.shape)
        return launch(kernel, q, *args, **kwargs)

    monkeypatch.setattr(rope, "_launch", counted)
    return launches


def test_registered_op_matches_the_eager_launch():
    """Eager calls launch the kernel directly; torch.compile traces the registered op; Part 1's
    launch_rope launches it plainly. All the same, bit for bit."""
    t, freqs, kwargs = make_inputs("thd", 80, 48, torch.float32, "packed", True)
    args = (
        t.detach(),
        None,
        None,
        freqs,
        None,
        rope._angles_shared((freqs,), True),
        None,
        kwargs["cu_seqlens"],
        kwargs["start_positions"],
        "thd",
        True,
    )
    positions = (kwargs["cu_seqlens"], kwargs["start_positions"])
    for backward in (False, True):
        eager = rope._rope_impl(*args, backward, 1, 0, 0, False)[0]
        traced = rope._rope.op(*args, backward, 1, 0, 0, False)[0]
        plain = rope.launch_rope(t.detach(), None, freqs, "thd", True, backward, *positions)[0]
        torch.testing.assert_close(traced, eager, rtol=0, atol=0)
        torch.testing.assert_close(plain, eager, rtol=0, atol=0)


class AttentionBlock(torch.nn.Module):
    """A small self-attention block with RoPE on q and k (bshd, as a linear layer gives it)."""

    def __init__(self, hidden, heads, rope_fn):
        super().__init__()
        self.heads = heads
        self.rope_fn = rope_fn
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x, freqs):
        b, s, hidden = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, hidden // self.heads).unbind(2)
        q = self.rope_fn(q, freqs)
        k = self.rope_fn(k, freqs)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(out.transpose(1, 2).reshape(b, s, hidden))


def eager_rope(t, freqs):  # TransformerEngine's unfused formula
    return rope.rope_reference(t, freqs, tensor_format="bshd", interleaved=True, compute_dtype=None)


def fused_rope(t, freqs):
    return rope.apply_rotary_pos_emb(t, freqs, tensor_format="bshd", interleaved=True)


def test_attention_block_same_loss_and_gradients():
    torch.manual_seed(0)
    x = torch.randn(2, S, 32, device=DEVICE)
    freqs = rope.rope_freqs(S, 8, interleaved=True, device=DEVICE)  # partial: 8 of 16 channels
    losses = []
    grads = []
    for rope_fn in (eager_rope, fused_rope):
        torch.manual_seed(1)
        block = AttentionBlock(32, 2, rope_fn).to(DEVICE)
        loss = block(x, freqs).square().mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in block.named_parameters()})
    torch.testing.assert_close(losses[0], losses[1])
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], msg=name)


def test_torch_compile_fullgraph():
    """Compiles without a graph break (fullgraph=True raises on one) and matches, forward and
    backward. On a GPU this is inductor with triton_op; in the CPU interpreter inductor cannot
    trace interpreted kernels, so the op is a custom_op and the graph is checked with aot_eager."""
    torch._dynamo.reset()
    t, freqs, kwargs = make_inputs("thd", 64, 32, torch.float32, "contiguous", True)
    t2 = t.detach().clone().requires_grad_()

    def f(x):
        return rope.apply_rotary_pos_emb(x * 2, freqs, interleaved=True, **kwargs).sin()

    backend = "inductor" if ON_GPU else "aot_eager"
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    y = compiled(t)
    y_eager = f(t2)
    torch.testing.assert_close(y, y_eager)
    dy = torch.randn_like(y)
    torch.testing.assert_close(
        torch.autograd.grad(y, t, dy)[0], torch.autograd.grad(y_eager, t2, dy)[0]
    )
    assert rope._USE_TRITON_OP == (ON_GPU and hasattr(torch.library, "triton_op"))

    def plain(x):
        return rope.apply_rotary_pos_emb(x, freqs, interleaved=True, **kwargs)

    y = torch.compile(plain, fullgraph=True, backend=backend)(t)
    y_eager = plain(t2)
    assert y.equal(y_eager)  # the op alone: compiled and eager, bit for bit, both ways
    assert torch.autograd.grad(y, t, dy)[0].equal(torch.autograd.grad(y_eager, t2, dy)[0])


@pytest.mark.parametrize("lengths", THD_PACKINGS.values(), ids=THD_PACKINGS)
def test_thd_packings_eager_and_compiled(lengths):
    """Every sequence rotated as if alone, from its own position 0 (plus its start position),
    forward and backward; the compiled call gives what the eager call gives, bit for bit."""
    torch._dynamo.reset()
    lengths = torch.tensor(lengths)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32).to(DEVICE)
    start = torch.randint(0, 3, lengths.shape, device=DEVICE)
    freqs = torch.randn(int(lengths.max()) + 3, 1, 1, 16, device=DEVICE)
    q = torch.randn(int(cu[-1]), 2, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(int(cu[-1]), 1, 16, device=DEVICE, requires_grad=True)
    grads = (torch.randn_like(q), torch.randn_like(k))

    def forward(q, k):
        return rope.apply_rotary_pos_emb_qk(q, k, freqs, "thd", start, cu_seqlens=cu)

    backend = "inductor" if ON_GPU else "aot_eager"
    compiled = torch.compile(forward, fullgraph=True, backend=backend)
    eager, got = (
        [*outs, *torch.autograd.grad(outs, (q, k), grads)]
        for outs in (forward(q, k), compiled(q, k))
    )
    assert all(a.equal(b) for a, b in zip(got, eager))
    bounds = cu.tolist()
    for i, first in enumerate(start.tolist()):  # each sequence alone, as sbhd with b = 1
        rows = slice(bounds[i], bounds[i + 1])
        for x, dy, y, dx in zip((q, k), grads, eager[:2], eager[2:]):
            seq = x[rows].detach().unsqueeze(1).requires_grad_()
            expected = rope.rope_reference(seq, freqs[first:], "sbhd").squeeze(1)
            torch.testing.assert_close(y[rows], expected)
            torch.testing.assert_close(
                dx[rows], torch.autograd.grad(expected, seq, dy[rows])[0][:, 0]
            )


def test_autocast():
    """Under autocast a linear layer gives low-precision q; RoPE keeps its dtype and its gradient
    flows. bf16 on the GPU; fp16 on the CPU, because Triton 3.9's interpreter casts float32 to bf16
    without rounding to nearest (about half the elements land one bf16 step away from torch's)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    linear = torch.nn.Linear(64, 64).to(DEVICE)
    x = torch.randn(2, S, 64, device=DEVICE)
    freqs = rope.rope_freqs(S, 16, device=DEVICE)
    results = []
    for rope_fn in (rope.rope_reference, rope.apply_rotary_pos_emb):
        with torch.autocast(DEVICE.type, dtype=dtype):
            q = linear(x).view(2, S, 4, 16)
            y = rope_fn(q, freqs, tensor_format="bshd")
            assert y.dtype == dtype
            loss = y.float().square().mean()
        results.append((loss, torch.autograd.grad(loss, linear.weight)[0]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=2e-2, atol=2e-3)


def test_freqs_requiring_grad_is_refused():
    t, freqs, kwargs = make_inputs("bshd", 16, 16, torch.float32, "contiguous", False)
    with pytest.raises(ValueError, match=r"freqs requires grad.*freqs\.detach\(\)"):
        rope.apply_rotary_pos_emb(t, freqs.requires_grad_(), **kwargs)
    with torch.no_grad():  # no gradient asked for: fine
        rope.apply_rotary_pos_emb(t, freqs, **kwargs)
    qkv = torch.randn(4, 2, 2, 48, device=DEVICE)
    table = torch.randn(4, 1, 1, 16, device=DEVICE)
    k_table = table.clone().requires_grad_()
    message = r"^k_freqs requires grad.*k_freqs\.detach\(\)"  # fused QKV names which
    with pytest.raises(ValueError, match=message):
        rope.apply_fused_qkv_rotary_pos_emb(qkv, table, k_table, [16, 16, 16])


def test_write_page(tmp_path, monkeypatch):
    """The page writer runs only on a GPU: check its file name and sections with a stand-in
    device name."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H100 80GB HBM3")
    rope.write_page(
        str(tmp_path / "results"),
        {"q and k, backward": ["| shape (b, s, h, d) | copy | ours |", "|---|"]},
    )
    page = (tmp_path / "results" / "03_rope_bwd_H100.md").read_text()
    for part in (
        "device: NVIDIA H100",
        "03_rope_bwd.py md5 ",
        "Command: `python ",
        "do_bench_cudagraph",
        "## q and k, backward\n\n| shape (b, s, h, d) | copy | ours |",
        "Raw log: `03_rope_bwd_H100.log`",
    ):
        assert part in page


def randn(*shape):
    return torch.randn(*shape, device=DEVICE)


def test_errors():
    t = randn
    f = randn
    cases = [
        (
            lambda: rope.apply_rotary_pos_emb(t(4, 2, 3, 16), f(4, 1, 1, 15)),
            ValueError,
            "must be even",
        ),
        (
            lambda: rope.apply_rotary_pos_emb(t(8, 3, 16), f(8, 1, 1, 16), "thd"),
            ValueError,
            "cu_seqlens is required",
        ),
        (
            lambda: rope.apply_rotary_pos_emb(t(4, 2, 3, 16).long(), f(4, 1, 1, 16)),
            TypeError,
            "t must be float32",
        ),
        (
            lambda: rope.apply_rotary_pos_emb(t(4, 2, 3, 16), f(4, 1, 1, 16).half()),
            TypeError,
            "freqs must be float32",
        ),
        (
            lambda: rope.apply_rotary_pos_emb(t(5, 2, 3, 16), f(4, 1, 1, 16)),
            ValueError,
            "over the 4 rows",
        ),
        (
            lambda: rope.apply_rotary_pos_emb(
                t(4, 2, 3, 16), f(8, 1, 1, 16), start_positions=torch.tensor([0, 5], device=DEVICE)
            ),
            ValueError,
            "positions up to 8",
        ),
        (
            lambda: rope.apply_rotary_pos_emb(t(4, 2, 3, 16), f(4, 1, 1, 16), tensor_format="hbsd"),
            ValueError,
            "tensor_format",
        ),
        (
            lambda: rope.apply_rotary_pos_emb_qk(
                t(4, 2, 3, 16), t(4, 2, 3, 16).half(), f(4, 1, 1, 16)
            ),
            ValueError,
            "k must match q",
        ),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU with > 17 GB free")
def test_backward_over_2_31_elements():
    t = torch.empty(
        2**31 // (16 * 128) + 7, 1, 16, 128, device=DEVICE, dtype=torch.bfloat16
    ).normal_()
    freqs = rope.rope_freqs(t.shape[0], 128, device=DEVICE)
    dt = rope_bwd(t, freqs)
    rows = [0, t.shape[0] - 3]  # the last rows lie past 2**31 elements
    for r in rows:
        torch.testing.assert_close(
            dt[r : r + 3], rope.rope_reference(t[r : r + 3], -freqs[r : r + 3])
        )


# Context parallelism, fused QKV, contiguous outputs: TransformerEngine's contract.


def rank_tokens(fmt, cu_seqlens, s, cp_size, cp_rank):
    """The indices (along the sequence dim; thd: the packed tokens) of what rank cp_rank holds of
    whole sequences: chunks cp_rank and 2 cp_size - 1 - cp_rank of each, cut into 2 cp_size
    chunks."""
    starts = [0]
    lengths = [s]
    if fmt == "thd":
        starts = cu_seqlens[:-1].tolist()
        lengths = cu_seqlens.diff().tolist()
    index = []
    for start, length in zip(starts, lengths):
        c = length // (2 * cp_size)
        index += [start + i * c + j for i in (cp_rank, 2 * cp_size - 1 - cp_rank) for j in range(c)]
    return torch.tensor(index, device=DEVICE, dtype=torch.long)


@pytest.mark.parametrize(
    "fmt, interleaved, cp_size, with_start, dtype",
    all_pairs(
        ["sbhd", "bshd", "thd"],
        [False, True],
        [2, 3],
        [False, True],
        [torch.float32, torch.bfloat16],
    ),
    ids=str,
)
def test_context_parallel_rank_equals_its_chunks_of_the_whole_sequence(
    fmt, interleaved, cp_size, with_start, dtype
):
    """Each rank's output and gradient equal that rank's chunks of the whole sequences rotated
    whole."""
    s = 4 * cp_size * (3 if ON_GPU else 1)
    t, freqs, kwargs = make_inputs(fmt, 48, 32, dtype, "contiguous", with_start, s=s)
    if fmt == "thd":  # lengths padded to multiples of 2 cp_size, one of them empty
        lengths = torch.randint(0, 4, (B,)) * 2 * cp_size
        kwargs["cu_seqlens"] = (
            torch.cat([torch.zeros(1), lengths.cumsum(0)]).to(torch.int32).to(DEVICE)
        )
        t = torch.randn(int(lengths.sum()), H, 48, device=DEVICE, dtype=dtype).requires_grad_()
    whole = rope.rope_reference(t, freqs, interleaved=interleaved, **kwargs)
    dy = torch.randn_like(whole)
    (dt_whole,) = torch.autograd.grad(whole, t, dy)
    seq_dim = {"sbhd": 0, "bshd": 1, "thd": 0}[fmt]
    for cp_rank in range(cp_size):
        index = rank_tokens(fmt, kwargs.get("cu_seqlens"), s, cp_size, cp_rank)
        local = t.detach().index_select(seq_dim, index).requires_grad_()
        y = rope.apply_rotary_pos_emb(
            local, freqs, interleaved=interleaved, cp_size=cp_size, cp_rank=cp_rank, **kwargs
        )
        torch.testing.assert_close(y, whole.index_select(seq_dim, index))
        (dt,) = torch.autograd.grad(y, local, dy.index_select(seq_dim, index))
        torch.testing.assert_close(dt, dt_whole.index_select(seq_dim, index))


def split_reference(qkv, q_freqs, k_freqs, split, **kwargs):
    """TE's unfused reading of a fused qkv: split the last dim, q's part as its heads, each
    rotated."""
    q, k, v = qkv.split(split, dim=-1)
    q = q.reshape(*q.shape[:2], -1, split[1])
    return rope.rope_reference(q, q_freqs, **kwargs), rope.rope_reference(k, k_freqs, **kwargs), v


@pytest.mark.parametrize(
    "fmt, interleaved, groups, d2, cp, with_start",
    all_pairs(["sbhd", "bshd"], [False, True], [1, 4], [48, 64], [(1, 0), (2, 1)], [False, True]),
    ids=str,
)
def test_fused_qkv_matches_the_split_reference_in_one_launch_each_way(
    fmt, interleaved, groups, d2, cp, with_start, monkeypatch
):
    """q, k and v out of one fused projection (Megatron's GQA layout), with their own angle
    tables for q and k: values and qkv's gradient against rotating the split parts (a rank's
    chunks of them under context parallelism); one launch each way, contiguous outputs."""
    d = 64
    h = 3
    s = 24 if ON_GPU else 8
    split = [groups * d, d, d]
    whole = make_view(
        logical_shape(fmt, B, s, h, sum(split)), torch.bfloat16, "permuted"
    ).requires_grad_()
    seq_dim = fmt.index("s")
    index = rank_tokens(fmt, None, s, *cp)
    qkv = whole if cp[0] == 1 else whole.index_select(seq_dim, index)  # this rank's part
    q_freqs = torch.randn(s + 5, 1, 1, d2, device=DEVICE)
    k_freqs = torch.randn(s + 5, 1, 1, d2, device=DEVICE)
    kwargs = dict(tensor_format=fmt, interleaved=interleaved, start_positions=None)
    if with_start:
        kwargs["start_positions"] = torch.randint(0, 6, (B,), device=DEVICE)
    launches = count_launches(monkeypatch)
    outs = rope.apply_fused_qkv_rotary_pos_emb(
        qkv, q_freqs, k_freqs, split, cp_size=cp[0], cp_rank=cp[1], **kwargs
    )
    assert len(launches) == 1 and all(y.is_contiguous() for y in outs)
    assert outs[0].shape[-2:] == (h * groups, d)
    assert outs[1].shape[-2:] == outs[2].shape[-2:] == (h, d)
    refs = [
        y.index_select(seq_dim, index)
        for y in split_reference(whole, q_freqs, k_freqs, split, **kwargs)
    ]
    grads = [torch.randn_like(y) for y in outs]
    got = (*outs, *torch.autograd.grad(outs, whole, grads))
    want = (*refs, *torch.autograd.grad(refs, whole, grads))
    for y, ref in zip(got, want):
        torch.testing.assert_close(y, ref)
    assert len(launches) == 2


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
def test_tokens_a_program_change_no_bit(fmt, monkeypatch):
    """Tokens a program are a launch choice only: one (a GPU's) and 16 (the interpreter's) give
    the same bits forward and backward, with blocks that end inside a sequence and past its end;
    in bshd also fused QKV, and Hugging Face's cache with position_ids."""
    q = make_view(logical_shape(fmt, 1, 18, 2, 16), torch.float32, "packed").requires_grad_()
    k = make_view(logical_shape(fmt, 1, 18, 1, 16), torch.float32, "contiguous").requires_grad_()
    freqs = torch.randn(24, 1, 1, 12, device=DEVICE)
    kwargs = dict(tensor_format=fmt, start_positions=torch.tensor([3], device=DEVICE))
    if fmt == "thd":
        kwargs["cu_seqlens"] = torch.tensor([0, 5, 18], dtype=torch.int32, device=DEVICE)
        kwargs["start_positions"] = torch.tensor([3, 1], device=DEVICE)
    qkv = torch.randn(1, 18, 2, 4 * 16, device=DEVICE, requires_grad=True)
    cache = torch.randn(2, 24, 12, device=DEVICE)
    position_ids = torch.randint(0, 24, (1, 18), device=DEVICE)

    def outputs_and_gradients(tokens):
        monkeypatch.setattr(rope, "TOKENS_A_PROGRAM", tokens)
        monkeypatch.setattr(rope, "_launches", {})  # no launch remembered from the other count
        calls = [(rope.apply_rotary_pos_emb_qk(q, k, freqs, **kwargs), (q, k))]
        if fmt == "bshd":
            fused = rope.apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, [32, 16, 16], **kwargs)
            views = (q.transpose(1, 2), k.transpose(1, 2))  # Hugging Face's [b, h, s, d]
            hf = rope.hf_apply_rotary_pos_emb(*views, *cache, position_ids=position_ids)
            calls += [(fused, (qkv,)), (hf, (q, k))]
        results = []
        for outs, inputs in calls:
            grads = [torch.ones_like(y).cumsum(-1) for y in outs]  # the same every call
            results += [*outs, *torch.autograd.grad(outs, inputs, grads)]
        return results

    got = outputs_and_gradients(1)
    assert all(a.equal(b) for a, b in zip(got, outputs_and_gradients(16), strict=True))


def test_fused_qkv_gradcheck_and_compile():
    """float64 gradients (and double backward) by gradcheck; compiled without graph breaks, equal
    to eager."""
    torch._dynamo.reset()
    # bshd: 1 sequence of 3 tokens, 2 groups of 2 q heads
    qkv = torch.randn(1, 3, 2, 4 * 8, device=DEVICE, dtype=torch.float64, requires_grad=True)
    q_freqs = torch.randn(6, 1, 1, 4, device=DEVICE)
    k_freqs = torch.randn(6, 1, 1, 4, device=DEVICE)

    def fn(x):
        return rope.apply_fused_qkv_rotary_pos_emb(x, q_freqs, k_freqs, [16, 8, 8], "bshd")

    assert torch.autograd.gradcheck(fn, (qkv,), fast_mode=True)
    assert torch.autograd.gradgradcheck(fn, (qkv,), fast_mode=True)
    x = qkv.detach().float().requires_grad_()
    compiled = torch.compile(fn, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    outs = compiled(x)
    outs_eager = fn(x)
    grads = [torch.randn_like(y) for y in outs]
    for got, want in zip(
        outs + torch.autograd.grad(outs, x, grads),
        outs_eager + torch.autograd.grad(outs_eager, x, grads),
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fused_qkv_with_one_table_for_q_and_k_compiles():
    """One angle table passed as both q_freqs and k_freqs, as most models do: compiled with
    fullgraph=True (autograd's Function never takes one tensor twice), equal to eager and to two
    equal tables."""
    torch._dynamo.reset()
    qkv = torch.randn(1, 3, 2, 4 * 8, device=DEVICE, requires_grad=True)
    freqs = torch.randn(6, 1, 1, 8, device=DEVICE)

    def fn(x, k_freqs):
        return rope.apply_fused_qkv_rotary_pos_emb(x, freqs, k_freqs, [16, 8, 8], "bshd")

    compiled = torch.compile(fn, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    outs = compiled(qkv, freqs)
    grads = [torch.randn_like(y) for y in outs]
    for k_freqs in (freqs, freqs.clone()):
        outs_eager = fn(qkv, k_freqs)
        for got, want in zip(
            outs + torch.autograd.grad(outs, qkv, grads, retain_graph=True),
            outs_eager + torch.autograd.grad(outs_eager, qkv, grads),
        ):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("transpose", [(0, 1), (2, 3)])
def test_outputs_are_contiguous_whatever_the_input_strides(transpose):
    """As TransformerEngine's: a caller may .view() the result."""
    freqs = torch.randn(8, 1, 1, 16, device=DEVICE)
    t = (
        torch.randn(8, 2, 3, 16, device=DEVICE)
        .transpose(*transpose)
        .contiguous()
        .transpose(*transpose)
    )
    t.requires_grad_()
    y = rope.apply_rotary_pos_emb(t, freqs)
    (dt,) = torch.autograd.grad(
        y, t, torch.randn_like(y).transpose(*transpose).contiguous().transpose(*transpose)
    )
    rope02 = load("02_rope_fwd.py")
    assert y.is_contiguous() and dt.is_contiguous() and rope_bwd(t.detach(), freqs).is_contiguous()
    assert rope02.rope_fwd(t.detach(), freqs).is_contiguous()
    torch.testing.assert_close(y, rope.rope_reference(t, freqs))


def test_context_parallel_and_fused_qkv_errors():
    t = randn

    def cu(*offsets):
        return torch.tensor(offsets, dtype=torch.int32, device=DEVICE)

    qkv_fn = rope.apply_fused_qkv_rotary_pos_emb
    cases = [
        (
            lambda: rope.apply_rotary_pos_emb(t(4, 2, 3, 16), t(8, 1, 1, 16), cp_size=2, cp_rank=2),
            "cp_rank",
        ),
        (lambda: rope.apply_rotary_pos_emb(t(4, 2, 3, 16), t(8, 1, 1, 16), cp_size=0), "cp_size"),
        (
            lambda: rope.apply_rotary_pos_emb(t(3, 2, 3, 16), t(8, 1, 1, 16), cp_size=2, cp_rank=1),
            "must be even",
        ),
        (
            lambda: rope.apply_rotary_pos_emb(t(4, 2, 3, 16), t(7, 1, 1, 16), cp_size=2),
            "times cp_size",
        ),
        (
            lambda: rope.apply_rotary_pos_emb(
                t(4, 2, 3, 16),
                t(8, 1, 1, 16),
                "sbhd",
                torch.tensor([0, 1], device=DEVICE),
                cp_size=2,
            ),
            "positions up to 8",
        ),
        (
            lambda: rope.apply_rotary_pos_emb(
                t(6, 3, 16), t(12, 1, 1, 16), "thd", cu_seqlens=cu(0, 6, 12), cp_size=2
            ),
            r"multiples of 2 \* cp_size",
        ),
        (
            lambda: rope.apply_rotary_pos_emb(
                t(6, 3, 16), t(12, 1, 1, 16), "thd", cu_seqlens=cu(0, 4, 8), cp_size=2
            ),
            "times cp_size",
        ),
        (
            lambda: qkv_fn(t(4, 2, 2, 48), t(4, 1, 1, 16), t(4, 1, 1, 16), [16, 16, 8]),
            "qkv_split_arg_list",
        ),
        (
            lambda: qkv_fn(t(4, 2, 2, 48), t(4, 1, 1, 16), t(4, 1, 1, 16), [20, 14, 14]),
            "qkv_split_arg_list",
        ),
        (
            lambda: qkv_fn(t(4, 2, 2, 48), t(4, 1, 1, 16), t(4, 1, 1, 16), [16, 16, 16, 0]),
            "qkv_split_arg_list",
        ),
        (
            lambda: qkv_fn(t(4, 2, 2, 40), t(4, 1, 1, 16), t(4, 1, 1, 16), [16, 16, 16]),
            "sum of qkv_split_arg_list",
        ),
        (lambda: qkv_fn(t(4, 2, 2, 48), t(4, 1, 1, 16), t(5, 1, 1, 16), [16, 16, 16]), "k_freqs"),
        (
            lambda: qkv_fn(t(8, 3, 48), t(4, 1, 1, 16), t(4, 1, 1, 16), [16, 16, 16], "thd"),
            "sbhd' or 'bshd",
        ),
        (
            lambda: qkv_fn(
                t(4, 2, 2, 48), t(4, 1, 1, 16), t(4, 1, 1, 16), [16, 16, 16], cp_size=2, cp_rank=1
            ),
            "over the 4 rows",
        ),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_no_silent_outputs_or_gradients():
    """q with no heads still rotates k (nothing left unwritten); a gradient that requires grad
    gets one that does (its own gradient is the forward rotation): double backward."""
    freqs = rope.rope_freqs(8, 16, device=DEVICE)
    q = torch.randn(1, 6, 0, 16, device=DEVICE)
    k = torch.randn(1, 6, 2, 16, device=DEVICE)
    torch.testing.assert_close(
        rope.apply_rotary_pos_emb_qk(q, k, freqs, "bshd")[1], rope.rope_reference(k, freqs, "bshd")
    )
    dy = torch.randn(1, 6, 2, 16, device=DEVICE, dtype=torch.float64, requires_grad=True)
    assert rope_bwd(dy, freqs, "bshd").requires_grad
    assert torch.autograd.gradcheck(lambda g: rope_bwd(g, freqs, "bshd"), (dy,), fast_mode=True)


def test_eager_calls_remember_by_signature_and_skip_autograd_without_grad():
    """A view 2 bytes off, of the same shape and strides, gets a launch of its own (Triton
    specializes on 16-byte alignment); a call that needs no gradient returns tensors outside
    autograd, one that does records the Function."""
    base = torch.randn(8, 2, 3, 33, device=DEVICE, dtype=torch.bfloat16)
    freqs = rope.rope_freqs(8, 32, device=DEVICE)
    for t in (base[..., :32], base[..., 1:]):
        for _ in range(2):  # the second call takes the remembered launch
            torch.testing.assert_close(
                rope.apply_rotary_pos_emb(t, freqs), rope.rope_reference(t, freqs)
            )
    assert rope.apply_rotary_pos_emb(base[..., :32], freqs).grad_fn is None
    y = rope.apply_rotary_pos_emb(base[..., :32].clone().requires_grad_(), freqs)
    assert type(y.grad_fn).__name__ == "_ApplyRoPEBackward"
    with torch.no_grad():
        assert (
            rope.apply_rotary_pos_emb(base[..., :32].clone().requires_grad_(), freqs).grad_fn
            is None
        )


@pytest.mark.skipif(ON_GPU, reason="on a GPU the remembered launches run for real (test above)")
def test_remembered_launch_gets_every_argument_in_order(monkeypatch):
    """On a GPU a signature's later calls skip Triton's launcher: the compiled kernel gets the
    tensors, then the scalars and constexprs remembered from the first call, all in order. Here
    a stand-in for the compiled kernel takes them by position and runs the interpreter by name:
    q and k, fused QKV's split and merge, and Hugging Face's entry point with per-row tables
    (viewed as the kernel's tables on the first call only), forward and backward, each called
    twice."""
    run = rope.rope_kernel.run
    remembered_launches = []

    def assert_outputs_passed_once(args):  # torch.compile would give each its own copy
        for i in (3, 5):  # k_out, v_out: not q_out, unless q's pair stands in for absent k or v
            assert args[i] is not args[1] or args[i - 1] is args[0]

    class Compiled:  # stands in for triton.compiler.CompiledKernel
        def __getitem__(self, grid):
            def launch(*args):
                remembered_launches.append(grid)
                assert_outputs_passed_once(args)
                kwargs = dict(zip(rope.rope_kernel.arg_names, args, strict=True))
                run(grid=grid, warmup=False, **kwargs)

            return launch

    def first_launch(*args, **kwargs):
        assert_outputs_passed_once(args)
        run(*args, **kwargs)
        return Compiled()

    monkeypatch.setattr(rope.rope_kernel, "run", first_launch)
    monkeypatch.setattr(rope.triton.compiler, "CompiledKernel", Compiled)
    monkeypatch.setattr(rope, "_launches", {})
    freqs = torch.randn(8, 1, 1, 16, device=DEVICE)  # partial rotary: 16 of 32 channels
    start = torch.tensor([1, 0], device=DEVICE)
    q = torch.randn(2, 2, 4, 32, device=DEVICE, requires_grad=True)
    k = torch.randn(2, 2, 2, 32, device=DEVICE, requires_grad=True)
    qkv = torch.randn(2, 2, 2, 4 * 32, device=DEVICE, requires_grad=True)  # 2 q heads a group
    split = [64, 32, 32]
    cos, sin = torch.randn(2, 2, 2, 16, device=DEVICE).unbind(0)  # [b, s, d2]: a table a row
    for _ in range(2):
        hf_q = q.transpose(1, 2)  # [b, h, s, d]
        hf_k = k.transpose(1, 2)
        outs = rope.hf_apply_rotary_pos_emb(hf_q, hf_k, cos, sin)
        refs = [hf_formula(x, cos, sin) for x in (hf_q, hf_k)]
        assert_close_with_gradients(outs, refs, (q, k))
        outs = rope.apply_rotary_pos_emb_qk(q, k, freqs, "bshd", start)
        refs = [rope.rope_reference(x, freqs, "bshd", start_positions=start) for x in (q, k)]
        assert_close_with_gradients(outs, refs, (q, k))
        outs = rope.apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs / 2, split, "bshd")
        refs = split_reference(qkv, freqs, freqs / 2, split, tensor_format="bshd")
        assert_close_with_gradients(outs, refs, (qkv,))
    assert len(rope._launches) == 6 and len(remembered_launches) == 6


def hf_formula(x, cos, sin):
    """transformers' x * cos + rotate_half(x) * sin on the first d2 channels of x [b, h, s, d]."""
    d2 = cos.shape[-1]
    first, second = x[..., :d2].chunk(2, dim=-1)
    rotated = x[..., :d2] * cos[:, None] + torch.cat((-second, first), -1) * sin[:, None]
    return torch.cat((rotated, x[..., d2:]), -1)


def assert_close_with_gradients(outs, refs, inputs):
    """outs and refs equal, and the gradients of inputs through each for the same random dy."""
    grads = [torch.randn_like(y) for y in outs]
    got = (*outs, *torch.autograd.grad(outs, inputs, grads))
    want = (*refs, *torch.autograd.grad(refs, inputs, grads))
    for y, ref in zip(got, want):
        torch.testing.assert_close(y, ref)


def test_tables_first_seen_in_inference_mode_then_with_gradients():
    """Values and flags remembered from a call under inference_mode serve a later call with
    gradients, which autograd saves; inference tensors themselves work too."""
    t, freqs, kwargs = make_inputs("thd", 64, 64, torch.float32, "contiguous", True)
    freqs = rope.rope_freqs(freqs.shape[0], 64, device=DEVICE)  # a model's table: halves equal
    with torch.inference_mode():
        rope.apply_rotary_pos_emb(t.detach(), freqs, **kwargs)
        inference_out = rope.apply_rotary_pos_emb(t.detach().clone(), freqs.clone(), **kwargs)
    out = rope.apply_rotary_pos_emb(t, freqs, **kwargs)
    torch.testing.assert_close(inference_out, out.detach())
    dy = torch.randn_like(out)
    got = torch.autograd.grad(out, t, dy)
    torch.testing.assert_close(
        got, torch.autograd.grad(rope.rope_reference(t, freqs, **kwargs), t, dy)
    )
