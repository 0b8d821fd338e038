"""04_rope_attention.py: output and dq/dk/dv against the float32 reference over causal x padding
mask x odd lengths x head dims x GQA x pairing x partial rotary x strides x dtype; the same loss and
gradients as 03's RoPE + SDPA; rows with no visible key; torch.compile (fullgraph and default
mode) against eager, and torch.library.opcheck of the two operators; Part 1's plain launchers
against the operators; memory; errors.

On the CPU the interpreter runs fp16 only: Triton 3.9's interpreter computes bf16 tl.dot wrongly,
so bf16 is tested on the GPU."""

import pytest
import torch

from conftest import DEVICE, ON_GPU, all_pairs, load

attn = load("04_rope_attention.py")
DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16]
# 64 (CPU), 128 and 512 (GPU) are whole numbers of blocks (EVEN_M, EVEN_N: the kernels skip the
# bounds masks); the others are not
LENGTHS = [1, 17, 100, 128, 257, 512, 1000] if ON_GPU else [1, 17, 64, 100]
TOL = dict(atol=2e-2, rtol=2e-2)


def make(b, s, h, h_kv, d, dtype=torch.float16, packed=False):
    """q, k, v [b, s, heads, d] requiring grad; `packed` makes them slices of one
    [b, s, h + 2 h_kv, d] tensor."""
    if packed:
        qkv = torch.randn(b, s, h + 2 * h_kv, d, device=DEVICE, dtype=dtype, requires_grad=True)
        return qkv, qkv[:, :, :h], qkv[:, :, h : h + h_kv], qkv[:, :, h + h_kv :]
    q = torch.randn(b, s, h, d, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(b, s, h_kv, d, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(b, s, h_kv, d, device=DEVICE, dtype=dtype, requires_grad=True)
    return None, q, k, v


def padding_mask(b, s, fully_padded=True):
    lengths = torch.randint(1, s + 1, (b,))
    if fully_padded:
        lengths[-1] = 0  # a sequence with no real token: every row of it sees nothing
    return (torch.arange(s)[None, :] < lengths[:, None]).to(DEVICE)


def lowp_reference(
    q, k, v, freqs, causal=False, attention_mask=None, sm_scale=None, interleaved=False
):
    """The same attention in torch, rounded to q's dtype where a kernel rounds: the rotated q and k,
    the probabilities, the output. Its error against the float32 reference is the yardstick for
    ours."""
    dtype = q.dtype
    group = q.shape[2] // k.shape[2]
    q, k = (
        attn.rope_reference(q, freqs, interleaved).to(dtype),
        attn.rope_reference(k, freqs, interleaved).to(dtype),
    )
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k).float() * (sm_scale or q.shape[-1] ** -0.5)
    s = q.shape[1]
    visible = torch.ones(s, s, dtype=torch.bool, device=q.device)
    visible = (visible.tril() if causal else visible)[None, None]
    if attention_mask is not None:
        visible = visible & attention_mask.bool()[:, None, None, :]
    p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0).to(dtype)
    return torch.einsum("bhqk,bkhd->bqhd", p, v).float()


def assert_close_to_reference(x, ref, lowp):
    """Within TOL of the float32 reference, or no further from it than 3x the same-precision torch
    computation (bf16 rounds 8x coarser than fp16; this is how FlashAttention's tests judge it)."""
    err = (x.float() - ref).abs().max().item()
    lowp_err = (lowp.float() - ref).abs().max().item()
    try:
        torch.testing.assert_close(x.float(), ref, **TOL)
    except AssertionError:
        assert err <= 3 * lowp_err + 1e-4, (
            f"max error {err:.3g}, same-precision torch's {lowp_err:.3g}"
        )


def check(q, k, v, freqs, leaves=None, **kwargs):
    """ours against the references, output and gradients; returns dout and our gradients."""
    out = attn.rope_attention(q, k, v, freqs, **kwargs)
    ref = attn.attention_reference(q, k, v, freqs, **kwargs)
    lowp = lowp_reference(q, k, v, freqs, **kwargs)
    assert_close_to_reference(out, ref, lowp)
    dout = torch.randn_like(out)
    inputs = leaves or (q, k, v)
    grads = torch.autograd.grad(out, inputs, dout)
    ref_grads = torch.autograd.grad(ref, inputs, dout.float())
    lowp_grads = torch.autograd.grad(lowp, inputs, dout.float())
    for g, r, lp in zip(grads, ref_grads, lowp_grads):
        assert torch.isfinite(g).all()
        assert_close_to_reference(g, r.float(), lp)
    return dout, grads


