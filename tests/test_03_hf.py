"""03_rope_bwd.py's Hugging Face entry points: hf_apply_rotary_pos_emb against transformers' own
apply_rotary_pos_emb (values and gradients), tiny random models with it patched in against the
same models unpatched, position_ids against gathered rows, M-RoPE, torch.compile, bad inputs.
Tests that need transformers skip without it (CI installs it). On the CPU the kernels run in
Triton's interpreter, whose bf16 arithmetic is wrong: bf16 runs on a GPU only."""

import re

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

rope = load("03_rope_bwd.py")


def check_against_transformers(q, k, cos, sin, position_ids=None):
    """hf_apply_rotary_pos_emb's values and gradients of float32 q and k ([b, h, s, d]) equal
    transformers' own (position_ids: cos and sin are a cache, transformers gets the rows)."""
    got = rope.hf_apply_rotary_pos_emb(q, k, cos, sin, position_ids=position_ids)
    grads = [torch.randn_like(x) for x in got]
    got = (*got, *torch.autograd.grad(got, (q, k), grads))
    if position_ids is not None:
        cos = cos[position_ids]
        sin = sin[position_ids]
    want = hf_reference(q, k, cos, sin)
    want = (*want, *torch.autograd.grad(want, (q, k), grads))
    for y, ref in zip(got, want):
        torch.testing.assert_close(y, ref)


def inputs(*args, **kwargs):
    """conftest's hf_inputs, q and k requiring grad."""
    q, k, cos, sin = hf_inputs(*args, **kwargs)
    return q.requires_grad_(), k.requires_grad_(), cos, sin


@pytest.mark.parametrize(
    "dtype, unsqueeze_dim, table_batch, d2, h_k, scale",
    all_pairs(HF_DTYPES, [1, 2], [1, 3], [16, 12, 8], [4, 2, 1], [1.0, 1.3]),
)
def test_equals_transformers(dtype, unsqueeze_dim, table_batch, d2, h_k, scale):
    """Values and gradients of q and k, over layouts, GQA, partial rotary (d2 = 12: masked lanes,
    four head steps, each loading the next), per-row tables and an attention factor in the
    tables: as transformers' formula computed in float32 and rounded once (the kernel's way), and
    within about one rounding of transformers' own, which multiplies in q's dtype."""
    q, k, cos, sin = inputs(3, 7, 4, h_k, 16, d2, dtype, unsqueeze_dim, table_batch, scale)
    got = rope.hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    grads = [torch.randn_like(x) for x in got]
    got = (*got, *torch.autograd.grad(got, (q, k), grads))
    upcast = [x.float() for x in (q, k, cos, sin)]
    want = hf_reference(*upcast, unsqueeze_dim)
    want = (*want, *torch.autograd.grad(want, upcast[:2], [g.float() for g in grads]))
    own = hf_reference(q, k, cos, sin, unsqueeze_dim)
    own = (*own, *torch.autograd.grad(own, (q, k), grads))
    ulp = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    for y, ref, hf in zip(got, want, own):
        assert y.shape == hf.shape and y.dtype == hf.dtype
        torch.testing.assert_close(y, ref.to(dtype))
        torch.testing.assert_close(y, hf, rtol=ulp, atol=2 * ulp)


def test_the_flag_reaches_the_kernel(monkeypatch):
    """With the flag forced to 1 on tables whose halves differ, the kernel reads the first halves
    only: the result is transformers' with each table's first half in both halves."""
    q, k, cos, sin = inputs(2, 5, 2, 2, 16, 16, torch.float32, 1, 1)
    cos = torch.randn_like(cos)
    sin = torch.randn_like(sin)
    ones = torch.ones(1, dtype=torch.int32, device=DEVICE)
    monkeypatch.setattr(rope, "_angles_shared", lambda *args: ones)
    got = rope.hf_apply_rotary_pos_emb(q, k, cos, sin)
    want = hf_reference(q, k, cos[..., :8].repeat(1, 1, 2), sin[..., :8].repeat(1, 1, 2))
    for y, ref in zip(got, want):
        torch.testing.assert_close(y, ref)


