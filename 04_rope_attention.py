"""
RoPE fused into attention, forward and backward
===============================================

In this tutorial, you will learn about:

* the unfused pipeline (rotate q and k, write them, read them back for attention) against a
  FlashAttention-style kernel that rotates q and k in registers, and what each costs in FLOPs
  and bytes; and where fusing pays: a separate RoPE pass costs O(s), rotating each K tile in the
  loop O(s^2 / BLOCK_M), measured;
* rotating in packed bf16x2 arithmetic with inline PTX, and finding such costs in the instruction
  counts of an offline compile;
* online softmax with key-padding and causal masks, and rows that see no key at all (zeros, not
  NaN);
* the backward: recompute the rotated tiles, accumulate dq and dk in the rotated basis, and
  rotate back once per tile before storing, which is exact because RoPE is linear and per-row;
  dq by float32 atomics (5 matmuls per tile pair) or, deterministic, by a second kernel (7);
* grouped-query attention (k and v with fewer heads than q), odd sequence lengths, head dims
  that are not powers of two, partial rotary and both pairings; q, k and v packed in one tensor,
  whose gradient the kernels then write as one (no copy to stack three);
* benchmarking against 03's RoPE followed by each SDPA backend and FlexAttention.

Run ``python 04_rope_attention.py``: it checks itself against a float32 PyTorch reference, then
benchmarks. This file imports only torch and triton: copy it alone into your project.
"""

# %%
# Setup
# -----
# With no GPU, run the kernels through Triton's interpreter; the variable must be set before
# triton is imported.
import argparse
import datetime
import math
import os
import platform
import statistics
import time
import weakref

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # used inside kernels: a global there must be a tl.constexpr
# Rotations run as packed two-lane bf16/fp16 instructions, written in PTX (NVIDIA GPUs only); the
# interpreter has no inline assembly and runs the same steps in float32, rounded the same way.
PACKED_PTX = tl.constexpr(torch.version.cuda is not None and os.environ.get("TRITON_INTERPRET") != "1")
# $0, $1 = ($2 cos_a - $3 sin_a, $3 cos_b + $2 sin_b) for ($2, $3, $4, $5, $6, $7) = (x_a, x_b, cos_a,
# sin_a, cos_b, sin_b), each register two lanes; fma with -0 as the addend is a rounded product
_ROTATE_PTX = """{{
    .reg .b32 neg_zero, neg_sin_a, prod_a, prod_b;
    mov.b32 neg_zero, 0x80008000;
    neg.{t} neg_sin_a, $5;
    fma.rn.{t} prod_a, $3, neg_sin_a, neg_zero;
    fma.rn.{t} $0, $2, $4, prod_a;
    fma.rn.{t} prod_b, $2, $7, neg_zero;
    fma.rn.{t} $1, $3, $6, prod_b;
}}"""
ROTATE_BF16X2, ROTATE_F16X2 = tl.constexpr(_ROTATE_PTX.format(t="bf16x2")), tl.constexpr(_ROTATE_PTX.format(t="f16x2"))

# %%
# The PyTorch reference
# ---------------------
# RoPE with 02's semantics (freqs are float32 angles [s2, 1, 1, d2]; the first d2 channels are
# rotated, rotate-half or interleaved pairs, with any angles), then softmax attention written
# out, in float32. A key-padding mask follows Hugging Face: attention_mask[b, j] = 1 for a real
# token, 0 for padding; a query row that sees no key returns zeros.


def rope_freqs(max_seq_len, rotary_dim, base=10000.0, interleaved=False, device=None):
    """Angle table [max_seq_len, 1, 1, rotary_dim], float32, laid out as TE's RotaryPositionEmbedding."""
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    return angles.view(max_seq_len, 1, 1, rotary_dim)


def rope_reference(t, freqs, interleaved=False):
    """RoPE on t [b, s, h, d] in float32."""
    d2, s = freqs.shape[-1], t.shape[1]
    angles = freqs[:s, 0, 0][None, :, None, :]
    x, x_pass = t[..., :d2].float(), t[..., d2:].float()
    if interleaved:
        x_rot = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        x_rot = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x * angles.cos() + x_rot * angles.sin(), x_pass), dim=-1)


def attention_reference(q, k, v, freqs, causal=False, attention_mask=None, sm_scale=None, interleaved=False,
                        tensor_format="bshd"):
    """float32 RoPE then softmax attention; the output in float32, in q's layout."""
    if tensor_format == "sbhd":
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    q, k = rope_reference(q, freqs, interleaved), rope_reference(k, freqs, interleaved)
    k, v = k.repeat_interleave(group, dim=2), v.float().repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * (sm_scale or q.shape[-1] ** -0.5)
    s = q.shape[1]
    visible = torch.ones(s, s, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible.tril()
    visible = visible[None, None]
    if attention_mask is not None:
        visible = visible & attention_mask.bool()[:, None, None, :]
    p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)  # empty rows: 0
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out.transpose(0, 1) if tensor_format == "sbhd" else out


# %%
# Unfused against fused: FLOPs and bytes
# --------------------------------------
# Attention over b sequences of s tokens, h heads of dim d: QK^T and PV are 2 * 2*b*h*s^2*d = 4bhs^2d
# FLOPs (half when causal); the backward is about 2.5 times that (dV, dP, dQ, dK, plus the
# recomputed QK^T), hence the 3.5x for forward + backward. The bytes are the inputs and outputs,
# O(b*s*h*d): attention is bound by arithmetic, not memory, as soon as s is a few hundred.
#
# The unfused pipeline runs 03's kernel first: it reads q and k and writes the rotated copies
# (4 * b*s*h*d elements with k as big as q), which attention reads again; its backward reads and
# writes dq and dk once more. At (4, 32, 4096, 128) in bf16 that is ~140 us of RoPE per direction
# against a few milliseconds of attention: fusion can save a few percent, no more. What it does
# buy is memory: the rotated q and k (and their gradients) are never allocated.
#
# The fused kernel rotates each tile as it is loaded. A q tile is rotated once per program; each
# K tile is rotated on every visit (s / BLOCK_M times over the whole grid), so the rotation sits in
# the inner loop next to the online softmax, and its instructions count: a pair of channels needs
# r_a = x_a cos - x_b sin and r_b = x_b cos + x_a sin. cos and sin are precomputed once per angle
# table (two tables when it is a true rotation, four when its halves differ), since computing them
# in the inner loop would keep the special-function units busier than the tensor cores.
#
# What that costs, measured on an H200 (results/04_rope_attention_ab.log, session 8): at
# (8, 16, 2048, 64) this forward (rotating as the next section says) runs 374 TF/s with K left
# unrotated (wrong scores, timing only), a little faster than FlexAttention without RoPE (366);
# 327 with K rotated by constant cos and sin (no table loads); 313 as written. At
# (4, 32, 4096, 128): 457, 411 and 372, against 413. So rotating every K tile on every visit
# costs 16-19% of the forward, a quarter of it the cos/sin loads at d = 64 and half at d = 128,
# while a separate RoPE pass costs FlexAttention 8% and 5%.
# The pass is O(s) work and the rotation in the loop O(s^2 / BLOCK_M): fusing wins at short
# sequences (13% ahead of FlexAttention + RoPE at s = 512) and loses at long ones (5-7% behind
# in the forward from s = 2048 on).
#
# Rotating in packed bf16
# -----------------------
# In float32 a pair costs about 9 instructions: convert x_a, x_b, cos and sin in, four multiplies
# and adds, convert back. Nsight Compute on an H200 counted ~18% more instructions in our d = 128
# forward than in FlexAttention's, at the same issue rate. So the rotation runs in the tile's own
# dtype, two lanes to a register (bf16x2 or f16x2), written in PTX (tl.inline_asm_elementwise with
# pack=2): one product rounded to that dtype, then a fused multiply-add, 2.5 instructions a pair.
# The price is roundings: a rotated value is within about 2 units in the last place of the exact
# rotation instead of about 0.5 (tables in bf16, the product rounded), still better than Hugging
# Face's and Liger's bf16 RoPE (each product and the sum rounded) and inside the tests' yardstick.
# The tables are in q's dtype. The softmax scale multiplies the float32 scores (in the FFMA that
# subtracts the running max) rather than riding on q, which would add another rounding; the
# gradients are rotated back in float32 arithmetic. The interpreter has no inline assembly and runs the same steps in
# float32, rounding where the GPU rounds. The inner loop of the d = 128 forward went from 1042 to
# 761 instructions (SASS of an offline compile for sm_90; results/04_rope_attention.md says how);
# on an H200 the forward gained 4-8% and forward + backward 2-4%.
#
# Two smaller cuts in the same loops: when the length is a whole number of blocks and the
# channels fill the tile (WHOLE), the inner loops load without masks, whose comparisons were a
# tenth of that loop (forward + backward +2-5%); and the forward computes QK^T as one dot (below).
#
# Halves, pairs and dots
# ----------------------
# The rotated tiles come out split into their a and b halves (rotate-half: channels i and
# i + d2/2; interleaved: 2i and 2i + 1) and the pass-through channels. QK^T is a sum over
# channels, so any channel order that q and k share gives the same scores: it can be a dot per
# half, q_a.k_a + q_b.k_b (+ q_pass.k_pass). But Triton waits for the first dot to finish before
# it issues the second, a pause of the tensor cores on every tile; joining the halves side by side
# in registers (a0 .. a63 b0 .. b63, for q once and for each K tile) makes it one dot: the forward
# gained 1-5% on an H200, except at d <= 64 under a causal mask, where it lost 2-4%, so there it
# keeps a dot per half. The backward's dK = dS^T Rq and dQ = dS Rk put the channels on the dots'
# N dimension instead, where halves make thin dots (N = 32 at d = 64). There, at d <= 64, each
# pair is held side by side in one tile (a0 b0 a1 b1 ...), so that dK and dQ are one dot each;
# they are split back into halves once, to be rotated back: 5-10% faster at d = 64; at d = 128,
# whose halves are 64 wide already, 8% slower. Measured and rejected: one full-width rotated tile,
# x * cos + x[partner] * sin with the partner read by a second load (20-37% slower); pointer
# tiles advanced each iteration instead of recomputed offsets (spills at d = 128); and a sum of
# two separately accumulated dots (Triton fuses it back into the chained form). (All in
# results/04_rope_attention_ab.log.) Interleaved pairs are loaded as one contiguous [rows, d2]
# tile and split in registers: two stride-2 loads each waste half of every memory transaction.
#
# The backward
# ------------
# S = scale * Rq Rk^T, where Rq is q with every row rotated by its position's angles. Given dS,
# the chain rule gives d(Rq) = scale * dS Rk and d(Rk) = scale * dS^T Rq: these accumulate over
# the K (or Q) tiles in the rotated basis. Each row's rotation is linear and depends only on that
# row's position, so dq = R^T d(Rq) row by row: the transposed rotation of 03 (the sines trade
# halves and change sign), applied once per tile after the loop, exactly.
#
# One program per block of keys loops over the query tiles: it recomputes P^T = exp(S^T - lse)
# and dP^T = V dO^T, and accumulates dV += P^T dO and d(Rk) += dS^T Rq in registers. dQ needs the
# opposite loop (over keys for a block of queries). Recomputing P and dP in a second kernel costs
# 7 matmuls per tile pair instead of 5, so by default each key block instead adds its share
# dS Rk straight into a float32 d(Rq) buffer with atomic adds, as FlashAttention 2 does, and a
# last small kernel rotates that back and casts it. Float atomics land in no fixed order: dq can
# differ in its last bits from run to run. Under torch.use_deterministic_algorithms(True) the
# backward takes the second-kernel route, whose sums have a fixed order. On an H200 the atomics
# took fwd+bwd from 279 to 319 TF/s at (4, 32, 4096, 128) and from 171 to 184 at
# (8, 16, 2048, 64) causal; at s = 512 and 2048 without causality the two routes tie.
#
# Offsets and registers
# ---------------------
# Each element a tile loads needs its own address, and the tiles of offsets are registers held
# next to the accumulators: at 8 warps these kernels sit at or near the limit of 255 registers a
# thread. So a head's base pointer is computed in int64 once, and the offsets within the head
# (position * row stride) are int32, half the registers of int64; they switch to int64 (WIDE)
# only for a tensor whose rows within one head could span 2^31 elements. On an H200 int32 made the
# forward 3-4% faster at most shapes, and 35% faster with interleaved pairs under a causal mask
# (whose kernel had needed 150 registers, now 118); forward + backward gained 1-3% (9% there).
#
# What is left to cuDNN
# ---------------------
# cuDNN runs attention 1.3-1.5x faster than these kernels at the larger shapes. It specializes
# warps: some load tiles while others compute, so the softmax (and here the rotation) would hide
# behind the tensor cores. Triton spells that tl.range(..., warp_specialize=True) over loads from
# TMA tensor descriptors. On Hopper, in Triton 3.6 and 3.9, a loop shaped like this file's dkdv
# loop does not compile with it, and the one forward loop that compiled never returned from its
# first call (results/04_rope_attention_ab.log, session 11). So every loop here is a plain
# software pipeline, which Triton builds from num_stages.

