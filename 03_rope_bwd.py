"""
RoPE backward, and a differentiable RoPE that drops into real models
====================================================================

In this tutorial, you will learn about:

* deriving RoPE's backward, element by element: the forward with each half's sine moved to the other half and
  negated (one kernel, a direction flag); why that is "the angle negated" only for true rotation tables;
* a ``torch.autograd.Function`` with TransformerEngine's ``apply_rotary_pos_emb`` signature, for q alone or q
  and k (grouped-query attention) in one launch each way, with context parallelism as a position map;
* fused QKV: q, k and v straight out of one projection's output, and its gradient written back as one tensor;
* registering Triton kernels with ``torch.library`` (``triton_op`` + ``wrap_triton``) so that
  ``torch.compile(fullgraph=True)`` captures them, and keeping host syncs out of compiled code;
* checking gradients with ``torch.autograd.gradcheck`` in float64, and what autograd over the eager formula costs;
* what an eager call costs on the host, next to an empty op, autograd alone and SDPA.

Run ``python 03_rope_bwd.py``: it checks itself against autograd through the PyTorch reference, then
benchmarks. This file imports only torch and triton: copy it alone into your project.
"""

# %%
# Setup: with no GPU, the kernels run in Triton's interpreter (set before triton is imported).
import argparse
import hashlib
import inspect
import itertools
import os
import sys
import time
import weakref
from typing import List, Optional

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TENSOR_FORMATS = ("sbhd", "bshd", "thd")
MAX_HEAD_DIM = 256

# %%
# The PyTorch reference (as in 02)
# --------------------------------
# y = x * cos(f) + R(x) * sin(f) on the first d2 channels, y = x on the rest, where R pairs channel a with b and
# negates the first: rotate-half (a = i, b = i + d2/2) or interleaved pairs (a = 2i, b = 2i + 1). Autograd
# through this function is the oracle for every gradient below.


def rope_freqs(max_seq_len, rotary_dim, base=10000.0, interleaved=False, device=None):
    """float32 angles [max_seq_len, 1, 1, rotary_dim], as TE's ``RotaryPositionEmbedding`` (halves or pairs)."""
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    return angles.view(max_seq_len, 1, 1, rotary_dim)


def _token_positions(t, tensor_format, cu_seqlens, start_positions):
    """Position of every token, shaped to broadcast against t[..., 0, 0]."""
    if tensor_format == "thd":
        tokens = torch.arange(t.shape[0], device=t.device)
        seq = torch.searchsorted(cu_seqlens[1:].long(), tokens, right=True)
        return tokens - cu_seqlens.long()[seq] + (start_positions.long()[seq] if start_positions is not None else 0)
    pos = torch.arange(t.shape[0 if tensor_format == "sbhd" else 1], device=t.device)
    start = start_positions.long() if start_positions is not None else pos.new_zeros(1)
    return pos[:, None] + start[None, :] if tensor_format == "sbhd" else start[:, None] + pos[None, :]


def rope_reference(t, freqs, tensor_format="sbhd", interleaved=False, cu_seqlens=None,
                   start_positions=None, compute_dtype=torch.float32):
    """Plain PyTorch RoPE; float32 rounds once, like the kernel; compute_dtype=None is TE's unfused formula."""
    d2 = freqs.shape[-1]
    pos = _token_positions(t, tensor_format, cu_seqlens, start_positions)
    angles = freqs.reshape(freqs.shape[0], d2)[pos].unsqueeze(-2)  # [..., 1, d2]: one row per token
    dtype = compute_dtype or t.dtype
    x, x_pass = t[..., :d2].to(dtype), t[..., d2:]
    x_a, x_b = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    x_rot = torch.stack((-x_b, x_a), dim=-1).flatten(-2) if interleaved else torch.cat((-x_b, x_a), dim=-1)
    y = x * angles.cos().to(dtype) + x_rot * angles.sin().to(dtype)
    return torch.cat((y.to(t.dtype), x_pass), dim=-1)


# %%
# The backward, derived
# ---------------------
# Per pair of channels (a, b), with angles f_a and f_b (equal in a model's table, not in general):
#
#     y_a = x_a cos(f_a) - x_b sin(f_a)
#     y_b = x_b cos(f_b) + x_a sin(f_b)
#
# y is linear in x, so the gradient is the transposed map applied to dy = dL/dy (in TE's notation dx = dy cos(f) +
# R^T(dy sin(f)), R^T = -R: a quarter turn back), e.g. dt[0] = dy[0] cos(f[0]) + dy[d2/2] sin(f[d2/2]):
#
#     dx_a = dy_a cos(f_a) + dy_b sin(f_b) = dy_a cos(f_a) - dy_b (-sin(f_b))
#     dx_b = dy_b cos(f_b) - dy_a sin(f_a) = dy_b cos(f_b) + dy_a (-sin(f_a))
#
# In the forward's shape (right): it is the forward applied to dy with  sin_a <- -sin(f_b)  and  sin_b <- -sin(f_a)
# (cos unchanged). For a true rotation table (f_a = f_b) that is the forward with the angle negated: the inverse
# rotation. For an arbitrary table the two halves' sines also trade places, and a backward that only negated the
# angle would be wrong; the tests use such tables to catch it. Pass-through channels (d2 < d): y = x, dx = dy (copied).
#
# Memory traffic
# --------------
# The backward reads dy once and writes dx once: 2N elements for N elements of q and k, as the forward and a copy do.
# Autograd over the eager formula runs the backward of every op of the forward (the two products, the rotate-half's
# slices, negation and concatenation, the sum, the concatenation with the pass-through part), each reading and writing
# full tensors.
#
# Fused QKV (Megatron's layout): one projection gives qkv [s, b, h, W], each of the h groups holding g q heads, one k
# head and one v head of d channels, W = (g + 2) d. Unfused, q is copied out of qkv to be viewed as [s, b, h g, d],
# then rotated (N_q read and written twice), k rotated, v passed as a view; the backward rotates dq and dk into new
# tensors and concatenates dq, dk and dv into dqkv (N read and written once more). Fused, the forward reads qkv and
# writes q, k and v once (2N, v's copy included), the backward reads dq, dk, dv and writes dqkv once (2N): with 4 q
# heads a group, 2/3 of the forward's traffic and half the backward's, and one launch instead of three each way.
#
# Context parallelism (TE's layout): each sequence is cut into 2 cp_size chunks of c tokens, and rank r holds chunks
# r and 2 cp_size - 1 - r (which balances causal attention). Local token i < c sits at position r c + i, local token
# i >= c at (2 cp_size - 2 - r) c + i. The kernel applies this map to each token's position; in thd cu_seqlens holds
# the full sequences' offsets, and the rank's tokens of sequence j are cu_seqlens[j] / cp_size onwards.
#
# The kernel
# ----------
# 02's kernel, generalised: (1) BACKWARD swaps and negates the sines (derived above). (2) float64 is computed in
# float64 (for gradcheck), other dtypes in float32. (3) In thd the grid walks the packed tokens, each finding its
# sequence by binary search in cu_seqlens: 02's grid needs the longest sequence, known on the host only after a sync;
# this one needs none, so compiled code launches it exactly. (4) Positions go through the context-parallel map
# (identity for cp_size = 1). (5) Fused QKV: q head j at group j // g, channel (j % g) d; k's own angle table; v
# copied by the same program. Angle rows past the table are masked (read as 0), not read out of bounds.