def test_tables_first_seen_in_inference_mode_then_with_gradients():
    """The flag remembered from a call under inference_mode serves a later call with gradients
    (autograd saves it), and inference tables themselves get a flag that reads both halves."""
    q, k, cos, sin = inputs(2, 5, 2, 2, 16, 16, torch.float32, 1, 1)
    with torch.inference_mode():
        rope.hf_apply_rotary_pos_emb(q.detach(), k.detach(), cos, sin)
        inference_cos, inference_sin = cos.clone(), sin.clone()
        flag = rope._angles_shared((inference_cos, inference_sin), False)
        assert flag.item() == 0  # read both halves: no pass over tables it cannot remember
        assert rope._angles_shared((inference_cos, inference_sin), False) is flag  # one a device
    check_against_transformers(q, k, cos, sin)


@pytest.mark.parametrize("halves_differ", ["none", "cos", "sin"])
def test_tables_second_halves_read_when_they_differ(halves_differ):
    """Equal halves in both tables (transformers' cat(freqs, freqs)) set the flag with which the
    kernel reads only the first halves; a table whose halves differ, cos or sin alone, clears it,
    and the results are still transformers'."""
    q, k, cos, sin = inputs(2, 5, 2, 2, 16, 16, torch.float32, 1, 1)
    if halves_differ == "cos":
        cos = torch.randn_like(cos)
    if halves_differ == "sin":
        sin = torch.randn_like(sin)
    flag = rope._angles_shared((cos, sin), False, "tables shared")
    assert flag.item() == (halves_differ == "none")
    check_against_transformers(q, k, cos, sin)


def test_position_ids_pick_rows_of_a_cache():
    """cos and sin as a cache [max_positions, d2] and position_ids [b or 1, s]: the rows that
    the ids pick, as if the tables had been gathered; positions past every id unused."""
    q, k, _, _ = inputs(2, 6, 4, 2, 16, 16, torch.float32, 1, 1)
    cos, sin = torch.randn(2, 40, 16, device=DEVICE)
    for position_ids in (torch.randint(0, 40, (2, 6)), torch.arange(30, 36)[None]):
        position_ids = position_ids.to(DEVICE)
        got = rope.hf_apply_rotary_pos_emb(q, k, cos, sin, position_ids=position_ids)
        gathered = (cos[position_ids], sin[position_ids])
        want = rope.hf_apply_rotary_pos_emb(q, k, *gathered)
        for y, ref in zip(got, want):
            assert y.equal(ref)
        grads = [torch.randn_like(y) for y in got]
        assert all(
            a.equal(b)
            for a, b in zip(
                torch.autograd.grad(got, (q, k), grads), torch.autograd.grad(want, (q, k), grads)
            )
        )


def test_a_signature_called_again_takes_the_remembered_launch():
    """A signature's second call (on a GPU the compiled kernel straight, with cos and sin passed
    as they are: their views are made on the first call only) equals transformers': per-row
    tables, and a cache with position_ids."""
    q, k, cos, sin = inputs(3, 7, 4, 2, 16, 8, torch.float32, 1, 3)
    cache = torch.randn(2, 20, 8, device=DEVICE)
    position_ids = torch.randint(0, 20, (3, 7), device=DEVICE)
    for _ in range(2):
        check_against_transformers(q, k, cos, sin)
        check_against_transformers(q, k, *cache, position_ids)


def test_compiles_forward_and_backward():
    """fullgraph=True (a graph break raises), the same values and gradients as eager, bit for
    bit; with tables and with position_ids."""
    torch._dynamo.reset()
    q, k, cos, sin = inputs(2, 5, 4, 2, 16, 8, torch.float32, 1, 2, 1.2)
    cache = torch.randn(9, 8, device=DEVICE)
    position_ids = torch.randint(0, 9, (1, 5), device=DEVICE)
    backend = "inductor" if ON_GPU else "aot_eager"
    compiled = torch.compile(rope.hf_apply_rotary_pos_emb, fullgraph=True, backend=backend)
    for args, kwargs in (((cos, sin), {}), ((cache, cache / 2), {"position_ids": position_ids})):
        got = compiled(q, k, *args, **kwargs)
        want = rope.hf_apply_rotary_pos_emb(q, k, *args, **kwargs)
        grads = [torch.randn_like(y) for y in want]
        got = (*got, *torch.autograd.grad(got, (q, k), grads))
        want = (*want, *torch.autograd.grad(want, (q, k), grads))
        assert all(a.equal(b) for a, b in zip(got, want))