# %%
# The kernels
# -----------


@triton.jit
def _positions(start, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """Positions start ... start + BLOCK - 1 as int32, or int64 when an offset within one head
    can reach 2^31 elements (WIDE; the text above says why int32 is the default)."""
    pos = start + tl.arange(0, BLOCK)
    if WIDE:
        pos = pos.to(tl.int64)
    return pos


@triton.jit
def _load(ptrs, mask, other, UNMASKED: tl.constexpr):
    """tl.load, with no mask when UNMASKED says that every element is in bounds (the mask's
    comparisons then cost nothing: they were a tenth of the forward's inner loop at d = 128)."""
    if UNMASKED:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=other)


@triton.jit
def _trig(trig_ptr, pos, mask, half, HALF: tl.constexpr, SHARED: tl.constexpr, UNMASKED: tl.constexpr):
    """cos/sin of the a and b angles of positions `pos`: [len(pos), HALF] each, in the table's dtype
    (q's dtype)."""
    i = tl.arange(0, HALF)[None, :]
    m = mask[:, None] & (i < half)
    rows = trig_ptr + pos[:, None] * ((2 if SHARED else 4) * half) + i
    cos_a = _load(rows, m, 0.0, UNMASKED)
    sin_a = _load(rows + half, m, 0.0, UNMASKED)
    if SHARED:  # a true rotation table: the b angles are the a angles, and only cos_a, sin_a are stored
        return cos_a, sin_a, cos_a, sin_a
    return cos_a, sin_a, _load(rows + 2 * half, m, 0.0, UNMASKED), _load(rows + 3 * half, m, 0.0, UNMASKED)


@triton.jit
def _rotate(x_a, x_b, cos_a, sin_a, cos_b, sin_b):
    """(x_a cos_a - x_b sin_a, x_b cos_b + x_a sin_b) in x's dtype (bf16 or fp16): one product rounded
    to that dtype, then a fused multiply-add, two lanes an instruction on the GPU."""
    if PACKED_PTX:
        return tl.inline_asm_elementwise(
            asm=ROTATE_BF16X2 if x_a.dtype == tl.bfloat16 else ROTATE_F16X2, constraints="=r,=r,r,r,r,r,r,r",
            args=[x_a, x_b, cos_a, sin_a, cos_b, sin_b], dtype=(x_a.dtype, x_a.dtype), is_pure=True, pack=2)
    dtype = x_a.dtype
    x_a, x_b = x_a.to(tl.float32), x_b.to(tl.float32)
    prod_a = (x_b * sin_a.to(tl.float32)).to(dtype).to(tl.float32)
    prod_b = (x_a * sin_b.to(tl.float32)).to(dtype).to(tl.float32)
    return (x_a * cos_a.to(tl.float32) - prod_a).to(dtype), (x_b * cos_b.to(tl.float32) + prod_b).to(dtype)


@triton.jit
def _pair_channels(mask, half, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Channel indices of the a and b members of each pair, [1, HALF], and the load mask."""
    i = tl.arange(0, HALF)[None, :]
    if INTERLEAVED:
        a, b = 2 * i, 2 * i + 1
    else:
        a, b = i, i + half
    return a, b, mask[:, None] & (i < half)


@triton.jit
def _load_head(base, pos, mask, stride_s, stride_d, trig_ptr, half, rot_dim, head_dim,
               HALF: tl.constexpr, PASS: tl.constexpr, INTERLEAVED: tl.constexpr, SHARED: tl.constexpr,
               UNMASKED: tl.constexpr):
    """Rows `pos` of one head, rotated: (x_a, x_b, x_pass) in x's dtype."""
    rows = base + pos[:, None] * stride_s
    if INTERLEAVED:  # one contiguous load of the pairs, split in registers (two stride-2 loads waste half of each)
        c = tl.arange(0, 2 * HALF)[None, :]
        x = _load(rows + c * stride_d, mask[:, None] & (c < rot_dim), 0.0, UNMASKED)
        x_a, x_b = tl.split(tl.reshape(x, (x.shape[0], HALF, 2)))
    else:
        a, b, m = _pair_channels(mask, half, HALF, INTERLEAVED)
        x_a = _load(rows + a * stride_d, m, 0.0, UNMASKED)
        x_b = _load(rows + b * stride_d, m, 0.0, UNMASKED)
    r_a, r_b = _rotate(x_a, x_b, *_trig(trig_ptr, pos, mask, half, HALF, SHARED, UNMASKED))
    p = rot_dim + tl.arange(0, PASS)[None, :]  # (always masked: PASS is at least 16, and maybe no channel is left)
    return r_a, r_b, tl.load(rows + p * stride_d, mask=mask[:, None] & (p < head_dim), other=0.0)


@triton.jit
def _halves_side_by_side(x_a, x_b):
    """[rows, HALF] twice -> one [rows, 2 * HALF] tile, a0 a1 ... b0 b1 ... (joined in registers)."""
    return tl.reshape(tl.permute(tl.join(x_a, x_b), (0, 2, 1)), (x_a.shape[0], 2 * x_a.shape[1]))


@triton.jit
def _pairs_side_by_side(x_a, x_b):
    """[rows, HALF] twice -> one [rows, 2 * HALF] tile, a0 b0 a1 b1 ... (joined in registers)."""
    return tl.reshape(tl.join(x_a, x_b), (x_a.shape[0], 2 * x_a.shape[1]))


@triton.jit
def _pairs_apart(x):
    """The inverse of _pairs_side_by_side: (x_a, x_b)."""
    return tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))