@pytest.mark.parametrize("s, masked, causal", all_pairs(LENGTHS, [False, True], [False, True]))
def test_lengths_causal_and_padding(causal, masked, s):
    torch.manual_seed(s)
    _, q, k, v = make(2, s, 4, 2, 64)
    mask = padding_mask(2, s) if masked else None
    check(q, k, v, attn.rope_freqs(s, 64, device=DEVICE), causal=causal, attention_mask=mask)


@pytest.mark.parametrize("d, d2", [(32, 32), (64, 64), (128, 128), (80, 80), (96, 64), (64, 16)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_head_dims_partial_rotary_and_pairings(d, d2, interleaved):
    torch.manual_seed(d + d2)
    s = 100 if ON_GPU else 33
    _, q, k, v = make(2, s, 2, 1, d)
    freqs = torch.randn(s + 3, 1, 1, d2, device=DEVICE)  # arbitrary angles: halves differ
    check(q, k, v, freqs, causal=True, interleaved=interleaved)


@pytest.mark.parametrize("h, h_kv", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_strides_dtypes(h, h_kv, dtype):
    torch.manual_seed(h * 10 + h_kv)
    s = 257 if ON_GPU else 40
    qkv, q, k, v = make(2, s, h, h_kv, 64, dtype, packed=True)  # strided views of one tensor
    mask = padding_mask(2, s, fully_padded=False)
    check(
        q,
        k,
        v,
        attn.rope_freqs(s, 64, interleaved=True, device=DEVICE),
        leaves=(qkv,),
        causal=False,
        attention_mask=mask,
        interleaved=True,
        sm_scale=0.3,
    )


@pytest.mark.parametrize("d, interleaved", all_pairs([32, 64, 128], [False, True]))
def test_whole_blocks(d, interleaved):
    """A length that is a whole number of every kernel's blocks, all channels rotated, a
    power-of-two head dim: the inner loops load their tiles with no mask (EVEN_M, EVEN_N,
    EVEN_D)."""
    torch.manual_seed(d)
    s = 512 if ON_GPU else 64
    kernels = ("fwd", "dkdv", "dq")
    blocks = [
        attn._config(kernel, d, s, True, False)[block]
        for kernel in kernels
        for block in ("BLOCK_M", "BLOCK_N")
    ]
    assert all(s % block == 0 for block in blocks)
    _, q, k, v = make(2, s, 4, 2, d)
    check(
        q,
        k,
        v,
        attn.rope_freqs(s, d, interleaved=interleaved, device=DEVICE),
        causal=True,
        interleaved=interleaved,
    )


@pytest.mark.parametrize(
    "causal, masked, d, d2, interleaved",
    [
        (False, False, 64, 64, False),
        (False, True, 64, 32, True),
        (True, True, 80, 64, True),
        (True, False, 96, 32, False),
        (False, True, 128, 128, False),
    ],
)
def test_backward_same_bits_every_call(causal, masked, d, d2, interleaved):
    """dq comes from its own kernel, summed over the keys in a fixed order (no atomics), and dk, dv
    from theirs likewise: right against the reference, and the same bits on every call, with no
    torch.use_deterministic_algorithms. Each tile config of the dq kernel (d <= 64 with and without
    a padding mask, d > 64) runs."""
    torch.manual_seed(d + d2)
    s = 257 if ON_GPU else 40
    _, q, k, v = make(2, s, 4, 2, d)
    freqs = torch.randn(s, 1, 1, d2, device=DEVICE)
    kwargs = dict(
        causal=causal,
        attention_mask=padding_mask(2, s) if masked else None,
        interleaved=interleaved,
    )
    dout, first = check(q, k, v, freqs, **kwargs)  # the first call, against the reference
    out = attn.rope_attention(q, k, v, freqs, **kwargs)
    second = torch.autograd.grad(out, (q, k, v), dout)
    assert all(a.equal(b) for a, b in zip(first, second))


def test_int64_offsets(monkeypatch):
    """Row offsets within one head are int32 in the kernels unless one could reach 2^31 elements
    (then int64). Lowering that limit runs the int64 path on a small case, in every kernel."""
    torch.manual_seed(7)
    s = 100 if ON_GPU else 33
    qkv, q, k, v = make(2, s, 4, 2, 64, packed=True)
    freqs = attn.rope_freqs(s, 64, interleaved=True, device=DEVICE)

    def wide():  # the forward's WIDE, from its launch builder: (grid, args, constexprs)
        grid, args, constexprs = attn._plan("fwd", q, k, 64, (q, v, v), 0.125, True, True, None)
        return constexprs["WIDE"]

    assert not wide()
    # q's last row now reaches the limit
    monkeypatch.setattr(attn, "INT32_LIMIT", (s - 1) * q.stride(1))
    assert wide()
    check(
        q,
        k,
        v,
        freqs,
        leaves=(qkv,),
        causal=True,
        attention_mask=padding_mask(2, s),
        interleaved=True,
    )


@pytest.mark.parametrize("case", [(False, False, 64, 64, True), (True, True, 80, 64, False)])
def test_qkvpacked_same_as_three_tensors(case):
    """rope_attention_qkvpacked(qkv) gives rope_attention(*qkv.unbind(2))'s output and gradients,
    bit for bit, with qkv's gradient made by the Function itself (no stacking of three gradients by
    autograd)."""
    causal, masked, d, d2, interleaved = case
    torch.manual_seed(d)
    b, h = 2, 4
    s = 257 if ON_GPU else 40
    qkv = torch.randn(b, s, 3, h, d, device=DEVICE, dtype=torch.float16, requires_grad=True)
    freqs = torch.randn(s, 1, 1, d2, device=DEVICE)
    kwargs = dict(
        causal=causal,
        attention_mask=padding_mask(b, s) if masked else None,
        interleaved=interleaved,
    )
    dout = torch.randn(b, s, h, d, device=DEVICE, dtype=torch.float16)
    packed = attn.rope_attention_qkvpacked(qkv, freqs, **kwargs)
    assert packed.grad_fn.next_functions[0][0].variable is qkv  # straight to qkv, no UnbindBackward
    (dqkv,) = torch.autograd.grad(packed, qkv, dout)
    three = attn.rope_attention(*qkv.unbind(2), freqs, **kwargs)
    (dqkv_three,) = torch.autograd.grad(three, qkv, dout)
    assert packed.equal(three)
    assert dqkv.equal(dqkv_three)
    ref = attn.attention_reference(*qkv.unbind(2), freqs, **kwargs)
    (ref_dqkv,) = torch.autograd.grad(ref, qkv, dout.float())
    assert_close_to_reference(dqkv, ref_dqkv, dqkv_three)


def test_rows_that_see_no_key_are_zero():
    _, q, k, v = make(2, 50, 2, 2, 32)
    # 0/1 integers, Hugging Face's convention
    mask = torch.zeros(2, 50, dtype=torch.int32, device=DEVICE)
    # causal rows 0..9 of sequence 0 see no real key; sequence 1 sees none at all
    mask[0, 10:20] = 1
    out = attn.rope_attention(
        q, k, v, attn.rope_freqs(50, 32, device=DEVICE), causal=True, attention_mask=mask
    )
    assert (out[0, :10] == 0).all() and (out[1] == 0).all() and (out[0, 10:] != 0).any()
    grads = torch.autograd.grad(out.float().square().sum() + out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][1] == 0).all()  # nothing flows through a sequence with no visible key


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64])
def test_any_nonzero_mask_value_is_a_token(dtype):
    """The kernels read the mask in its own dtype: a value such as 256 is a token, as in the bool
    mask (a cast to int8 would wrap it to 0), forward and backward."""
    _, q, k, v = make(2, 24, 2, 2, 32)
    freqs = attn.rope_freqs(24, 32, device=DEVICE)
    mask = padding_mask(2, 24, fully_padded=False)
    values = mask.to(dtype) * (256 if dtype.itemsize > 1 else 3)
    outs = [
        (o, *torch.autograd.grad(o.float().square().sum(), (q, k, v)))
        for o in (attn.rope_attention(q, k, v, freqs, attention_mask=m) for m in (mask, values))
    ]
    assert all(a.equal(b) for a, b in zip(*outs))