def legacy_multimodal(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """Qwen2-VL's apply_multimodal_rotary_pos_emb as transformers 4 wrote it."""
    sections = list(mrope_section) * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(sections, dim=-1))], dim=-1)
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(sections, dim=-1))], dim=-1)
    return hf_reference(q, k, cos, sin, unsqueeze_dim)


@pytest.mark.parametrize("halves", ["random", "equal"])
def test_multimodal_equals_the_formula(halves):
    """M-RoPE against the transformers-4 formula, eager, compiled and its gradients; with each
    stream's halves equal (a model's tables), the flag from the tables before recomposing is 1."""
    q, k, _, _ = inputs(2, 6, 4, 2, 16, 16, torch.float32, 1, 1)
    cos, sin = torch.randn(2, 3, 2, 6, 16, device=DEVICE)  # three position streams
    if halves == "equal":
        cos = cos[..., :8].repeat(1, 1, 1, 2)
        sin = sin[..., :8].repeat(1, 1, 1, 2)
    assert rope._angles_shared((cos, sin), False).item() == (halves == "equal")
    got = rope.hf_apply_multimodal_rotary_pos_emb(q, k, cos, sin, [2, 3, 3])
    want = legacy_multimodal(q, k, cos, sin, [2, 3, 3])
    torch.testing.assert_close(got, want)
    torch._dynamo.reset()
    compiled = torch.compile(
        rope.hf_apply_multimodal_rotary_pos_emb,
        fullgraph=True,
        backend="inductor" if ON_GPU else "aot_eager",
    )
    assert all(a.equal(b) for a, b in zip(compiled(q, k, cos, sin, [2, 3, 3]), got))
    grads = [torch.randn_like(y) for y in want]
    torch.testing.assert_close(
        torch.autograd.grad(got, (q, k), grads), torch.autograd.grad(want, (q, k), grads)
    )


@pytest.mark.parametrize("name", HF_MODELS)
def test_patched_model_equals_unpatched(name, monkeypatch):
    """A tiny random model whose attention calls hf_apply_rotary_pos_emb gives the unpatched
    model's outputs and parameter gradients (float32)."""
    modeling, config, model, tokens = tiny_hf_model(name)

    def run():
        model.zero_grad()
        output = model(tokens)
        output = output[0]  # the logits, or the text model's last hidden state
        output.square().mean().backward()
        return output.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    want, want_grads = run()
    calls = []

    def counted(*args, **kwargs):  # the patched model calls ours, once a layer
        calls.append(1)
        return rope.hf_apply_rotary_pos_emb(*args, **kwargs)

    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", counted)
    got, got_grads = run()
    assert len(calls) == config.num_hidden_layers
    torch.testing.assert_close(got, want)
    assert len(got_grads) == len(want_grads) > 0
    for got_grad, want_grad in zip(got_grads, want_grads):
        torch.testing.assert_close(got_grad, want_grad)


def _bad_inputs():
    cases = hf_bad_inputs()
    q, k, cos, _ = cases["cos and sin differ"][0]
    cases["cos requiring grad"] = (
        (q, k, cos.clone().requires_grad_(), cos),
        {},
        "cos requires grad, but no gradient flows",
    )
    return cases


@pytest.mark.parametrize("case", _bad_inputs())
def test_bad_inputs_raise_one_clear_error(case):
    args, kwargs, message = _bad_inputs()[case]
    with pytest.raises((ValueError, TypeError), match=message):
        rope.hf_apply_rotary_pos_emb(*args, **kwargs)


