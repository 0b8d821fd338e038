"""02_rope_fwd.py's Hugging Face entry point, hf_rope_fwd (forward, for inference): against
transformers' own apply_rotary_pos_emb, tiny random models with it patched in against the same
models unpatched, position_ids against gathered rows, the halves-equal flag, the remembered launch,
Part 1's launcher, torch.compile and bad inputs. Tests that need transformers skip without it (CI
installs it); bf16 runs on a GPU only (conftest)."""

import pytest
import torch

from conftest import (
    DEVICE,
    HF_DTYPES,
    HF_MODELS,
    ON_GPU,
    all_pairs,
    hf_bad_inputs,
    hf_inputs,
    hf_reference,
    load,
    tiny_hf_model,
)

rope = load("02_rope_fwd.py")
BACKEND = "inductor" if ON_GPU else "aot_eager"  # Inductor cannot run interpreted kernels


@pytest.mark.parametrize(
    "dtype, unsqueeze_dim, table_batch, d2, h_k, scale",
    all_pairs(HF_DTYPES, [1, 2], [1, 3], [16, 8], [4, 2, 1], [1.0, 1.3]),
)
def test_equals_transformers(dtype, unsqueeze_dim, table_batch, d2, h_k, scale):
    """Over layouts, GQA, partial rotary, per-row tables and an attention factor in the tables:
    transformers' formula computed in float32 and rounded once (the kernel's way), within about
    one rounding of transformers' own, which multiplies in q's dtype; its shapes and dtype, and
    q's and k's strides (as q * cos keeps them)."""
    q, k, cos, sin = hf_inputs(3, 7, 4, h_k, 16, d2, dtype, unsqueeze_dim, table_batch, scale)
    got = rope.hf_rope_fwd(q, k, cos, sin, unsqueeze_dim)
    want = hf_reference(*[x.float() for x in (q, k, cos, sin)], unsqueeze_dim)
    own = hf_reference(q, k, cos, sin, unsqueeze_dim)
    ulp = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    for x, y, ref, hf in zip((q, k), got, want, own, strict=True):
        assert (y.shape, y.dtype, y.stride()) == (hf.shape, hf.dtype, x.stride())
        torch.testing.assert_close(y, ref.to(dtype))
        torch.testing.assert_close(y, hf, rtol=ulp, atol=2 * ulp)


@pytest.mark.parametrize("halves_differ", ["none", "cos", "sin"])
def test_second_halves_read_when_they_differ(halves_differ):
    """Equal halves in both tables (transformers' cat(freqs, freqs)) set the flag with which the
    kernel reads only the first halves; a table whose halves differ, cos or sin alone, clears it,
    and the results are still transformers'."""
    q, k, cos, sin = hf_inputs(2, 5, 2, 2, 16, 16, torch.float32, 1, 1)
    if halves_differ == "cos":
        cos = torch.randn_like(cos)
    if halves_differ == "sin":
        sin = torch.randn_like(sin)
    assert rope._angles_shared((cos, sin), False).item() == (halves_differ == "none")
    for y, ref in zip(rope.hf_rope_fwd(q, k, cos, sin), hf_reference(q, k, cos, sin)):
        torch.testing.assert_close(y, ref)


def test_the_flag_reaches_the_kernel(monkeypatch):
    """With the flag forced to 1 on tables whose halves differ, the kernel reads the first halves
    only: the result is transformers' with each table's first half in both halves."""
    q, k, _, _ = hf_inputs(2, 5, 2, 2, 16, 16, torch.float32, 1, 1)
    cos, sin = torch.randn(2, 1, 5, 16, device=DEVICE)
    ones = torch.ones(1, dtype=torch.int32, device=DEVICE)
    monkeypatch.setattr(rope, "_angles_shared", lambda *args: ones)
    got = rope.hf_rope_fwd(q, k, cos, sin)
    want = hf_reference(q, k, cos[..., :8].repeat(1, 1, 2), sin[..., :8].repeat(1, 1, 2))
    for y, ref in zip(got, want):
        torch.testing.assert_close(y, ref)


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_unusual_layouts_and_dtypes(unsqueeze_dim):
    """q and k as slices of one packed qkv (not dense), cos and sin of two dtypes and of other
    strides (the kernel then reads copies with cos' strides), a table expanded over the batch
    (stride 0), int32 position_ids of batch 1 given column-major: transformers' results."""
    qkv = torch.randn(2, 5, 7, 16, device=DEVICE)  # [b, s, 4 q + 2 k + 1 v heads, d]
    q = qkv[:, :, :4]
    k = qkv[:, :, 4:6]
    if unsqueeze_dim == 1:
        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
    angles = torch.randn(1, 5, 8, device=DEVICE).repeat(1, 1, 2)
    cos = angles.cos().expand(2, -1, -1)
    sin = angles.sin().transpose(1, 2).contiguous().transpose(1, 2).half()  # column-major, fp16
    sin = sin.expand(2, -1, -1)
    for y, ref in zip(
        rope.hf_rope_fwd(q, k, cos, sin, unsqueeze_dim), hf_reference(q, k, cos, sin, unsqueeze_dim)
    ):
        torch.testing.assert_close(y, ref)
    cache = torch.randn(2, 9, 16, device=DEVICE)
    ids = torch.tensor([[3], [1], [4], [1], [5]], dtype=torch.int32, device=DEVICE).t()
    got = rope.hf_rope_fwd(q, k, *cache, unsqueeze_dim, position_ids=ids)
    want = hf_reference(q, k, cache[0][ids.long()], cache[1][ids.long()], unsqueeze_dim)
    for y, ref in zip(got, want):
        torch.testing.assert_close(y, ref)


