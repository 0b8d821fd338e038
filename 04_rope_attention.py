"""
RoPE fused into attention, forward and backward
===============================================

In this tutorial, you will learn about:

* where the rotation belongs: RoPE is O(s) work and attention O(s^2), so K is rotated once in a pass of its own,
  q in the forward's prologue, both saved rotated: no attention loop rotates;
* a rotated layout (the halves of each pair side by side, zero-padded) in which every loop loads one whole tile
  per step and computes QK^T as one dot;
* the backward in the rotated basis, rotated back once as dk and dq are stored (exact: RoPE is linear and acts on
  each row alone); dq by a second kernel that loops the other way, in a fixed order, rather than by atomics;
* online softmax with key-padding and causal masks, grouped-query attention, odd lengths, head dims that are not
  powers of two, partial rotary, both pairings, packed qkv;
* opaque ``torch.library.custom_op``s that ``torch.compile(fullgraph=True)`` takes whole, and an eager path that
  skips the dispatcher;
* benchmarking against 03's RoPE followed by SDPA (cuDNN, flash) and FlexAttention, eager and compiled.

Run ``python 04_rope_attention.py``: it checks itself against a float32 PyTorch reference, then benchmarks. This
file imports only torch and triton: copy it alone into your project.
"""

# %%
# Setup
# -----
# With no GPU, the kernels run in Triton's interpreter: the variable must be set before triton is imported.
import argparse
import hashlib
import importlib.util
import itertools
import math
import os
import sys
import time
import timeit
import types
from typing import List, Optional, Tuple

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16  # of the checks: the interpreter's bf16 dot is wrong
Tensor = torch.Tensor
LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # used inside kernels: a global there must be a tl.constexpr

# %%
# The PyTorch reference
# ---------------------
# RoPE with 02's semantics (freqs are float32 angles [s2, 1, 1, d2]; the first d2 channels are rotated, rotate-half
# or interleaved pairs, with any angles), then softmax attention written out, in float32. A key-padding mask follows
# Hugging Face: attention_mask[b, j] = 1 for a real token, 0 for padding; a query row that sees no key returns zeros.


def rope_freqs(max_seq_len, rotary_dim, base=10000.0, interleaved=False, device=None):
    """Angle table [max_seq_len, 1, 1, rotary_dim], float32, laid out as TE's RotaryPositionEmbedding."""
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    return angles.view(max_seq_len, 1, 1, rotary_dim)