@pytest.mark.parametrize(
    "sin_shape, section, message",
    [
        ((3, 2, 5, 16), [2, 2, 2], "must sum to half"),
        ((3, 2, 5, 16), 4, "mrope_section must be 3 non-negative ints"),
        ((3, 2, 5, 16), [5, -2, 1], "mrope_section must be 3 non-negative ints"),
        ((3, 2, 5, 16), [1.0, 3.0, 4.0], "mrope_section must be 3 non-negative ints"),
        ((2, 2, 5, 16), [2, 3, 3], r"sin must have shape \[3, b, s, d\], got \(2, 2, 5, 16\)"),
        ((3, 2, 5, 12), [2, 3, 3], "cos and sin must have one shape"),
    ],
)
def test_multimodal_bad_arguments(sin_shape, section, message):
    q, k = torch.randn(2, 1, 2, 4, 5, 16, device=DEVICE)
    cos = torch.randn(3, 2, 5, 16, device=DEVICE)
    sin = torch.randn(sin_shape, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        rope.hf_apply_multimodal_rotary_pos_emb(q, k, cos, sin, section)


@pytest.mark.parametrize("shape", [(3, 2, 4, 16), (3, 3, 5, 16)])
def test_multimodal_tables_of_another_length_or_batch(shape):
    """The error names the [3, b, s, d] tables the caller passed, not the recomposed ones."""
    q, k = torch.randn(2, 2, 4, 5, 16, device=DEVICE)
    cos = torch.randn(shape, device=DEVICE)
    message = f"must have shape [3, 2 or 1, 5, d] (streams, batch, sequence), got {shape}"
    with pytest.raises(ValueError, match=re.escape(message)):
        rope.hf_apply_multimodal_rotary_pos_emb(q, k, cos, cos, [2, 3, 3])


def test_a_wider_table_promotes_as_transformers_does():
    """q and k in float16 with float32 tables (a model under autocast): float32 results, as
    transformers' q * cos gives."""
    q, k, cos, sin = inputs(2, 5, 4, 2, 16, 16, torch.float16, 1, 1)
    got = rope.hf_apply_rotary_pos_emb(q, k, cos.float(), sin.float())
    want = hf_reference(q, k, cos.float(), sin.float())
    for y, ref in zip(got, want):
        assert y.dtype == ref.dtype == torch.float32
        torch.testing.assert_close(y, ref)


def test_position_ids_edges():
    """Empty position_ids; position_ids made under inference_mode (no version counter); a
    negative id in a compiled call (not checked there) reads no memory before the table."""
    q, k, _, _ = inputs(2, 3, 4, 2, 16, 16, torch.float32, 1, 1)
    cache = torch.randn(5, 16, device=DEVICE)
    no_ids = torch.zeros(2, 0, dtype=torch.long, device=DEVICE)
    empty = rope.hf_apply_rotary_pos_emb(
        q[:, :, :0], k[:, :, :0], cache, cache, position_ids=no_ids
    )
    assert [tuple(y.shape) for y in empty] == [(2, 4, 0, 16), (2, 2, 0, 16)]
    with torch.inference_mode():
        ids = torch.tensor([[0, 2, 1]], device=DEVICE)
        got = rope.hf_apply_rotary_pos_emb(q, k, cache, cache / 2, position_ids=ids)
        want = rope.hf_apply_rotary_pos_emb(q, k, cache[ids], cache[ids] / 2)
        assert all(a.equal(b) for a, b in zip(got, want))
    torch._dynamo.reset()
    compiled = torch.compile(
        rope.hf_apply_rotary_pos_emb, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager"
    )
    ids = torch.tensor([[-1, 0, 2]], device=DEVICE)
    q_embed, _ = compiled(q.detach(), k.detach(), cache, cache, position_ids=ids)
    assert q_embed[:, :, 0].eq(0).all()  # cos and sin read as 0 outside the table


def test_a_table_past_2_31_elements():
    """Per-row tables whose batch offset passes 2**31 elements: 64-bit offsets (only the pages
    read are touched)."""
    big = torch.empty(2 * 2**30 + 8, dtype=torch.float32, device=DEVICE)
    cos = big.as_strided((3, 2, 4), (2**30, 4, 1))
    cos.fill_(0.5)
    q, k = torch.randn(2, 3, 1, 2, 4, device=DEVICE)
    got = rope.hf_apply_rotary_pos_emb(q, k, cos, cos)
    torch.testing.assert_close(got, hf_reference(q, k, cos, cos))
