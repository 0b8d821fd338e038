"""
RoPE fused into attention, forward and backward
===============================================

In this tutorial, you will learn about:

* where the rotation belongs: RoPE is O(s) work and attention O(s^2), so K is rotated once in a
  pass of its own, q in the forward's prologue, both saved rotated: no attention loop rotates;
* a rotated layout (the halves of each pair side by side, zero-padded) in which every loop loads
  one whole tile per step and computes QK^T as one dot;
* the backward in the rotated basis, rotated back once as dk and dq are stored (exact: RoPE is
  linear and acts on each row alone); dq by a second kernel that loops the other way, in a fixed
  order, rather than by atomics;
* online softmax with key-padding and causal masks, grouped-query attention, odd lengths, head
  dims that are not powers of two, partial rotary, both pairings, packed qkv;
* opaque ``torch.library.custom_op``s that ``torch.compile(fullgraph=True)`` takes whole, and an
  eager path that skips the dispatcher;
* benchmarking against 03's RoPE followed by SDPA (cuDNN, flash) and FlexAttention, eager and
  compiled.

How to read this file. Part 1 is the lesson, in two sittings. The forward (about 45 minutes): the
PyTorch reference, where the rotation belongs and what it moves, the rotated layout, the rotation
pass and the forward kernel, and ``launch_forward``, a plain launcher you can call. Then, after a
marked stopping point, the backward (about 35 minutes): its derivation in the rotated basis, the
two backward kernels and ``launch_backward``. Part 2 is the drop-in: argument checks and launches
remembered per signature, the launches as ``torch.library`` ops that
``torch.compile(fullgraph=True)`` and autograd take, and the public functions ``rope_attention``
and ``rope_attention_qkvpacked``; skip it on a first read. Part 3 checks the kernels against a
float32 PyTorch reference and benchmarks them against RoPE then attention.

Run ``python 04_rope_attention.py``: it checks itself against a float32 PyTorch reference, then
benchmarks. This file imports only torch and triton: copy it alone into your project.
"""

# %% Part 1 - the lesson
# With no GPU, the kernels run in Triton's interpreter: the variable must be set before triton is
# imported.
import argparse
import functools
import hashlib
import importlib.util
import itertools
import math
import os
import sys
import time
from typing import List, Optional, Tuple

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # used inside kernels: a global there must be a tl.constexpr

# %%
# The PyTorch reference
# ---------------------
# RoPE with 02's semantics (freqs are float32 angles [s2, 1, 1, d2], as Part 2's rope_freqs builds
# them; the first d2 channels are rotated, rotate-half or interleaved pairs, with any angles), then
# softmax attention written out, in float32. A key-padding mask follows Hugging Face:
# attention_mask[b, j] = 1 for a real token, 0 for padding; a query row that sees no key returns
# zeros.


