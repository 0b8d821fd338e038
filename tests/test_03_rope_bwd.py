"""03_rope_bwd.py: gradients against autograd through rope_reference over the feature matrix,
gradcheck in float64, q/k in one launch each way, a model-level check, torch.compile without
graph breaks, autocast, and the errors. CPU runs small shapes in the interpreter."""
import pytest
import torch

from conftest import DEVICE, ON_GPU, all_pairs, load, logical_shape, make_view, random_cu_seqlens

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


def reference_grad(t, freqs, dy, interleaved, **kwargs):
    y = rope.rope_reference(t, freqs, interleaved=interleaved, **kwargs)
    return y, torch.autograd.grad(y, t, dy)[0]


@pytest.mark.parametrize("fmt, interleaved, dims, dtype, view, with_start", all_pairs(
    ["sbhd", "bshd", "thd"], [False, True], [(64, 64), (80, 48)],  # full; partial with non-power-of-2 halves
    DTYPES, ["contiguous", "packed", "strided_d"], [False, True]), ids=str)
def test_gradients_match_autograd_of_reference(fmt, interleaved, dims, dtype, view, with_start):
    d, d2 = dims
    t, freqs, kwargs = make_inputs(fmt, d, d2, dtype, view, with_start)
    y = rope.apply_rotary_pos_emb(t, freqs, interleaved=interleaved, **kwargs)
    dy = make_view(y.shape, dtype, "permuted" if fmt != "thd" else "strided_d")  # a strided gradient
    (dt,) = torch.autograd.grad(y, t, dy)
    y_ref, dt_ref = reference_grad(t, freqs, dy, interleaved, **kwargs)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(dt, dt_ref)
    # rope_bwd alone gives the same gradient
    torch.testing.assert_close(rope.rope_bwd(dy, freqs, interleaved=interleaved, **kwargs), dt_ref)


def test_backward_is_not_the_negated_angle_for_arbitrary_tables():
    """The derivation's point: with f_a != f_b the sines trade halves. Negating the angle instead
    gives a different answer, and the kernel must not."""
    t, freqs, kwargs = make_inputs("bshd", 16, 16, torch.float32, "contiguous", False)
    dy = torch.randn_like(t)
    dt = rope.rope_bwd(dy, freqs, **kwargs)
    _, dt_ref = reference_grad(t, freqs, dy, False, **kwargs)
    torch.testing.assert_close(dt, dt_ref)
    negated = rope.rope_reference(dy, -freqs, **kwargs)
    assert (negated - dt_ref).abs().max() > 1e-2  # the check above can tell the two apart
    # ... while for a true rotation table the two agree
    table = rope.rope_freqs(freqs.shape[0], 16, device=DEVICE)
    torch.testing.assert_close(rope.rope_bwd(dy, table, **kwargs), rope.rope_reference(dy, -table, **kwargs))


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_gradcheck_float64(fmt, interleaved):
    full = fmt == "bshd" and not interleaved  # one full Jacobian (slow in the interpreter), the rest fast
    t, freqs, kwargs = make_inputs(fmt, 12, 8, torch.float64, "contiguous", True, b=2, s=2 if full else 3, h=1 if full else 2)
    fn = lambda x: rope.apply_rotary_pos_emb(x, freqs, interleaved=interleaved, **kwargs)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (t,), fast_mode=not full)
    assert torch.autograd.gradgradcheck(fn, (t,), fast_mode=True)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("k_heads", [1, 3])
def test_qk_one_launch_each_way_with_fewer_k_heads(fmt, k_heads, monkeypatch):
    q = make_view(logical_shape(fmt, B, S, 6, 64), torch.bfloat16, "packed").requires_grad_()
    k = make_view(logical_shape(fmt, B, S, k_heads, 64), torch.bfloat16, "contiguous").requires_grad_()
    freqs = torch.randn(B * S, 1, 1, 64, device=DEVICE)
    kwargs = dict(tensor_format=fmt, interleaved=True)
    if fmt == "thd":
        kwargs["cu_seqlens"] = random_cu_seqlens(B, B * S)
    launches = []
    launch = rope._launch_kernel

    def counting_launch(kernel, grid, *args, **kwargs):
        launches.append(grid)
        launch(kernel, grid, *args, **kwargs)
    monkeypatch.setattr(rope, "_launch_kernel", counting_launch)
    q_out, k_out = rope.apply_rotary_pos_emb_qk(q, k, freqs, **kwargs)
    assert len(launches) == 1
    dq_out, dk_out = torch.randn_like(q_out), torch.randn_like(k_out)
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (dq_out, dk_out))
    assert len(launches) == 2
    for x, y, dy, dx in ((q, q_out, dq_out, dq), (k, k_out, dk_out, dk)):
        y_ref, dx_ref = reference_grad(x, freqs, dy, **kwargs)
        torch.testing.assert_close(y, y_ref)
        torch.testing.assert_close(dx, dx_ref)
    torch.testing.assert_close(rope.rope_bwd_qk(dq_out, dk_out, freqs, **kwargs), (dq, dk))