def test_same_loss_and_gradients_as_rope03_then_sdpa():
    rope03 = load("03_rope_bwd.py")
    torch.manual_seed(0)
    b, s, hidden, heads = 2, 48, 64, 4
    x = torch.randn(b, s, hidden, device=DEVICE)
    freqs = attn.rope_freqs(s, hidden // heads, interleaved=True, device=DEVICE)
    results = []
    for fused in (False, True):
        torch.manual_seed(1)
        qkv = torch.nn.Linear(hidden, 3 * hidden).to(DEVICE)
        proj = torch.nn.Linear(hidden, hidden).to(DEVICE)
        q, k, v = qkv(x).half().view(b, s, 3, heads, hidden // heads).unbind(2)
        if fused:
            out = attn.rope_attention(q, k, v, freqs, causal=True, interleaved=True)
        else:
            q, k = rope03.apply_rotary_pos_emb_qk(
                q, k, freqs, tensor_format="bshd", interleaved=True
            )
            out = (
                torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2).float(),
                    k.transpose(1, 2).float(),
                    v.transpose(1, 2).float(),
                    is_causal=True,
                )
                .transpose(1, 2)
                .half()
            )
        loss = proj(out.float().reshape(b, s, hidden)).square().mean()
        results.append(
            (loss, torch.autograd.grad(loss, list(qkv.parameters()) + list(proj.parameters())))
        )
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-2, atol=1e-4)
    for a, b_ in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b_, rtol=2e-2, atol=2e-3)