@triton.jit
def _store_head_grad(base, pos, mask, stride_s, stride_d, g_a, g_b, g_p, trig_ptr, half, rot_dim, head_dim,
                     HALF: tl.constexpr, PASS: tl.constexpr, INTERLEAVED: tl.constexpr, SHARED: tl.constexpr):
    """Rotate a gradient from the rotated basis back (R^T) and store it in the tensor's dtype."""
    cos_a, sin_a, cos_b, sin_b = _trig(trig_ptr, pos, mask, half, HALF, SHARED, False)
    cos_a, sin_a, cos_b, sin_b = cos_a.to(tl.float32), sin_a.to(tl.float32), cos_b.to(tl.float32), sin_b.to(tl.float32)
    rows = base + pos[:, None] * stride_s
    dtype = base.dtype.element_ty
    r_a, r_b = (g_a * cos_a + g_b * sin_b).to(dtype), (g_b * cos_b - g_a * sin_a).to(dtype)
    if INTERLEAVED:  # pairs joined in registers, one contiguous store
        c = tl.arange(0, 2 * HALF)[None, :]
        tl.store(rows + c * stride_d, _pairs_side_by_side(r_a, r_b), mask=mask[:, None] & (c < rot_dim))
    else:
        a, b, m = _pair_channels(mask, half, HALF, INTERLEAVED)
        tl.store(rows + a * stride_d, r_a, mask=m)
        tl.store(rows + b * stride_d, r_b, mask=m)
    p = rot_dim + tl.arange(0, PASS)[None, :]
    tl.store(rows + p * stride_d, g_p.to(dtype), mask=mask[:, None] & (p < head_dim))


@triton.jit
def _qk(q_a, q_b, q_p, k_a, k_b, k_p, HAS_PASS: tl.constexpr):
    """Q K^T as the sum of the dots of the a halves, the b halves and the pass-through channels."""
    s = tl.dot(q_a, tl.trans(k_a))
    s = tl.dot(q_b, tl.trans(k_b), s)
    if HAS_PASS:
        s = tl.dot(q_p, tl.trans(k_p), s)
    return s


@triton.jit
def _visible(offs_m, offs_n, seqlen, key_mask_ptr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
             EVEN_N: tl.constexpr):
    """[len(offs_m), len(offs_n)]: may query m see key n? (bounds, padding mask, causality)"""
    visible = tl.full((offs_m.shape[0], offs_n.shape[0]), 1, tl.int1)
    if not EVEN_N:
        visible = visible & (offs_n < seqlen)[None, :]
    if HAS_MASK:
        visible = visible & (tl.load(key_mask_ptr + offs_n, mask=offs_n < seqlen, other=0) != 0)[None, :]
    if CAUSAL:
        visible = visible & (offs_m[:, None] >= offs_n[None, :])
    return visible