@triton.jit
def _load_pairs(x_tile, stride_d, mask, rot_dim, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
                HALF: tl.constexpr, INTERLEAVED: tl.constexpr, IS_FP64: tl.constexpr):
    """Load the rotated channels of a [BLOCK_S, BLOCK_H] tile of heads as (x_a, x_b)."""
    compute = tl.float64 if IS_FP64 else tl.float32
    if INTERLEAVED:  # one contiguous load of d2 channels, split into even and odd in registers
        j = tl.arange(0, 2 * HALF)[None, None, :]
        x = tl.load(x_tile + j * stride_d, mask=mask & (j < rot_dim), other=0.0)
        x_a, x_b = tl.split(tl.reshape(x.to(compute), (BLOCK_S, BLOCK_H, HALF, 2)))
    else:  # two contiguous loads: the first and the second half of the d2 channels
        a = tl.arange(0, HALF)[None, None, :]
        m = mask & (a < rot_dim // 2)
        x_a = tl.load(x_tile + a * stride_d, mask=m, other=0.0).to(compute)
        x_b = tl.load(x_tile + (a + rot_dim // 2) * stride_d, mask=m, other=0.0).to(compute)
    return x_a, x_b


@triton.jit
def _store_rotated(y_tile, stride_d, mask, x_a, x_b, angles, rot_dim, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
                   HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """y_a = x_a cos_a - x_b sin_a, y_b = x_b cos_b + x_a sin_b, stored in y's dtype."""
    cos_a, sin_a, cos_b, sin_b = angles
    y_a = (x_a * cos_a - x_b * sin_a).to(y_tile.dtype.element_ty)
    y_b = (x_b * cos_b + x_a * sin_b).to(y_tile.dtype.element_ty)
    if INTERLEAVED:
        j = tl.arange(0, 2 * HALF)[None, None, :]
        tl.store(y_tile + j * stride_d, tl.reshape(tl.join(y_a, y_b), (BLOCK_S, BLOCK_H, 2 * HALF)),
                 mask=mask & (j < rot_dim))
    else:
        a = tl.arange(0, HALF)[None, None, :]
        m = mask & (a < rot_dim // 2)
        tl.store(y_tile + a * stride_d, y_a, mask=m)
        tl.store(y_tile + (a + rot_dim // 2) * stride_d, y_b, mask=m)


@triton.jit
def _copy_pass_through(x_tile, y_tile, stride_xd, stride_yd, mask, head_dim, rot_dim, PASS: tl.constexpr):
    p = rot_dim + tl.arange(0, PASS)[None, None, :]
    m = mask & (p < head_dim)
    tl.store(y_tile + p * stride_yd, tl.load(x_tile + p * stride_xd, mask=m), mask=m)


@triton.jit
def _sequence_of(cu_seqlens_ptr, token, n_seqs, cp_size):
    """Each token's sequence: the last i with cu_seqlens[i] / cp_size <= token, by binary search (probes cached)."""
    lo = tl.zeros_like(token)
    hi = lo + n_seqs  # invariant: cu_seqlens[lo] <= token < cu_seqlens[hi] (divided by cp_size)
    while tl.max(hi - lo, axis=0) > 1:
        mid = (lo + hi) // 2
        right = tl.load(cu_seqlens_ptr + mid) // cp_size <= token
        lo, hi = tl.where(right, mid, lo), tl.where(right, hi, mid)
    return lo


@triton.jit
def _cos_sin(freqs_ptr, angles_shared_ptr, pos, row_mask, n_positions, stride_fs, stride_fd, rot_dim,
             HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, IS_FP64: tl.constexpr):
    """(cos_a, sin_a, cos_b, sin_b), [BLOCK_S, 1, HALF] each; f_b read only if the table's halves differ (as in 02)."""
    i = tl.arange(0, HALF)
    if INTERLEAVED:
        f_a, f_b = 2 * i, 2 * i + 1
    else:
        f_a, f_b = i, i + rot_dim // 2
    f_mask = (row_mask & (pos < n_positions))[:, None] & (i < rot_dim // 2)[None, :]
    f_rows = freqs_ptr + pos.to(tl.int64)[:, None] * stride_fs
    angle_a = tl.load(f_rows + f_a[None, :] * stride_fd, mask=f_mask, other=0.0)
    read_b = tl.load(angles_shared_ptr + 0 * i)[None, :] == 0  # the flag, one copy per lane
    angle_b = tl.load(f_rows + f_b[None, :] * stride_fd, mask=f_mask & read_b, other=0.0)
    angle_a, angle_b = angle_a[:, None, :], tl.where(read_b, angle_b, angle_a)[:, None, :]
    compute = tl.float64 if IS_FP64 else tl.float32
    cos_a, sin_a = tl.cos(angle_a).to(compute), tl.sin(angle_a).to(compute)
    cos_b, sin_b = tl.cos(angle_b).to(compute), tl.sin(angle_b).to(compute)
    if BACKWARD:  # the transposed rotation: the sines trade halves and change sign
        sin_a, sin_b = -sin_b, -sin_a
    return cos_a, sin_a, cos_b, sin_b


@triton.jit
def rope_kernel(
    q_ptr, q_out_ptr, k_ptr, k_out_ptr, v_ptr, v_out_ptr, freqs_ptr, angles_shared_ptr, k_freqs_ptr,
    k_angles_shared_ptr, cu_seqlens_ptr, start_positions_ptr,
    n_batch, n_seq_blocks, seqlen, n_q_heads, n_k_heads, head_dim, rot_dim, n_positions, cp_size, cp_rank,
    k_col, k_out_col, v_col, v_out_col,  # fused QKV: where k and v start in the packed tensor (channels)
    stride_qb, stride_qs, stride_qh, stride_qd, stride_qob, stride_qos, stride_qoh, stride_qod,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_kob, stride_kos, stride_koh, stride_kod,
    stride_vb, stride_vs, stride_vh, stride_vd, stride_vob, stride_vos, stride_voh, stride_vod,
    stride_fs, stride_fd, stride_kfs, stride_kfd,
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HK: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr,
    DIM: tl.constexpr,
    N_HEAD_BLOCKS: tl.constexpr, INTERLEAVED: tl.constexpr, IS_THD: tl.constexpr,
    HAS_START_POSITIONS: tl.constexpr, HAS_K: tl.constexpr, HAS_V: tl.constexpr, K_FREQS: tl.constexpr,
    Q_GROUP_IN: tl.constexpr, Q_GROUP_OUT: tl.constexpr, PACKED_OUT: tl.constexpr, COPY_PASS: tl.constexpr,
    BATCH_FASTEST: tl.constexpr, BACKWARD: tl.constexpr, IS_FP64: tl.constexpr,
):
    # A 1-D grid in memory order: in sbhd the batch index moves fastest, in bshd the position; in
    # thd the program walks the packed tokens (seqlen is then the number of tokens).
    pid = tl.program_id(0)
    if PACKED_OUT:  # fused QKV's gradient: one output tensor, passed once (compiled code copies each one written)
        k_out_ptr, v_out_ptr = q_out_ptr, q_out_ptr
    if IS_THD:
        s = pid * BLOCK_S + tl.arange(0, BLOCK_S)
        row_mask = s < seqlen
        batch = _sequence_of(cu_seqlens_ptr, s, n_batch, cp_size)  # one sequence per token
        first = tl.load(cu_seqlens_ptr + batch) // cp_size
        length = tl.load(cu_seqlens_ptr + batch + 1) // cp_size - first
        pos = s - first
    else:
        if BATCH_FASTEST:
            pid_s, batch = pid // n_batch, pid % n_batch
        else:
            pid_s, batch = pid % n_seq_blocks, pid // n_seq_blocks
        s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
        row_mask = s < seqlen
        pos, length = s, seqlen
    half_local = length // 2  # c: the context-parallel map, the identity when cp_size = 1
    pos = tl.where(pos < half_local, pos + cp_rank * half_local, pos + (2 * cp_size - 2 - cp_rank) * half_local)
    if HAS_START_POSITIONS:
        pos = pos + tl.load(start_positions_ptr + batch)
    q_angles = _cos_sin(freqs_ptr, angles_shared_ptr, pos, row_mask, n_positions, stride_fs, stride_fd, rot_dim,
                        HALF, INTERLEAVED, BACKWARD, IS_FP64)
    k_angles = q_angles
    if K_FREQS:  # fused QKV: k has a table of its own
        k_angles = _cos_sin(k_freqs_ptr, k_angles_shared_ptr, pos, row_mask, n_positions, stride_kfs, stride_kfd,
                            rot_dim, HALF, INTERLEAVED, BACKWARD, IS_FP64)

    tokens = s.to(tl.int64)[:, None, None]  # row offsets in int64, [BLOCK_S, 1, 1]
    batch = 0 if IS_THD else batch.to(tl.int64)  # thd's rows are the packed tokens themselves
    q_rows, q_out_rows = q_ptr + batch * stride_qb + tokens * stride_qs, q_out_ptr + batch * stride_qob + tokens * stride_qos
    k_rows = k_ptr + k_col * stride_kd + batch * stride_kb + tokens * stride_ks
    k_out_rows = k_out_ptr + k_out_col * stride_kod + batch * stride_kob + tokens * stride_kos
    v_rows = v_ptr + v_col * stride_vd + batch * stride_vb + tokens * stride_vs
    v_out_rows = v_out_ptr + v_out_col * stride_vod + batch * stride_vob + tokens * stride_vos
    # The heads in N_HEAD_BLOCKS unrolled steps, each with a share of q's (BLOCK_H) and of k's and v's (BLOCK_HK, fewer
    # with GQA: equal shares keep as many bytes in flight at every step); all loads of a step before its first store.
    for hb in tl.static_range(N_HEAD_BLOCKS):
        h = (hb * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)[None, :, None]
        hk = (hb * BLOCK_HK + tl.arange(0, BLOCK_HK)).to(tl.int64)[None, :, None]
        q_mask, k_mask = row_mask[:, None, None] & (h < n_q_heads), row_mask[:, None, None] & (hk < n_k_heads)
        q_tile = q_rows + (h // Q_GROUP_IN) * stride_qh + (h % Q_GROUP_IN) * head_dim * stride_qd
        q_out_tile = q_out_rows + (h // Q_GROUP_OUT) * stride_qoh + (h % Q_GROUP_OUT) * head_dim * stride_qod
        q_a, q_b = _load_pairs(q_tile, stride_qd, q_mask, rot_dim, BLOCK_S, BLOCK_H, HALF, INTERLEAVED, IS_FP64)
        if HAS_K:
            k_a, k_b = _load_pairs(k_rows + hk * stride_kh, stride_kd, k_mask, rot_dim, BLOCK_S, BLOCK_HK, HALF,
                                   INTERLEAVED, IS_FP64)
        if HAS_V:  # fused QKV: v (or its gradient) copied whole, loaded with q and k, before any store
            c = tl.arange(0, DIM)[None, None, :]
            v = tl.load(v_rows + hk * stride_vh + c * stride_vd, mask=k_mask & (c < head_dim))
        _store_rotated(q_out_tile, stride_qod, q_mask, q_a, q_b, q_angles, rot_dim, BLOCK_S, BLOCK_H, HALF, INTERLEAVED)
        if HAS_K:
            _store_rotated(k_out_rows + hk * stride_koh, stride_kod, k_mask, k_a, k_b, k_angles, rot_dim, BLOCK_S,
                           BLOCK_HK, HALF, INTERLEAVED)
        if COPY_PASS:  # channels d2..d-1 pass through (the gradient too: dx = dy there)
            _copy_pass_through(q_tile, q_out_tile, stride_qd, stride_qod, q_mask, head_dim, rot_dim, PASS)
            if HAS_K:
                _copy_pass_through(k_rows + hk * stride_kh, k_out_rows + hk * stride_koh, stride_kd, stride_kod,
                                   k_mask, head_dim, rot_dim, PASS)
        if HAS_V:
            tl.store(v_out_rows + hk * stride_voh + c * stride_vod, v, mask=k_mask & (c < head_dim))


# %%
# The op: one launch, registered with torch.library
# -------------------------------------------------
# torch.compile cannot see inside a plain Python call to a Triton kernel; it would break the graph there.
# ``torch.library.triton_op`` registers the launcher as an operator and ``wrap_triton`` lets the compiler trace
# the kernel itself. Where torch lacks triton_op, or in the interpreter, a ``custom_op`` with a "fake" (output
# shapes only) keeps the graph whole, the kernel opaque. Either way: pure tensor work, no host syncs.


def _layout(t, tensor_format):  # (batch, seqlen, heads, head_dim) and the strides in that order; thd: batch stride 0
    if tensor_format == "thd":
        return (None, *t.shape), (0, *t.stride())
    order = (1, 0, 2, 3) if tensor_format == "sbhd" else (0, 1, 2, 3)
    return tuple(t.shape[i] for i in order), tuple(t.stride(i) for i in order)


def _launch(kernel, q, q_out, k, k_out, freqs, angles_shared, cu_seqlens, start_positions, tensor_format,
            interleaved, backward, cp_size, cp_rank, v=None, v_out=None, k_freqs=None, k_shared=None, q_groups=(1, 1),
            cols=(0, 0, 0, 0)):
    """Rotate q into q_out and k into k_out (backward=True: the transposed rotation) and copy v into v_out, in one
    launch. Fused QKV: q heads a group (q_groups, in and out), where k and v start in the packed tensor (cols)."""
    if kernel is None or q.numel() + (k.numel() if k is not None else 0) == 0:
        return
    io = [(q, q_out), (k, k_out) if k is not None else (q, q_out), (v, v_out) if v is not None else (q, q_out)]
    pointers = [x for pair in io for x in pair]
    pointers[3::2] = pointers[2::2] if cols[1] else pointers[3::2]  # PACKED_OUT: k, v stand in for the unused outputs
    pointers += [freqs, angles_shared, freqs if k_freqs is None else k_freqs, *[angles_shared if x is None else x for x
                 in (k_shared, cu_seqlens, start_positions)]]  # (the flag stands in for absent tensors: never read)
    key = kernel is rope_kernel and _signature(  # eager (outputs are new: the inputs decide); traced: no key
        q, k, v, freqs, k_freqs, cu_seqlens, start_positions, tensor_format, interleaved, backward, cp_size, cp_rank,
        q_groups, cols)
    launch = key and _launches.get((kernel, key))  # after the first call with a key, straight to the compiled kernel
    if launch:
        return launch[0](*pointers, *launch[1])
    (batch, seqlen, _, head_dim), _ = _layout(q_out if cols[0] else q, tensor_format)  # not the packed qkv
    rot_dim, n_heads = freqs.shape[3], (q.shape[-2] * q_groups[0], (k if k is not None else q).shape[-2])
    pow2 = lambda n: 1 << (int(n) - 1).bit_length()  # noqa: E731 (triton.next_power_of_2 is slower)
    half, blocks = pow2(rot_dim // 2), [max(1, pow2(n) // 4) for n in n_heads]  # heads in ~4 steps
    n_programs, batch = (seqlen, cu_seqlens.shape[0] - 1) if tensor_format == "thd" else (seqlen * batch, batch)
    grid, scalars, constexprs = (n_programs,), (  # one token a program; thd walks the packed tokens
        batch, seqlen, seqlen, *n_heads, head_dim, rot_dim, freqs.shape[0], cp_size, cp_rank, *cols,
        *[s for pair in io for x in pair for s in _layout(x, tensor_format)[1]], freqs.stride(0), freqs.stride(3),
        pointers[8].stride(0), pointers[8].stride(3)), dict(
        BLOCK_S=1, BLOCK_H=blocks[0], BLOCK_HK=blocks[1], N_HEAD_BLOCKS=max(-(-n // b) for n, b in zip(n_heads, blocks)),
        HALF=half, PASS=pow2(max(head_dim - rot_dim, 1)), DIM=pow2(head_dim), INTERLEAVED=interleaved,
        IS_THD=tensor_format == "thd", HAS_START_POSITIONS=start_positions is not None, HAS_K=k is not None,
        HAS_V=v is not None, K_FREQS=k_shared is not None, Q_GROUP_IN=q_groups[0], Q_GROUP_OUT=q_groups[1],
        PACKED_OUT=cols[1] > 0, COPY_PASS=rot_dim < head_dim, BATCH_FASTEST=tensor_format == "sbhd",
        BACKWARD=backward, IS_FP64=q.dtype == torch.float64,  # warps: results/02_rope_fwd_sweep.log, 03_..._sweep.log
        num_warps=4 if blocks[0] * half > 128 else 1 if v is not None and (blocks[0] + 2 * blocks[1]) * half < 256
        else 2)
    compiled = kernel[grid](*pointers, *scalars, **constexprs)  # through Triton (always, in the interpreter)
    if key and isinstance(compiled, triton.compiler.CompiledKernel):  # it takes all arguments in order, constexprs too
        _once(_launches, (kernel, key), lambda: (compiled[(*grid, 1, 1)[:3]], (*scalars, *[
            constexprs[name] for name in kernel.arg_names if name in constexprs])))


def _rope_impl(x: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor], freqs: torch.Tensor,
               k_freqs: Optional[torch.Tensor], angles_shared: torch.Tensor, k_shared: Optional[torch.Tensor],
               cu_seqlens: Optional[torch.Tensor], start_positions: Optional[torch.Tensor], tensor_format: str,
               interleaved: bool, backward: bool, cp_size: int, cp_rank: int, q_width: int,
               kernel=rope_kernel) -> List[torch.Tensor]:
    """RoPE (backward=True: the transposed rotation) into new contiguous tensors, as TransformerEngine's. q_width = 0:
    x is q, k optional. Fused QKV (q_width > 0): k None splits x = qkv [.., h, q_width + 2 d] into q [.., h g, d], k
    and v [.., h, d]; else x, k, v (dq, dk, dv) are merged into one [.., h, q_width + 2 d] (no concatenation)."""
    args = (freqs, angles_shared, cu_seqlens, start_positions, tensor_format, interleaved, backward, cp_size, cp_rank)
    if not q_width:
        outs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (x, k) if t is not None]
        _launch(kernel, x, outs[0], k, outs[-1] if k is not None else None, *args)
        return outs
    split, d = k is None, (x.shape[-1] - q_width) // 2 if k is None else k.shape[-1]
    qkv = x if split else x.new_empty(*k.shape[:3], q_width + 2 * d)
    parts = [x.new_empty(*x.shape[:2], x.shape[2] * (q_width // d), d), x.new_empty(*x.shape[:3], d),
             x.new_empty(*x.shape[:3], d)] if split else [x, k, v]
    (q, k, v), (q_out, k_out, v_out) = ([qkv] * 3, parts) if split else (parts, [qkv] * 3)  # qkv whole: no views
    g = q_width // d  # q heads a group; in qkv, k starts at channel q_width and v at q_width + d
    _launch(kernel, q, q_out, k, k_out, *args, v, v_out, k_freqs, k_shared, (g, 1) if split else (1, g),
            (q_width, 0, q_width + d, 0) if split else (0, q_width, 0, q_width + d))
    return parts if split else [qkv]


def _register(name, impl):  # impl as the op rope_tutorial::<name> (fresh if this file was loaded before)
    name = next(f"rope_tutorial::{name}{n or ''}" for n in itertools.count()
                if not hasattr(torch.ops.rope_tutorial, f"{name}{n or ''}"))
    kernel = torch.library.wrap_triton(rope_kernel) if _USE_TRITON_OP else rope_kernel

    def body(*args):
        return impl(*args, kernel=kernel)
    signature = inspect.signature(impl)  # the op's schema: impl's annotated arguments, without `kernel`
    body.__signature__ = signature.replace(parameters=list(signature.parameters.values())[:-1])
    op = (torch.library.triton_op if _USE_TRITON_OP else torch.library.custom_op)(name, body, mutates_args=())
    if not _USE_TRITON_OP:
        op.register_fake(lambda *args: impl(*args, kernel=None))  # outputs allocated, nothing launched

    def call(*args):  # the op where torch.compile traces; in eager mode a direct launch, where the dispatcher, the
        return op(*args) if torch.compiler.is_compiling() else impl(*args)  # op's autograd and alias checks cost time
    call.op = op
    return call


_USE_TRITON_OP = hasattr(torch.library, "triton_op") and os.environ.get("TRITON_INTERPRET") != "1"
_rope = _register("rope", _rope_impl)


# %%
# Argument checks, and the host cost of an eager call
# ----------------------------------------------------
# The checks run outside the op: in eager mode, and traced by torch.compile. Values on the GPU (cu_seqlens,
# start_positions) cost a host sync to read: their verdict is kept for the last tensors seen (as the "halves equal"
# flag is), and compiled code skips them (the kernel masks angle rows past the table). All else (checks, launch
# parameters) depends only on the call's signature: computed once per signature, later launches go straight to the
# compiled kernel (as in 02); a call that needs no gradient skips autograd. What it still costs: the host-cost table.

_checked, _launches, _last_results = {}, {}, {}


def _signature(*args):  # each tensor's shape, strides, dtype, device and 16-byte alignment; other arguments as is
    return tuple([(x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16) if isinstance(x, torch.Tensor)
                  else (type(x), x) for x in args])


def _once(cache, key, compute):
    """compute(), once per key; not kept if it raised (or the key is unhashable: a bad argument, named by the check)."""
    try:
        return cache[key]
    except (KeyError, TypeError):
        pass
    if len(cache) >= 4096:  # a workload of ever new shapes starts over
        cache.clear()
    cache[key] = value = compute()
    return value


def _remember(what, tensors, extra_key, compute):  # compute(), or its result for the same tensors and versions
    key = tuple((id(x), x._version) for x in tensors) + extra_key
    last = _last_results.get(what)
    if last is None or last[0] != key or not all(ref() is x for ref, x in zip(last[1], tensors)):
        _last_results[what] = (key, tuple(weakref.ref(x) for x in tensors), compute())
    return _last_results[what][2]


def _read_values(cu_seqlens, start_positions, seqlen, n_tokens, max_positions, cp_size):  # a host sync
    if cu_seqlens is not None:
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu[:8]}...")
        if cu[-1] != n_tokens * cp_size:
            raise ValueError(f"cu_seqlens[-1] = {cu[-1]} must be t's number of tokens times cp_size, {n_tokens * cp_size}")
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        if cp_size > 1 and any(n % (2 * cp_size) for n in lengths):
            raise ValueError(f"with cp_size = {cp_size}, the sequence lengths in cu_seqlens must be multiples of "
                             f"2 * cp_size (padded), got {lengths[:8]}")
    else:
        lengths = [seqlen * cp_size] * start_positions.numel()
    starts = start_positions.tolist() if start_positions is not None else [0] * len(lengths)
    if min(starts, default=0) < 0:
        raise ValueError(f"start_positions must be >= 0, got {min(starts)}")
    needed = max((s + n for s, n in zip(starts, lengths)), default=0)
    if needed > max_positions:
        raise ValueError(f"positions up to {needed - 1} are needed, but freqs has only {max_positions} rows (s2)")
    return True


def _angles_shared(freqs, interleaved, what="angles shared"):  # int32 [1]: 1 if f_b == f_a everywhere; no sync
    def compute():
        f = freqs[:, 0, 0]
        f_a, f_b = (f[:, 0::2], f[:, 1::2]) if interleaved else f.chunk(2, dim=-1)
        return (f_a == f_b).all().to(torch.int32).reshape(1)
    if torch.compiler.is_compiling():  # traced into the graph; the memo is eager-only
        return compute()
    return _remember(what, (freqs,), (interleaved,), compute)


def _check(tensors, names, freqs, tensor_format, cu_seqlens, start_positions, cp_size=1, cp_rank=0):
    if tensor_format not in TENSOR_FORMATS:
        raise ValueError(f"tensor_format must be one of {TENSOR_FORMATS}, got {tensor_format!r}")
    if not (isinstance(cp_size, int) and isinstance(cp_rank, int) and 0 <= cp_rank < cp_size):
        raise ValueError(f"cp_size and cp_rank: ints, 0 <= cp_rank < cp_size; got cp_size={cp_size!r}, cp_rank={cp_rank!r}")
    rank, t = 3 if tensor_format == "thd" else 4, tensors[0]
    for x, name in zip(tensors, names):
        if getattr(x, "dtype", None) not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise TypeError(f"{name} must be float32, float16, bfloat16 or float64 (a torch.Tensor), got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
        if x.dim() != rank:
            raise ValueError(f"{name} must have {rank} dims for tensor_format='{tensor_format}', got shape {tuple(x.shape)}")
        if x.dtype != t.dtype or x.shape[:-2] != t.shape[:-2] or x.shape[-1] != t.shape[-1]:
            raise ValueError(f"{name} must match {names[0]} in dtype and in every dim but heads: got "
                             f"{tuple(x.shape)} {x.dtype}, {names[0]} is {tuple(t.shape)} {t.dtype}")
    if getattr(freqs, "dtype", None) != torch.float32:
        raise TypeError(f"freqs must be float32 angles in a torch.Tensor (cos/sin are taken inside the kernel), got "
                        f"{getattr(freqs, 'dtype', type(freqs).__name__)}")
    if freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1:
        raise ValueError(f"freqs must have shape [s2, 1, 1, d2], got {tuple(freqs.shape)}")
    (batch, seqlen, _, head_dim), _ = _layout(t, tensor_format)
    max_positions, rot_dim = freqs.shape[0], freqs.shape[3]
    if rot_dim % 2 or not 2 <= rot_dim <= head_dim:
        raise ValueError(f"freqs' last dim d2 = {rot_dim} must be even and between 2 and the head dim {head_dim}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head dim {head_dim} is over the supported {MAX_HEAD_DIM}")
    for x, n in [*zip(tensors, names), (freqs, "freqs"), (cu_seqlens, "cu_seqlens"), (start_positions, "start_positions")]:
        if isinstance(x, torch.Tensor) and x.device != t.device:
            raise ValueError(f"{n} is on {x.device} but {names[0]} is on {t.device}")
    if tensor_format == "thd":
        if cu_seqlens is None:
            raise ValueError("cu_seqlens is required for tensor_format='thd'")
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32:
            raise TypeError(f"cu_seqlens must be an int32 tensor, got {getattr(cu_seqlens, 'dtype', type(cu_seqlens))}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must have shape [b + 1] with b >= 1, got {tuple(cu_seqlens.shape)}")
        batch = cu_seqlens.numel() - 1
    elif cu_seqlens is not None:
        raise ValueError(f"cu_seqlens is only for tensor_format='thd', got tensor_format={tensor_format!r}")
    elif cp_size > 1 and seqlen % 2:
        raise ValueError(f"with cp_size > 1 the local sequence length must be even (two chunks), got {seqlen}")
    elif seqlen * cp_size > max_positions:
        raise ValueError(f"sequence length {seqlen} (times cp_size) is over the {max_positions} rows (s2) of freqs")
    if start_positions is not None:
        if not isinstance(start_positions, torch.Tensor) or start_positions.dtype not in (torch.int32, torch.int64):
            raise TypeError("start_positions must be an int32 or int64 tensor")
        if start_positions.shape != (batch,):
            raise ValueError(f"start_positions must have shape [b] = [{batch}], got {tuple(start_positions.shape)}")
    return seqlen, t.shape[0], max_positions


# %%
# The autograd Function and the public API
# ----------------------------------------
# The forward saves nothing but the (small) angle table and index tensors: the backward needs only dy and the
# angles, not x. That is the whole memory cost of RoPE in training.


class _ApplyRoPE(torch.autograd.Function):
    """_rope_impl; each direction's gradient is the other (rotation and transpose, split and merge): double backward.
    Its arguments: the three inputs and the six other tensors of _rope_impl, then the rest as one tuple."""

    @staticmethod
    def forward(ctx, x, k, v, *args):
        ctx.save_for_backward(*args[:6])
        ctx.options = (*args[6][:2], not args[6][2], *args[6][3:])  # the other direction: backward flipped
        return tuple(_rope(x, k, v, *args[:6], *args[6]))

    @staticmethod
    def backward(ctx, *grads):
        args = (*grads, *[None] * (3 - len(grads)), *ctx.saved_tensors)
        dx = _ApplyRoPE.apply(*args, ctx.options) if torch.is_grad_enabled() else _rope(*args, *ctx.options)
        return (*dx, *[None] * (len(ctx.needs_input_grad) - len(dx)))  # (grad enabled: create_graph=True)


def _apply(tensors, names, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size=1, cp_rank=0,
           k_freqs=None, split=(0,), check=None):  # the last three: fused QKV's
    """Checks (once per signature; values once per tensor), then RoPE, through autograd where a gradient is wanted."""
    tracing = torch.compiler.is_compiling()
    if check is None:  # (not `check or ...`: torch 2.11's Dynamo cannot take a function's truth value)
        check = lambda: _check(tensors, names, freqs, tensor_format, cu_seqlens, start_positions, cp_size, cp_rank)  # noqa
    sizes = check() if tracing else _once(_checked, _signature(
        *tensors, freqs, k_freqs, cu_seqlens, start_positions, tensor_format, cp_size, cp_rank, *split), check)
    if not tracing and (cu_seqlens is not None or start_positions is not None):  # the values: a host sync, remembered
        values = (cu_seqlens, start_positions, *sizes, cp_size)
        _remember("values checked", [x for x in values[:2] if x is not None], values[2:], lambda: _read_values(*values))
    for f, name in ((freqs, "freqs" if k_freqs is None else "q_freqs"), (k_freqs, "k_freqs")):  # no silent loss of a
        if f is not None and f.requires_grad and torch.is_grad_enabled():  # gradient
            raise ValueError(f"{name} requires grad, but no gradient flows to the angle table here (as in "
                             f"TransformerEngine's fused RoPE); pass {name}.detach()")
    args = (*tensors, *[None] * (3 - len(tensors)), freqs, k_freqs, _angles_shared(freqs, interleaved),
            k_freqs if k_freqs is None else _angles_shared(k_freqs, interleaved, "k angles shared"), cu_seqlens,
            start_positions)
    options = (tensor_format, interleaved, False, cp_size, cp_rank, split[0])
    if tracing or torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
        return _ApplyRoPE.apply(*args, options)
    return tuple(_rope(*args, *options))  # no graph to record


def apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                         fused=True, cu_seqlens=None, cp_size=1, cp_rank=0):
    """Differentiable RoPE; TransformerEngine's ``apply_rotary_pos_emb`` arguments, in its order.

    t: [s, b, h, d] (sbhd) | [b, s, h, d] (bshd) | [total_tokens, h, d] (thd); fp32, fp16, bf16 (fp64 for gradcheck),
        any strides, d <= 256.
    freqs: float32 angles [s2, 1, 1, d2], d2 even, d2 <= d. Only t[..., :d2] is rotated. No gradient flows to freqs:
        one that requires grad is refused (pass freqs.detach()).
    start_positions: int [b]: sequence i uses angle rows start_positions[i] onwards.
    interleaved: rotate pairs (x0, x1), (x2, x3), ... (RoFormer, GPT-J) instead of halves.
    fused: accepted for TE compatibility and ignored: this is always one fused kernel.
    cu_seqlens: int32 [b + 1], thd only; with cp_size > 1 the full sequences' offsets (lengths multiples of 2 cp_size).
    cp_size, cp_rank: context parallelism: t holds rank cp_rank's two chunks of each sequence (see above);
        start_positions shift the whole sequences' positions (TE refuses start_positions with cp_size > 1).
    Returns a new contiguous tensor shaped like t. Works under torch.compile(fullgraph=True) and autocast.
    """
    return _apply([t], ("t",), freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank)[0]


def apply_rotary_pos_emb_qk(q, k, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                            cu_seqlens=None, cp_size=1, cp_rank=0):
    """``apply_rotary_pos_emb`` on q and k in one launch each way; k may have fewer heads (GQA). Returns (q, k)."""
    return _apply([q, k], ("q", "k"), freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank)


def apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format="sbhd",
                                   start_positions=None, interleaved=False, cu_seqlens=None, cp_size=1, cp_rank=0):
    """TransformerEngine's ``apply_fused_qkv_rotary_pos_emb``: RoPE of q and k straight out of a fused projection.

    qkv: [s, b, h, q_width + 2 d] (sbhd) | [b, s, h, q_width + 2 d] (bshd), any strides; each of the h groups holds
        q_width / d q heads, one k head and one v head (Megatron's GQA layout). qkv_split_arg_list: [q_width, d, d].
    q_freqs, k_freqs: float32 angle tables [s2, 1, 1, d2] of one shape. cu_seqlens: None (no thd, as in TE).
    Returns contiguous q [s, b, h q_width / d, d], k and v [s, b, h, d] (bshd: [b, s, ...]); one launch each way."""
    def check():
        if tensor_format not in ("sbhd", "bshd") or cu_seqlens is not None:
            raise ValueError(f"fused QKV takes tensor_format 'sbhd' or 'bshd' and cu_seqlens=None, got {tensor_format!r}")
        if len(split) != 3 or not all(type(w) is int and w > 0 for w in split) or split[2] != split[1] or (
                split[0] % split[1]):
            raise ValueError(f"qkv_split_arg_list must be [q_width, d, d], q_width a multiple of d, got "
                             f"{qkv_split_arg_list!r}")
        if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[-1] != sum(split):
            raise ValueError(f"qkv must be a 4-dim tensor whose last dim is {sum(split)}, the sum of qkv_split_arg_list")
        if not isinstance(k_freqs, torch.Tensor) or (k_freqs.shape, k_freqs.dtype, k_freqs.device) != (
                q_freqs.shape, q_freqs.dtype, q_freqs.device):
            raise ValueError("k_freqs must be a tensor of q_freqs' shape, dtype and device")
        return _check([qkv[..., split[0]:split[0] + split[1]]], ("qkv",), q_freqs, tensor_format, None, start_positions,
                      cp_size, cp_rank)
    split = list(qkv_split_arg_list) if isinstance(qkv_split_arg_list, (list, tuple)) else []
    return _apply([qkv], ("qkv",), q_freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank,
                  k_freqs, split, check)


# %%
# Unit test
# ---------
# Values and gradients against autograd through the reference (the printout lists the cases); tests/test_03_rope_bwd.py
# covers the whole matrix, context parallelism, gradcheck in float64, torch.compile and a model-level check.


def self_check():
    torch.manual_seed(0)
    b, s, h, d = (3, 36, 5, 80) if DEVICE.type == "cuda" else (2, 8, 3, 80)
    cu = torch.tensor([0] + [1 + i * s for i in range(b - 1)] + [b * s], dtype=torch.int32, device=DEVICE)  # one of length 1
    for dtype, fmt, interleaved in itertools.product((torch.float32, torch.bfloat16), TENSOR_FORMATS, (False, True)):
        x = torch.randn(b, s, 3, h, d, device=DEVICE, dtype=dtype)
        q, k = ((y.transpose(0, 1) if fmt == "sbhd" else y.flatten(0, 1) if fmt == "thd" else y).requires_grad_() for y
                in (x[:, :, 0], x[:, :, 1, :2]))  # strided views; k has fewer heads
        kw = dict(tensor_format=fmt, start_positions=torch.randint(0, 5, (b,), device=DEVICE), interleaved=interleaved,
                  cu_seqlens=cu if fmt == "thd" else None)
        freqs = torch.randn(2 * b * s, 1, 1, 48, device=DEVICE)  # partial rotary, halves differ
        cases = [(apply_rotary_pos_emb_qk(q, k, freqs, **kw), tuple(rope_reference(y, freqs, **kw) for y in (q, k)),
                  (q, k))]
        if fmt != "thd":  # fused QKV, 2 q heads a group
            qkv = torch.randn(*q.shape[:2], 2, 4 * d, device=DEVICE, dtype=dtype, requires_grad=True)
            q_in, k_in, v_in = qkv.split([2 * d, d, d], dim=-1)
            cases.append((apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs / 3, [2 * d, d, d], **kw), (rope_reference(
                q_in.reshape(*q.shape[:2], 4, d), freqs, **kw), rope_reference(k_in, freqs / 3, **kw), v_in), (qkv,)))
        for outs, refs, inputs in cases:  # values, and gradients with respect to inputs
            grads = [torch.randn_like(y) for y in outs]
            for got, want in zip(outs + torch.autograd.grad(outs, inputs, grads),
                                 refs + torch.autograd.grad(refs, inputs, grads)):
                torch.testing.assert_close(got, want)
    print(f"self-check passed: forward and gradients, fp32/bf16 x sbhd/bshd/thd x half/interleaved, d={d}, d2=48, "
          f"GQA, strided views, start_positions, fused QKV (device: {DEVICE.type})")


# %%
# Benchmark
# ---------
TIMED = ("bf16, bshd. Fused QKV: qkv [b, s, h / 4, 6 d], 4 q heads a group; \"three calls\": split, q copied out, q and k "
         "rotated by `apply_rotary_pos_emb`. eager, torch.compile: TE's unfused formula; compiled: per shape, fullgraph. A "
         "cell: median GPU time (`do_bench_cudagraph`) or (\"eager call\") of ten calls in a row (`do_bench`), per call, "
         "host cost included; (x%): a same-run copy of the bytes that must move (x2 forward + backward) over the cell's "
         "time. Host cost: median of 7 interleaved rounds of 200 calls in a row (wall time, one sync) at (1, 128, 2, 64).")


def _us(fn, eager_call=False, calls=0):  # per call, as TIMED says (ten eager calls in a row: do_bench clears L2
    if DEVICE.type == "cuda" and not calls:  # between calls, which would hide their host cost)
        n, bench = (10, triton.testing.do_bench) if eager_call else (1, triton.testing.do_bench_cudagraph)
        return bench(lambda: [fn() for _ in range(n)], return_mode="median") * 1e3 / n
    sync = torch.cuda.synchronize if calls else lambda: None  # calls in a row after a warm one; no GPU: one, cold
    _ = calls and (fn(), sync())
    start = time.perf_counter()
    for _ in range(calls or 1):
        fn()
    sync()
    return (time.perf_counter() - start) / (calls or 1) * 1e6


def benchmark(results_dir):  # prints each row as measured; on a GPU, writes results/<script>_<GPU kind>.md
    class Identity(torch.autograd.Function):  # autograd's own cost (host-cost table): a Function that launches nothing
        forward = staticmethod(lambda ctx, *xs: tuple(x.new_empty(x.shape) for x in xs))
        backward = staticmethod(lambda ctx, *grads: grads)
    on_gpu, pages, bf16 = DEVICE.type == "cuda", {}, dict(device=DEVICE, dtype=torch.bfloat16)
    ours = lambda q, k, f: apply_rotary_pos_emb_qk(q, k, f, "bshd")  # noqa: E731
    eager = lambda q, k, f: [rope_reference(x, f, "bshd", compute_dtype=None) for x in (q, k)]  # noqa: E731 (TE's)
    fused = lambda x, f: apply_fused_qkv_rotary_pos_emb(x, f, f, [4 * f.shape[-1], *f.shape[-1:] * 2], "bshd")  # noqa
    three_calls = lambda x, f: (lambda q, k, v: (*(apply_rotary_pos_emb(y, f, "bshd") for y in (  # noqa: E731
        q.reshape(*k.shape[:2], -1, k.shape[-1]), k)), v))(*x.split([4 * f.shape[-1], *f.shape[-1:] * 2], dim=-1))
    qk = {"ours": ours, "ours, eager call": ours, "eager": eager, **({"ours, compiled": torch.compile(
        ours, fullgraph=True, dynamic=False), "torch.compile": torch.compile(eager, dynamic=False)} if on_gpu else {})}
    qkv = {"fused": fused, "fused, eager call": fused, "three calls": three_calls,
           **({"fused, compiled": torch.compile(fused, fullgraph=True, dynamic=False)} if on_gpu else {})}
    backward = lambda dq, dk, f: _rope(dq, dk, None, f, None, _angles_shared(f, False), None, None, None,  # noqa
                                       "bshd", False, True, 1, 0, 0)  # the backward kernel alone
    torch._dynamo.config.cache_size_limit = 64  # a graph per shape (dynamic=False)
    if not on_gpu:
        print("\nNO GPU: the kernels run in Triton's interpreter on the CPU. The timings below only "
              "show that the benchmark runs; they say nothing about speed.")
    for b, s, h, d in [(4, 4096, 32, 128), (32, 512, 12, 64), (1, 32768, 8, 128)] if on_gpu else [(2, 8, 4, 64)]:
        freqs, (src, dst) = rope_freqs(s, d, device=DEVICE), torch.randn(2, 2 * b * s * h * d, **bf16)  # for the copy
        q, k, x = (torch.randn(b, s, n, w, **bf16, requires_grad=True) for n, w in ((h, d), (h, d), (h // 4, 6 * d)))
        dq, dk, dkv = (torch.randn(b, s, n, d, **bf16) for n in (h, h, h // 4))  # dkv: dk and dv of fused QKV
        for table, xs, dxs, fns in [("q and k, backward", (dq, dk), None, {"ours": backward}),
                                    ("q and k, forward + backward", (q, k), (dq, dk), qk),
                                    ("fused QKV, forward", (x,), None, qkv),
                                    ("fused QKV, forward + backward", (x,), (dq, dkv, dkv), qkv)]:
            fns = {"copy x2" if dxs else "copy": lambda n=sum(y.numel() for y in xs): [dst[:n].copy_(src[:n]) for _ in
                   range(1 + bool(dxs))], **{n: (lambda f=f: torch.autograd.grad(f(*xs, freqs), xs, dxs)) if dxs else (
                       lambda f=f: f(*xs, freqs)) for n, f in fns.items()}}  # the copy: the bytes that must move, each way
            us = {name: _us(fn, "eager call" in name) for name, fn in fns.items()}
            lines = pages.setdefault(table, [f"| shape (b, s, h, d) | {' | '.join(us)} |", "|---" * (len(us) + 1) + "|"])
            lines.append(f"| {(b, s, h, d)} | " + " | ".join(  # (x%): the copy's time (first column) over t
                f"{t:.1f} us" + f" ({100 * next(iter(us.values())) / t:.0f}%)" * on_gpu for t in us.values()) + " |")
            print(f"{table}: {lines[-1]}")
    if not on_gpu:
        return
    x, freqs = torch.randn(1, 128, 2, 64, **bf16), rope_freqs(128, 64, device=DEVICE)  # the GPU waits for the host
    (q, k, v), qkv = [x.clone().requires_grad_() for _ in "qkv"], x.repeat(1, 1, 1, 3).requires_grad_()
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(*(y.transpose(1, 2) for y in (q, k, v)))  # noqa
    ours = lambda: apply_rotary_pos_emb_qk(q, k, freqs, "bshd")  # noqa: E731
    bwd = lambda f, n=2: lambda: torch.autograd.backward(f(), [x] * n)  # noqa: E731: forward + backward of f
    fns = {"empty op (x + 1)": lambda: x + 1, "autograd alone: identity Function on q, k, forward + backward":
           bwd(lambda: Identity.apply(q, k)), "SDPA, forward": sdpa, "SDPA, forward + backward":
           lambda: sdpa().backward(x.transpose(1, 2)), "ours, q and k, forward, no grad":
           lambda: apply_rotary_pos_emb_qk(x, x, freqs, "bshd"), "ours, q and k, forward": ours,
           "ours, q and k, forward + backward": bwd(ours), "ours, fused QKV, forward + backward":
           bwd(lambda: apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, [64, 64, 64], "bshd"), 3)}
    times = [(name, _us(fn, calls=200)) for _ in range(7) for name, fn in fns.items()]  # rounds interleaved
    us = {name: sorted(t for n, t in times if n == name)[3] for name in fns}
    rows = ["| eager call, (1, 128, 2, 64) bf16 | host us per call | empty ops |", "|---|---|---|"] + [
        f"| {name} | {t:.1f} | {t / us['empty op (x + 1)']:.1f} |" for name, t in us.items()]
    print("\n".join(pages.setdefault("host cost of an eager call", rows)))
    write_page(results_dir, pages)


def write_page(results_dir, pages):  # results/<script>_<GPU kind>.md: title, environment, command, TIMED, tables, log
    (here, script), gpu = os.path.split(os.path.abspath(__file__)), torch.cuda.get_device_name()
    stem = script[:-3] + "_" + next((w for w in gpu.split() if w[:1] in "ABHL" and w[1:2].isdigit()), "gpu")
    commit = os.popen(f'git -C "{here}" rev-parse --short HEAD 2>{os.devnull}').read().strip() or "n/a"
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, stem + ".md"), "w") as f:
        f.write(f"# {__doc__.splitlines()[1]}\n\ndevice: {gpu}; date: {time.strftime('%Y-%m-%d')}; torch "
                f"{torch.__version__}; triton {triton.__version__}; python {sys.version.split()[0]}; commit {commit}; "
                f"{script} md5 {hashlib.md5(open(__file__, 'rb').read()).hexdigest()[:8]}\n\nCommand: `python "
                f"{' '.join(sys.argv)}`\n\n{TIMED}\n\n" + "".join(f"## {t}\n\n" + "\n".join(lines) + "\n\n"
                                                            for t, lines in pages.items()) + f"Raw log: `{stem}.log`.\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                        help="folder for the page (written only on a GPU)")
    args, _ = parser.parse_args(), self_check()
    benchmark(args.results)