@pytest.mark.skipif(not ON_GPU, reason="peak memory is measured on the GPU")
def test_forward_backward_memory_grows_linearly_in_s():
    """No s x s buffer: what one forward + backward allocates beyond its inputs stays within the
    O(s) buffers, at one head of dim 64 1,416 bytes a token (o, rq, rk, dO and the three gradients
    128 each, the float32 cos/sin table 512, lse and delta 4 each), bounded at 1.5 KB a token: at
    s = 16384 an s x s buffer of more than 1/128 byte an entry breaks the bound. Each size has the
    bound, not the ratio of the two: some runs peak 384 bytes a token lower at s = 8192 (three of
    the 128-byte buffers not counted), which reads as growth faster than linear
    (results/04_memory_peaks_H200.log)."""
    for s in (8192, 16384):
        _, q, k, v = make(1, s, 1, 1, 64, torch.bfloat16)
        freqs = attn.rope_freqs(s, 64, device=DEVICE)
        torch.autograd.grad(
            attn.rope_attention(q, k, v, freqs, causal=True), (q, k, v), torch.randn_like(q)
        )
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.autograd.grad(
            attn.rope_attention(q, k, v, freqs, causal=True), (q, k, v), torch.randn_like(q)
        )
        extra = torch.cuda.max_memory_allocated() - base
        assert extra <= 1536 * s, f"{extra} bytes at s = {s}: {extra / s:.0f} a token, over 1,536"