@triton.jit
def rope_attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, trig_ptr, key_mask_ptr,
    qk_scale, seqlen, n_heads, group, half, rot_dim, head_dim,
    stride_qb, stride_qs, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd, stride_ob, stride_os, stride_oh, stride_od,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr, D: tl.constexpr,
    INTERLEAVED: tl.constexpr, SHARED: tl.constexpr, HAS_PASS: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr, EVEN_N: tl.constexpr, WHOLE: tl.constexpr, WIDE: tl.constexpr, ONE_DOT: tl.constexpr,
):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // n_heads, bh % n_heads
    offs_m = _positions(pid_m * BLOCK_M, BLOCK_M, WIDE)
    m_mask = offs_m < seqlen
    b64 = b.to(tl.int64)
    q_a, q_b, q_p = _load_head(q_ptr + b64 * stride_qb + h.to(tl.int64) * stride_qh, offs_m, m_mask, stride_qs,
                               stride_qd, trig_ptr, half, rot_dim, head_dim, HALF, PASS, INTERLEAVED, SHARED, False)
    if ONE_DOT:  # the rotated halves side by side, so that QK^T is one dot (the text says why)
        q_r = _halves_side_by_side(q_a, q_b)
    k_base = k_ptr + b64 * stride_kb + (h // group).to(tl.int64) * stride_kh
    v_base = v_ptr + b64 * stride_vb + (h // group).to(tl.int64) * stride_vh
    key_mask_row = key_mask_ptr + b64 * seqlen
    d = tl.arange(0, D)[None, :]
    # scores are scaled by qk_scale (the softmax scale in log2 units, for exp2) in float32, in the same
    # multiply-add that subtracts the running max
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # running max of the scaled scores
    l_i = tl.zeros((BLOCK_M,), tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    hi = seqlen
    if CAUSAL:
        hi = tl.minimum((pid_m + 1) * BLOCK_M, seqlen)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = _positions(start_n, BLOCK_N, WIDE)
        n_mask = offs_n < seqlen
        k_a, k_b, k_p = _load_head(k_base, offs_n, n_mask, stride_ks, stride_kd, trig_ptr, half, rot_dim, head_dim,
                                   HALF, PASS, INTERLEAVED, SHARED, WHOLE)
        if ONE_DOT:
            scores = tl.dot(q_r, tl.trans(_halves_side_by_side(k_a, k_b)))
            if HAS_PASS:
                scores = tl.dot(q_p, tl.trans(k_p), scores)
        else:
            scores = _qk(q_a, q_b, q_p, k_a, k_b, k_p, HAS_PASS)
        if (not EVEN_N) or HAS_MASK:
            scores = tl.where(_visible(offs_m, offs_n, seqlen, key_mask_row, CAUSAL, HAS_MASK, EVEN_N), scores,
                              float("-inf"))
        elif CAUSAL:
            # only the diagonal blocks need the causal mask (a second, branch-free loop for the blocks
            # left of the diagonal, as in Triton's tutorial, was 20% slower here on an H200)
            if start_n + BLOCK_N > pid_m * BLOCK_M:
                scores = tl.where(offs_m[:, None] >= offs_n[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)
        if HAS_MASK:  # a row that has seen no visible key yet keeps m = -inf: subtract 0 instead
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new
        p = tl.exp2(scores * qk_scale - m_new_safe[:, None])
        alpha = tl.exp2(m_i - m_new_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load(v_base + offs_n[:, None] * stride_vs + d * stride_vd, n_mask[:, None] & (d < head_dim), 0.0,
                  WHOLE)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    empty = l_i == 0.0  # rows that saw no key: output 0, and lse = +inf so the backward's p is 0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    o_rows = o_ptr + b64 * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_os
    tl.store(o_rows + d * stride_od, out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & (d < head_dim))
    tl.store(lse_ptr + bh.to(tl.int64) * seqlen + offs_m, tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i))),
             mask=m_mask)


@triton.jit
def rope_attn_bwd_delta_kernel(o_ptr, do_ptr, delta_ptr, dq_acc_ptr, seqlen, n_heads, head_dim,
                               stride_ob, stride_os, stride_oh, stride_od, stride_db, stride_ds, stride_dh, stride_dd,
                               BLOCK_M: tl.constexpr, D: tl.constexpr, W: tl.constexpr, W_TILE: tl.constexpr,
                               ZERO_DQ: tl.constexpr):
    """delta = rowsum(dO * O): the softmax backward's dP correction, one value per query row; with
    ZERO_DQ, also zero these rows of the float32 dq buffer [b * h, s, W] the dkdv kernel adds into."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // n_heads).to(tl.int64), (bh % n_heads).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)[None, :]
    mask = (offs_m < seqlen)[:, None] & (d < head_dim)
    rows = offs_m.to(tl.int64)[:, None]
    o = tl.load(o_ptr + b * stride_ob + h * stride_oh + rows * stride_os + d * stride_od, mask=mask, other=0.0)
    do = tl.load(do_ptr + b * stride_db + h * stride_dh + rows * stride_ds + d * stride_dd, mask=mask, other=0.0)
    row_stats = bh.to(tl.int64) * seqlen + offs_m
    tl.store(delta_ptr + row_stats, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=offs_m < seqlen)
    if ZERO_DQ:
        j = tl.arange(0, W_TILE)[None, :]
        tl.store(dq_acc_ptr + row_stats[:, None] * W + j, tl.zeros((BLOCK_M, W_TILE), tl.float32),
                 mask=(offs_m < seqlen)[:, None] & (j < W))


@triton.jit
def _add_dq_share(dq_rows, m_mask, ds_t, k_r, k_a, k_b, k_p, HALF: tl.constexpr, PASS: tl.constexpr,
                  HAS_PASS: tl.constexpr, JOIN_PAIRS: tl.constexpr):
    """Add one key block's share of d(Rq), dS Rk, into the float32 rows `dq_rows` (atomically: every
    key block of the head adds to the same rows)."""
    ds = tl.trans(ds_t)
    if JOIN_PAIRS:
        j = tl.arange(0, 2 * HALF)[None, :]
        rows_ok = m_mask[:, None] & (j < 2 * HALF)  # (j < 2 * HALF is all true: it gives the tile's shape)
        tl.atomic_add(dq_rows + j, tl.dot(ds, k_r), mask=rows_ok, sem="relaxed")
    else:
        i = tl.arange(0, HALF)[None, :]
        rows_ok = m_mask[:, None] & (i < HALF)
        tl.atomic_add(dq_rows + i, tl.dot(ds, k_a), mask=rows_ok, sem="relaxed")
        tl.atomic_add(dq_rows + HALF + i, tl.dot(ds, k_b), mask=rows_ok, sem="relaxed")
    if HAS_PASS:
        c = tl.arange(0, PASS)[None, :]
        tl.atomic_add(dq_rows + 2 * HALF + c, tl.dot(ds, k_p), mask=m_mask[:, None] & (c < PASS), sem="relaxed")


@triton.jit
def rope_attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, dq_acc_ptr, lse_ptr, delta_ptr, trig_ptr, key_mask_ptr,
    qk_scale, seqlen, n_heads, n_kv_heads, group, half, rot_dim, head_dim,
    stride_qb, stride_qs, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd, stride_db, stride_ds, stride_dh, stride_dd,
    stride_dkb, stride_dks, stride_dkh, stride_dkd, stride_dvb, stride_dvs, stride_dvh, stride_dvd,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr, D: tl.constexpr,
    INTERLEAVED: tl.constexpr, SHARED: tl.constexpr, HAS_PASS: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr, EVEN_N: tl.constexpr, WHOLE: tl.constexpr, W: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    JOIN_PAIRS: tl.constexpr, WIDE: tl.constexpr,
):
    """One block of keys of one k/v head: dK and dV, summed over the q heads of its group; with
    ATOMIC_DQ, also this block's share of dQ, added into a float32 buffer [b * h, s, W] that every
    key block of the head adds to (rotated basis: the a halves then the b halves, or with JOIN_PAIRS
    the pairs side by side; then the pass-through channels). JOIN_PAIRS: hold each rotated pair side
    by side in one tile, so that dK and dQ are one dot each with N = d2 (the text above says why)."""
    pid_n, bh = tl.program_id(0), tl.program_id(1)
    b, hk = (bh // n_kv_heads).to(tl.int64), (bh % n_kv_heads).to(tl.int64)
    offs_n = _positions(pid_n * BLOCK_N, BLOCK_N, WIDE)
    n_mask = offs_n < seqlen
    d = tl.arange(0, D)[None, :]
    k_a, k_b, k_p = _load_head(k_ptr + b * stride_kb + hk * stride_kh, offs_n, n_mask, stride_ks, stride_kd,
                               trig_ptr, half, rot_dim, head_dim, HALF, PASS, INTERLEAVED, SHARED, False)
    k_r = _pairs_side_by_side(k_a, k_b)  # used with JOIN_PAIRS (else compiled away, as are the unused zeros)
    v = tl.load(v_ptr + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vs + d * stride_vd,
                mask=n_mask[:, None] & (d < head_dim), other=0.0)
    dk_r = tl.zeros((BLOCK_N, 2 * HALF), tl.float32)
    dk_a = tl.zeros((BLOCK_N, HALF), tl.float32)
    dk_b = tl.zeros((BLOCK_N, HALF), tl.float32)
    dk_p = tl.zeros((BLOCK_N, PASS), tl.float32)
    dv = tl.zeros((BLOCK_N, D), tl.float32)
    start = 0
    if CAUSAL:  # earlier queries cannot see these keys
        start = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for g in range(group):
        h = hk * group + g
        q_base = q_ptr + b * stride_qb + h * stride_qh
        do_base = do_ptr + b * stride_db + h * stride_dh
        row_stats = (b * n_heads + h) * seqlen
        for start_m in range(start, seqlen, BLOCK_M):
            offs_m = _positions(start_m, BLOCK_M, WIDE)
            m_mask = offs_m < seqlen
            q_a, q_b, q_p = _load_head(q_base, offs_m, m_mask, stride_qs, stride_qd, trig_ptr, half, rot_dim,
                                       head_dim, HALF, PASS, INTERLEAVED, SHARED, WHOLE)
            if JOIN_PAIRS:  # S^T: [BLOCK_N, BLOCK_M]
                q_r = _pairs_side_by_side(q_a, q_b)
                scores_t = tl.dot(k_r, tl.trans(q_r))
                if HAS_PASS:
                    scores_t = tl.dot(k_p, tl.trans(q_p), scores_t)
            else:
                scores_t = _qk(k_a, k_b, k_p, q_a, q_b, q_p, HAS_PASS)
            lse = _load(lse_ptr + row_stats + offs_m, m_mask, float("inf"), WHOLE)
            p_t = tl.exp2(scores_t * qk_scale - lse[None, :])
            if (not EVEN_N) or HAS_MASK:
                p_t = tl.where(tl.trans(_visible(offs_m, offs_n, seqlen, key_mask_ptr + b * seqlen, CAUSAL, HAS_MASK,
                                                 EVEN_N)), p_t, 0.0)
            elif CAUSAL:
                if start_m < (pid_n + 1) * BLOCK_N - 1:  # only the blocks on the diagonal need the causal mask
                    p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
            do = _load(do_base + offs_m[:, None] * stride_ds + d * stride_dd, m_mask[:, None] & (d < head_dim), 0.0,
                       WHOLE)
            dv = tl.dot(p_t.to(do.dtype), do, dv)
            dp_t = tl.dot(v, tl.trans(do))
            delta = _load(delta_ptr + row_stats + offs_m, m_mask, 0.0, WHOLE)
            ds_t = (p_t * (dp_t - delta[None, :])).to(q_a.dtype)
            # The order of the last two steps matters to Triton's schedule: at d <= 64, adding the dQ
            # share before the dK dot made forward + backward 2-5% faster on an H200; at d = 128 that
            # order needs more shared memory than an SM has at 3 stages, so there dK goes first.
            dq_rows = (dq_acc_ptr + row_stats * W) + offs_m[:, None] * W
            if ATOMIC_DQ and JOIN_PAIRS:
                _add_dq_share(dq_rows, m_mask, ds_t, k_r, k_a, k_b, k_p, HALF, PASS, HAS_PASS, JOIN_PAIRS)
            if JOIN_PAIRS:
                dk_r = tl.dot(ds_t, q_r, dk_r)
            else:
                dk_a = tl.dot(ds_t, q_a, dk_a)
                dk_b = tl.dot(ds_t, q_b, dk_b)
            if HAS_PASS:
                dk_p = tl.dot(ds_t, q_p, dk_p)
            if ATOMIC_DQ and not JOIN_PAIRS:
                _add_dq_share(dq_rows, m_mask, ds_t, k_r, k_a, k_b, k_p, HALF, PASS, HAS_PASS, JOIN_PAIRS)
    if JOIN_PAIRS:
        dk_a, dk_b = _pairs_apart(dk_r)
    sm_scale = qk_scale * LN2  # dS/dRk = sm_scale * dS^T Rq (qk_scale is in log2 units)
    _store_head_grad(dk_ptr + b * stride_dkb + hk * stride_dkh, offs_n, n_mask, stride_dks, stride_dkd,
                     dk_a * sm_scale, dk_b * sm_scale, dk_p * sm_scale, trig_ptr, half, rot_dim, head_dim, HALF, PASS,
                     INTERLEAVED, SHARED)
    tl.store(dv_ptr + b * stride_dvb + hk * stride_dvh + offs_n[:, None] * stride_dvs + d * stride_dvd,
             dv.to(dv_ptr.dtype.element_ty), mask=n_mask[:, None] & (d < head_dim))


@triton.jit
def rope_attn_bwd_dq_store_kernel(
    dq_acc_ptr, dq_ptr, trig_ptr, sm_scale, seqlen, n_heads, half, rot_dim, head_dim,
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,
    BLOCK_M: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr, W: tl.constexpr, INTERLEAVED: tl.constexpr,
    SHARED: tl.constexpr, HAS_PASS: tl.constexpr, JOIN_PAIRS: tl.constexpr, WIDE: tl.constexpr,
):
    """dQ from the float32 buffer the dkdv kernel added into: scaled, rotated back, stored in q's dtype."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // n_heads).to(tl.int64), (bh % n_heads).to(tl.int64)
    offs_m = _positions(pid_m * BLOCK_M, BLOCK_M, WIDE)
    m_mask = offs_m < seqlen
    rows = dq_acc_ptr + (bh.to(tl.int64) * seqlen + offs_m)[:, None] * W
    i = tl.arange(0, HALF)[None, :]
    c = tl.arange(0, PASS)[None, :]
    if JOIN_PAIRS:
        g_r = tl.load(rows + tl.arange(0, 2 * HALF)[None, :], mask=m_mask[:, None], other=0.0) * sm_scale
        g_a, g_b = _pairs_apart(g_r)
    else:
        g_a = tl.load(rows + i, mask=m_mask[:, None], other=0.0) * sm_scale
        g_b = tl.load(rows + HALF + i, mask=m_mask[:, None], other=0.0) * sm_scale
    if HAS_PASS:
        g_p = tl.load(rows + 2 * HALF + c, mask=m_mask[:, None], other=0.0) * sm_scale
    else:
        g_p = tl.zeros((BLOCK_M, PASS), tl.float32)  # stored nowhere: the pass channels start at head_dim
    _store_head_grad(dq_ptr + b * stride_dqb + h * stride_dqh, offs_m, m_mask, stride_dqs, stride_dqd, g_a, g_b, g_p,
                     trig_ptr, half, rot_dim, head_dim, HALF, PASS, INTERLEAVED, SHARED)


@triton.jit
def rope_attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, lse_ptr, delta_ptr, trig_ptr, key_mask_ptr,
    qk_scale, sm_scale, seqlen, n_heads, group, half, rot_dim, head_dim,
    stride_qb, stride_qs, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd, stride_db, stride_ds, stride_dh, stride_dd,
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr, D: tl.constexpr,
    INTERLEAVED: tl.constexpr, SHARED: tl.constexpr, HAS_PASS: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr, EVEN_N: tl.constexpr, WHOLE: tl.constexpr, WIDE: tl.constexpr,
):
    """One block of queries of one q head: dQ, accumulated over the keys it sees."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // n_heads).to(tl.int64), (bh % n_heads).to(tl.int64)
    offs_m = _positions(pid_m * BLOCK_M, BLOCK_M, WIDE)
    m_mask = offs_m < seqlen
    d = tl.arange(0, D)[None, :]
    q_a, q_b, q_p = _load_head(q_ptr + b * stride_qb + h * stride_qh, offs_m, m_mask, stride_qs, stride_qd, trig_ptr,
                               half, rot_dim, head_dim, HALF, PASS, INTERLEAVED, SHARED, False)
    do = tl.load(do_ptr + b * stride_db + h * stride_dh + offs_m[:, None] * stride_ds + d * stride_dd,
                 mask=m_mask[:, None] & (d < head_dim), other=0.0)
    lse = tl.load(lse_ptr + bh.to(tl.int64) * seqlen + offs_m, mask=m_mask, other=float("inf"))
    delta = tl.load(delta_ptr + bh.to(tl.int64) * seqlen + offs_m, mask=m_mask, other=0.0)
    k_base = k_ptr + b * stride_kb + (h // group) * stride_kh
    v_base = v_ptr + b * stride_vb + (h // group) * stride_vh
    dq_a = tl.zeros((BLOCK_M, HALF), tl.float32)
    dq_b = tl.zeros((BLOCK_M, HALF), tl.float32)
    dq_p = tl.zeros((BLOCK_M, PASS), tl.float32)
    hi = seqlen
    if CAUSAL:
        hi = tl.minimum((pid_m + 1) * BLOCK_M, seqlen)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = _positions(start_n, BLOCK_N, WIDE)
        n_mask = offs_n < seqlen
        k_a, k_b, k_p = _load_head(k_base, offs_n, n_mask, stride_ks, stride_kd, trig_ptr, half, rot_dim, head_dim,
                                   HALF, PASS, INTERLEAVED, SHARED, WHOLE)
        p = tl.exp2(_qk(q_a, q_b, q_p, k_a, k_b, k_p, HAS_PASS) * qk_scale - lse[:, None])
        if (not EVEN_N) or HAS_MASK:
            p = tl.where(_visible(offs_m, offs_n, seqlen, key_mask_ptr + b * seqlen, CAUSAL, HAS_MASK, EVEN_N), p, 0.0)
        elif CAUSAL:
            if start_n + BLOCK_N > pid_m * BLOCK_M:  # only the blocks on the diagonal need the causal mask
                p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        v = _load(v_base + offs_n[:, None] * stride_vs + d * stride_vd, n_mask[:, None] & (d < head_dim), 0.0,
                  WHOLE)
        dp = tl.dot(do, tl.trans(v))
        ds = (p * (dp - delta[:, None])).to(k_a.dtype)
        dq_a = tl.dot(ds, k_a, dq_a)
        dq_b = tl.dot(ds, k_b, dq_b)
        if HAS_PASS:
            dq_p = tl.dot(ds, k_p, dq_p)
    _store_head_grad(dq_ptr + b * stride_dqb + h * stride_dqh, offs_m, m_mask, stride_dqs, stride_dqd,
                     dq_a * sm_scale, dq_b * sm_scale, dq_p * sm_scale, trig_ptr, half, rot_dim, head_dim, HALF, PASS,
                     INTERLEAVED, SHARED)


# %%
# The wrapper and the autograd Function
# -------------------------------------
# cos and sin of the angle table are computed once per table (kept by identity and version
# counter, as in 02) into a table in q's dtype: [s2, 4 * d2/2] (cos_a, sin_a, cos_b, sin_b), or
# [s2, 2 * d2/2] when the halves are equal. Whether they are is read once per table too (one host
# sync per table, not per call).
#
# A model usually makes q, k and v with one matmul, [b, s, 3 * h * d], and views it as
# [b, s, 3, h, d]. Handed to rope_attention as the three views qkv.unbind(2), autograd gives
# each its own gradient and then stacks the three into qkv's: a copy of all of them (38 us a layer
# at 05's BERT-base batch, (32, 12, 512, 64), on an H200: 8% of this attention's forward +
# backward). rope_attention_qkvpacked takes qkv itself, as FlashAttention's
# flash_attn_qkvpacked_func does, and the kernels write dq, dk and dv, whose strides they take
# like any tensor's, straight into the three slices of one gradient.


class _LastResult:
    """Remember one result for the last tensors seen, by identity and version counter."""

    def __init__(self):
        self.key, self.refs, self.value = None, (), None

    def get(self, tensors, extra_key, compute):
        key = tuple((id(x), x._version) for x in tensors) + extra_key
        if self.key != key or not all(ref() is x for ref, x in zip(self.refs, tensors)):
            self.value = compute()
            self.key, self.refs = key, tuple(weakref.ref(x) for x in tensors)
        return self.value


_trig_tables = _LastResult()


def _trig_table(freqs, interleaved, dtype):
    """(dtype [s2, 4 * d2/2]: cos_a, sin_a, cos_b, sin_b per position, or [s2, 2 * d2/2]: cos_a, sin_a
    when a == b everywhere; whether a == b)."""
    def compute():
        f = freqs[:, 0, 0]
        f_a, f_b = (f[:, 0::2], f[:, 1::2]) if interleaved else f.chunk(2, dim=-1)
        shared = bool(torch.equal(f_a, f_b))
        parts = (f_a.cos(), f_a.sin()) if shared else (f_a.cos(), f_a.sin(), f_b.cos(), f_b.sin())
        return torch.cat(parts, dim=-1).to(dtype).contiguous(), shared
    return _trig_tables.get((freqs,), (interleaved, dtype), compute)


def _bshd_strides(x, tensor_format):
    s = x.stride()
    return (s[1], s[0], s[2], s[3]) if tensor_format == "sbhd" else s


# Row offsets within one head (position * row stride) are int32 in the kernels unless one could
# reach this many elements; then WIDE makes them int64. (A test lowers it to run that path.)
INT32_LIMIT = 2**31


def _wide_offsets(seqlen, head_dim, tensor_format, trig, *tensors):
    """WIDE: could some position's offset within one head (or one trig row) reach INT32_LIMIT?"""
    ends = [(seqlen - 1) * abs(st[1]) + (head_dim - 1) * abs(st[3])
            for st in (_bshd_strides(x, tensor_format) for x in tensors)]
    return max(ends + [seqlen * trig.shape[1]]) >= INT32_LIMIT