def test_registered_op_matches_the_eager_launch():
    """Eager calls launch the kernel directly; torch.compile traces the registered op. Both the same."""
    t, freqs, kwargs = make_inputs("thd", 80, 48, torch.float32, "packed", True)
    args = (t.detach(), None, freqs, rope._angles_shared(freqs, True), kwargs["cu_seqlens"],
            kwargs["start_positions"], "thd", True)
    for backward in (False, True):
        torch.testing.assert_close(rope.rope_op(*args, backward)[0], rope._rope_impl(*args, backward)[0],
                                   rtol=0, atol=0)


class AttentionBlock(torch.nn.Module):
    """A small self-attention block with RoPE on q and k (bshd, as a linear layer gives it)."""

    def __init__(self, hidden, heads, rope_fn):
        super().__init__()
        self.heads, self.rope_fn = heads, rope_fn
        self.qkv, self.proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)

    def forward(self, x, freqs):
        b, s, hidden = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, hidden // self.heads).unbind(2)
        q, k = self.rope_fn(q, freqs), self.rope_fn(k, freqs)
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                v.transpose(1, 2), is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, hidden))


def eager_rope(t, freqs):  # TransformerEngine's unfused formula
    return rope.rope_reference(t, freqs, tensor_format="bshd", interleaved=True, compute_dtype=None)


def fused_rope(t, freqs):
    return rope.apply_rotary_pos_emb(t, freqs, tensor_format="bshd", interleaved=True)


def test_attention_block_same_loss_and_gradients():
    torch.manual_seed(0)
    x = torch.randn(2, S, 32, device=DEVICE)
    freqs = rope.rope_freqs(S, 8, interleaved=True, device=DEVICE)  # partial rotary: 8 of 16 channels
    losses, grads = [], []
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
    compiled = torch.compile(f, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    y, y_eager = compiled(t), f(t2)
    torch.testing.assert_close(y, y_eager)
    dy = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, t, dy)[0], torch.autograd.grad(y_eager, t2, dy)[0])
    assert rope._USE_TRITON_OP == (ON_GPU and hasattr(torch.library, "triton_op"))


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


def test_errors():
    t = lambda *shape: torch.randn(*shape, device=DEVICE)  # noqa: E731
    f = lambda *shape: torch.randn(*shape, device=DEVICE)  # noqa: E731
    cases = [
        (lambda: rope.apply_rotary_pos_emb(t(4, 2, 3, 16), f(4, 1, 1, 15)), ValueError, "must be even"),
        (lambda: rope.apply_rotary_pos_emb(t(8, 3, 16), f(8, 1, 1, 16), "thd"), ValueError, "cu_seqlens is required"),
        (lambda: rope.apply_rotary_pos_emb(t(4, 2, 3, 16).long(), f(4, 1, 1, 16)), TypeError, "t must be float32"),
        (lambda: rope.apply_rotary_pos_emb(t(4, 2, 3, 16), f(4, 1, 1, 16).half()), TypeError, "freqs must be float32"),
        (lambda: rope.apply_rotary_pos_emb(t(5, 2, 3, 16), f(4, 1, 1, 16)), ValueError, "over the 4 rows"),
        (lambda: rope.apply_rotary_pos_emb(t(4, 2, 3, 16), f(4, 1, 1, 16), cp_size=2), ValueError,
         "context parallelism"),
        (lambda: rope.apply_rotary_pos_emb(t(4, 2, 3, 16), f(8, 1, 1, 16), start_positions=torch.tensor(
            [0, 5], device=DEVICE)), ValueError, "positions up to 8"),
        (lambda: rope.rope_bwd(t(4, 2, 3, 16), f(4, 1, 1, 16), tensor_format="hbsd"), ValueError, "tensor_format"),
        (lambda: rope.rope_bwd_qk(t(4, 2, 3, 16), t(4, 2, 3, 8), f(4, 1, 1, 8)), ValueError, "grad_k must match"),
        (lambda: rope.apply_rotary_pos_emb_qk(t(4, 2, 3, 16), t(4, 2, 3, 16).half(), f(4, 1, 1, 16)), ValueError,
         "k must match q"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU with > 17 GB free")
def test_backward_over_2_31_elements():
    t = torch.empty(2**31 // (16 * 128) + 7, 1, 16, 128, device=DEVICE, dtype=torch.bfloat16).normal_()
    freqs = rope.rope_freqs(t.shape[0], 128, device=DEVICE)
    dt = rope.rope_bwd(t, freqs)
    rows = [0, t.shape[0] - 3]  # the last rows lie past 2**31 elements
    for r in rows:
        torch.testing.assert_close(dt[r:r + 3], rope.rope_reference(t[r:r + 3], -freqs[r:r + 3]))