def test_errors():
    _, q, k, v = make(2, 8, 4, 2, 32)
    f = attn.rope_freqs(8, 32, device=DEVICE)
    cases = [
        (
            lambda: attn.rope_attention(q.float(), k, v, f),
            TypeError,
            "q must be float16 or bfloat16",
        ),
        (lambda: attn.rope_attention(q, k.bfloat16(), v, f), TypeError, "k must have q's dtype"),
        (
            lambda: attn.rope_attention(q, k[:, :4], v, f),
            ValueError,
            "k and v must have the same shape",
        ),
        (lambda: attn.rope_attention(q[:, :, :3], k, v, f), ValueError, "multiple of k's 2"),
        (
            lambda: attn.rope_attention(q[:, :, :0], k[:, :, :0], v[:, :, :0], f),
            ValueError,
            "multiple of k's 0 >= 1",
        ),
        (lambda: attn.rope_attention(q, k, v, f[:4]), ValueError, "over the 4 rows"),
        (lambda: attn.rope_attention(q, k, v, f[..., :15]), ValueError, "must be even"),
        (lambda: attn.rope_attention(q, k, v, f.double()), ValueError, "freqs must be float32"),
        (
            lambda: attn.rope_attention(
                q, k, v, f, attention_mask=torch.ones(2, 7, device=DEVICE).bool()
            ),
            ValueError,
            r"attention_mask must have shape \[b, s\] = \[2, 8\]",
        ),
        (
            lambda: attn.rope_attention(q, k, v, f, attention_mask=torch.ones(2, 8, device=DEVICE)),
            TypeError,
            "attention_mask must be bool or integer",
        ),
        (
            lambda: attn.rope_attention(q, k, v, f.clone().requires_grad_()),
            ValueError,
            "freqs requires grad",
        ),
        (
            lambda: attn.rope_attention(q[..., :8], k[..., :8], v[..., :8], f[..., :8]),
            ValueError,
            "head dim must be between 16 and 128",
        ),
        (
            lambda: attn.rope_attention(q, k, v, f, sm_scale=-0.5),
            ValueError,
            "sm_scale must be a positive",
        ),
        (
            lambda: attn.rope_attention(q, k, v, f, sm_scale=0),
            ValueError,
            "sm_scale must be a positive",
        ),
        (
            lambda: attn.rope_attention_qkvpacked([q, k, v], f),
            TypeError,
            "qkv must be a torch.Tensor",
        ),
        (lambda: attn.rope_attention_qkvpacked(q, f), ValueError, r"qkv must be \[b, s, 3, h, d\]"),
        (lambda: attn.rope_attention_qkvpacked(torch.stack((q, q), 2), f), ValueError, "got shape"),
        (
            lambda: attn.rope_attention_qkvpacked(torch.stack((q, q, q), 2).float(), f),
            TypeError,
            "qkv must be float16 or bfloat16",
        ),
        (
            lambda: attn.rope_attention_qkvpacked(torch.stack((q, q, q), 2), f[:4]),
            ValueError,
            "over the 4 rows",
        ),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


COMPILE_CASES = {  # name -> (h, h_kv, d, d2, causal, masked, interleaved, packed)
    "plain": (2, 2, 32, 32, False, False, False, False),
    "causal, padding mask": (2, 2, 32, 32, True, True, False, False),
    "GQA, interleaved, partial rotary": (4, 2, 48, 32, True, False, True, False),
    "packed, padding mask": (2, 2, 32, 32, False, True, True, True),
}


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("case", list(COMPILE_CASES))
def test_torch_compile_matches_eager(case, fullgraph):
    """torch.compile takes both functions whole (fullgraph=True would raise on a graph break),
    forward and backward, and gives eager's output and gradients."""
    h, h_kv, d, d2, causal, masked, interleaved, packed = COMPILE_CASES[case]
    torch.manual_seed(3)
    b = 2
    s = 100 if ON_GPU else 24
    kwargs = dict(
        causal=causal,
        attention_mask=padding_mask(b, s) if masked else None,
        interleaved=interleaved,
    )
    freqs = torch.randn(s, 1, 1, d2, device=DEVICE)
    if packed:
        inputs = (
            torch.randn(b, s, 3, h, d, device=DEVICE, dtype=torch.float16, requires_grad=True),
        )
        fn = attn.rope_attention_qkvpacked
    else:
        inputs = tuple(
            torch.randn(b, s, heads, d, device=DEVICE, dtype=torch.float16, requires_grad=True)
            for heads in (h, h_kv, h_kv)
        )
        fn = attn.rope_attention
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=fullgraph, backend="inductor" if ON_GPU else "aot_eager")
    # every sum in a fixed order: eager and compiled agree bit for bit
    eager_out = fn(*inputs, freqs, **kwargs)
    compiled_out = compiled(*inputs, freqs, **kwargs)
    dout = torch.randn_like(eager_out)
    eager_grads = torch.autograd.grad(eager_out, inputs, dout)
    compiled_grads = torch.autograd.grad(compiled_out, inputs, dout)
    assert compiled_out.equal(eager_out)
    for a, b_ in zip(compiled_grads, eager_grads):
        assert a.equal(b_)
    ref = attn.attention_reference(*(inputs[0].unbind(2) if packed else inputs), freqs, **kwargs)
    assert_close_to_reference(
        compiled_out,
        ref,
        lowp_reference(*(inputs[0].unbind(2) if packed else inputs), freqs, **kwargs),
    )


@pytest.mark.parametrize("packed", [False, True])
def test_opcheck(packed):
    """torch.library.opcheck: the operators' schemas, fake (shape-only) implementations and autograd
    registration agree with what the kernels do, as torch.compile relies on."""
    torch.manual_seed(4)
    b, s, h, d = 2, 20, 2, 32
    freqs = attn.rope_freqs(s, d, device=DEVICE)
    mask = padding_mask(b, s, fully_padded=False).to(torch.int8)
    qkv = (
        [torch.randn(b, s, 3, h, d, device=DEVICE, dtype=torch.float16, requires_grad=True)]
        if packed
        else [
            torch.randn(b, s, h, d, device=DEVICE, dtype=torch.float16, requires_grad=True)
            for _ in range(3)
        ]
    )
    args = (qkv, freqs, mask, 0.25, True, False, True)
    torch.library.opcheck(attn.forward_op, args)
    # the backward op has no backward
    o, lse, rq, rk, trig = (x.detach() for x in attn.forward_op(*args))
    assert rq.shape == (b, h, s, 32) and rk.shape == (b, h, s, 32) and trig.shape == (s, 4 * 16)
    saved = (qkv[0] if packed else qkv[2]).detach()
    torch.library.opcheck(
        attn.backward_op,
        (torch.randn_like(o), rq, rk, saved, o, lse, trig, mask, d, 0.25, True, False, packed),
    )