def rope_reference(t, freqs, interleaved=False):
    """RoPE on t [b, s, h, d] in float32."""
    d2 = freqs.shape[-1]
    angles = freqs[: t.shape[1], 0, 0][None, :, None, :]
    x = t[..., :d2].float()
    if interleaved:
        x_rot = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        x_rot = torch.cat((-x[..., d2 // 2 :], x[..., : d2 // 2]), dim=-1)
    y = x * angles.cos() + x_rot * angles.sin()
    return torch.cat((y, t[..., d2:].float()), dim=-1)


def attention_reference(
    q, k, v, freqs, causal=False, attention_mask=None, sm_scale=None, interleaved=False
):
    """float32 RoPE then softmax attention on [b, s, h, d]; the output [b, s, h, d] in float32."""
    group = q.shape[2] // k.shape[2]
    s = q.shape[1]
    q = rope_reference(q, freqs, interleaved)
    k = rope_reference(k, freqs, interleaved).repeat_interleave(group, dim=2)
    v = v.float().repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * (sm_scale or q.shape[-1] ** -0.5)
    visible = torch.ones(s, s, dtype=torch.bool, device=q.device)
    visible = visible.tril(0 if causal else s)[None, None]
    if attention_mask is not None:
        visible = visible & attention_mask.bool()[:, None, None, :]
    p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", p.nan_to_num(0.0), v)  # a row that sees no key: 0


# %%
# Where to rotate: FLOPs and bytes
# --------------------------------
# QK^T and PV are 4*b*h*s^2*d FLOPs (half when causal), FlashAttention's backward 2.5 times that
# (five matmuls to the forward's two), on O(b*s*h*d) inputs: attention is bound by arithmetic from
# a few hundred tokens on, and RoPE is a question of bytes and of where its instructions go. RoPE
# is O(s) work: rotated inside the attention loops, each K tile would be rotated again for every
# block of queries. So K is rotated once, by a pass of its own, and q in the forward's prologue.
# In units U = b*s*h*d elements (h_kv = h, d2 = d), each tensor counted once per kernel that reads
# or writes it, forward + backward:
# - RoPE then attention (03 + SDPA or FlexAttention): RoPE reads q, k and writes rotated copies
#   (4U), attention reads them and v and writes o (4U); attention's backward reads q, k, v, o, dO
#   and writes dq, dk, dv (8U at the least), RoPE's reads and writes dq and dk (4U): 8U + 12U or
#   more.
# - Here: the pass reads k and writes rk (2U), and cos and sin once per position into a float32
#   table [s, 4 * HALF]; the forward reads q, rk, v and writes o (4U) and, when a backward will
#   run, the q tile it rotated (1U): 7U (6U with no backward). The backward reads the saved rq and
#   rk and rotates dq and dk back as it stores them: the dq kernel reads rq, rk, v, o, dO and writes
#   dq (6U), the dkdv kernel reads rq, rk, v, dO and writes dk, dv (6U): 7U + 12U, every loop plain
#   FlashAttention. Reading rq, rk, v and dO in both kernels (4U more than one kernel would) buys
#   dq summed in a fixed order (see the backward).
# The alternatives lose: K tiles rotated inside the loops, or q rotated again in the backward, move
# more bytes or instructions into the loops; dq summed by float32 atomics is slower and its sums
# change order from run to run; tensor-descriptor (TMA) loads and warp specialization gain nothing
# under Triton 3.6 on Hopper (results/04_rope_attention_ab.log, results/04_hopper.md).
#
# The rotated layout
# ------------------
# QK^T sums over channels, so q and k may hold them in any order they share. rq [b, h, s, W] and
# rk [b, h_kv, s, W] hold per row the a members of the d2/2 pairs (rotate-half: channel i;
# interleaved: 2i), zero-padded to a power of two HALF, then the b members likewise, then the
# d - d2 channels that are not rotated: W = 2 * HALF + d - d2. A loop loads a tile as one
# [rows, 2 * HALF] block with no channel mask, and QK^T is one dot (plus one for the pass-through
# channels). q and k are rotated in float32 and rounded once.

# %%
# The forward kernels
# -------------------
# Offsets in the attention kernels: a head's base pointer is int64, offsets within it int32 unless
# they could reach 2^31 (WIDE); the rotation pass computes its offsets in int64. The rotation pass
# takes BLOCK_S positions x HEADS heads of k per program and writes rk and the cos/sin table; the
# attention kernel is FlashAttention's forward on rq, rk and v.


@triton.jit
def _positions(start, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """Positions start ... start + BLOCK - 1. A head's base pointer is int64; offsets within it are
    int32 (fewer registers next to the accumulators) unless they could reach 2^31 (WIDE)."""
    pos = start + tl.arange(0, BLOCK)
    return pos.to(tl.int64) if WIDE else pos


@triton.jit
def _load(ptrs, mask, other, UNMASKED: tl.constexpr):
    """tl.load, with no mask when UNMASKED says that every element is in bounds."""
    if UNMASKED:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=other)


@triton.jit
def _load_pairs(rows, stride_d, rows_ok, half, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The a and b members of the pairs of `rows`, [rows, HALF] each, float32, 0 past `half`.
    Interleaved pairs are loaded as one contiguous row and split in registers: two loads of every
    other channel would not vectorize."""
    if INTERLEAVED:
        c = tl.arange(0, 2 * HALF)[None, :]
        x = tl.load(rows + c * stride_d, mask=rows_ok & (c < 2 * half), other=0.0).to(tl.float32)
        return tl.split(tl.reshape(x, (x.shape[0], HALF, 2)))
    i = tl.arange(0, HALF)[None, :]
    return (
        tl.load(rows + i * stride_d, mask=rows_ok & (i < half), other=0.0).to(tl.float32),
        tl.load(rows + (i + half) * stride_d, mask=rows_ok & (i < half), other=0.0).to(tl.float32),
    )


@triton.jit
def _trig(trig_ptr, pos, rows_ok, HALF: tl.constexpr):
    """cos and sin of the a and b angles of positions `pos`, [len(pos), HALF] each, from the table
    the pass wrote."""
    rows = trig_ptr + pos[:, None] * (4 * HALF) + tl.arange(0, HALF)[None, :]
    return (
        tl.load(rows, mask=rows_ok, other=0.0),
        tl.load(rows + HALF, mask=rows_ok, other=0.0),
        tl.load(rows + 2 * HALF, mask=rows_ok, other=0.0),
        tl.load(rows + 3 * HALF, mask=rows_ok, other=0.0),
    )


@triton.jit
def _rotate(x_a, x_b, cos_a, sin_a, cos_b, sin_b):
    """R x, as its a and b halves."""
    return x_a * cos_a - x_b * sin_a, x_b * cos_b + x_a * sin_b


@triton.jit
def _per_head(t, HEADS: tl.constexpr):
    """[BLOCK_S, HALF] -> [BLOCK_S * HEADS, HALF]: each position's row repeated for HEADS heads."""
    return tl.reshape(
        tl.broadcast_to(t[:, None, :], (t.shape[0], HEADS, t.shape[1])),
        (t.shape[0] * HEADS, t.shape[1]),
    )


@triton.jit
def rope_pass_kernel(
    x_ptr,
    y_ptr,
    freqs_ptr,
    trig_ptr,
    seqlen,
    n_heads,
    half,
    n_pass,
    stride_xb,
    stride_xs,
    stride_xh,
    stride_xd,
    stride_yb,
    stride_ys,
    stride_yh,
    stride_yd,
    stride_fs,
    stride_fd,
    BLOCK_S: tl.constexpr,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_PASS: tl.constexpr,
):
    """BLOCK_S positions x HEADS heads of one sequence, one tile of BLOCK_S * HEADS rows: y = R x,
    from x's own layout into the rotated one (k to rk), with cos and sin taken once per position;
    the programs of batch 0's first block of heads write them to the table the other kernels
    read."""
    pid_s, b, pid_h = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    r = tl.arange(0, BLOCK_S * HEADS)
    pos, head = (pid_s * BLOCK_S + r // HEADS).to(tl.int64), pid_h * HEADS + r % HEADS
    ok = ((pos < seqlen) & (head < n_heads))[:, None]
    i, c = tl.arange(0, HALF)[None, :], tl.arange(0, PASS)[None, :]
    x_rows = x_ptr + b * stride_xb + pos[:, None] * stride_xs + head[:, None] * stride_xh
    y_rows = y_ptr + b * stride_yb + pos[:, None] * stride_ys + head[:, None] * stride_yh
    pos_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    ok_s = (pos_s < seqlen)[:, None]
    f_a, f_b = _load_pairs(
        freqs_ptr + pos_s[:, None] * stride_fs, stride_fd, ok_s, half, HALF, INTERLEAVED
    )
    cos_a, sin_a, cos_b, sin_b = tl.cos(f_a), tl.sin(f_a), tl.cos(f_b), tl.sin(f_b)
    if (b == 0) & (pid_h == 0):
        table = trig_ptr + pos_s[:, None] * (4 * HALF) + i
        tl.store(table, cos_a, mask=ok_s)
        tl.store(table + HALF, sin_a, mask=ok_s)
        tl.store(table + 2 * HALF, cos_b, mask=ok_s)
        tl.store(table + 3 * HALF, sin_b, mask=ok_s)
    x_a, x_b = _load_pairs(x_rows, stride_xd, ok, half, HALF, INTERLEAVED)
    y_a, y_b = _rotate(
        x_a,
        x_b,
        _per_head(cos_a, HEADS),
        _per_head(sin_a, HEADS),
        _per_head(cos_b, HEADS),
        _per_head(sin_b, HEADS),
    )
    # all lanes: the pads are stored as 0
    tl.store(y_rows + i * stride_yd, y_a.to(y_ptr.dtype.element_ty), mask=ok)
    tl.store(y_rows + (HALF + i) * stride_yd, y_b.to(y_ptr.dtype.element_ty), mask=ok)
    if HAS_PASS:
        x_p = tl.load(x_rows + (2 * half + c) * stride_xd, mask=ok & (c < n_pass), other=0.0)
        tl.store(y_rows + (2 * HALF + c) * stride_yd, x_p, mask=ok & (c < n_pass))


@triton.jit
def _masked(
    x,
    q_idx,
    k_idx,
    seqlen,
    key_mask_row,
    fill,
    diagonal,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    """x, `fill` where a query may not see a key: past the end, padded, or (causal) later. q_idx
    and k_idx index x's rows and columns, either way round ([m, 1] and [1, n], or the transpose).
    With no bounds or padding to test, the causal test runs only on tiles that cross the
    diagonal."""
    if (not EVEN_N) or HAS_MASK:
        visible = k_idx < seqlen
        if HAS_MASK:
            visible = visible & (tl.load(key_mask_row + k_idx, mask=k_idx < seqlen, other=0) != 0)
        if CAUSAL:
            visible = visible & (q_idx >= k_idx)
        x = tl.where(visible, x, fill)
    elif CAUSAL:
        if diagonal:
            x = tl.where(q_idx >= k_idx, x, fill)
    return x


@triton.jit
def _scores(
    x_r,
    x_p,
    y_rows,
    y_ok,
    n_pass,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    HAS_PASS: tl.constexpr,
    EVEN: tl.constexpr,
):
    """x y^T for a tile x held in registers (x_r: the rotated halves, x_p: the pass-through
    channels) and the rows y_rows of rq or rk, loaded whole; returns the scores and y's two
    parts."""
    y_r = _load(y_rows + tl.arange(0, 2 * HALF)[None, :], y_ok, 0.0, EVEN)
    scores = tl.dot(x_r, tl.trans(y_r))
    y_p = x_p  # (unused without HAS_PASS)
    if HAS_PASS:
        c = tl.arange(0, PASS)[None, :]
        y_p = tl.load(y_rows + 2 * HALF + c, mask=y_ok & (c < n_pass), other=0.0)
        scores = tl.dot(x_p, tl.trans(y_p), scores)
    return scores, y_r, y_p


@triton.jit
def rope_attn_fwd_kernel(
    q_ptr,
    rk_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    rq_ptr,
    trig_ptr,
    key_mask_ptr,
    qk_scale,
    seqlen,
    n_heads,
    group,
    half,
    n_pass,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_qd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ob,
    stride_os,
    stride_oh,
    stride_od,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    D: tl.constexpr,
    W: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_PASS: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    SAVE_RQ: tl.constexpr,
    WIDE: tl.constexpr,
):
    """One block of queries of one head: the output rows and their log-sum-exp (base 2)."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // n_heads).to(tl.int64), (bh % n_heads).to(tl.int64)
    offs_m = _positions(pid_m * BLOCK_M, BLOCK_M, WIDE)
    m_ok = (offs_m < seqlen)[:, None]
    c, d = tl.arange(0, PASS)[None, :], tl.arange(0, D)[None, :]
    head_dim = 2 * half + n_pass
    # prologue: this block's q rows rotated, the halves side by side, rounded to q's dtype, saved
    # for the backward
    q_rows = q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs
    q_a, q_b = _load_pairs(q_rows, stride_qd, m_ok, half, HALF, INTERLEAVED)
    cos_a, sin_a, cos_b, sin_b = _trig(trig_ptr, offs_m, m_ok, HALF)
    q_a, q_b = _rotate(q_a, q_b, cos_a, sin_a, cos_b, sin_b)
    q_r = tl.reshape(tl.permute(tl.join(q_a, q_b), (0, 2, 1)), (BLOCK_M, 2 * HALF)).to(
        q_ptr.dtype.element_ty
    )
    # q's pass-through channels (0s without HAS_PASS)
    q_p = tl.load(q_rows + (2 * half + c) * stride_qd, mask=m_ok & (c < n_pass), other=0.0)
    if SAVE_RQ:
        rq_rows = rq_ptr + bh.to(tl.int64) * seqlen * W + offs_m[:, None] * W
        tl.store(rq_rows + tl.arange(0, 2 * HALF)[None, :], q_r, mask=m_ok)
        if HAS_PASS:
            tl.store(rq_rows + 2 * HALF + c, q_p, mask=m_ok & (c < n_pass))
    # rk is [b, h_kv, s, W]: this head's rows are row b * h_kv + h // group
    rk_head = rk_ptr + (bh // group).to(tl.int64) * seqlen * W
    v_head = v_ptr + b * stride_vb + (h // group) * stride_vh
    # qk_scale (the softmax scale in log2 units, for exp2) is applied in the multiply-add that
    # subtracts the max
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # running max of the scaled scores
    l_i = tl.zeros((BLOCK_M,), tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    # causal: no key past the block's last query
    hi = tl.minimum((pid_m + 1) * BLOCK_M, seqlen) if CAUSAL else seqlen
    for start_n in range(0, hi, BLOCK_N):
        offs_n = _positions(start_n, BLOCK_N, WIDE)
        n_ok = (offs_n < seqlen)[:, None]
        scores, _, _ = _scores(
            q_r, q_p, rk_head + offs_n[:, None] * W, n_ok, n_pass, HALF, PASS, HAS_PASS, EVEN_N
        )
        scores = _masked(
            scores,
            offs_m[:, None],
            offs_n[None, :],
            seqlen,
            key_mask_ptr + b * seqlen,
            float("-inf"),
            start_n + BLOCK_N > pid_m * BLOCK_M,
            CAUSAL,
            HAS_MASK,
            EVEN_N,
        )
        m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)
        # with a padding mask, a row that has seen no visible key yet keeps m = -inf: subtract 0
        # instead
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new) if HAS_MASK else m_new
        p = tl.exp2(scores * qk_scale - m_new_safe[:, None])
        alpha = tl.exp2(m_i - m_new_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load(
            v_head + offs_n[:, None] * stride_vs + d * stride_vd,
            n_ok & (d < head_dim),
            0.0,
            EVEN_N and EVEN_D,
        )
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    empty = l_i == 0.0  # rows that saw no key: output 0, and lse = +inf so the backward's p is 0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    o_rows = o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os
    tl.store(o_rows + d * stride_od, out.to(o_ptr.dtype.element_ty), mask=m_ok & (d < head_dim))
    lse = tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(lse_ptr + bh.to(tl.int64) * seqlen + offs_m, lse, mask=offs_m < seqlen)


# %%
# Launching the forward
# ---------------------
# Tile configs per kernel and shape class, from per-shape sweeps (results/
# 04_rope_attention_sweep.log; the backward's, _ab.log): at d = 64 short sequences want small
# query blocks in the forward (more programs to fill the GPU), longer ones 128 x 128; at d = 128
# causality favours the smaller tiles; at d = 64 the dq kernel wants 4 warps with a padding mask,
# 8 without. The interpreter runs 32 x 32 tiles. The builders, _pass_plan for the pass and _plan
# for the three attention kernels, give a kernel's grid, its arguments after the tensors (sizes,
# then strides per tensor) and its constexprs by name; the launchers pass them on, and Part 2
# remembers what they built.
CONFIGS = {  # (kernel, shape class): (BLOCK_M, BLOCK_N, num_warps, num_stages)
    ("fwd", "d<=64, s<=1024"): (64, 64, 4, 2),
    ("fwd", "d<=64, s>1024"): (128, 128, 4, 3),
    ("fwd", "d>64, causal"): (64, 64, 4, 3),
    ("fwd", "d>64"): (128, 128, 8, 3),
    ("dkdv", "d<=64"): (64, 64, 4, 3),
    ("dkdv", "d>64"): (64, 128, 8, 3),
    ("dq", "d<=64"): (128, 64, 8, 3),
    ("dq", "d<=64, mask"): (64, 64, 4, 3),
    ("dq", "d>64"): (128, 64, 8, 3),
}
# Offsets within a head that could reach INT32_LIMIT are int64 (WIDE); a test lowers it.
INT32_LIMIT = 2**31


def _config(kernel, head_dim, seqlen, causal, masked):
    """The tile config of kernel ("fwd", "dkdv" or "dq") for its shape class, by name."""
    shape = "d<=64" if head_dim <= 64 else "d>64"
    if kernel == "fwd" and head_dim <= 64:
        shape += ", s<=1024" if seqlen <= 1024 else ", s>1024"
    elif kernel == "fwd" and causal:
        shape += ", causal"
    elif kernel == "dq" and head_dim <= 64 and masked:
        shape += ", mask"
    config = dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), CONFIGS[(kernel, shape)]))
    if DEVICE.type != "cuda":
        config.update(BLOCK_M=32, BLOCK_N=32, num_warps=4)
    return config


def _pow2(n, at_least):
    """The smallest power of two >= n, and >= at_least (not triton.next_power_of_2: a
    constexpr function, slower to call from Python)."""
    return max(at_least, 1 << (int(n) - 1).bit_length())


def _layout(rot_dim, head_dim):
    """The rotated layout's HALF (the pairs, padded; 2 * HALF >= 16, a dot's smallest K), PASS
    (the tile of the d - d2 pass-through channels) and W (a row's width)."""
    HALF = _pow2(rot_dim // 2, 8)
    n_pass = head_dim - rot_dim
    return HALF, _pow2(n_pass, 16), 2 * HALF + n_pass


def _pass_plan(k, rk, freqs, interleaved):
    """The rotation pass's grid, arguments after the tensors, and constexprs: a program per BLOCK_S
    positions x HEADS heads of one sequence. rk [b, h_kv, s, W] goes in (b, s, h, d) order."""
    b, s, h_kv, d = k.shape
    rot_dim = freqs.shape[3]
    HALF, PASS, _ = _layout(rot_dim, d)
    HEADS = min(_pow2(h_kv, 1), 64)  # 64 rows (positions x heads) a program
    BLOCK_S = 64 // HEADS
    grid = (triton.cdiv(s, BLOCK_S), b, triton.cdiv(h_kv, HEADS))
    sizes = (s, h_kv, rot_dim // 2, d - rot_dim)
    strides = (*k.stride(), *rk.transpose(1, 2).stride(), freqs.stride(0), freqs.stride(3))
    constexprs = dict(
        BLOCK_S=BLOCK_S,
        HEADS=HEADS,
        HALF=HALF,
        PASS=PASS,
        INTERLEAVED=interleaved,
        HAS_PASS=d > rot_dim,
        num_warps=4,
    )
    return grid, (*sizes, *strides), constexprs


def _plan(kernel, q, k, rot_dim, strided, sm_scale, causal, interleaved, key_mask, save_rq=False):
    """An attention kernel's grid, arguments after the tensors, and constexprs: a program per block
    of queries of a head ("fwd", "dq"), or of keys of a k/v head ("dkdv"). q and k give the sizes
    (dq and dk in the backward); strided: the [b, s, h, d] tensors whose strides the kernel takes,
    in its order."""
    b, s, h, d = q.shape
    h_kv = k.shape[2]
    HALF, PASS, W = _layout(rot_dim, d)
    D = _pow2(d, 16)
    config = _config(kernel, d, s, causal, key_mask is not None)
    if kernel == "dkdv":
        grid = (triton.cdiv(s, config["BLOCK_N"]), b * h_kv)
    else:
        grid = (triton.cdiv(s, config["BLOCK_M"]), b * h)
    sizes = (s, h, h // h_kv, rot_dim // 2, d - rot_dim)
    strides = [stride for x in strided for stride in x.stride()]
    # WIDE: could a row's offset within one head reach INT32_LIMIT, in a strided tensor or rq, rk?
    ends = [(s - 1) * abs(x.stride(1)) + (d - 1) * abs(x.stride(3)) for x in strided]
    constexprs = dict(
        **config,
        HALF=HALF,
        PASS=PASS,
        D=D,
        W=W,
        INTERLEAVED=interleaved,
        HAS_PASS=d > rot_dim,
        CAUSAL=causal,
        HAS_MASK=key_mask is not None,
        EVEN_N=s % config["BLOCK_N"] == 0,
        EVEN_D=D == d,
        WIDE=max(ends + [s * W]) >= INT32_LIMIT,
    )
    if kernel == "fwd":
        constexprs["SAVE_RQ"] = save_rq
    if kernel == "dkdv":
        constexprs["EVEN_M"] = s % config["BLOCK_M"] == 0
    return grid, (sm_scale * LOG2E, *sizes, *strides), constexprs


def _forward_outputs(q, k, rot_dim, save_rq):
    """The forward's outputs, empty: o, lse, rq (empty unless save_rq), rk, and trig, the float32
    table [s, 4 * HALF] of cos_a, sin_a, cos_b, sin_b per position."""
    b, s, h, d = q.shape
    HALF, _, W = _layout(rot_dim, d)
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty(b, h, s, dtype=torch.float32)
    rq = q.new_empty(b, h, s, W) if save_rq else q.new_empty(0)
    rk = q.new_empty(b, k.shape[2], s, W)
    trig = q.new_empty(s, 4 * HALF, dtype=torch.float32)
    return o, lse, rq, rk, trig


def _launch(kernel, tensors, plan, *plan_args):
    """One kernel, launched plainly: kernel[grid](*tensors, *args, **constexprs), with the grid, the
    arguments after the tensors and the constexprs from its builder, plan(*plan_args)."""
    grid, args, constexprs = plan(*plan_args)
    kernel[grid](*tensors, *args, **constexprs)


def launch_forward(
    q,
    k,
    v,
    freqs,
    sm_scale,
    causal=False,
    key_mask=None,
    interleaved=False,
    save_rq=True,
    launch=_launch,
):
    """The forward: the rotation pass, then the attention kernel; no argument checks.

    q: [b, s, h, d]; k, v: [b, s, h_kv, d]; any strides. freqs: float32 angles [s2, 1, 1, d2].
    sm_scale: the softmax scale, as d ** -0.5. key_mask: contiguous [b, s], nonzero = a real
    token, or None.
    Returns o [b, s, h, d], and what the backward reads: lse [b, h, s] (float32, base 2),
    rq [b, h, s, W] (empty unless save_rq), rk [b, h_kv, s, W] and trig [s, 4 * HALF].
    launch(kernel, tensors, builder, *builder_args) launches each kernel: _launch, or Part 2's
    launch remembered per signature."""
    rot_dim = freqs.shape[3]
    o, lse, rq, rk, trig = _forward_outputs(q, k, rot_dim, save_rq)
    launch(rope_pass_kernel, (k, rk, freqs, trig), _pass_plan, k, rk, freqs, interleaved)
    mask = key_mask if key_mask is not None else lse  # without HAS_MASK, never read
    tensors = (q, rk, v, o, lse, rq, trig, mask)
    options = (sm_scale, causal, interleaved, key_mask, save_rq)
    launch(rope_attn_fwd_kernel, tensors, _plan, "fwd", q, k, rot_dim, (q, v, o), *options)
    return o, lse, rq, rk, trig


# %%
# Stop here for a first sitting
# -----------------------------
# The forward is whole: launch_forward(q, k, v, freqs, sm_scale) returns the output, and all that
# a backward will read (lse, rq, rk, trig). The second sitting derives the backward in the rotated
# basis, then writes its two kernels and their launcher.

# %%
# The backward
# ------------
# S = scale * Rq Rk^T, Rq being q with each row rotated by its position's angles. d(Rq) = scale *
# dS Rk and d(Rk) = scale * dS^T Rq accumulate in the rotated basis; each row's rotation is linear
# and depends only on its position, so dq = R^T d(Rq) row by row (the sines trade halves and
# change sign), applied once per finished tile. One program per block of keys loops over the query
# tiles, recomputes P^T = exp(S^T - lse) and dP^T = V dO^T, and accumulates dV += P^T dO and
# d(Rk) += dS^T Rq. A second kernel, one program per block of queries, loops over the keys and
# accumulates d(Rq) += dS Rk: 7 matmuls per pair of tiles instead of 5 (it recomputes S and dP),
# but every sum in a fixed order (the same bits on every run) and dq written once, rotated back,
# in its own dtype. FlashAttention 2 sums dq in the first kernel instead, by atomics into a float32
# buffer as large as q, and FlashAttention 3 by the TMA unit's reduce-add: 5 matmuls, but sums
# whose order changes from run to run, a float32 tile added to memory per pair of tiles, and two
# passes more (delta, and dq cast from float32). Here, those passes counted, neither measured
# faster than the fixed order: pointer atomics, nor the reduce-add under every tile config tried
# (results/04_hopper.md).
# Both kernels subtract delta = rowsum(dO * O) from dP: the dq kernel runs first and computes it
# next to the dO tile it loads anyway, for the dkdv kernel to read (a launch and a read of dO fewer
# than a kernel of its own).


@triton.jit
def _store_gradient(
    rows,
    stride_d,
    rows_ok,
    pos,
    trig_ptr,
    g_r,
    g_p,
    half,
    n_pass,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_PASS: tl.constexpr,
):
    """Store a gradient of the rows at positions `pos` held in the rotated layout (g_r:
    [rows, 2 * HALF]; g_p: the pass-through channels) in the tensor's own basis, layout and dtype:
    R^T g, then g_p (_load_pairs' inverse)."""
    dtype = rows.dtype.element_ty
    cos_a, sin_a, cos_b, sin_b = _trig(trig_ptr, pos, rows_ok, HALF)
    g_a, g_b = tl.split(tl.permute(tl.reshape(g_r, (g_r.shape[0], 2, HALF)), (0, 2, 1)))
    y_a, y_b = g_a * cos_a + g_b * sin_b, g_b * cos_b - g_a * sin_a
    if INTERLEAVED:
        c = tl.arange(0, 2 * HALF)[None, :]
        tl.store(
            rows + c * stride_d,
            tl.reshape(tl.join(y_a, y_b), (y_a.shape[0], 2 * HALF)).to(dtype),
            mask=rows_ok & (c < 2 * half),
        )
    else:
        i = tl.arange(0, HALF)[None, :]
        tl.store(rows + i * stride_d, y_a.to(dtype), mask=rows_ok & (i < half))
        tl.store(rows + (i + half) * stride_d, y_b.to(dtype), mask=rows_ok & (i < half))
    if HAS_PASS:
        c = tl.arange(0, PASS)[None, :]
        tl.store(rows + (2 * half + c) * stride_d, g_p.to(dtype), mask=rows_ok & (c < n_pass))


@triton.jit
def rope_attn_bwd_dkdv_kernel(
    rq_ptr,
    rk_ptr,
    v_ptr,
    do_ptr,
    dk_ptr,
    dv_ptr,
    lse_ptr,
    delta_ptr,
    trig_ptr,
    key_mask_ptr,
    qk_scale,
    seqlen,
    n_heads,
    group,
    half,
    n_pass,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_db,
    stride_ds,
    stride_dh,
    stride_dd,
    stride_dkb,
    stride_dks,
    stride_dkh,
    stride_dkd,
    stride_dvb,
    stride_dvs,
    stride_dvh,
    stride_dvd,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    D: tl.constexpr,
    W: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_PASS: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    WIDE: tl.constexpr,
):
    """One block of keys of one k/v head: dK and dV, summed over the q heads of its group."""
    pid_n, bhk = tl.program_id(0), tl.program_id(1)
    n_kv_heads = n_heads // group
    b, hk = (bhk // n_kv_heads).to(tl.int64), (bhk % n_kv_heads).to(tl.int64)
    offs_n = _positions(pid_n * BLOCK_N, BLOCK_N, WIDE)
    n_ok = (offs_n < seqlen)[:, None]
    c, d = tl.arange(0, PASS)[None, :], tl.arange(0, D)[None, :]
    head_dim = 2 * half + n_pass
    k_rows = rk_ptr + bhk.to(tl.int64) * seqlen * W + offs_n[:, None] * W
    k_r = tl.load(k_rows + tl.arange(0, 2 * HALF)[None, :], mask=n_ok, other=0.0)
    # (all zeros without HAS_PASS)
    k_p = tl.load(k_rows + 2 * HALF + c, mask=n_ok & (c < n_pass), other=0.0)
    v = tl.load(
        v_ptr + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vs + d * stride_vd,
        mask=n_ok & (d < head_dim),
        other=0.0,
    )
    dk_r = tl.zeros((BLOCK_N, 2 * HALF), tl.float32)
    dk_p = tl.zeros((BLOCK_N, PASS), tl.float32)
    dv = tl.zeros((BLOCK_N, D), tl.float32)
    # causal: earlier queries cannot see these keys
    start = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M if CAUSAL else 0
    for g in range(group):
        bh = b * n_heads + hk * group + g
        do_head = do_ptr + b * stride_db + (hk * group + g) * stride_dh
        for start_m in range(start, seqlen, BLOCK_M):
            offs_m = _positions(start_m, BLOCK_M, WIDE)
            m_ok = (offs_m < seqlen)[:, None]
            # S^T: [BLOCK_N, BLOCK_M]
            scores_t, q_r, q_p = _scores(
                k_r,
                k_p,
                rq_ptr + bh * seqlen * W + offs_m[:, None] * W,
                m_ok,
                n_pass,
                HALF,
                PASS,
                HAS_PASS,
                EVEN_M,
            )
            lse = _load(lse_ptr + bh * seqlen + offs_m, offs_m < seqlen, float("inf"), EVEN_M)
            p_t = tl.exp2(scores_t * qk_scale - lse[None, :])
            p_t = _masked(
                p_t,
                offs_m[None, :],
                offs_n[:, None],
                seqlen,
                key_mask_ptr + b * seqlen,
                0.0,
                start_m < (pid_n + 1) * BLOCK_N - 1,
                CAUSAL,
                HAS_MASK,
                EVEN_N,
            )
            do = _load(
                do_head + offs_m[:, None] * stride_ds + d * stride_dd,
                m_ok & (d < head_dim),
                0.0,
                EVEN_M and EVEN_D,
            )
            dv = tl.dot(p_t.to(do.dtype), do, dv)
            dp_t = tl.dot(v, tl.trans(do))
            delta = _load(delta_ptr + bh * seqlen + offs_m, offs_m < seqlen, 0.0, EVEN_M)
            ds_t = (p_t * (dp_t - delta[None, :])).to(q_r.dtype)
            dk_r = tl.dot(ds_t, q_r, dk_r)
            if HAS_PASS:
                dk_p = tl.dot(ds_t, q_p, dk_p)
    # epilogue: dk = R^T d(Rk), scaled (dS/dRk = sm_scale * dS^T Rq; qk_scale is in log2 units)
    sm_scale = qk_scale * LN2
    _store_gradient(
        dk_ptr + b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dks,
        stride_dkd,
        n_ok,
        offs_n,
        trig_ptr,
        dk_r * sm_scale,
        dk_p * sm_scale,
        half,
        n_pass,
        HALF,
        PASS,
        INTERLEAVED,
        HAS_PASS,
    )
    tl.store(
        dv_ptr + b * stride_dvb + hk * stride_dvh + offs_n[:, None] * stride_dvs + d * stride_dvd,
        dv.to(dv_ptr.dtype.element_ty),
        mask=n_ok & (d < head_dim),
    )


@triton.jit
def rope_attn_bwd_dq_kernel(
    rq_ptr,
    rk_ptr,
    v_ptr,
    do_ptr,
    o_ptr,
    dq_ptr,
    lse_ptr,
    delta_ptr,
    trig_ptr,
    key_mask_ptr,
    qk_scale,
    seqlen,
    n_heads,
    group,
    half,
    n_pass,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_db,
    stride_ds,
    stride_dh,
    stride_dd,
    stride_ob,
    stride_os,
    stride_oh,
    stride_od,
    stride_dqb,
    stride_dqs,
    stride_dqh,
    stride_dqd,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    D: tl.constexpr,
    W: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_PASS: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    WIDE: tl.constexpr,
):
    """One block of queries of one q head: dQ, summed over the keys it sees in a fixed order."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // n_heads).to(tl.int64), (bh % n_heads).to(tl.int64)
    offs_m = _positions(pid_m * BLOCK_M, BLOCK_M, WIDE)
    m_ok = (offs_m < seqlen)[:, None]
    c, d = tl.arange(0, PASS)[None, :], tl.arange(0, D)[None, :]
    head_dim = 2 * half + n_pass
    q_rows = rq_ptr + bh.to(tl.int64) * seqlen * W + offs_m[:, None] * W
    q_r = tl.load(q_rows + tl.arange(0, 2 * HALF)[None, :], mask=m_ok, other=0.0)
    q_p = tl.load(q_rows + 2 * HALF + c, mask=m_ok & (c < n_pass), other=0.0)
    do = tl.load(
        do_ptr + b * stride_db + h * stride_dh + offs_m[:, None] * stride_ds + d * stride_dd,
        mask=m_ok & (d < head_dim),
        other=0.0,
    )
    lse = tl.load(
        lse_ptr + bh.to(tl.int64) * seqlen + offs_m, mask=offs_m < seqlen, other=float("inf")
    )
    # delta = rowsum(dO * O), the softmax backward's dP correction, stored for the dkdv kernel that
    # runs next
    o = tl.load(
        o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + d * stride_od,
        mask=m_ok & (d < head_dim),
        other=0.0,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(delta_ptr + bh.to(tl.int64) * seqlen + offs_m, delta, mask=offs_m < seqlen)
    rk_head = rk_ptr + (bh // group).to(tl.int64) * seqlen * W
    v_head = v_ptr + b * stride_vb + (h // group) * stride_vh
    dq_r = tl.zeros((BLOCK_M, 2 * HALF), tl.float32)
    dq_p = tl.zeros((BLOCK_M, PASS), tl.float32)
    hi = tl.minimum((pid_m + 1) * BLOCK_M, seqlen) if CAUSAL else seqlen
    for start_n in range(0, hi, BLOCK_N):
        offs_n = _positions(start_n, BLOCK_N, WIDE)
        n_ok = (offs_n < seqlen)[:, None]
        scores, k_r, k_p = _scores(
            q_r, q_p, rk_head + offs_n[:, None] * W, n_ok, n_pass, HALF, PASS, HAS_PASS, EVEN_N
        )
        p = tl.exp2(scores * qk_scale - lse[:, None])
        p = _masked(
            p,
            offs_m[:, None],
            offs_n[None, :],
            seqlen,
            key_mask_ptr + b * seqlen,
            0.0,
            start_n + BLOCK_N > pid_m * BLOCK_M,
            CAUSAL,
            HAS_MASK,
            EVEN_N,
        )
        v = _load(
            v_head + offs_n[:, None] * stride_vs + d * stride_vd,
            n_ok & (d < head_dim),
            0.0,
            EVEN_N and EVEN_D,
        )
        ds = (p * (tl.dot(do, tl.trans(v)) - delta[:, None])).to(q_r.dtype)
        dq_r = tl.dot(ds, k_r, dq_r)
        if HAS_PASS:
            dq_p = tl.dot(ds, k_p, dq_p)
    _store_gradient(
        dq_ptr + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs,
        stride_dqd,
        m_ok,
        offs_m,
        trig_ptr,
        dq_r * (qk_scale * LN2),
        dq_p * (qk_scale * LN2),
        half,
        n_pass,
        HALF,
        PASS,
        INTERLEAVED,
        HAS_PASS,
    )


# %%
# Launching the backward
# ----------------------
# The same builder as the forward's; the dq kernel runs first, as delta is its by-product.


def launch_backward(
    do,
    v,
    o,
    lse,
    rq,
    rk,
    trig,
    grads,
    rot_dim,
    sm_scale,
    causal=False,
    key_mask=None,
    interleaved=False,
    launch=_launch,
):
    """The backward: the dq kernel (which writes delta), then the dkdv kernel; no argument checks.
    do: o's gradient [b, s, h, d]; v, and launch_forward's o, lse, rq, rk, trig (rq saved); grads:
    dq [b, s, h, d], dk and dv [b, s, h_kv, d], any strides, written here (e.g. torch.empty_like
    of q, k and v); rot_dim: d2, freqs' last dim; the options as for launch_forward."""
    dq, dk, dv = grads
    delta = torch.empty_like(lse)  # written by the dq kernel, read by the dkdv kernel
    mask = key_mask if key_mask is not None else lse  # without HAS_MASK, never read
    options = (sm_scale, causal, interleaved, key_mask)
    tensors = (rq, rk, v, do, o, dq, lse, delta, trig, mask)
    launch(rope_attn_bwd_dq_kernel, tensors, _plan, "dq", dq, dk, rot_dim, (v, do, o, dq), *options)
    tensors = (rq, rk, v, do, dk, dv, lse, delta, trig, mask)
    launch(
        rope_attn_bwd_dkdv_kernel,
        tensors,
        _plan,
        "dkdv",
        dq,
        dk,
        rot_dim,
        (v, do, dk, dv),
        *options,
    )


# %% Part 2 - the drop-in
# What a model needs beyond Part 1's launchers, and what each piece buys:
# - argument checks, run once per signature (shapes, strides, dtypes, devices, 16-byte alignment,
#   options): errors that name the argument, for a dict lookup per call;
# - launches remembered per signature: the ops run Part 1's launchers with a launch function that
#   runs each builder once per signature, then goes straight to the compiled kernel, past Triton's
#   binding and specializing of some forty arguments per call;
# - the launches as torch.library custom ops: torch.compile(fullgraph=True) takes them whole,
#   forward and backward;
# - an autograd Function for eager calls: the ops' own functions with no dispatcher (it costs more
#   than a launch), and no autograd at all when no gradient is wanted;
# - rope_attention and rope_attention_qkvpacked, the public functions; packed qkv gets its
#   gradient as one tensor, with no stacking copy;
# - rope_freqs: the angle table as TransformerEngine lays it out, for callers.
# What an eager call costs on the host, against an empty op and PyTorch's own: results/host_cost.py
# measures it; results/compare_H100.md holds a run.
Tensor = torch.Tensor


def rope_freqs(max_seq_len, rotary_dim, base=10000.0, interleaved=False, device=None):
    """Angle table [max_seq_len, 1, 1, rotary_dim], float32, laid out as TE's
    RotaryPositionEmbedding."""
    channels = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device)
    inv_freq = base ** (-channels / rotary_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32, device=device), inv_freq)
    if interleaved:  # the angle of pair i at channels 2i and 2i + 1
        angles = angles.repeat_interleave(2, dim=-1)
    else:  # at channels i and i + d2/2
        angles = torch.cat((angles, angles), dim=-1)
    return angles.view(max_seq_len, 1, 1, rotary_dim)


# %%
# Remembered per signature: checks and launches
# ---------------------------------------------
_checked = {}  # signature -> None: its checks passed
_launches = {}  # (kernel, signature) -> the compiled kernel bound to its grid, and its arguments


def _signature(*args):
    """What checks and launches depend on: each tensor's shape, strides, dtype, device and 16-byte
    alignment (Triton specializes pointers on it); every other argument's type and value."""
    return tuple(
        [
            (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16)
            if isinstance(x, torch.Tensor)
            else (type(x), x)
            for x in args
        ]
    )


def _once(cache, key, compute, *args):
    """compute(*args), once per key; not kept if it raised (or the key is unhashable: a bad
    argument, which the check names)."""
    try:
        return cache[key]
    except (KeyError, TypeError):
        if len(cache) >= 4096:  # a workload of ever new shapes starts over
            cache.clear()
    value = compute(*args)
    cache[key] = value
    return value


def _launch_cached(key, kernel, tensors, plan, *plan_args):
    """_launch, remembered per key (the op's signature): the first call goes through Triton, later
    ones straight to the compiled kernel (in the interpreter, every call goes through Triton). The
    ops pass it to Part 1's launchers as functools.partial(_launch_cached, key)."""
    launch = _launches.get((kernel, key))
    if launch is not None:
        run, args = launch
        return run(*tensors, *args)
    grid, args, constexprs = plan(*plan_args)
    compiled = kernel[grid](*tensors, *args, **constexprs)
    if isinstance(compiled, triton.compiler.CompiledKernel):  # not the interpreter
        # the compiled kernel takes all arguments after the tensors in order, constexprs too
        values = [constexprs[name] for name in kernel.arg_names if name in constexprs]
        if len(_launches) >= 4096:  # as in _once: a workload of ever new shapes starts over
            _launches.clear()
        _launches[(kernel, key)] = (compiled[(*grid, 1, 1)[:3]], (*args, *values))


# %%
# The operators
# -------------
# torch.compile cannot trace into a Triton launch it does not know. Registered as a
# torch.library.custom_op, the launch is one opaque node of the graph: register_fake gives the
# compiler the outputs' shapes without running anything, register_autograd the backward (another
# custom op); Inductor compiles the code around them and calls our kernels as they are. Outside the
# ops all is traced: checks read shapes, dtypes, devices, never values (a sync breaks the graph).


def _forward_fake(qkv, freqs, key_mask, sm_scale, causal, interleaved, save_rotated):
    """The forward op's outputs, empty: (o, lse, rq, rk, trig); rq is empty when no backward will
    run."""
    q, k, _ = qkv if len(qkv) == 3 else qkv[0].unbind(2)
    return _forward_outputs(q, k, freqs.shape[3], save_rotated)


def _forward(
    qkv: List[Tensor],
    freqs: Tensor,
    key_mask: Optional[Tensor],
    sm_scale: float,
    causal: bool,
    interleaved: bool,
    save_rotated: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The forward op: launch_forward, its launches remembered per signature; qkv is [q, k, v], or
    [qkv] packed as [b, s, 3, h, d]."""
    q, k, v = qkv if len(qkv) == 3 else qkv[0].unbind(2)
    key = _signature(q, k, v, freqs, key_mask, sm_scale, causal, interleaved, save_rotated)
    launch = functools.partial(_launch_cached, key)
    return launch_forward(
        q, k, v, freqs, sm_scale, causal, key_mask, interleaved, save_rotated, launch
    )


def _backward_fake(
    do, rq, rk, qkv_or_v, o, lse, trig, key_mask, rot_dim, sm_scale, causal, interleaved, packed
):
    """The backward op's outputs, empty and contiguous: [dqkv] for packed qkv, else [dq, dk, dv]
    (dq with o's shape, dk and dv with v's)."""
    dv = torch.empty_like(qkv_or_v, memory_format=torch.contiguous_format)  # packed: dqkv
    if packed:
        return [dv]
    dk = torch.empty_like(qkv_or_v, memory_format=torch.contiguous_format)
    return [torch.empty_like(o), dk, dv]  # o is contiguous


def _backward(
    do: Tensor,
    rq: Tensor,
    rk: Tensor,
    qkv_or_v: Tensor,
    o: Tensor,
    lse: Tensor,
    trig: Tensor,
    key_mask: Optional[Tensor],
    rot_dim: int,
    sm_scale: float,
    causal: bool,
    interleaved: bool,
    packed: bool,
) -> List[Tensor]:
    """The backward op: launch_backward, its launches remembered per signature; qkv_or_v is v, or
    packed qkv whole; dq, dk, dv are written with any strides (packed: the thirds of one
    gradient)."""
    settings = (key_mask, rot_dim, sm_scale, causal, interleaved, packed)  # the op's, after tensors
    grads = _backward_fake(do, rq, rk, qkv_or_v, o, lse, trig, *settings)
    key = _signature(do, rq, rk, qkv_or_v, o, lse, trig, *settings)
    v = qkv_or_v.unbind(2)[2] if packed else qkv_or_v
    outputs = grads[0].unbind(2) if packed else grads
    launch = functools.partial(_launch_cached, key)
    tensors = (do, v, o, lse, rq, rk, trig, outputs)
    launch_backward(*tensors, rot_dim, sm_scale, causal, key_mask, interleaved, launch)
    return grads


def _custom_op(name, fn, fake):
    """fn as the op rope_attention_tutorial::<name>, a fresh name if this file was loaded before."""
    n = 0
    while hasattr(torch.ops.rope_attention_tutorial, f"{name}{n or ''}"):
        n += 1
    op = torch.library.custom_op(f"rope_attention_tutorial::{name}{n or ''}", fn, mutates_args=())
    op.register_fake(fake)
    return op


forward_op = _custom_op("forward", _forward, _forward_fake)
backward_op = _custom_op("backward", _backward, _backward_fake)


def _save_for_backward(ctx, inputs, output):
    """The forward op's setup_context, and the eager Function's."""
    qkv, freqs, key_mask, sm_scale, causal, interleaved, _ = inputs
    o, lse, rq, rk, trig = output
    # only o carries a gradient, and autograd would otherwise fill zero gradients as large as rq
    # and rk for the others
    ctx.mark_non_differentiable(lse, rq, rk, trig)
    ctx.set_materialize_grads(False)
    v_or_qkv = qkv[2] if len(qkv) == 3 else qkv[0]  # v, or all of packed qkv
    ctx.save_for_backward(rq, rk, v_or_qkv, o, lse, trig, key_mask)
    ctx.args = (freqs.shape[3], sm_scale, causal, interleaved, len(qkv) == 1)


def _forward_op_backward(ctx, do, *_):
    """The forward op's backward: o's gradient (the other outputs carry none) to qkv alone."""
    grads = backward_op(do, *ctx.saved_tensors, *ctx.args)
    return grads, None, None, None, None, None, None


forward_op.register_autograd(_forward_op_backward, setup_context=_save_for_backward)


class _RoPEAttention(torch.autograd.Function):
    """Eager calls: the ops' own functions, with no dispatcher (it costs more than a launch)."""

    @staticmethod
    def forward(ctx, *args):
        # args: q, k, v (or packed qkv), then freqs, key_mask, sm_scale, causal, interleaved
        qkv = list(args[:-5])
        inputs = (qkv, *args[-5:], True)  # True: save the rotated q for the backward
        output = _forward(*inputs)
        _save_for_backward(ctx, inputs, output)
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, *_):
        grads = _backward(do, *ctx.saved_tensors, *ctx.args)  # dq, dk, dv (or dqkv)
        return (*grads, None, None, None, None, None)


# %%
# Argument checks and the public functions
# ----------------------------------------


def _check(q, k, v, freqs, attention_mask, sm_scale):
    for name, x in dict(q=q, k=k, v=v, freqs=freqs, attention_mask=attention_mask).items():
        if not isinstance(x, torch.Tensor) and not (name == "attention_mask" and x is None):
            raise TypeError(
                f"{name} must be a torch.Tensor{' or None' if name == 'attention_mask' else ''}, "
                f"got {type(x).__name__}"
            )
        if x is not None and x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
        if name == "q" and q.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"q must be float16 or bfloat16, got {q.dtype}")
        if name not in "qkv":
            continue
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [b, s, h, d], got shape {tuple(x.shape)}")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(
            "k must match q but in heads (self-attention): "
            f"got {tuple(k.shape)}, q {tuple(q.shape)}"
        )
    if not k.shape[2] or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"q's {q.shape[2]} heads must be a multiple of k's {k.shape[2]} >= 1 "
            "(grouped-query attention)"
        )
    batch, seqlen, _, head_dim = q.shape
    if not 16 <= head_dim <= 128:
        raise ValueError(f"head dim must be between 16 and 128, got {head_dim}")
    if freqs.dtype != torch.float32 or freqs.dim() != 4 or freqs.shape[1:3] != (1, 1):
        raise ValueError(
            "freqs must be float32 angles of shape [s2, 1, 1, d2], "
            f"got {tuple(freqs.shape)} {freqs.dtype}"
        )
    if freqs.shape[3] % 2 or not 2 <= freqs.shape[3] <= head_dim:
        raise ValueError(
            f"freqs' last dim d2 = {freqs.shape[3]} must be even and between 2 and the head dim "
            f"{head_dim}"
        )
    if freqs.shape[0] < seqlen:
        raise ValueError(
            f"sequence length {seqlen} is over the {freqs.shape[0]} rows (s2) of freqs"
        )
    if attention_mask is not None and (
        attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex
    ):
        raise TypeError(
            "attention_mask must be bool or integer (1 = token, 0 = padding), "
            f"got {attention_mask.dtype}"
        )
    if attention_mask is not None and attention_mask.shape != (batch, seqlen):
        raise ValueError(
            f"attention_mask must have shape [b, s] = [{batch}, {seqlen}], "
            f"got {tuple(attention_mask.shape)}"
        )
    if sm_scale is not None and (
        isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float))
    ):
        raise TypeError(f"sm_scale must be a number or None, got {type(sm_scale).__name__}")
    if sm_scale is not None and not 0 < sm_scale < math.inf:
        raise ValueError(f"sm_scale must be a positive finite number, got {sm_scale}")


def _attention(qkv, q, k, v, freqs, causal, attention_mask, sm_scale, interleaved):
    tracing = torch.compiler.is_compiling()
    if tracing:  # checked as the graph is traced, once
        _check(q, k, v, freqs, attention_mask, sm_scale)
    else:  # checked once per signature
        key = _signature(q, k, v, freqs, attention_mask, sm_scale)
        _once(_checked, key, _check, q, k, v, freqs, attention_mask, sm_scale)
    if freqs.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "freqs requires grad, but no gradient flows to the angle table; pass freqs.detach()"
        )
    # the mask is read in its own dtype: no conversion op
    key_mask = attention_mask.contiguous() if attention_mask is not None else None
    sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    # with no gradient to compute, rq is not written
    save_rotated = torch.is_grad_enabled() and any(x.requires_grad for x in qkv)
    options = (freqs, key_mask, sm_scale, causal, interleaved)
    if tracing:  # the op, which torch.compile traces through its fake and autograd registrations
        return forward_op(qkv, *options, save_rotated)[0]
    if save_rotated:  # eager: the op's functions in an autograd Function, no dispatcher
        return _RoPEAttention.apply(*qkv, *options)[0]
    return _forward(qkv, *options, False)[0]  # no gradient wanted: no autograd either


def rope_attention(
    q, k, v, freqs, *, causal=False, attention_mask=None, sm_scale=None, interleaved=False
):
    """Attention with RoPE applied to q and k by the kernels; differentiable in q, k and v, and
    traceable whole by torch.compile(fullgraph=True).

    q: [b, s, h, d], float16 or bfloat16, any strides, 16 <= d <= 128.
    k, v: [b, s, h_kv, d], q's dtype, h % h_kv == 0 (grouped-query attention).
    freqs: float32 angles [s2, 1, 1, d2], s2 >= s, d2 even and <= d (02's semantics: only the
        first d2 channels are rotated; any angles). No gradient flows to freqs.
    causal: each query sees keys at its position and before.
    attention_mask: bool or integer [b, s], 1 (nonzero) = a real token, 0 = padding (Hugging
        Face's convention); padded keys are never attended to. A query that sees no key returns
        zeros.
    sm_scale: softmax scale, positive, 1/sqrt(d) by default. interleaved: rotate pairs (RoFormer,
        GPT-J).
    Returns the output [b, s, h, d] in q's dtype. The gradients are deterministic: every sum runs
    in a fixed order, so a call gives the same bits every time."""
    return _attention([q, k, v], q, k, v, freqs, causal, attention_mask, sm_scale, interleaved)


def rope_attention_qkvpacked(
    qkv, freqs, *, causal=False, attention_mask=None, sm_scale=None, interleaved=False
):
    """rope_attention with q, k and v packed as one QKV projection makes them (FlashAttention's
    qkvpacked): qkv is [b, s, 3, h, d], and q, k, v = qkv.unbind(2). The same output and gradients
    as rope_attention(*qkv.unbind(2), freqs, ...), but qkv's gradient is written as one tensor, not
    stacked from three (a copy saved)."""
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must be [b, s, 3, h, d], got shape {tuple(qkv.shape)}")
    if qkv.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"qkv must be float16 or bfloat16, got {qkv.dtype}")
    return _attention([qkv], *qkv.unbind(2), freqs, causal, attention_mask, sm_scale, interleaved)


# %% Part 3 - check and benchmark
# The self-check runs one irregular case of every feature at once, eager and compiled;
# tests/test_04_rope_attention.py covers the whole matrix. The benchmark times ours and RoPE then
# attention at six shapes, against a bf16 matmul timed in the same run.
# The checks' dtype: bf16 on a GPU, fp16 in the interpreter (Triton 3.9's bf16 dot is wrong there).
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16


def self_check():
    torch.manual_seed(0)
    on_gpu = DEVICE.type == "cuda"
    b, s, h, h_kv, d = (3, 257, 4, 2, 80) if on_gpu else (2, 37, 2, 1, 32)
    freqs = torch.randn(s, 1, 1, d - 16, device=DEVICE)  # partial rotary, halves differ
    mask = torch.ones(b, s, dtype=torch.bool, device=DEVICE)
    mask[0, s // 2 :] = False  # padding after s/2
    mask[-1] = False  # a sequence with no real token: its rows return 0
    compiled = torch.compile(
        rope_attention, fullgraph=True, backend="inductor" if on_gpu else "aot_eager"
    )
    for causal, interleaved, fn in itertools.product(
        (False, True), (False, True), (rope_attention, compiled)
    ):
        q, k, v = (
            torch.randn(b, s, n, d, device=DEVICE, dtype=DTYPE, requires_grad=True)
            for n in (h, h_kv, h_kv)
        )
        kwargs = dict(causal=causal, attention_mask=mask, interleaved=interleaved)
        out = fn(q, k, v, freqs, **kwargs)
        ref = attention_reference(q, k, v, freqs, **kwargs)
        do = torch.randn_like(out)
        ours = (out, *torch.autograd.grad(out, (q, k, v), do))  # the output, then dq, dk, dv
        expected = (ref, *torch.autograd.grad(ref, (q, k, v), do.float()))
        for x, r in zip(ours, expected):
            torch.testing.assert_close(x.float(), r.float(), atol=2e-2, rtol=2e-2)
    print(
        "self-check passed: output and dq/dk/dv, eager and torch.compile(fullgraph=True), causal "
        f"and not, both pairings, a fully padded sequence, GQA {h}/{h_kv}, s={s}, d={d}, "
        f"d2={d - 16}, {DTYPE} ({DEVICE.type})"
    )


def time_us(fn, eager_call=False):
    """Median us per call: GPU work replayed from a CUDA graph, or (eager_call) ten calls in a
    row timed as one, so that do_bench's L2 clearing before each call cannot hide their host
    cost. No GPU: one call, timed."""
    if DEVICE.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    if eager_call:

        def ten_calls():
            for _ in range(10):
                fn()

        return triton.testing.do_bench(ten_calls, return_mode="median") * 100
    return triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3


EAGER_CALLS = ("fused (ours)", "03 RoPE + SDPA cuDNN")  # timed as eager calls too
BENCH_SHAPES = [  # (b, h, s, d, causal, padding mask)
    (32, 12, 512, 64, False, False),
    (16, 12, 512, 64, False, True),
    (8, 16, 2048, 64, False, False),
    (4, 32, 4096, 128, False, False),
    (4, 32, 4096, 128, True, False),
    (2, 16, 8192, 64, True, False),
]


def _unfused(rope03, freqs, attend, q, k, v):
    """03's RoPE on q and k [b, s, h, d], then attend on [b, h, s, d]."""
    q, k = rope03.apply_rotary_pos_emb_qk(q, k, freqs, "bshd")
    return attend(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)


def providers(rope03, freqs, causal, mask):
    """{name: fn(q, k, v)}: ours, eager and compiled; with 03, its RoPE then SDPA's cuDNN or flash
    backend, or FlexAttention compiled for the shape."""
    ours = functools.partial(rope_attention, freqs=freqs, causal=causal, attention_mask=mask)
    compiled = torch.compile(ours, fullgraph=True, dynamic=False)
    fns = {"fused (ours)": ours, "fused (ours), compiled": compiled}
    if rope03 is None:
        return fns
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def visible(b, h, q_idx, kv_idx):  # FlexAttention's mask_mod
        ok = (q_idx >= kv_idx) if causal else (q_idx >= 0)
        return ok & mask[b, kv_idx] if mask is not None else ok

    s = freqs.shape[0]
    batch = len(mask) if mask is not None else None
    block_mask = create_block_mask(visible, batch, None, s, s, device=DEVICE)
    sdpa = functools.partial(
        torch.nn.functional.scaled_dot_product_attention,
        is_causal=causal and mask is None,
        attn_mask=mask[:, None, None, :] if mask is not None else None,
    )
    attends = {
        "SDPA cuDNN": sdpa_kernel(SDPBackend.CUDNN_ATTENTION)(sdpa),
        "SDPA flash": sdpa_kernel(SDPBackend.FLASH_ATTENTION)(sdpa),
        "FlexAttention": functools.partial(
            torch.compile(flex_attention, dynamic=False), block_mask=block_mask
        ),
    }
    for name, attend in attends.items():
        fns[f"03 RoPE + {name}"] = functools.partial(_unfused, rope03, freqs, attend)
    return fns


def _forward_backward(fn, q, k, v, dout):
    return torch.autograd.grad(fn(q, k, v), (q, k, v), dout)


def benchmark(rope03, yardstick):
    """bf16; ours, and the unfused paths: 03's RoPE (apply_rotary_pos_emb_qk) on q and k, then SDPA
    (cuDNN, flash) or FlexAttention compiled per shape. Timing 'graph': GPU time, calls replayed
    from a CUDA graph (do_bench_cudagraph); 'eager call' (ours and RoPE + cuDNN): ten calls in a
    row as a user makes them, host cost included (do_bench), per call; medians. TF/s count
    4*b*h*s^2*d FLOPs, halved when causal, x3.5 for forward + backward, against a bf16 8192^3
    matmul timed as 'graph' in the same run."""
    on_gpu = DEVICE.type == "cuda"
    rows = [
        "| (b, h, s, d) | causal | padding mask | provider | timing | fwd TF/s | fwd+bwd TF/s "
        "| of the matmul, fwd / fwd+bwd |",
        "|---" * 8 + "|",
    ]
    print(*rows, sep="\n")
    for b, h, s, d, causal, padded in BENCH_SHAPES if on_gpu else [(1, 2, 64, 32, True, True)]:
        q, k, v = (
            torch.randn(b, s, h, d, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in "qkv"
        )
        freqs = rope_freqs(s, d, device=DEVICE)
        dout = torch.randn_like(q)
        mask = None
        if padded:  # Hugging Face style: each sequence is padded after a random length
            lengths = torch.randint(s // 2, s + 1, (b, 1), device=DEVICE)
            mask = torch.arange(s, device=DEVICE) < lengths
        torch._dynamo.reset()  # what is compiled is compiled for this shape alone (dynamic=False)
        flops = 4 * b * h * s * s * d * (0.5 if causal else 1)
        for name, fn in providers(rope03, freqs, causal, mask).items():
            calls = (
                functools.partial(fn, q, k, v),  # the forward
                functools.partial(_forward_backward, fn, q, k, v, dout),
            )
            timings = ("graph", "eager call") if name in EAGER_CALLS else ("graph",)
            for timing in timings if on_gpu else ("wall",):
                try:
                    calls[1]()  # compiles, where it does
                    us = [time_us(call, timing == "eager call") for call in calls]
                    tfs = [flops / us[0] / 1e6, 3.5 * flops / us[1] / 1e6]
                    cells = f"{tfs[0]:.0f} ({us[0]:.0f} us) | {tfs[1]:.0f} ({us[1]:.0f} us) | "
                    cells += " / ".join(f"{t / yardstick:.0%}" for t in tfs) if yardstick else "n/a"
                except Exception as e:  # a backend that does not take this case: flash with a mask
                    cells = f"n/a ({type(e).__name__}) | |"
                rows.append(
                    f"| {(b, h, s, d)} | {causal} | {padded} | {name} | {timing} | {cells} |"
                )
                print(rows[-1], flush=True)
    return rows


def write_page(rows, yardstick, results_dir, here):
    """results_dir/04_rope_attention_<GPU>.md: environment, command, what is timed (benchmark's
    docstring), the table, the raw log's name. here: this file's folder, for its git commit."""
    gpu = torch.cuda.get_device_name()
    kind = next((w for w in gpu.split() if w[:1] in "ABHL" and w[1:2].isdigit()), "gpu")
    commit = os.popen(f'git -C "{here}" rev-parse --short HEAD 2>{os.devnull}').read().strip()
    with open(__file__, "rb") as f:
        md5 = hashlib.md5(f.read()).hexdigest()[:8]
    page = [
        f"# RoPE + attention on the {kind}: fused against RoPE then attention\n",
        f"device: {gpu}; date: {time.strftime('%Y-%m-%d')}; torch {torch.__version__}; "
        f"triton {triton.__version__}; python {sys.version.split()[0]}; "
        f"commit {commit or 'n/a'}; 04_rope_attention.py md5 {md5}\n",
        f"Command: `python {' '.join(sys.argv)}`\n",
        " ".join(benchmark.__doc__.split()) + f" The matmul ran at {yardstick:.0f} TF/s.\n",
        *rows,
        f"\nRaw log: `04_rope_attention_{kind}.log`\n",
    ]
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, f"04_rope_attention_{kind}.md"), "w") as f:
        f.write("\n".join(page))


def load_03(here):
    """03_rope_bwd.py from beside this file, the unfused paths' RoPE; None if it is not there."""
    path = os.path.join(here, "03_rope_bwd.py")
    if os.path.exists(path):
        spec = importlib.util.spec_from_file_location("rope_bwd", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["rope_bwd"] = module  # torch.compile finds a traced function's module by name
        spec.loader.exec_module(module)
        return module
    print(f"{path} is missing: ours alone, no unfused paths to compare with")


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument(
        "--results", default=os.path.join(here, "results"), help="folder for the page (GPU only)"
    )
    args = parser.parse_args()
    self_check()
    if DEVICE.type != "cuda":
        print(
            "\nNO GPU: the kernels run in Triton's interpreter on the CPU. The timings below "
            "only show that the benchmark runs; they say nothing about speed."
        )
        benchmark(None, None)
    else:
        a = torch.randn(8192, 8192, device=DEVICE, dtype=DTYPE)
        yardstick = 2 * 8192**3 / time_us(functools.partial(torch.matmul, a, a)) / 1e6
        print(
            f"yardstick: a bf16 8192^3 matmul runs at {yardstick:.0f} TF/s on this GPU (GPU time)"
        )
        rows = benchmark(load_03(here), yardstick)
        write_page(rows, yardstick, args.results, here)