def test_position_ids_pick_rows_of_a_cache():
    """cos and sin as a cache [max_positions, d2] and position_ids [b or 1, s]: the rows that the
    ids pick, as if the tables had been gathered, bit for bit; called twice (on a GPU the second
    call takes the remembered launch)."""
    q, k, _, _ = hf_inputs(2, 6, 4, 2, 16, 16, torch.float32, 1, 1)
    cos, sin = torch.randn(2, 40, 16, device=DEVICE)
    for position_ids in (torch.randint(0, 40, (2, 6)), torch.arange(30, 36)[None]):
        position_ids = position_ids.to(DEVICE)
        for _ in range(2):
            got = rope.hf_rope_fwd(q, k, cos, sin, position_ids=position_ids)
            want = rope.hf_rope_fwd(q, k, cos[position_ids], sin[position_ids])
            assert all(a.equal(b) for a, b in zip(got, want, strict=True))


def test_equals_03s_entry_point():
    """02's forward and 03's differentiable entry point run the same arithmetic: equal bit for
    bit, with per-row tables, partial rotary and GQA, and with position_ids."""
    rope03 = load("03_rope_bwd.py")
    q, k, cos, sin = hf_inputs(3, 7, 4, 2, 16, 8, torch.float16, 1, 3, 1.3)
    cache = torch.randn(2, 20, 8, device=DEVICE, dtype=torch.float16)
    position_ids = torch.randint(0, 20, (3, 7), device=DEVICE)
    for tables, kwargs in (((cos, sin), {}), (cache, {"position_ids": position_ids})):
        got = rope.hf_rope_fwd(q, k, *tables, **kwargs)
        want = rope03.hf_apply_rotary_pos_emb(q, k, *tables, **kwargs)
        assert all(a.equal(b) for a, b in zip(got, want, strict=True))


def test_plain_launcher_reads_tables():
    """Part 1's launch_rope_fwd with cos and sin, per batch row, and with a cache and a 2-D
    start_positions (position_ids), writes what hf_rope_fwd writes, bit for bit."""
    q, k, cos, sin = hf_inputs(3, 7, 4, 2, 16, 8, torch.float32, 1, 3, 1.3)
    plain = rope.launch_rope_fwd(q, k, cos, "bhsd", sin=sin)
    assert all(a.equal(b) for a, b in zip(plain, rope.hf_rope_fwd(q, k, cos, sin), strict=True))
    cache = torch.randn(2, 20, 8, device=DEVICE)
    ids = torch.randint(0, 20, (3, 7), device=DEVICE)
    plain = rope.launch_rope_fwd(q, k, cache[0], "bhsd", start_positions=ids, sin=cache[1])
    want = rope.hf_rope_fwd(q, k, *cache, position_ids=ids)
    assert all(a.equal(b) for a, b in zip(plain, want, strict=True))


def test_compiles():
    """fullgraph=True (a graph break raises), the same values as eager, bit for bit; with tables
    and with position_ids; and the op's registration (schema, fake outputs) with tables."""
    torch._dynamo.reset()
    q, k, cos, sin = hf_inputs(2, 5, 4, 2, 16, 8, torch.float32, 1, 2, 1.2)
    cache = torch.randn(9, 8, device=DEVICE)
    position_ids = torch.randint(0, 9, (1, 5), device=DEVICE)
    compiled = torch.compile(rope.hf_rope_fwd, fullgraph=True, backend=BACKEND)
    for args, kwargs in (((cos, sin), {}), ((cache, cache / 2), {"position_ids": position_ids})):
        got = compiled(q, k, *args, **kwargs)
        want = rope.hf_rope_fwd(q, k, *args, **kwargs)
        assert all(a.equal(b) for a, b in zip(got, want, strict=True))
    flag = rope._angles_shared((cos, sin), False)
    outs = (torch.empty_like(q), torch.empty_like(k))
    args = (q, outs[0], k, outs[1], cos, sin, flag, None, None, "bhsd", False)
    torch.library.opcheck(rope._rope_op, args)