def test_plain_launchers_are_the_operators():
    """Part 1's launch_forward and launch_backward, called as a learner calls them (each kernel
    launched plainly), give the operators' outputs and gradients bit for bit (the operators run the
    same launchers, their launches remembered per signature)."""
    torch.manual_seed(6)
    b, s, d2 = 2, 20, 16
    _, q, k, v = make(b, s, 2, 1, 32)
    freqs = torch.randn(s, 1, 1, d2, device=DEVICE)  # partial rotary, halves differ
    mask = padding_mask(b, s, fully_padded=False)
    launched = attn.launch_forward(q, k, v, freqs, 0.25, True, mask, True)
    o, lse, rq, rk, trig = (
        x.detach() for x in attn.forward_op([q, k, v], freqs, mask, 0.25, True, True, True)
    )
    assert all(a.equal(b_) for a, b_ in zip(launched, (o, lse, rq, rk, trig)))
    do = torch.randn_like(o)
    grads = tuple(torch.empty_like(x) for x in (q, k, v))
    attn.launch_backward(do, v, o, lse, rq, rk, trig, grads, d2, 0.25, True, mask, True)
    op_grads = attn.backward_op(
        do, rq, rk, v.detach(), o, lse, trig, mask, d2, 0.25, True, True, False
    )
    assert all(a.equal(b_) for a, b_ in zip(grads, op_grads))


def test_rotated_layout_is_zero_padded():
    """rq and rk hold each row as [a members | pad | b members | pad | pass-through]; the pad lanes
    are zeros (they are read whole by the attention loops), and q's rotated copy is RoPE(q)."""
    torch.manual_seed(5)
    b, s, h, d, d2 = 2, 30, 2, 64, 44  # 22 pairs, padded to 32: W = 2 * 32 + 20
    q, k, v = (
        torch.randn(b, s, h, d, device=DEVICE, dtype=torch.float16, requires_grad=True)
        for _ in range(3)
    )
    for x in (q, k):
        with torch.no_grad():
            x[..., d2:] += 1.0  # pass-through channels away from 0
    freqs = torch.randn(s, 1, 1, d2, device=DEVICE)
    _, _, rq, rk, _ = attn.forward_op([q, k, v], freqs, None, 0.125, False, True, True)
    assert rq.shape == rk.shape == (b, h, s, 84)
    for x, rx in ((q, rq), (k, rk)):
        expected = attn.rope_reference(x, freqs, interleaved=True).transpose(1, 2)
        a = expected[..., 0:d2:2]  # interleaved pairs: the a members
        b_ = expected[..., 1:d2:2]  # the b members
        rest = expected[..., d2:]  # the pass-through channels
        torch.testing.assert_close(rx[..., :22].float(), a, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(rx[..., 32:54].float(), b_, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(rx[..., 64:].float(), rest, atol=0, rtol=0)
        assert (rx[..., 22:32] == 0).all() and (rx[..., 54:64] == 0).all()


def test_eager_calls_remember_by_signature_alignment_included():
    """A view 2 bytes off, of the same shape and strides, gets launches of its own (Triton
    specializes on 16-byte alignment); without a gradient no graph is recorded, and a second
    backward through the graph is refused."""
    base = torch.randn(2, 40, 3, 2, 33, device=DEVICE, dtype=torch.float16)
    freqs = torch.randn(40, 1, 1, 32, device=DEVICE)
    for view in (base[..., :32], base[..., 1:]):
        q, k, v = (x.detach().requires_grad_() for x in view.unbind(2))
        for _ in range(2):  # the second call takes the remembered launches
            out = attn.rope_attention(q, k, v, freqs)
            ref = attn.attention_reference(q, k, v, freqs)
            torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
            grads = torch.autograd.grad(
                out, (q, k, v), torch.ones_like(out).requires_grad_(), create_graph=True
            )
            for g, r in zip(grads, torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))):
                torch.testing.assert_close(g.float(), r.float(), atol=2e-2, rtol=2e-2)
    assert attn.rope_attention(q.detach(), k.detach(), v.detach(), freqs).grad_fn is None
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grads[0].sum().backward()