def _pow2(n, at_least=16):
    return max(at_least, 1 << (int(n) - 1).bit_length())


def _whole_tiles(seqlen, block, head_dim, rot_dim):
    """WHOLE: do the tiles an inner loop loads (block rows, all channels) never cross the end of
    the sequence or of the channels? Then its loads need no mask."""
    return seqlen % block == 0 and head_dim == _pow2(head_dim) and rot_dim == 2 * _pow2(rot_dim // 2)


# (BLOCK_M, BLOCK_N, warps, stages) per kernel and head-dim class, from sweeps on an H200
# (results/04_rope_attention_sweep.log, and results/04_rope_attention_ab.log for the d > 64 forward
# and the dkdv kernel with atomic dq); "dq" is the deterministic route's kernel. Small blocks in
# the interpreter, where they run fastest.
CONFIGS = {
    ("d<=64", "fwd"): dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    ("d>64", "fwd"): dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
    ("d<=64", "dkdv"): dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=3),
    ("d>64", "dkdv"): dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=3),
    ("d<=64", "dq"): dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
    ("d>64", "dq"): dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
}


def _config(head_dim, kernel, shared):
    config = dict(CONFIGS[("d<=64" if head_dim <= 64 else "d>64", kernel)])
    if DEVICE.type != "cuda":
        return dict(config, BLOCK_M=32, BLOCK_N=32, num_warps=4)
    # four cos/sin tiles a stage, not two: 3 stages overflowed shared memory (float32 tables; not re-measured)
    if head_dim > 64 and not shared:
        config["num_stages"] = 2
    return config