def rope_reference(t, freqs, interleaved=False):
    """RoPE on t [b, s, h, d] in float32."""
    d2, angles = freqs.shape[-1], freqs[:t.shape[1], 0, 0][None, :, None, :]
    x, x_pass = t[..., :d2].float(), t[..., d2:].float()
    x_rot = (torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2) if interleaved
             else torch.cat((-x[..., d2 // 2:], x[..., :d2 // 2]), dim=-1))
    return torch.cat((x * angles.cos() + x_rot * angles.sin(), x_pass), dim=-1)


def attention_reference(q, k, v, freqs, causal=False, attention_mask=None, sm_scale=None, interleaved=False):
    """float32 RoPE then softmax attention on [b, s, h, d]; the output [b, s, h, d] in float32."""
    group, s = q.shape[2] // k.shape[2], q.shape[1]
    q, k = rope_reference(q, freqs, interleaved), rope_reference(k, freqs, interleaved)
    k, v = k.repeat_interleave(group, dim=2), v.float().repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * (sm_scale or q.shape[-1] ** -0.5)
    visible = torch.ones(s, s, dtype=torch.bool, device=q.device).tril(0 if causal else s)[None, None]
    visible = visible & attention_mask.bool()[:, None, None, :] if attention_mask is not None else visible
    p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)  # empty rows: 0
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


# %%
# Where to rotate: FLOPs and bytes
# --------------------------------
# QK^T and PV are 4*b*h*s^2*d FLOPs (half when causal), the backward about 2.5 times that, on O(b*s*h*d) inputs:
# attention is bound by arithmetic from a few hundred tokens on, and RoPE is a question of bytes and of where its
# instructions go. In units U = b*s*h*d elements, forward + backward:
# - RoPE then attention (03 + SDPA or FlexAttention): RoPE reads q, k and writes rotated copies (4U), attention
#   reads them and v and writes o (4U); attention's backward reads 5U and writes 3U, RoPE's reads and writes dq and
#   dk (4U): 8U + 12U.
# - Here: a pass rotates K once (2U) and writes cos and sin once per position into a float32 table [s, 4 * HALF];
#   the forward rotates its q tile in the prologue and, when a backward will run, saves it (1U); attention reads
#   4U. The backward reads the saved rq and rk and rotates dk and dq back as they are stored: 7U + 8U, every loop
#   plain FlashAttention (its dq kernel reads rq, rk, v and dO again: 4U more).
#
# The rotated layout
# ------------------
# QK^T sums over channels, so q and k may hold them in any order they share. rq [b, h, s, W] and rk [b, h_kv, s, W]
# hold per row the a members of the d2/2 pairs (rotate-half: channel i; interleaved: 2i), zero-padded to a power
# of two HALF, then the b members likewise, then the d - d2 channels that are not rotated: W = 2 * HALF + d - d2.
# A loop loads a tile as one [rows, 2 * HALF] block with no channel mask, and QK^T is one dot (plus one for the
# pass-through channels). q and k are rotated in float32 and rounded once.
#
# The backward
# ------------
# S = scale * Rq Rk^T, Rq being q with each row rotated by its position's angles. d(Rq) = scale * dS Rk and
# d(Rk) = scale * dS^T Rq accumulate in the rotated basis; each row's rotation is linear and depends only on its
# position, so dq = R^T d(Rq) row by row (the sines trade halves and change sign), applied once per finished tile.
# One program per block of keys loops over the query tiles, recomputes P^T = exp(S^T - lse) and dP^T = V dO^T, and
# accumulates dV += P^T dO and d(Rk) += dS^T Rq. A second kernel, one program per block of queries, loops over the
# keys and accumulates d(Rq) += dS Rk: 7 matmuls per pair of tiles instead of 5, but every sum in a fixed order
# (the same bits on every run) and dq written once, rotated back, in its own dtype.
# Both kernels subtract delta = rowsum(dO * O) from dP: the dq kernel runs first and computes it next to the dO tile
# it loads anyway, for the dkdv kernel to read (a launch and a read of dO fewer than a kernel of its own).
#
# Did not help (results/04_rope_attention_ab.log): K tiles rotated in the loops, no pass (forward + backward slower
# everywhere); q rotated again in the backward, not saved (the write moves into a kernel bound by bytes); sin and cos
# per element; FlashAttention 2's d(Rq) summed by atomics into a float32 buffer as large as q (slower at every shape).
# Nor, with Triton 3.6 on Hopper (results/04_hopper.md): the forward's loads through tensor descriptors (TMA),
# its loop warp-specialized (no effect), QK^T of the next tile issued before this tile's softmax, long blocks first.

# %%
# The kernels
# -----------


@triton.jit
def _positions(start, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """Positions start ... start + BLOCK - 1. A head's base pointer is int64; offsets within it are int32 (fewer
    registers next to the accumulators) unless they could reach 2^31 (WIDE)."""
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
    """The a and b members of the pairs of `rows`, [rows, HALF] each, float32, 0 past `half`. Interleaved pairs are
    loaded as one contiguous row and split in registers: two loads of every other channel would not vectorize."""
    if INTERLEAVED:
        c = tl.arange(0, 2 * HALF)[None, :]
        x = tl.load(rows + c * stride_d, mask=rows_ok & (c < 2 * half), other=0.0).to(tl.float32)
        return tl.split(tl.reshape(x, (x.shape[0], HALF, 2)))
    i = tl.arange(0, HALF)[None, :]
    return (tl.load(rows + i * stride_d, mask=rows_ok & (i < half), other=0.0).to(tl.float32),
            tl.load(rows + (i + half) * stride_d, mask=rows_ok & (i < half), other=0.0).to(tl.float32))


@triton.jit
def _trig(trig_ptr, pos, rows_ok, HALF: tl.constexpr):
    """cos and sin of the a and b angles of positions `pos`, [len(pos), HALF] each, from the table the pass wrote."""
    rows = trig_ptr + pos[:, None] * (4 * HALF) + tl.arange(0, HALF)[None, :]
    return (tl.load(rows, mask=rows_ok, other=0.0), tl.load(rows + HALF, mask=rows_ok, other=0.0),
            tl.load(rows + 2 * HALF, mask=rows_ok, other=0.0), tl.load(rows + 3 * HALF, mask=rows_ok, other=0.0))


@triton.jit
def _rotate(x_a, x_b, cos_a, sin_a, cos_b, sin_b):
    """R x, as its a and b halves."""
    return x_a * cos_a - x_b * sin_a, x_b * cos_b + x_a * sin_b


@triton.jit
def _store_gradient(rows, stride_d, rows_ok, pos, trig_ptr, g_r, g_p, half, n_pass, HALF: tl.constexpr,
                    PASS: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_PASS: tl.constexpr):
    """Store a gradient of the rows at positions `pos` held in the rotated layout (g_r: [rows, 2 * HALF]; g_p: the
    pass-through channels) in the tensor's own basis, layout and dtype: R^T g, then g_p (_load_pairs' inverse)."""
    dtype = rows.dtype.element_ty
    cos_a, sin_a, cos_b, sin_b = _trig(trig_ptr, pos, rows_ok, HALF)
    g_a, g_b = tl.split(tl.permute(tl.reshape(g_r, (g_r.shape[0], 2, HALF)), (0, 2, 1)))
    y_a, y_b = g_a * cos_a + g_b * sin_b, g_b * cos_b - g_a * sin_a
    if INTERLEAVED:
        c = tl.arange(0, 2 * HALF)[None, :]
        tl.store(rows + c * stride_d, tl.reshape(tl.join(y_a, y_b), (y_a.shape[0], 2 * HALF)).to(dtype),
                 mask=rows_ok & (c < 2 * half))
    else:
        i = tl.arange(0, HALF)[None, :]
        tl.store(rows + i * stride_d, y_a.to(dtype), mask=rows_ok & (i < half))
        tl.store(rows + (i + half) * stride_d, y_b.to(dtype), mask=rows_ok & (i < half))
    if HAS_PASS:
        c = tl.arange(0, PASS)[None, :]
        tl.store(rows + (2 * half + c) * stride_d, g_p.to(dtype), mask=rows_ok & (c < n_pass))


@triton.jit
def _per_head(t, HEADS: tl.constexpr):
    """[BLOCK_S, HALF] -> [BLOCK_S * HEADS, HALF]: each position's row repeated for HEADS heads."""
    return tl.reshape(tl.broadcast_to(t[:, None, :], (t.shape[0], HEADS, t.shape[1])), (t.shape[0] * HEADS, t.shape[1]))


@triton.jit
def rope_pass_kernel(x_ptr, y_ptr, freqs_ptr, trig_ptr, seqlen, n_heads, half, n_pass,
                     stride_xb, stride_xs, stride_xh, stride_xd, stride_yb, stride_ys, stride_yh, stride_yd,
                     stride_fs, stride_fd, BLOCK_S: tl.constexpr, HEADS: tl.constexpr, HALF: tl.constexpr,
                     PASS: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_PASS: tl.constexpr):
    """BLOCK_S positions x HEADS heads of one sequence, one tile of BLOCK_S * HEADS rows: y = R x, from x's own
    layout into the rotated one (k to rk), with cos and sin taken once per position; the programs of sequence 0
    write them to the table the other kernels read."""
    pid_s, b, pid_h = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    r = tl.arange(0, BLOCK_S * HEADS)
    pos, head = (pid_s * BLOCK_S + r // HEADS).to(tl.int64), pid_h * HEADS + r % HEADS
    ok = ((pos < seqlen) & (head < n_heads))[:, None]
    i, c = tl.arange(0, HALF)[None, :], tl.arange(0, PASS)[None, :]
    x_rows = x_ptr + b * stride_xb + pos[:, None] * stride_xs + head[:, None] * stride_xh
    y_rows = y_ptr + b * stride_yb + pos[:, None] * stride_ys + head[:, None] * stride_yh
    pos_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    ok_s = (pos_s < seqlen)[:, None]
    f_a, f_b = _load_pairs(freqs_ptr + pos_s[:, None] * stride_fs, stride_fd, ok_s, half, HALF, INTERLEAVED)
    cos_a, sin_a, cos_b, sin_b = tl.cos(f_a), tl.sin(f_a), tl.cos(f_b), tl.sin(f_b)
    if (b == 0) & (pid_h == 0):
        table = trig_ptr + pos_s[:, None] * (4 * HALF) + i
        tl.store(table, cos_a, mask=ok_s)
        tl.store(table + HALF, sin_a, mask=ok_s)
        tl.store(table + 2 * HALF, cos_b, mask=ok_s)
        tl.store(table + 3 * HALF, sin_b, mask=ok_s)
    x_a, x_b = _load_pairs(x_rows, stride_xd, ok, half, HALF, INTERLEAVED)
    y_a, y_b = _rotate(x_a, x_b, _per_head(cos_a, HEADS), _per_head(sin_a, HEADS), _per_head(cos_b, HEADS),
                       _per_head(sin_b, HEADS))
    tl.store(y_rows + i * stride_yd, y_a.to(y_ptr.dtype.element_ty), mask=ok)  # all lanes: pads are 0
    tl.store(y_rows + (HALF + i) * stride_yd, y_b.to(y_ptr.dtype.element_ty), mask=ok)
    if HAS_PASS:
        x_p = tl.load(x_rows + (2 * half + c) * stride_xd, mask=ok & (c < n_pass), other=0.0)
        tl.store(y_rows + (2 * HALF + c) * stride_yd, x_p, mask=ok & (c < n_pass))


@triton.jit
def _masked(x, q_idx, k_idx, seqlen, key_mask_row, fill, diagonal, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
            EVEN_N: tl.constexpr):
    """x, `fill` where a query may not see a key: past the end, padded, or (causal) later. q_idx and k_idx index
    x's rows and columns, either way round ([m, 1] and [1, n], or the transpose). With no bounds or padding to
    test, the causal test runs only on tiles that cross the diagonal."""
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
def _scores(x_r, x_p, y_rows, y_ok, n_pass, HALF: tl.constexpr, PASS: tl.constexpr, HAS_PASS: tl.constexpr,
            EVEN: tl.constexpr):
    """x y^T for a tile x held in registers (x_r: the rotated halves, x_p: the pass-through channels) and the rows
    y_rows of rq or rk, loaded whole; returns the scores and y's two parts."""
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
    q_ptr, rk_ptr, v_ptr, o_ptr, lse_ptr, rq_ptr, trig_ptr, key_mask_ptr,
    qk_scale, seqlen, n_heads, group, half, n_pass,
    stride_qb, stride_qs, stride_qh, stride_qd, stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh, stride_od,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr, D: tl.constexpr,
    W: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_PASS: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, SAVE_RQ: tl.constexpr, WIDE: tl.constexpr):
    """One block of queries of one head: the output rows and their log-sum-exp (base 2)."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // n_heads).to(tl.int64), (bh % n_heads).to(tl.int64)
    offs_m = _positions(pid_m * BLOCK_M, BLOCK_M, WIDE)
    m_ok = (offs_m < seqlen)[:, None]
    c, d = tl.arange(0, PASS)[None, :], tl.arange(0, D)[None, :]
    head_dim = 2 * half + n_pass
    # prologue: this block's q rows rotated, the halves side by side, rounded to q's dtype, saved for the backward
    q_rows = q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs
    q_a, q_b = _load_pairs(q_rows, stride_qd, m_ok, half, HALF, INTERLEAVED)
    cos_a, sin_a, cos_b, sin_b = _trig(trig_ptr, offs_m, m_ok, HALF)
    q_a, q_b = _rotate(q_a, q_b, cos_a, sin_a, cos_b, sin_b)
    q_r = tl.reshape(tl.permute(tl.join(q_a, q_b), (0, 2, 1)), (BLOCK_M, 2 * HALF)).to(q_ptr.dtype.element_ty)
    q_p = tl.load(q_rows + (2 * half + c) * stride_qd, mask=m_ok & (c < n_pass), other=0.0)  # 0s without HAS_PASS
    if SAVE_RQ:
        rq_rows = rq_ptr + bh.to(tl.int64) * seqlen * W + offs_m[:, None] * W
        tl.store(rq_rows + tl.arange(0, 2 * HALF)[None, :], q_r, mask=m_ok)
        if HAS_PASS:
            tl.store(rq_rows + 2 * HALF + c, q_p, mask=m_ok & (c < n_pass))
    rk_head = rk_ptr + (bh // group).to(tl.int64) * seqlen * W  # rk is [b, h_kv, s, W]: row b * h_kv + h // group
    v_head = v_ptr + b * stride_vb + (h // group) * stride_vh
    # qk_scale (the softmax scale in log2 units, for exp2) is applied in the multiply-add that subtracts the max
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # running max of the scaled scores
    l_i = tl.zeros((BLOCK_M,), tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    hi = tl.minimum((pid_m + 1) * BLOCK_M, seqlen) if CAUSAL else seqlen  # causal: no key past the block's last query
    for start_n in range(0, hi, BLOCK_N):
        offs_n = _positions(start_n, BLOCK_N, WIDE)
        n_ok = (offs_n < seqlen)[:, None]
        scores, _, _ = _scores(q_r, q_p, rk_head + offs_n[:, None] * W, n_ok, n_pass, HALF, PASS, HAS_PASS, EVEN_N)
        scores = _masked(scores, offs_m[:, None], offs_n[None, :], seqlen, key_mask_ptr + b * seqlen, float("-inf"),
                         start_n + BLOCK_N > pid_m * BLOCK_M, CAUSAL, HAS_MASK, EVEN_N)
        m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)
        # with a padding mask, a row that has seen no visible key yet keeps m = -inf: subtract 0 instead
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new) if HAS_MASK else m_new
        p = tl.exp2(scores * qk_scale - m_new_safe[:, None])
        alpha = tl.exp2(m_i - m_new_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load(v_head + offs_n[:, None] * stride_vs + d * stride_vd, n_ok & (d < head_dim), 0.0, EVEN_N and EVEN_D)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    empty = l_i == 0.0  # rows that saw no key: output 0, and lse = +inf so the backward's p is 0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    o_rows = o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os
    tl.store(o_rows + d * stride_od, out.to(o_ptr.dtype.element_ty), mask=m_ok & (d < head_dim))
    lse = tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(lse_ptr + bh.to(tl.int64) * seqlen + offs_m, lse, mask=offs_m < seqlen)


@triton.jit
def rope_attn_bwd_dkdv_kernel(
    rq_ptr, rk_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, lse_ptr, delta_ptr, trig_ptr, key_mask_ptr,
    qk_scale, seqlen, n_heads, group, half, n_pass,
    stride_vb, stride_vs, stride_vh, stride_vd, stride_db, stride_ds, stride_dh, stride_dd,
    stride_dkb, stride_dks, stride_dkh, stride_dkd, stride_dvb, stride_dvs, stride_dvh, stride_dvd,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr, D: tl.constexpr,
    W: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_PASS: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, WIDE: tl.constexpr):
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
    k_p = tl.load(k_rows + 2 * HALF + c, mask=n_ok & (c < n_pass), other=0.0)  # (all zeros without HAS_PASS)
    v = tl.load(v_ptr + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vs + d * stride_vd,
                mask=n_ok & (d < head_dim), other=0.0)
    dk_r = tl.zeros((BLOCK_N, 2 * HALF), tl.float32)
    dk_p = tl.zeros((BLOCK_N, PASS), tl.float32)
    dv = tl.zeros((BLOCK_N, D), tl.float32)
    start = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M if CAUSAL else 0  # causal: earlier queries cannot see these keys
    for g in range(group):
        bh = b * n_heads + hk * group + g
        do_head = do_ptr + b * stride_db + (hk * group + g) * stride_dh
        for start_m in range(start, seqlen, BLOCK_M):
            offs_m = _positions(start_m, BLOCK_M, WIDE)
            m_ok = (offs_m < seqlen)[:, None]
            scores_t, q_r, q_p = _scores(k_r, k_p, rq_ptr + bh * seqlen * W + offs_m[:, None] * W, m_ok, n_pass, HALF,
                                         PASS, HAS_PASS, EVEN_M)  # S^T: [BLOCK_N, BLOCK_M]
            lse = _load(lse_ptr + bh * seqlen + offs_m, offs_m < seqlen, float("inf"), EVEN_M)
            p_t = tl.exp2(scores_t * qk_scale - lse[None, :])
            p_t = _masked(p_t, offs_m[None, :], offs_n[:, None], seqlen, key_mask_ptr + b * seqlen, 0.0,
                          start_m < (pid_n + 1) * BLOCK_N - 1, CAUSAL, HAS_MASK, EVEN_N)
            do = _load(do_head + offs_m[:, None] * stride_ds + d * stride_dd, m_ok & (d < head_dim), 0.0,
                       EVEN_M and EVEN_D)
            dv = tl.dot(p_t.to(do.dtype), do, dv)
            dp_t = tl.dot(v, tl.trans(do))
            delta = _load(delta_ptr + bh * seqlen + offs_m, offs_m < seqlen, 0.0, EVEN_M)
            ds_t = (p_t * (dp_t - delta[None, :])).to(q_r.dtype)
            dk_r = tl.dot(ds_t, q_r, dk_r)
            if HAS_PASS:
                dk_p = tl.dot(ds_t, q_p, dk_p)
    # epilogue: dk = R^T d(Rk), scaled (dS/dRk = sm_scale * dS^T Rq; qk_scale is in log2 units)
    sm_scale = qk_scale * LN2
    _store_gradient(dk_ptr + b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dks, stride_dkd, n_ok, offs_n,
                    trig_ptr, dk_r * sm_scale, dk_p * sm_scale, half, n_pass, HALF, PASS, INTERLEAVED, HAS_PASS)
    tl.store(dv_ptr + b * stride_dvb + hk * stride_dvh + offs_n[:, None] * stride_dvs + d * stride_dvd,
             dv.to(dv_ptr.dtype.element_ty), mask=n_ok & (d < head_dim))


@triton.jit
def rope_attn_bwd_dq_kernel(
    rq_ptr, rk_ptr, v_ptr, do_ptr, o_ptr, dq_ptr, lse_ptr, delta_ptr, trig_ptr, key_mask_ptr,
    qk_scale, seqlen, n_heads, group, half, n_pass,
    stride_vb, stride_vs, stride_vh, stride_vd, stride_db, stride_ds, stride_dh, stride_dd,
    stride_ob, stride_os, stride_oh, stride_od, stride_dqb, stride_dqs, stride_dqh, stride_dqd,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr, D: tl.constexpr,
    W: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_PASS: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, WIDE: tl.constexpr):
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
    do = tl.load(do_ptr + b * stride_db + h * stride_dh + offs_m[:, None] * stride_ds + d * stride_dd,
                 mask=m_ok & (d < head_dim), other=0.0)
    lse = tl.load(lse_ptr + bh.to(tl.int64) * seqlen + offs_m, mask=offs_m < seqlen, other=float("inf"))
    # delta = rowsum(dO * O), the softmax backward's dP correction, stored for the dkdv kernel that runs next
    o = tl.load(o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + d * stride_od,
                mask=m_ok & (d < head_dim), other=0.0)
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
        scores, k_r, k_p = _scores(q_r, q_p, rk_head + offs_n[:, None] * W, n_ok, n_pass, HALF, PASS, HAS_PASS, EVEN_N)
        p = tl.exp2(scores * qk_scale - lse[:, None])
        p = _masked(p, offs_m[:, None], offs_n[None, :], seqlen, key_mask_ptr + b * seqlen, 0.0,
                    start_n + BLOCK_N > pid_m * BLOCK_M, CAUSAL, HAS_MASK, EVEN_N)
        v = _load(v_head + offs_n[:, None] * stride_vs + d * stride_vd, n_ok & (d < head_dim), 0.0, EVEN_N and EVEN_D)
        ds = (p * (tl.dot(do, tl.trans(v)) - delta[:, None])).to(q_r.dtype)
        dq_r = tl.dot(ds, k_r, dq_r)
        if HAS_PASS:
            dq_p = tl.dot(ds, k_p, dq_p)
    _store_gradient(dq_ptr + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs, stride_dqd, m_ok, offs_m,
                    trig_ptr, dq_r * (qk_scale * LN2), dq_p * (qk_scale * LN2), half, n_pass, HALF, PASS, INTERLEAVED,
                    HAS_PASS)


# %%
# Launching the kernels
# ---------------------
# Tile configs (BLOCK_M, BLOCK_N, warps, stages) per kernel and shape class, from per-shape sweeps (results/
# 04_rope_attention_sweep.log; the backward's, _ab.log): at d = 64 short sequences want small query blocks in the
# forward (more programs to fill the GPU), longer ones 128 x 128; at d = 128 causality favours the smaller tiles; at
# d = 64 the dq kernel wants 4 warps with a padding mask, 8 without. The interpreter runs 32 x 32 tiles.
CONFIGS = {
    ("fwd", "d<=64, s<=1024"): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
    ("fwd", "d<=64, s>1024"): dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3),
    ("fwd", "d>64, causal"): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    ("fwd", "d>64"): dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
    ("dkdv", "d<=64"): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    ("dkdv", "d>64"): dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=3),
    ("dq", "d<=64"): dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    ("dq", "d<=64, mask"): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    ("dq", "d>64"): dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
}
PASS_CONFIG = dict(ROWS=64, num_warps=4)  # rows (positions x heads) per program of the rotation pass
INT32_LIMIT = 2**31  # offsets within a head that could reach this are int64 (WIDE); a test lowers it
_checked, _launches = {}, {}
_strides = lambda *ts, order=(0, 1, 2, 3): [x.stride(i) for x in ts for i in order]  # noqa: E731  (b, s, h, d) order
# An eager call on small tensors is bound by the host: ``kernel[grid](...)`` binds and specializes some forty
# arguments per call, and checks and launch parameters would be rebuilt, yet all depend only on the signature (shapes,
# strides, dtypes, devices, options, and the 16-byte alignment Triton specializes pointers on). So checks run once per
# signature, later launches go straight to the compiled kernel, and eager calls skip the dispatcher (host cost table).
_signature = lambda *args: tuple([(x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16)  # noqa: E731
                                  if isinstance(x, torch.Tensor) else (type(x), x) for x in args])


def _once(cache, key, compute):
    """compute(), once per key; not kept if it raised (or the key is unhashable: a bad argument, named by the check)."""
    try:
        return cache[key]
    except (KeyError, TypeError):
        if len(cache) >= 4096:  # a workload of ever new shapes starts over
            cache.clear()
    cache[key] = value = compute()
    return value


def _launch_cached(kernel, key, tensors, plan):
    """kernel[grid](*tensors, *scalars, **constexprs) with (grid, scalars, constexprs) = plan(): the first call with a
    key goes through Triton, later ones straight to the compiled kernel (key False, or the interpreter: always Triton)."""
    launch = key and _launches.get((kernel, key))
    if launch:
        return launch[0](*tensors, *launch[1])
    grid, scalars, constexprs = plan()
    compiled = kernel[grid](*tensors, *scalars, **constexprs)
    if key and isinstance(compiled, triton.compiler.CompiledKernel):  # it takes all arguments in order, constexprs too
        _once(_launches, (kernel, key), lambda: (compiled[(*grid, 1, 1)[:3]], (*scalars, *[
            constexprs[name] for name in kernel.arg_names if name in constexprs])))


def _config(kernel, head_dim, seqlen=0, causal=False, masked=False):
    shape = "d<=64" if head_dim <= 64 else "d>64"
    shape += {"fwd": (", s<=1024" if seqlen <= 1024 else ", s>1024") if head_dim <= 64 else ", causal" * causal,
              "dq": ", mask" if head_dim <= 64 and masked else ""}.get(kernel, "")
    interpreter = {} if DEVICE.type == "cuda" else dict(BLOCK_M=32, BLOCK_N=32, num_warps=4)
    return dict(CONFIGS[(kernel, shape)], **interpreter)


def _dims(q, k, rot_dim):
    """Sizes; the rotated layout's HALF (pairs, padded), PASS (pass-through tile), W (row width); the pass's HEADS (k
    heads) and BLOCK_S (positions) per program; the sizes the attention kernels take."""
    pow2 = lambda n, at_least: max(at_least, 1 << (int(n) - 1).bit_length())  # noqa: E731
    (b, s, h, d), h_kv, half, n_pass = q.shape, k.shape[2], rot_dim // 2, q.shape[3] - rot_dim
    HALF, HEADS = pow2(half, 8), min(pow2(h_kv, 1), PASS_CONFIG["ROWS"])  # 2 * HALF >= 16: a dot's smallest K
    return types.SimpleNamespace(batch=b, seqlen=s, n_heads=h, n_kv_heads=h_kv, head_dim=d, half=half, n_pass=n_pass,
                                 HALF=HALF, PASS=pow2(n_pass, 16), W=2 * HALF + n_pass, D=pow2(d, 16), HEADS=HEADS,
                                 BLOCK_S=PASS_CONFIG["ROWS"] // HEADS, sizes=(s, h, h // h_kv, half, n_pass))


def _plan(kernel, d, sm_scale, causal, interleaved, key_mask, strided, wide, **extra):
    """(grid, scalars, constexprs) of an attention kernel: a program per block of queries of a head, or (dkdv) of keys
    of a k head. WIDE: could a position's offset within one head (of a tensor in wide, or rq, rk) reach INT32_LIMIT?"""
    cfg, dkdv = _config(kernel, d.head_dim, d.seqlen, causal, key_mask is not None), kernel == "dkdv"
    ends = [(d.seqlen - 1) * abs(x.stride(1)) + (d.head_dim - 1) * abs(x.stride(3)) for x in wide]
    blocks, heads = (cfg["BLOCK_N"], d.n_kv_heads) if dkdv else (cfg["BLOCK_M"], d.n_heads)
    return (triton.cdiv(d.seqlen, blocks), d.batch * heads), (sm_scale * LOG2E, *d.sizes, *_strides(*strided)), dict(
        EVEN_N=d.seqlen % cfg["BLOCK_N"] == 0, **(dict(EVEN_M=d.seqlen % cfg["BLOCK_M"] == 0) if dkdv else {}), **extra,
        **cfg, HALF=d.HALF, PASS=d.PASS, D=d.D, W=d.W, INTERLEAVED=interleaved, HAS_PASS=d.n_pass > 0, CAUSAL=causal,
        HAS_MASK=key_mask is not None, EVEN_D=d.D == d.head_dim, WIDE=max(ends + [d.seqlen * d.W]) >= INT32_LIMIT)


def _forward_fake(qkv, freqs, key_mask, sm_scale, causal, interleaved, save_rotated):
    """The forward op's outputs, empty: (o, lse, rq, rk, trig); rq is empty when no backward will run; trig is the
    float32 table [s, 4 * HALF] of cos_a, sin_a, cos_b, sin_b per position."""
    q, k, _ = qkv if len(qkv) == 3 else qkv[0].unbind(2)
    (b, s, h, _), h_kv, d = q.shape, k.shape[2], _dims(q, k, freqs.shape[3])
    rq = q.new_empty(b, h, s, d.W) if save_rotated else q.new_empty(0)
    return (torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(b, h, s, dtype=torch.float32), rq,
            q.new_empty(b, h_kv, s, d.W), q.new_empty(s, 4 * d.HALF, dtype=torch.float32))


def _forward(qkv: List[Tensor], freqs: Tensor, key_mask: Optional[Tensor], sm_scale: float, causal: bool,
             interleaved: bool, save_rotated: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The forward op: qkv is [q, k, v], or [qkv] packed as [b, s, 3, h, d]."""
    q, k, v = qkv if len(qkv) == 3 else qkv[0].unbind(2)
    o, lse, rq, rk, trig = _forward_fake(qkv, freqs, key_mask, sm_scale, causal, interleaved, save_rotated)
    key = _signature(q, k, v, freqs, key_mask, sm_scale, causal, interleaved, save_rotated)

    def plan_pass():  # the pass: k -> rk, and the cos/sin table
        d = _dims(q, k, freqs.shape[3])
        return (triton.cdiv(d.seqlen, d.BLOCK_S), d.batch, triton.cdiv(d.n_kv_heads, d.HEADS)), (
            d.seqlen, d.n_kv_heads, d.half, d.n_pass, *_strides(k), *_strides(rk, order=(0, 2, 1, 3)), freqs.stride(0),
            freqs.stride(-1)), dict(BLOCK_S=d.BLOCK_S, HEADS=d.HEADS, HALF=d.HALF, PASS=d.PASS, INTERLEAVED=interleaved,
                                    HAS_PASS=d.n_pass > 0, num_warps=PASS_CONFIG["num_warps"])
    _launch_cached(rope_pass_kernel, key, (k, rk, freqs, trig), plan_pass)
    _launch_cached(rope_attn_fwd_kernel, key, (q, rk, v, o, lse, rq, trig, key_mask if key_mask is not None else lse),
                   lambda: _plan("fwd", _dims(q, k, freqs.shape[3]), sm_scale, causal, interleaved, key_mask,
                                 (q, v, o), (q, v, o), SAVE_RQ=save_rotated))
    return o, lse, rq, rk, trig


def _backward_fake(do, rq, rk, qkv_or_v, o, lse, trig, key_mask, rot_dim, sm_scale, causal, interleaved, packed):
    """The backward op's outputs, empty: [dqkv] for packed qkv, else [dq, dk, dv] (dq's shape from rq [b, h, s, W])."""
    v, (b, h, s) = qkv_or_v, rq.shape[:3]
    return [v.new_empty(v.shape)] if packed else [
        v.new_empty(b, s, h, v.shape[3]), *(torch.empty_like(v, memory_format=torch.contiguous_format) for _ in "kv")]


def _backward(do: Tensor, rq: Tensor, rk: Tensor, qkv_or_v: Tensor, o: Tensor, lse: Tensor, trig: Tensor,
              key_mask: Optional[Tensor], rot_dim: int, sm_scale: float, causal: bool, interleaved: bool,
              packed: bool) -> List[Tensor]:
    """The backward op: v, or packed qkv whole; dq, dk, dv written with any strides (packed: one gradient's thirds)."""
    grads = _backward_fake(do, rq, rk, qkv_or_v, o, lse, trig, key_mask, rot_dim, sm_scale, causal, interleaved, packed)
    v, (dq, dk, dv) = (qkv_or_v.unbind(2)[2], grads[0].unbind(2)) if packed else (qkv_or_v, grads)
    delta = torch.empty_like(lse)  # written by the dq kernel, read by the dkdv kernel
    key = _signature(do, rq, rk, qkv_or_v, o, lse, trig, key_mask, rot_dim, sm_scale, causal, interleaved, packed)
    shared = (lse, delta, trig, key_mask if key_mask is not None else lse)  # (lse stands in for an absent mask)
    plan = lambda kernel, *outs: _plan(kernel, _dims(dq, dk, rot_dim), sm_scale, causal, interleaved,  # noqa: E731
                                       key_mask, (v, do, *outs), (v, do, dq, dk, dv))
    _launch_cached(rope_attn_bwd_dq_kernel, key, (rq, rk, v, do, o, dq, *shared), lambda: plan("dq", o, dq))
    _launch_cached(rope_attn_bwd_dkdv_kernel, key, (rq, rk, v, do, dk, dv, *shared), lambda: plan("dkdv", dk, dv))
    return grads


# %%
# The operators, argument checks and the public functions
# -------------------------------------------------------
# torch.compile cannot trace into a Triton launch it does not know. Registered as a torch.library.custom_op, the launch
# is one opaque node of the graph: register_fake gives the compiler the outputs' shapes without running anything,
# register_autograd the backward (another custom op); Inductor compiles the code around them and calls our kernels as
# they are. Outside the ops all is traced: checks read shapes, dtypes, devices, never values (a sync breaks the graph).


def _custom_op(name, fn, fake):  # rope_attention_tutorial::name, a fresh name if this file was loaded before
    n = next(n for n in itertools.count() if not hasattr(torch.ops.rope_attention_tutorial, f"{name}{n or ''}"))
    op = torch.library.custom_op(f"rope_attention_tutorial::{name}{n or ''}", fn, mutates_args=())
    op.register_fake(fake)
    return op


forward_op = _custom_op("forward", _forward, _forward_fake)
backward_op = _custom_op("backward", _backward, _backward_fake)


def _save_for_backward(ctx, inputs, output):  # the forward op's setup_context, and the eager Function's
    qkv, freqs, key_mask, sm_scale, causal, interleaved, _ = inputs
    o, lse, rq, rk, trig = output
    ctx.mark_non_differentiable(lse, rq, rk, trig)  # only o carries a gradient, and autograd would
    ctx.set_materialize_grads(False)  # otherwise fill zero gradients as large as rq and rk for the others
    ctx.save_for_backward(rq, rk, qkv[2] if len(qkv) == 3 else qkv[0], o, lse, trig, key_mask)  # v, or all of qkv
    ctx.args = freqs.shape[3], sm_scale, causal, interleaved, len(qkv) == 1
    return output


forward_op.register_autograd(lambda ctx, do, *_: (backward_op(do, *ctx.saved_tensors, *ctx.args),) + (None,) * 6,
                             setup_context=_save_for_backward)  # o's gradient (the others carry none) to qkv alone


class _RoPEAttention(torch.autograd.Function):  # eager: the ops' functions, no dispatcher (it costs more than a launch)
    @staticmethod
    def forward(ctx, *args):  # q, k, v (or packed qkv), freqs, key_mask, sm_scale, causal, interleaved
        return _save_for_backward(ctx, inputs := (list(args[:-5]), *args[-5:], True), _forward(*inputs))
    backward = staticmethod(torch.autograd.function.once_differentiable(
        lambda ctx, do, *_: (*_backward(do, *ctx.saved_tensors, *ctx.args), *[None] * 5)))


def _check(q, k, v, freqs, attention_mask, sm_scale):
    for name, x in dict(q=q, k=k, v=v, freqs=freqs, attention_mask=attention_mask).items():
        if not isinstance(x, torch.Tensor) and not (name == "attention_mask" and x is None):
            raise TypeError(f"{name} must be a torch.Tensor{' or None' if name == 'attention_mask' else ''}, "
                            f"got {type(x).__name__}")
        if x is not None and x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
        if name == "q" and q.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"q must be float16 or bfloat16, got {q.dtype}")
        if name in "qkv" and x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
        if name in "qkv" and x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [b, s, h, d], got shape {tuple(x.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k must match q but in heads (self-attention): got {tuple(k.shape)}, q {tuple(q.shape)}")
    if not k.shape[2] or q.shape[2] % k.shape[2]:
        raise ValueError(f"q's {q.shape[2]} heads must be a multiple of k's {k.shape[2]} >= 1 (grouped-query attention)")
    (batch, seqlen), head_dim = q.shape[:2], q.shape[3]
    if not 16 <= head_dim <= 128:
        raise ValueError(f"head dim must be between 16 and 128, got {head_dim}")
    if freqs.dtype != torch.float32 or freqs.dim() != 4 or freqs.shape[1:3] != (1, 1):
        raise ValueError(f"freqs must be float32 angles of shape [s2, 1, 1, d2], got {tuple(freqs.shape)} {freqs.dtype}")
    if freqs.shape[3] % 2 or not 2 <= freqs.shape[3] <= head_dim:
        raise ValueError(f"freqs' last dim d2 = {freqs.shape[3]} must be even and between 2 and the head dim {head_dim}")
    if freqs.shape[0] < seqlen:
        raise ValueError(f"sequence length {seqlen} is over the {freqs.shape[0]} rows (s2) of freqs")
    if attention_mask is not None and (attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex):
        raise TypeError(f"attention_mask must be bool or integer (1 = token, 0 = padding), got {attention_mask.dtype}")
    if attention_mask is not None and attention_mask.shape != (batch, seqlen):
        raise ValueError(f"attention_mask must have shape [b, s] = [{batch}, {seqlen}], got {tuple(attention_mask.shape)}")
    if sm_scale is not None and (isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float))):
        raise TypeError(f"sm_scale must be a number or None, got {type(sm_scale).__name__}")
    if sm_scale is not None and not 0 < sm_scale < math.inf:
        raise ValueError(f"sm_scale must be a positive finite number, got {sm_scale}")


def _attention(qkv, q, k, v, freqs, causal, attention_mask, sm_scale, interleaved):
    tracing = torch.compiler.is_compiling()
    check = lambda: _check(q, k, v, freqs, attention_mask, sm_scale)  # noqa: E731
    check() if tracing else _once(_checked, _signature(q, k, v, freqs, attention_mask, sm_scale), check)
    if freqs.requires_grad and torch.is_grad_enabled():
        raise ValueError("freqs requires grad, but no gradient flows to the angle table; pass freqs.detach()")
    key_mask = attention_mask.contiguous() if attention_mask is not None else None  # read as is: no conversion op
    sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    save_rotated = torch.is_grad_enabled() and any(x.requires_grad for x in qkv)  # else rq is not written
    args = (freqs, key_mask, sm_scale, causal, interleaved)
    if tracing:  # the op, which torch.compile traces through its fake and autograd registrations
        return forward_op(qkv, *args, save_rotated)[0]
    return (_RoPEAttention.apply(*qkv, *args) if save_rotated else _forward(qkv, *args, False))[0]


def rope_attention(q, k, v, freqs, *, causal=False, attention_mask=None, sm_scale=None, interleaved=False):
    """Attention with RoPE applied to q and k by the kernels; differentiable in q, k and v, and traceable whole by
    torch.compile(fullgraph=True).

    q: [b, s, h, d], float16 or bfloat16, any strides, 16 <= d <= 128.
    k, v: [b, s, h_kv, d], q's dtype, h % h_kv == 0 (grouped-query attention).
    freqs: float32 angles [s2, 1, 1, d2], s2 >= s, d2 even and <= d (02's semantics: only the first d2 channels
        are rotated; any angles). No gradient flows to freqs.
    causal: each query sees keys at its position and before.
    attention_mask: bool or integer [b, s], 1 (nonzero) = a real token, 0 = padding (Hugging Face's convention);
        padded keys are never attended to. A query that sees no key returns zeros.
    sm_scale: softmax scale, positive, 1/sqrt(d) by default. interleaved: rotate pairs (RoFormer, GPT-J).
    Returns the output [b, s, h, d] in q's dtype. The gradients are deterministic: every sum runs in a fixed
    order, so a call gives the same bits every time."""
    return _attention([q, k, v], q, k, v, freqs, causal, attention_mask, sm_scale, interleaved)


def rope_attention_qkvpacked(qkv, freqs, *, causal=False, attention_mask=None, sm_scale=None, interleaved=False):
    """rope_attention with q, k and v packed as one QKV projection makes them (FlashAttention's qkvpacked): qkv is
    [b, s, 3, h, d], and q, k, v = qkv.unbind(2). The same output and gradients as rope_attention(*qkv.unbind(2),
    freqs, ...), but qkv's gradient is written as one tensor, not stacked from three (a copy saved)."""
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must be [b, s, 3, h, d], got shape {tuple(qkv.shape)}")
    if qkv.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"qkv must be float16 or bfloat16, got {qkv.dtype}")
    return _attention([qkv], *qkv.unbind(2), freqs, causal, attention_mask, sm_scale, interleaved)


# %%
# Unit test
# ---------
# One irregular case of each feature, eager and compiled; tests/test_04_rope_attention.py covers the whole matrix.


def self_check():
    torch.manual_seed(0)
    b, s, h, h_kv, d = (3, 257, 4, 2, 80) if DEVICE.type == "cuda" else (2, 37, 2, 1, 32)
    freqs = torch.randn(s, 1, 1, d - 16, device=DEVICE)  # partial rotary, halves differ
    mask = torch.ones(b, s, dtype=torch.bool, device=DEVICE)
    mask[0, s // 2:], mask[-1] = False, False  # padding after s/2; a sequence with no real token (its rows return 0)
    compiled = torch.compile(rope_attention, fullgraph=True, backend="inductor" if DEVICE.type == "cuda" else "aot_eager")
    for causal, interleaved, fn in itertools.product((False, True), (False, True), (rope_attention, compiled)):
        q, k, v = (torch.randn(b, s, n, d, device=DEVICE, dtype=DTYPE, requires_grad=True) for n in (h, h_kv, h_kv))
        kwargs = dict(causal=causal, attention_mask=mask, interleaved=interleaved)
        out, ref = fn(q, k, v, freqs, **kwargs), attention_reference(q, k, v, freqs, **kwargs)
        do = torch.randn_like(out)  # the output, then dq, dk, dv
        for x, r in zip((out, *torch.autograd.grad(out, (q, k, v), do)),
                        (ref, *torch.autograd.grad(ref, (q, k, v), do.float()))):
            torch.testing.assert_close(x.float(), r.float(), atol=2e-2, rtol=2e-2)
    print(f"self-check passed: output and dq/dk/dv, eager and torch.compile(fullgraph=True), causal and not, both "
          f"pairings, a fully padded sequence, GQA {h}/{h_kv}, s={s}, d={d}, d2={d - 16}, {DTYPE} ({DEVICE.type})")


# %%
# Benchmark
# ---------
BENCH_SHAPES = [(32, 12, 512, 64, False, False), (16, 12, 512, 64, False, True), (8, 16, 2048, 64, False, False),
                (4, 32, 4096, 128, False, False), (4, 32, 4096, 128, True, False), (2, 16, 8192, 64, True, False)]


def _providers(freqs, causal, mask, rope03, b, s):
    """[(name, timing, fn(q, k, v) -> [b, s, h, d])]: ours; with rope03, 03's RoPE then attention on [b, h, s, d]."""
    ours = lambda q, k, v: rope_attention(q, k, v, freqs, causal=causal, attention_mask=mask)  # noqa: E731
    fns = [("fused (ours)", "graph", ours), ("fused (ours)", "eager call", ours),
           ("fused (ours), compiled", "graph", torch.compile(ours, fullgraph=True, dynamic=False))]
    if rope03 is None:
        return fns
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def mask_mod(b_, h_, q_idx, kv_idx):
        ok = (q_idx >= kv_idx) if causal else (q_idx >= 0)
        return ok & mask[b_, kv_idx] if mask is not None else ok
    block_mask = create_block_mask(mask_mod, b if mask is not None else None, None, s, s, device=DEVICE)
    flex = torch.compile(flex_attention, dynamic=False)
    sdpa = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q, k, v, is_causal=causal and mask is None, attn_mask=mask[:, None, None, :] if mask is not None else None)
    cudnn, flash = (sdpa_kernel(be)(sdpa) for be in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION))
    attend = {"SDPA cuDNN": cudnn, "SDPA flash": flash, "FlexAttention": lambda *qkv: flex(*qkv, block_mask=block_mask)}
    unfused = lambda fn: lambda q, k, v: fn(*(x.transpose(1, 2) for x in (  # noqa: E731
        *rope03.apply_rotary_pos_emb_qk(q, k, freqs, tensor_format="bshd"), v))).transpose(1, 2)
    return fns + [(f"03 RoPE + {name}", how, unfused(fn)) for name, fn in attend.items()
                  for how in ("graph", "eager call")[:1 + (name == "SDPA cuDNN")]]


def benchmark(rope03, yardstick):
    """bf16; ours, and the unfused paths: 03's RoPE (apply_rotary_pos_emb_qk) on q and k, then SDPA (cuDNN, flash) or
    FlexAttention compiled per shape. Timing 'graph': GPU time, calls replayed from a CUDA graph (do_bench_cudagraph);
    'eager call': calls as a user makes them, host cost included (do_bench); medians. TF/s count 4*b*h*s^2*d FLOPs,
    halved when causal, x3.5 for forward + backward, against a bf16 8192^3 matmul timed as 'graph' in the same run."""
    rows, cuda = ["| (b, h, s, d) | causal | padding mask | provider | timing | fwd TF/s | fwd+bwd TF/s | of the "
                  "matmul, fwd / fwd+bwd |", "|---" * 8 + "|"], DEVICE.type == "cuda"
    print(*rows, sep="\n")
    for b, h, s, d, causal, padded in BENCH_SHAPES if cuda else [(1, 2, 64, 32, True, True)]:
        q, k, v = (torch.randn(b, s, h, d, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in "qkv")
        freqs, mask, dout = rope_freqs(s, d, device=DEVICE), None, torch.randn_like(q)
        if padded:  # Hugging Face style: each sequence is padded after a random length
            mask = torch.arange(s, device=DEVICE)[None, :] < torch.randint(s // 2, s + 1, (b, 1), device=DEVICE)
        torch._dynamo.reset()  # what is compiled is compiled for this shape alone (dynamic=False)
        for name, how, fn in _providers(freqs, causal, mask, rope03, b, s):
            fwd, both = lambda: fn(q, k, v), lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
            bench = triton.testing.do_bench if how == "eager call" else triton.testing.do_bench_cudagraph
            try:
                both()  # compiles, where it does; on the CPU, the timing is one call's wall time
                ms = [bench(c, return_mode="median") if cuda else timeit.timeit(c, number=1) * 1e3 for c in (fwd, both)]
                tfs = [n * 4 * b * h * s * s * d * (0.5 if causal else 1) / m / 1e9 for n, m in zip((1, 3.5), ms)]
                cells = " | ".join([f"{t:.0f} ({m * 1e3:.0f} us)" for t, m in zip(tfs, ms)] + [
                    " / ".join(f"{t / yardstick:.0%}" for t in tfs) if yardstick else "n/a"])
            except Exception as e:  # noqa: BLE001  (a backend that does not take this case: flash with a mask)
                cells = f"n/a ({type(e).__name__}) | |"
            rows.append(f"| {(b, h, s, d)} | {causal} | {padded} | {name} | {how if cuda else 'wall'} | {cells} |")
            print(rows[-1], flush=True)
    return rows


def host_cost(rope03):
    """Eager calls on tensors so small that the GPU waits for the host: wall time per call of 200 calls in a row and
    one sync, the median of 7 interleaved rounds. 03's RoPE is apply_rotary_pos_emb_qk; SDPA its default backend."""
    class Identity(torch.autograd.Function):  # autograd's own cost: a Function that launches nothing
        forward = staticmethod(lambda ctx, *xs: tuple(x.new_empty(x.shape) for x in xs))
        backward = staticmethod(lambda ctx, *grads: grads)
    x, freqs = torch.randn(1, 128, 2, 64, device=DEVICE, dtype=DTYPE), rope_freqs(128, 64, device=DEVICE)
    q, k, v = (x.clone().requires_grad_() for _ in "qkv")
    sdpa = lambda q, k: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    fns = {"empty op (x + 1)": lambda: x + 1, "autograd alone: identity Function on q, k, v": lambda: Identity.apply(
        q, k, v)[0], "SDPA": lambda: sdpa(q, k), "03 RoPE + SDPA": rope03 and (lambda: sdpa(
            *rope03.apply_rotary_pos_emb_qk(q, k, freqs, "bshd"))), "ours": lambda: rope_attention(q, k, v, freqs)}
    fns = {name: fn for name, fn in fns.items() if fn}  # 03's row only where 03 sits beside this file
    fns = {**{f"{n}, forward": f for n, f in fns.items()}, "ours, forward, no grad": lambda: rope_attention(
        x, x, x, freqs), **{f"{n}, forward + backward": lambda f=f: f().backward(x) for n, f in list(fns.items())[1:]}}
    times, clock = {name: [] for name in fns}, lambda: torch.cuda.synchronize() or time.perf_counter()
    for _, (name, fn) in itertools.product(range(7), fns.items()):  # rounds: a busy moment of the host touches all
        fn()  # warm; timeit reads the clock (a sync) before and after; garbage collection stays on, as for a user
        times[name].append(timeit.Timer(fn, "gc.enable()", clock).timeit(200) / 200 * 1e6)
    us = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    return ["| eager call, (1, 128, 2, 64) bf16 | host us per call | empty ops |", "|---|---|---|"] + [
        f"| {name} | {t:.1f} | {t / us['empty op (x + 1), forward']:.1f} |" for name, t in us.items()]


def write_page(rows, host, yardstick, results_dir):
    """results_dir/04_rope_attention_<GPU>.md: environment, command, what is timed, the tables, the raw log's name."""
    (here, script), gpu = os.path.split(os.path.abspath(__file__)), torch.cuda.get_device_name()
    kind = next((w for w in gpu.split() if w[:1] in "ABHL" and w[1:2].isdigit()), "gpu")
    commit = os.popen(f'git -C "{here}" rev-parse --short HEAD 2>{os.devnull}').read().strip() or "n/a"
    timed = [" ".join(fn.__doc__.split()) for fn in (benchmark, host_cost)]  # what is timed: their docstrings
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, f"04_rope_attention_{kind}.md"), "w") as f:
        f.write(f"# RoPE + attention on the {kind}: fused against RoPE then attention\n\ndevice: {gpu}; date: "
                f"{time.strftime('%Y-%m-%d')}; torch {torch.__version__}; triton {triton.__version__}; python "
                f"{sys.version.split()[0]}; commit {commit}; {script} md5 "
                f"{hashlib.md5(open(__file__, 'rb').read()).hexdigest()[:8]}\n\nCommand: `python {' '.join(sys.argv)}`"
                f"\n\n{timed[0]} The matmul ran at {yardstick:.0f} TF/s.\n\n" + "\n".join(rows)
                + f"\n\n## Host cost of an eager call\n\n{timed[1]}\n\n" + "\n".join(host)
                + f"\n\nRaw log: `04_rope_attention_{kind}.log`\n")


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--results", default=os.path.join(here, "results"), help="folder for the page (GPU only)")
    args, _, peer = parser.parse_args(), self_check(), os.path.join(here, "03_rope_bwd.py")
    if DEVICE.type != "cuda":
        print("\nNO GPU: the kernels run in Triton's interpreter on the CPU. The timings below only show that the "
              "benchmark runs; they say nothing about speed.")
        benchmark(None, None)
    else:
        a, rope03 = torch.randn(8192, 8192, device=DEVICE, dtype=DTYPE), None  # rope03: the unfused paths' first step
        yardstick = 2 * 8192**3 / triton.testing.do_bench_cudagraph(lambda: a @ a, return_mode="median") / 1e9
        print(f"yardstick: a bf16 8192^3 matmul runs at {yardstick:.0f} TF/s on this GPU (GPU time)")
        if os.path.exists(peer):
            spec = importlib.util.spec_from_file_location("rope_bwd", peer)
            spec.loader.exec_module(rope03 := importlib.util.module_from_spec(spec))
        else:
            print(f"{peer} is missing: ours alone, no unfused paths to compare with")
        rows, host = benchmark(rope03, yardstick), host_cost(rope03)
        print(*host, sep="\n")
        write_page(rows, host, yardstick, args.results)