@pytest.mark.parametrize("name", HF_MODELS)
def test_patched_model_equals_unpatched(name, monkeypatch):
    """A tiny random model whose attention calls hf_rope_fwd gives the unpatched model's outputs
    (float32, no_grad, as inference runs)."""
    modeling, config, model, tokens = tiny_hf_model(name)
    with torch.no_grad():
        want = model(tokens)[0]  # the logits, or the text model's last hidden state
        calls = []

        def counted(*args, **kwargs):  # the patched model calls ours, once a layer
            calls.append(1)
            return rope.hf_rope_fwd(*args, **kwargs)

        monkeypatch.setattr(modeling, "apply_rotary_pos_emb", counted)
        got = model(tokens)[0]
    assert len(calls) == config.num_hidden_layers
    torch.testing.assert_close(got, want)


def test_inputs_requiring_grad_are_refused_unless_no_grad():
    """02 has no backward: q, k, cos or sin requiring grad would lose its gradient, so the call
    is refused (pointing at 03), and runs under no_grad."""
    q, k, cos, sin = hf_inputs(2, 5, 4, 2, 16, 16, torch.float32, 1, 1)
    for i, name in enumerate(("q", "k", "cos", "sin")):
        args = [q, k, cos, sin]
        args[i] = args[i].clone().requires_grad_()
        with pytest.raises(ValueError, match=f"{name} requires grad.*03's hf_apply_rotary_pos_emb"):
            rope.hf_rope_fwd(*args)
        with torch.no_grad():
            for y, ref in zip(rope.hf_rope_fwd(*args), hf_reference(q, k, cos, sin)):
                torch.testing.assert_close(y, ref)


def test_a_wider_table_promotes_as_transformers_does():
    """q and k in float16 with float32 tables (a model under autocast): float32 results, as
    transformers' q * cos gives; float64 tables are refused (02 computes no float64)."""
    q, k, cos, sin = hf_inputs(2, 5, 4, 2, 16, 16, torch.float16, 1, 1)
    got = rope.hf_rope_fwd(q, k, cos.float(), sin.float())
    want = hf_reference(q, k, cos.float(), sin.float())
    for y, ref in zip(got, want):
        assert y.dtype == ref.dtype == torch.float32
        torch.testing.assert_close(y, ref)
    with pytest.raises(TypeError, match="must promote to float32, float16 or bfloat16"):
        rope.hf_rope_fwd(q, k, cos.double(), sin.double())


def test_position_ids_edges():
    """Empty position_ids; tables and position_ids made under inference_mode (no version counter;
    the flag then reads both halves); a negative id in a compiled call (not checked there) reads
    no memory before the table."""
    q, k, _, _ = hf_inputs(2, 3, 4, 2, 16, 16, torch.float32, 1, 1)
    cache = torch.randn(5, 16, device=DEVICE)
    no_ids = torch.zeros(2, 0, dtype=torch.long, device=DEVICE)
    empty = rope.hf_rope_fwd(q[:, :, :0], k[:, :, :0], cache, cache, position_ids=no_ids)
    assert [tuple(y.shape) for y in empty] == [(2, 4, 0, 16), (2, 2, 0, 16)]
    with torch.inference_mode():
        ids = torch.tensor([[0, 2, 1]], device=DEVICE)
        inference_cache = cache.clone()
        assert rope._angles_shared((inference_cache, inference_cache), False).item() == 0
        got = rope.hf_rope_fwd(q, k, inference_cache, cache / 2, position_ids=ids)
        want = rope.hf_rope_fwd(q, k, cache[ids], cache[ids] / 2)
        assert all(a.equal(b) for a, b in zip(got, want))
    torch._dynamo.reset()
    compiled = torch.compile(rope.hf_rope_fwd, fullgraph=True, backend=BACKEND)
    ids = torch.tensor([[-1, 0, 2]], device=DEVICE)
    q_embed, _ = compiled(q, k, cache, cache, position_ids=ids)
    assert q_embed[:, :, 0].eq(0).all()  # cos and sin read as 0 outside the table


def test_a_table_past_2_31_elements():
    """Per-row tables whose batch offset passes 2**31 elements: 64-bit offsets (only the pages
    read are touched)."""
    big = torch.empty(2 * 2**30 + 8, dtype=torch.float32, device=DEVICE)
    cos = big.as_strided((3, 2, 4), (2**30, 4, 1))
    cos.fill_(0.5)
    q, k = torch.randn(2, 3, 1, 2, 4, device=DEVICE)
    got = rope.hf_rope_fwd(q, k, cos, cos)
    for y, ref in zip(got, hf_reference(q, k, cos, cos)):
        torch.testing.assert_close(y, ref)


def _bad_inputs():
    cases = hf_bad_inputs()
    q, k, cos, _ = cases["cos and sin differ"][0]
    cases["float64 q and k"] = ((q.double(), k.double(), cos, cos), {}, "must promote to")
    return cases


@pytest.mark.parametrize("case", _bad_inputs())
def test_bad_inputs_raise_one_clear_error(case):
    args, kwargs, message = _bad_inputs()[case]
    with pytest.raises((ValueError, TypeError), match=message):
        rope.hf_rope_fwd(*args, **kwargs)