def _attention_forward(q, k, v, freqs, attention_mask, sm_scale, causal, interleaved, tensor_format):
    """Launch the forward; return the output and what the backward needs: (o, lse, trig, key_mask, args)."""
    batch, seqlen = (q.shape[1], q.shape[0]) if tensor_format == "sbhd" else (q.shape[0], q.shape[1])
    n_heads, n_kv_heads, head_dim, rot_dim = q.shape[2], k.shape[2], q.shape[3], freqs.shape[3]
    trig, shared = _trig_table(freqs, interleaved, q.dtype)
    key_mask = attention_mask if attention_mask is not None else trig  # unused when HAS_MASK is False
    o = torch.empty_like(q)
    lse = torch.empty(batch, n_heads, seqlen, device=q.device, dtype=torch.float32)
    common = dict(HALF=_pow2(rot_dim // 2), PASS=_pow2(head_dim - rot_dim), D=_pow2(head_dim),
                  INTERLEAVED=interleaved, SHARED=shared, HAS_PASS=rot_dim < head_dim, CAUSAL=causal,
                  HAS_MASK=attention_mask is not None,
                  WIDE=_wide_offsets(seqlen, head_dim, tensor_format, trig, q, k, v, o))
    cfg = _config(head_dim, "fwd", common["SHARED"])
    # QK^T as one dot over the halves side by side, not a dot per half: on an H200 the forward
    # gained 1-5%, except at d <= 64 under a causal mask, where it lost 2-4%
    cfg["ONE_DOT"] = head_dim > 64 or not causal
    rope_attn_fwd_kernel[(triton.cdiv(seqlen, cfg["BLOCK_M"]), batch * n_heads)](
        q, k, v, o, lse, trig, key_mask, sm_scale * LOG2E, seqlen, n_heads, n_heads // n_kv_heads,
        rot_dim // 2, rot_dim, head_dim, *(s for x in (q, k, v, o) for s in _bshd_strides(x, tensor_format)),
        EVEN_N=seqlen % cfg["BLOCK_N"] == 0, WHOLE=_whole_tiles(seqlen, cfg["BLOCK_N"], head_dim, rot_dim),
        **common, **cfg)
    args = (batch, seqlen, n_heads, n_kv_heads, head_dim, rot_dim, sm_scale, tensor_format, common)
    return o, lse, trig, key_mask, args


def _attention_backward(args, q, k, v, o, lse, trig, key_mask, do, dq, dk, dv):
    """Launch the backward, writing into dq, dk and dv (any strides: views of one tensor work)."""
    batch, seqlen, n_heads, n_kv_heads, head_dim, rot_dim, sm_scale, tensor_format, common = args
    strides = lambda *xs: [s for x in xs for s in _bshd_strides(x, tensor_format)]  # noqa: E731
    # dQ: added up by the dkdv kernel with float32 atomics (5 matmuls a tile pair in all, as in
    # FlashAttention 2), or, when torch.use_deterministic_algorithms(True) asks for a fixed sum
    # order, by a second kernel that recomputes P and dP over the keys (7 matmuls).
    atomic_dq = not torch.are_deterministic_algorithms_enabled()
    width = 2 * common["HALF"] + (common["PASS"] if common["HAS_PASS"] else 0)
    common = dict(common, WIDE=_wide_offsets(seqlen, head_dim, tensor_format, trig, q, k, v, do, dq, dk, dv)
                  or seqlen * width >= INT32_LIMIT)  # the dq buffer's rows too
    # the float32 dq buffer is zeroed by the delta kernel, which visits the same rows anyway: one
    # launch fewer, and 24.6 instead of 26.9 us of GPU time at (32, 12, 512, 64) on an H200
    dq_acc = torch.empty(batch * n_heads, seqlen, width, device=q.device, dtype=torch.float32) if atomic_dq else lse
    delta = torch.empty_like(lse)
    rope_attn_bwd_delta_kernel[(triton.cdiv(seqlen, 64), batch * n_heads)](
        o, do, delta, dq_acc, seqlen, n_heads, head_dim, *strides(o, do), BLOCK_M=64, D=common["D"], W=width,
        W_TILE=_pow2(width), ZERO_DQ=atomic_dq)
    scalars = (seqlen, n_heads)
    cfg = _config(head_dim, "dkdv", common["SHARED"])
    # pairs side by side where halves would make thin dots (N = d2 / 2 <= 32): 5-10% faster at
    # d = 64 on an H200; at d = 128 the halves are 64 wide, and joining was 8% slower
    join_pairs = head_dim <= 64
    rope_attn_bwd_dkdv_kernel[(triton.cdiv(seqlen, cfg["BLOCK_N"]), batch * n_kv_heads)](
        q, k, v, do, dk, dv, dq_acc, lse, delta, trig, key_mask, sm_scale * LOG2E, *scalars, n_kv_heads,
        n_heads // n_kv_heads, rot_dim // 2, rot_dim, head_dim, *strides(q, k, v, do, dk, dv),
        EVEN_N=seqlen % cfg["BLOCK_N"] == 0, WHOLE=_whole_tiles(seqlen, cfg["BLOCK_M"], head_dim, rot_dim), W=width,
        ATOMIC_DQ=atomic_dq, JOIN_PAIRS=join_pairs, **common, **cfg)
    if atomic_dq:
        rope_attn_bwd_dq_store_kernel[(triton.cdiv(seqlen, 64), batch * n_heads)](
            dq_acc, dq, trig, sm_scale, seqlen, n_heads, rot_dim // 2, rot_dim, head_dim, *strides(dq),
            BLOCK_M=64, HALF=common["HALF"], PASS=common["PASS"], W=width, INTERLEAVED=common["INTERLEAVED"],
            SHARED=common["SHARED"], HAS_PASS=common["HAS_PASS"], JOIN_PAIRS=join_pairs, WIDE=common["WIDE"])
        return
    cfg = _config(head_dim, "dq", common["SHARED"])
    rope_attn_bwd_dq_kernel[(triton.cdiv(seqlen, cfg["BLOCK_M"]), batch * n_heads)](
        q, k, v, do, dq, lse, delta, trig, key_mask, sm_scale * LOG2E, sm_scale, *scalars,
        n_heads // n_kv_heads, rot_dim // 2, rot_dim, head_dim, *strides(q, k, v, do, dq),
        EVEN_N=seqlen % cfg["BLOCK_N"] == 0, WHOLE=_whole_tiles(seqlen, cfg["BLOCK_N"], head_dim, rot_dim),
        **common, **cfg)


class _RoPEAttention(torch.autograd.Function):
    """q, k and v as three tensors."""

    @staticmethod
    def forward(ctx, q, k, v, freqs, attention_mask, sm_scale, causal, interleaved, tensor_format):
        o, lse, trig, key_mask, ctx.args = _attention_forward(q, k, v, freqs, attention_mask, sm_scale, causal,
                                                              interleaved, tensor_format)
        ctx.save_for_backward(q, k, v, o, lse, trig, key_mask)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, trig, key_mask = ctx.saved_tensors
        grads = tuple(torch.empty_like(x) for x in (q, k, v))
        _attention_backward(ctx.args, q, k, v, o, lse, trig, key_mask, do, *grads)
        return *grads, None, None, None, None, None, None


class _RoPEAttentionQKVPacked(torch.autograd.Function):
    """q, k and v as one tensor [.., 3, h, d]. Its gradient is one tensor of that shape too, into
    which the kernels write dq, dk and dv; given three views of it instead, autograd would stack
    their three gradients, a copy of all three (38 us a layer at 05's BERT-base batch on an H200)."""

    @staticmethod
    def forward(ctx, qkv, freqs, attention_mask, sm_scale, causal, interleaved, tensor_format):
        o, lse, trig, key_mask, ctx.args = _attention_forward(*qkv.unbind(2), freqs, attention_mask, sm_scale, causal,
                                                              interleaved, tensor_format)
        ctx.save_for_backward(qkv, o, lse, trig, key_mask)
        return o

    @staticmethod
    def backward(ctx, do):
        qkv, o, lse, trig, key_mask = ctx.saved_tensors
        dqkv = torch.empty_like(qkv)
        _attention_backward(ctx.args, *qkv.unbind(2), o, lse, trig, key_mask, do, *dqkv.unbind(2))
        return dqkv, None, None, None, None, None, None


def _check(q, k, v, freqs, attention_mask, sm_scale, tensor_format):
    if tensor_format not in ("bshd", "sbhd"):
        raise ValueError(f"tensor_format must be 'bshd' or 'sbhd', got {tensor_format!r}")
    for x, name in ((q, "q"), (k, "k"), (v, "v"), (freqs, "freqs")):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"q must be float16 or bfloat16, got {q.dtype}")
    for x, name in ((k, "k"), (v, "v")):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [{', '.join(tensor_format)}], got shape {tuple(x.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k must match q in every dim but heads (self-attention): got {tuple(k.shape)}, "
                         f"q is {tuple(q.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q's {q.shape[2]} heads must be a multiple of k's {k.shape[2]} (grouped-query attention)")
    head_dim, seqlen = q.shape[3], q.shape[0 if tensor_format == "sbhd" else 1]
    if not 16 <= head_dim <= 128:
        raise ValueError(f"head dim must be between 16 and 128, got {head_dim}")
    if freqs.dtype != torch.float32 or freqs.dim() != 4 or freqs.shape[1:3] != (1, 1):
        raise ValueError(f"freqs must be float32 angles of shape [s2, 1, 1, d2], got {tuple(freqs.shape)} {freqs.dtype}")
    if freqs.shape[3] % 2 or not 2 <= freqs.shape[3] <= head_dim:
        raise ValueError(f"freqs' last dim d2 = {freqs.shape[3]} must be even and between 2 and the head dim {head_dim}")
    if freqs.shape[0] < seqlen:
        raise ValueError(f"sequence length {seqlen} is over the {freqs.shape[0]} rows (s2) of freqs")
    if freqs.requires_grad and torch.is_grad_enabled():
        raise ValueError("freqs requires grad, but no gradient flows to the angle table; pass freqs.detach()")
    if attention_mask is not None:
        batch = q.shape[1 if tensor_format == "sbhd" else 0]
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention_mask must be a torch.Tensor or None, got {type(attention_mask).__name__}")
        if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
            raise TypeError(f"attention_mask must be bool or integer (1 = token, 0 = padding), got {attention_mask.dtype}")
        if attention_mask.shape != (batch, seqlen):
            raise ValueError(f"attention_mask must have shape [b, s] = [{batch}, {seqlen}], got "
                             f"{tuple(attention_mask.shape)}")
        if attention_mask.device != q.device:
            raise ValueError(f"attention_mask is on {attention_mask.device} but q is on {q.device}")
    if sm_scale is not None and not isinstance(sm_scale, (int, float)):
        raise TypeError(f"sm_scale must be a number or None, got {type(sm_scale).__name__}")
    if sm_scale is not None and not 0 < sm_scale < math.inf:
        raise ValueError(f"sm_scale must be a positive finite number, got {sm_scale}")


def _checked(q, k, v, freqs, attention_mask, sm_scale, tensor_format):
    """Check the arguments; return the mask as the kernels read it (int8, contiguous) and the scale."""
    _check(q, k, v, freqs, attention_mask, sm_scale, tensor_format)
    if attention_mask is not None:
        attention_mask = attention_mask.to(torch.int8).contiguous()
    return attention_mask, float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])


def rope_attention(q, k, v, freqs, *, causal=False, attention_mask=None, sm_scale=None, interleaved=False,
                   tensor_format="bshd"):
    """Attention with RoPE applied to q and k inside the kernel; differentiable in q, k and v.

    q: [b, s, h, d] (bshd) | [s, b, h, d] (sbhd), float16 or bfloat16, any strides, 16 <= d <= 128.
    k, v: the same layout and length, h_kv heads with h % h_kv == 0 (grouped-query attention).
    freqs: float32 angles [s2, 1, 1, d2], s2 >= s, d2 even and <= d (02's semantics: only the
        first d2 channels are rotated; any angles). No gradient flows to freqs.
    causal: each query sees keys at its position and before.
    attention_mask: bool or integer [b, s], 1 (nonzero) = a real token, 0 = padding (Hugging Face's
        convention); padded keys are never attended to. A query that sees no key returns zeros.
    sm_scale: softmax scale, positive, 1/sqrt(d) by default. interleaved: rotate pairs (RoFormer, GPT-J).
    Returns the output [like q], in q's layout and dtype. dq is summed with float32 atomics (its
    last bits can vary between runs) unless torch.use_deterministic_algorithms(True) is on.
    """
    return _RoPEAttention.apply(q, k, v, freqs, *_checked(q, k, v, freqs, attention_mask, sm_scale, tensor_format),
                                causal, interleaved, tensor_format)


def rope_attention_qkvpacked(qkv, freqs, *, causal=False, attention_mask=None, sm_scale=None, interleaved=False,
                             tensor_format="bshd"):
    """rope_attention with q, k and v packed in one tensor, as one QKV projection makes them
    (FlashAttention's flash_attn_qkvpacked_func): qkv is [b, s, 3, h, d] (bshd) or [s, b, 3, h, d]
    (sbhd), and q, k, v = qkv.unbind(2). The same output and gradients as rope_attention(*qkv.unbind(2),
    freqs, ...), but qkv's gradient is written as one tensor, not stacked from three (a copy saved).
    """
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must be [b, s, 3, h, d] (bshd) or [s, b, 3, h, d] (sbhd), got shape {tuple(qkv.shape)}")
    if qkv.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"qkv must be float16 or bfloat16, got {qkv.dtype}")
    return _RoPEAttentionQKVPacked.apply(qkv, freqs, *_checked(*qkv.unbind(2), freqs, attention_mask, sm_scale,
                                                                tensor_format), causal, interleaved, tensor_format)


# %%
# Unit test
# ---------
# Odd lengths, GQA, partial rotary with arbitrary angles, a padding mask with a fully padded
# sequence: output and gradients against the float32 reference. tests/test_04_rope_attention.py
# covers the whole matrix.


def self_check():
    torch.manual_seed(0)
    b, s, h, h_kv, d = (3, 257, 4, 2, 80) if DEVICE.type == "cuda" else (2, 37, 2, 1, 32)
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16  # the interpreter's bf16 dot is wrong
    freqs = torch.randn(s, 1, 1, d - 16, device=DEVICE)  # partial rotary, halves differ
    mask = torch.ones(b, s, dtype=torch.bool, device=DEVICE)
    mask[0, s // 2:] = False  # padding at the end of one sequence ...
    mask[-1] = False  # ... and a sequence with no real token: its rows return 0

    def assert_matches_reference(out, ref, inputs):
        dout = torch.randn_like(out)
        tol = dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(out.float(), ref, **tol)
        for name, g, r in zip(("dq", "dk", "dv") if len(inputs) == 3 else ("dqkv",),
                              torch.autograd.grad(out, inputs, dout), torch.autograd.grad(ref, inputs, dout.float())):
            torch.testing.assert_close(g.float(), r.float(), **tol, msg=lambda m: f"{name}: {m}")

    for causal in (False, True):
        for interleaved in (False, True):
            q = torch.randn(b, s, h, d, device=DEVICE, dtype=dtype, requires_grad=True)
            k = torch.randn(b, s, h_kv, d, device=DEVICE, dtype=dtype, requires_grad=True)
            v = torch.randn(b, s, h_kv, d, device=DEVICE, dtype=dtype, requires_grad=True)
            kwargs = dict(causal=causal, attention_mask=mask, interleaved=interleaved)
            assert_matches_reference(rope_attention(q, k, v, freqs, **kwargs),
                                     attention_reference(q, k, v, freqs, **kwargs), (q, k, v))
    qkv = torch.randn(b, s, 3, h, d, device=DEVICE, dtype=dtype, requires_grad=True)
    assert_matches_reference(rope_attention_qkvpacked(qkv, freqs, attention_mask=mask),
                             attention_reference(*qkv.unbind(2), freqs, attention_mask=mask), (qkv,))
    print(f"self-check passed: output and dq/dk/dv, causal and not, both pairings, padding mask with a fully padded "
          f"sequence, GQA {h}/{h_kv}, s={s}, d={d}, d2={d - 16}, {dtype}; q, k, v packed (device: {DEVICE.type})")


# %%
# Benchmark
# ---------
# bf16, against the best unfused path: 03's RoPE (apply_rotary_pos_emb_qk) on q and k, then
# scaled_dot_product_attention with each backend (cuDNN, flash, efficient) and FlexAttention.
# TF/s count 4*b*h*s^2*d FLOPs (halved when causal; x3.5 for forward + backward). GPU time from a
# CUDA graph when the call can be captured, else from do_bench; the table says which. The yardstick,
# timed the same way in the same run, is a bf16 8192^3 matmul: attention is matmuls, so that is its
# ceiling on this GPU. Then a sweep of sequence lengths at a fixed number of tokens, for the plot of
# TF/s against s.

BENCH_SHAPES = [  # (b, h, s, d, causal, padding mask)
    (16, 12, 512, 64, False, False), (16, 12, 512, 64, False, True), (8, 16, 2048, 64, False, False),
    (8, 16, 2048, 64, True, False), (4, 32, 4096, 128, False, False), (4, 32, 4096, 128, True, False)]
CPU_SHAPES = [(1, 2, 64, 32, True, True)]
# TF/s against sequence length: 16k tokens a batch (b = 16384 / s), 16 heads of dim 64, not causal
SWEEP_LENGTHS, SWEEP_TOKENS, CPU_SWEEP_LENGTHS = [512, 1024, 2048, 4096, 8192], 16384, [32, 64]


def _time_ms(fn):
    if DEVICE.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3, "wall"
    try:
        with torch.cuda.stream(torch.cuda.Stream()):  # each: 10 replays of a graph of ~40 ms of calls
            return statistics.median(triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")
                                     for _ in range(3)), "graph"
    except Exception:  # not capturable (e.g. a first call that syncs): time calls issued one by one
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median"), "stream"


def _load_sibling(filename):
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), filename)
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location(filename[:-3].lstrip("0123456789_"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _unfused_providers(q, k, v, freqs, causal, mask, rope03):
    """name -> (q, k, v) -> output in bshd: 03's RoPE, then SDPA (each backend) or FlexAttention."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    fns = {}
    b, s = q.shape[:2]
    sdpa_mask = mask.bool()[:, None, None, :] if mask is not None else None

    def rotated(q, k):
        q, k = rope03.apply_rotary_pos_emb_qk(q, k, freqs, tensor_format="bshd")
        return q.transpose(1, 2), k.transpose(1, 2)
    for backend, name in ((SDPBackend.CUDNN_ATTENTION, "cuDNN"), (SDPBackend.FLASH_ATTENTION, "flash"),
                          (SDPBackend.EFFICIENT_ATTENTION, "efficient")):
        def run(q, k, v, backend=backend):
            qr, kr = rotated(q, k)
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(
                    qr, kr, v.transpose(1, 2), attn_mask=sdpa_mask, is_causal=causal and sdpa_mask is None)
            return out.transpose(1, 2)
        fns["03 RoPE + SDPA " + name] = run
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        # dynamic=False: a kernel specialized to each shape, as a model of fixed shapes gets (left
        # dynamic, torch.compile switches to one slower kernel for all shapes once it sees a second);
        # the reset keeps the shapes already compiled from counting towards its recompile limit.
        torch._dynamo.reset()
        flex = torch.compile(flex_attention, dynamic=False)

        def mask_mod(b_, h_, q_idx, kv_idx):
            ok = (q_idx >= kv_idx) if causal else (q_idx >= 0)
            return ok & mask.bool()[b_, kv_idx] if mask is not None else ok
        block_mask = create_block_mask(mask_mod, b if mask is not None else None, None, s, s, device=DEVICE)

        def run_flex(q, k, v):
            qr, kr = rotated(q, k)
            return flex(qr, kr, v.transpose(1, 2), block_mask=block_mask).transpose(1, 2)
        fns["03 RoPE + FlexAttention"] = run_flex
    except Exception as e:  # noqa: BLE001
        print(f"(FlexAttention unavailable, its row is skipped: {e})")
    return fns


def measure(b, h, s, d, causal, padded, rope03, providers=None):
    """Rows of fwd and fwd+bwd timings at one shape: ours and (on a GPU) the unfused paths."""
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16
    q, k, v = (torch.randn(b, s, h, d, device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(3))
    freqs = rope_freqs(s, d, device=DEVICE)
    mask = None
    if padded:  # Hugging Face style: each sequence is padded after a random length
        lengths = torch.randint(s // 2, s + 1, (b,), device=DEVICE)
        mask = torch.arange(s, device=DEVICE)[None, :] < lengths[:, None]
    fns = {"fused (ours)": lambda q, k, v: rope_attention(q, k, v, freqs, causal=causal, attention_mask=mask)}
    if rope03 is not None:
        fns.update(_unfused_providers(q, k, v, freqs, causal, mask, rope03))
    if providers is not None:
        fns = {name: fn for name, fn in fns.items() if any(p in name for p in providers)}
    flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
    dout = torch.randn_like(q)
    rows = []
    for name, fn in fns.items():
        try:
            fn(q, k, v)
        except Exception as e:  # noqa: BLE001  (a backend that does not take this shape)
            print(f"{(b, h, s, d)} causal={causal} mask={padded} {name}: n/a ({type(e).__name__})")
            continue
        fwd_ms, fwd_how = _time_ms(lambda: fn(q, k, v))
        both_ms, both_how = _time_ms(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout))
        torch.cuda.reset_peak_memory_stats() if DEVICE.type == "cuda" else None
        base = torch.cuda.memory_allocated() if DEVICE.type == "cuda" else 0
        torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
        peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20 if DEVICE.type == "cuda" else float("nan")
        row = dict(shape=(b, h, s, d), causal=causal, padded=padded, provider=name, fwd_ms=fwd_ms,
                   both_ms=both_ms, fwd_tflops=flops / fwd_ms / 1e9, both_tflops=3.5 * flops / both_ms / 1e9,
                   peak_mb=peak_mb, timing=fwd_how if fwd_how == both_how else f"{fwd_how}/{both_how}")
        rows.append(row)
        print(f"{str(row['shape']):>20} causal={causal!s:5} mask={padded!s:5} {name:>26} fwd {fwd_ms * 1e3:8.1f} us "
              f"{row['fwd_tflops']:6.1f} TF/s  fwd+bwd {both_ms * 1e3:8.1f} us {row['both_tflops']:6.1f} TF/s  "
              f"peak +{peak_mb:.0f} MiB ({row['timing']})")
    return rows


def matmul_tflops():
    """The yardstick: TF/s of a bf16 [8192, 8192] @ [8192, 8192] matmul on this GPU (None on the CPU)."""
    if DEVICE.type != "cuda":
        return None
    a, b = (torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    return 2 * 8192**3 / _time_ms(lambda: a @ b)[0] / 1e9


def benchmark():
    """(rows at the issue's shapes, rows of the sequence-length sweep, the matmul yardstick in TF/s)."""
    on_gpu = DEVICE.type == "cuda"
    if not on_gpu:
        print("\nNO GPU: the kernels run in Triton's interpreter on the CPU. The timings below only "
              "show that the benchmark runs; they say nothing about speed.")
    yardstick = matmul_tflops()
    if yardstick:
        print(f"yardstick: a bf16 8192^3 matmul runs at {yardstick:.0f} TF/s on this GPU")
    rope03 = _load_sibling("03_rope_bwd.py") if on_gpu else None
    rows = [r for shape in (BENCH_SHAPES if on_gpu else CPU_SHAPES) for r in measure(*shape, rope03)]
    print("\nsequence-length sweep:")
    sweep = [r for s in (SWEEP_LENGTHS if on_gpu else CPU_SWEEP_LENGTHS)
             for r in measure(max(1, SWEEP_TOKENS // s) if on_gpu else 1, 16 if on_gpu else 2, s, 64 if on_gpu else 32,
                              False, False, rope03, providers=("ours", "cuDNN", "flash", "Flex"))]
    return rows, sweep, yardstick


def markdown_table(rows, yardstick):
    lines = ["| (b, h, s, d) | causal | padding mask | provider | fwd TF/s | fwd+bwd TF/s | of the matmul, "
             "fwd / fwd+bwd | peak extra memory, fwd+bwd | timing |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        of_matmul = f"{r['fwd_tflops'] / yardstick:.0%} / {r['both_tflops'] / yardstick:.0%}" if yardstick else "n/a"
        lines.append(f"| {r['shape']} | {r['causal']} | {r['padded']} | {r['provider']} | {r['fwd_tflops']:.0f} "
                     f"({r['fwd_ms'] * 1e3:.0f} us) | {r['both_tflops']:.0f} ({r['both_ms'] * 1e3:.0f} us) | "
                     f"{of_matmul} | {r['peak_mb']:.0f} MiB | {r['timing']} |")
    return "\n".join(lines)


def environment():
    gpu = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "none (Triton interpreter)"
    return (f"device: {gpu}; date: {datetime.date.today()}; torch {torch.__version__}; "
            f"triton {triton.__version__}; python {platform.python_version()}")


def save_results(rows, sweep, yardstick, results_dir):
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, "04_rope_attention.md"), "w") as f:
        f.write(f"# RoPE + attention, fused against RoPE then attention\n\n{environment()}\n\nThe yardstick: a "
                f"bf16 8192^3 matmul ran at {yardstick:.0f} TF/s in this run, timed the same way.\n\nbf16. TF/s count "
                "4*b*h*s^2*d FLOPs, halved when causal, x3.5 for forward + backward. 'graph': GPU time replayed "
                "from a CUDA graph (median of three do_bench_cudagraph(rep=40) medians); 'stream': do_bench. Peak extra "
                "memory: what one forward + backward allocated above the inputs. Raw log: "
                f"`04_rope_attention.log`.\n\n{markdown_table(rows, yardstick)}\n\n## TF/s against sequence length\n\n"
                f"{SWEEP_TOKENS} tokens a batch (b = {SWEEP_TOKENS} / s), 16 heads of dim 64, not causal, no mask "
                f"(plot: `04_rope_attention_seqlen.png`).\n\n{markdown_table(sweep, yardstick)}\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    groups = list(dict.fromkeys((r["shape"], r["causal"], r["padded"]) for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(15, 4.8))
    width = 0.8 / len(providers)
    for ax, key, title in zip(axes, ("fwd_tflops", "both_tflops"), ("forward", "forward + backward")):
        for n, provider in enumerate(providers):
            vals = {(r["shape"], r["causal"], r["padded"]): r[key] for r in rows if r["provider"] == provider}
            ax.bar([g + n * width for g in range(len(groups))], [vals.get(g, 0) for g in groups], width, label=provider)
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
        ax.set_xticklabels([f"{s}\n{'causal' if c else ''}{' mask' if p else ''}" for s, c, p in groups], fontsize=7)
        ax.set_ylabel("TF/s")
        ax.set_title(f"RoPE + attention, {title} ({environment().split(';')[0].removeprefix('device: ')})", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(results_dir, "04_rope_attention.png"), dpi=120)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in zip(axes, ("fwd_tflops", "both_tflops"), ("forward", "forward + backward")):
        for provider in dict.fromkeys(r["provider"] for r in sweep):
            pts = [(r["shape"][2], r[key]) for r in sweep if r["provider"] == provider]
            ax.plot(*zip(*pts), marker="o", label=provider)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length s (batch = %d / s, 16 heads, d = 64)" % SWEEP_TOKENS)
        ax.set_ylabel("TF/s")
        ax.set_title(f"RoPE + attention, {title} ({environment().split(';')[0].removeprefix('device: ')})", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(results_dir, "04_rope_attention_seqlen.png"), dpi=120)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                        help="folder for the table and plot (written only on a GPU)")
    args = parser.parse_args()
    print(environment())
    self_check()
    rows, sweep, yardstick = benchmark()
    if DEVICE.type == "cuda":
        save_results(rows, sweep, yardstick, args.results)
        print("\n" + markdown_table(rows, yardstick) + "\n\n" + markdown_table(sweep, yardstick))
