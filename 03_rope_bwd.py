"""
RoPE backward, and a differentiable RoPE that drops into real models
====================================================================

In this tutorial, you will learn about:

* deriving RoPE's backward, element by element: the forward with each half's sine moved to the
  other half and negated (one kernel, a direction flag); why that is "the angle negated" only for
  true rotation tables;
* a ``torch.autograd.Function`` with TransformerEngine's ``apply_rotary_pos_emb`` signature, for q
  alone or q and k (grouped-query attention) in one launch each way, with context parallelism as a
  position map;
* fused QKV: q, k and v straight out of one projection's output, and its gradient written back as
  one tensor;
* Hugging Face's ``apply_rotary_pos_emb(q, k, cos, sin)``: the kernel reading cos/sin tables as a
  model's rotary module builds them (any RoPE type, its attention factor included), per batch row
  or picked by ``position_ids``, and M-RoPE;
* registering Triton kernels with ``torch.library`` (``triton_op`` + ``wrap_triton``) so that
  ``torch.compile(fullgraph=True)`` captures them, and keeping host syncs out of compiled code;
* checking gradients against autograd through the reference (and, in the tests, with
  ``torch.autograd.gradcheck`` in float64: the kernel computes float64 as float64), and what
  autograd over the eager formula costs.

How to read this file. Part 1 is the lesson (about 45 minutes): the PyTorch reference, the backward
derived, the memory traffic (fused QKV included), context parallelism's position map, the kernel,
and ``launch_rope``, a plain launcher built on ``rope_launch_args``. Part 2 is the drop-in: argument
checks, the per-signature launch cache, the ``torch.library`` op, the autograd Function,
TransformerEngine's three entry points and ``rope_freqs``, and Hugging Face's two; skip it on a
first read. Part 3 checks values and gradients against autograd through the reference on irregular
shapes, and times the kernels against a same-run copy of the bytes and against the eager formula
(the host cost of an eager call is measured for 02-04 together by ``results/host_cost.py``).

Run ``python 03_rope_bwd.py``: it checks itself against autograd through the PyTorch reference,
then benchmarks. This file imports only torch and triton: copy it alone into your project.
"""

# %% Part 1 - the lesson
# With no GPU, the kernels run in Triton's interpreter (numpy on the CPU), chosen before triton
# is imported.
import argparse
import functools
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
# Tokens a program: one on a GPU (the launch below says why). Triton's interpreter runs the
# programs one after another at a high cost each, so on a CPU a program takes 16.
TOKENS_A_PROGRAM = 1 if DEVICE.type == "cuda" else 16
TENSOR_FORMATS = ("sbhd", "bshd", "thd")
MAX_HEAD_DIM = 256

# %%
# The PyTorch reference (as in 02)
# --------------------------------
# y = x * cos(f) + R(x) * sin(f) on the first d2 channels, y = x on the rest, where R pairs
# channel a with b and negates the first: rotate-half (a = i, b = i + d2/2) or interleaved pairs
# (a = 2i, b = 2i + 1). The angles f come as a float32 table [s2, 1, 1, d2], a row a position; a
# model's row p holds p base^(-2i/d2) for pair i, both channels of a pair the same angle
# (rope_freqs, in Part 2, builds TransformerEngine's). Autograd through this function is the
# oracle for every gradient below.


def _token_positions(t, tensor_format, cu_seqlens, start_positions):
    """Position of every token, shaped to broadcast against t[..., 0, 0]."""
    if tensor_format == "thd":
        tokens = torch.arange(t.shape[0], device=t.device)
        seq = torch.searchsorted(cu_seqlens[1:].long(), tokens, right=True)
        pos = tokens - cu_seqlens.long()[seq]
        if start_positions is not None:
            pos = pos + start_positions.long()[seq]
        return pos
    pos = torch.arange(t.shape[tensor_format.index("s")], device=t.device)
    start = pos.new_zeros(1)
    if start_positions is not None:
        start = start_positions.long()
    if tensor_format == "sbhd":
        return pos[:, None] + start[None, :]
    return start[:, None] + pos[None, :]


def rope_reference(
    t,
    freqs,
    tensor_format="sbhd",
    interleaved=False,
    cu_seqlens=None,
    start_positions=None,
    compute_dtype=torch.float32,
):
    """Plain PyTorch RoPE; float32 rounds once, like the kernel; compute_dtype=None is TE's
    unfused formula."""
    d2 = freqs.shape[-1]
    pos = _token_positions(t, tensor_format, cu_seqlens, start_positions)
    angles = freqs.reshape(freqs.shape[0], d2)[pos].unsqueeze(-2)  # [..., 1, d2]: a row a token
    dtype = t.dtype if compute_dtype is None else compute_dtype
    x = t[..., :d2].to(dtype)
    if interleaved:
        x_rot = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        x_a, x_b = x.chunk(2, dim=-1)
        x_rot = torch.cat((-x_b, x_a), dim=-1)
    y = x * angles.cos().to(dtype) + x_rot * angles.sin().to(dtype)
    return torch.cat((y.to(t.dtype), t[..., d2:]), dim=-1)


# %%
# The backward, derived
# ---------------------
# Per pair of channels (a, b), with angles f_a and f_b (equal in a model's table, not in general):
#
#     y_a = x_a cos(f_a) - x_b sin(f_a)
#     y_b = x_b cos(f_b) + x_a sin(f_b)
#
# y is linear in x, so the gradient is the transposed map applied to dy = dL/dy (in TE's notation
# dx = dy cos(f) + R^T(dy sin(f)), R^T = -R: a quarter turn back), e.g.
# dt[0] = dy[0] cos(f[0]) + dy[d2/2] sin(f[d2/2]):
#
#     dx_a = dy_a cos(f_a) + dy_b sin(f_b) = dy_a cos(f_a) - dy_b (-sin(f_b))
#     dx_b = dy_b cos(f_b) - dy_a sin(f_a) = dy_b cos(f_b) + dy_a (-sin(f_a))
#
# In the forward's shape (right): it is the forward applied to dy with  sin_a <- -sin(f_b)  and
# sin_b <- -sin(f_a)  (cos unchanged). For a true rotation table (f_a = f_b) that is the forward
# with the angle negated: the inverse rotation. For an arbitrary table the two halves' sines also
# trade places, and a backward that only negated the angle would be wrong; the tests use such
# tables to catch it. Pass-through channels (d2 < d): y = x, dx = dy (copied).
#
# Memory traffic
# --------------
# The backward reads dy once and writes dx once: 2N elements for N elements of q and k, as the
# forward and a copy do. Autograd over the eager formula runs the backward of every op of the
# forward (the two products, the rotate-half's slices, negation and concatenation, the sum, the
# concatenation with the pass-through part), each reading and writing full tensors.
#
# Fused QKV (Megatron's layout): one projection gives qkv [s, b, h, W], each of the h groups
# holding g q heads, one k head and one v head of d channels, W = (g + 2) d. Unfused, q is copied
# out of qkv to be viewed as [s, b, h g, d] (for g > 1 no view can regroup its heads), then rotated
# (N_q read and written twice), k rotated, v passed as a view; the backward rotates dq and dk into
# new tensors and concatenates dq, dk and dv into dqkv (N read and written once more). Fused, the
# forward reads qkv and writes q, k and v once (2N, v's copy included), the backward reads dq, dk,
# dv and writes dqkv once (2N). Counted in heads of a group, with 4 q heads a group (N = 6, N_q = 4,
# N_k = N_v = 1): the forward moves 12 against 8 + 8 + 2 = 18, 2/3; the backward 12 against
# 8 + 2 + 12 = 22, 6/11 (a little over half); and one launch instead of three each way.
#
# Context parallelism (TE's layout): each sequence is cut into 2 cp_size chunks of c tokens, and
# rank r holds chunks r and 2 cp_size - 1 - r (which balances causal attention). Local token i < c
# sits at position r c + i, local token i >= c at (2 cp_size - 2 - r) c + i. The kernel applies
# this map to each token's position; in thd cu_seqlens holds the full sequences' offsets, and the
# rank's tokens of sequence j are cu_seqlens[j] / cp_size onwards.
#
# The kernel
# ----------
# 02's kernel, generalised: (1) BACKWARD swaps and negates the sines (derived above). (2) float64
# is computed in float64 (for gradcheck), other dtypes in float32. (3) In thd the grid walks the
# packed tokens, each finding its sequence by 02's search in cu_seqlens (divided by cp_size). (4)
# Positions go through the context-parallel map (identity for cp_size = 1). (5) Fused QKV: q head
# j at group j // g, channel (j % g) d; k's own angle table; v copied by the same program. (6)
# TABLES: cos and sin read from two tables as they are (Hugging Face's, 02's lesson says why), a
# row per batch row and position, or the row that position_ids names. Angle rows past the table
# are masked (read as 0), not read out of bounds.


@triton.jit
def _load_pairs(
    x_tile,
    stride_d,
    mask,
    rot_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    IS_FP64: tl.constexpr,
):
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
def _load_qk(
    q_tile,
    k_rows,
    hk,
    stride_qd,
    stride_kh,
    stride_kd,
    q_mask,
    k_mask,
    rot_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    IS_FP64: tl.constexpr,
    HAS_K: tl.constexpr,
):
    """One step's (q_a, q_b, k_a, k_b), k's heads hk; without k, q's pair stands in for k's."""
    q_a, q_b = _load_pairs(
        q_tile, stride_qd, q_mask, rot_dim, BLOCK_S, BLOCK_H, HALF, INTERLEAVED, IS_FP64
    )
    k_a, k_b = q_a, q_b
    if HAS_K:
        k_a, k_b = _load_pairs(
            k_rows + hk * stride_kh,
            stride_kd,
            k_mask,
            rot_dim,
            BLOCK_S,
            BLOCK_HK,
            HALF,
            INTERLEAVED,
            IS_FP64,
        )
    return q_a, q_b, k_a, k_b


@triton.jit
def _store_rotated(
    y_tile,
    stride_d,
    mask,
    x_a,
    x_b,
    angles,
    rot_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """y_a = x_a cos_a - x_b sin_a, y_b = x_b cos_b + x_a sin_b, stored in y's dtype."""
    cos_a, sin_a, cos_b, sin_b = angles
    y_a = (x_a * cos_a - x_b * sin_a).to(y_tile.dtype.element_ty)
    y_b = (x_b * cos_b + x_a * sin_b).to(y_tile.dtype.element_ty)
    if INTERLEAVED:
        j = tl.arange(0, 2 * HALF)[None, None, :]
        tl.store(
            y_tile + j * stride_d,
            tl.reshape(tl.join(y_a, y_b), (BLOCK_S, BLOCK_H, 2 * HALF)),
            mask=mask & (j < rot_dim),
        )
    else:
        a = tl.arange(0, HALF)[None, None, :]
        m = mask & (a < rot_dim // 2)
        tl.store(y_tile + a * stride_d, y_a, mask=m)
        tl.store(y_tile + (a + rot_dim // 2) * stride_d, y_b, mask=m)


@triton.jit
def _copy_pass_through(
    x_tile, y_tile, stride_xd, stride_yd, mask, head_dim, rot_dim, PASS: tl.constexpr
):
    p = rot_dim + tl.arange(0, PASS)[None, None, :]
    m = mask & (p < head_dim)
    tl.store(y_tile + p * stride_yd, tl.load(x_tile + p * stride_xd, mask=m), mask=m)


@triton.jit
def _sequence_of(cu_seqlens_ptr, token, n_seqs, cp_size, WAYS: tl.constexpr):
    """Each token's sequence: the last i with cu_seqlens[i] / cp_size <= token, by 02's WAYS-ary
    search (log_WAYS(b) steps of WAYS probes loaded at once)."""
    lo = tl.zeros_like(token)
    width = lo + n_seqs  # invariant: the answer is one of lo .. lo + width - 1
    while tl.max(width, axis=0) > 1:
        step = (width + WAYS - 1) // WAYS
        probe = lo[:, None] + step[:, None] * (tl.arange(0, WAYS) + 1)[None, :]
        inside = probe < (lo + width)[:, None]
        cu = tl.load(cu_seqlens_ptr + probe, mask=inside, other=0) // cp_size
        count = tl.sum((inside & (cu <= token[:, None])).to(tl.int32), axis=1)  # a prefix
        lo = lo + count * step
        width = tl.minimum(step, width - count * step)
    return lo


@triton.jit
def _cos_sin(
    freqs_ptr,
    sin_ptr,
    angles_shared_ptr,
    rows,
    row_mask,
    stride_fd,
    rot_dim,
    HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr,
    IS_FP64: tl.constexpr,
    TABLES: tl.constexpr,
):
    """(cos_a, sin_a, cos_b, sin_b), [BLOCK_S, 1, HALF] each, from the table rows at offsets rows:
    angles, or TABLES: cos and sin read as they are (Hugging Face's, in any float dtype, perhaps
    scaled by an attention factor). The second halves are read only if the flag says the halves
    differ: rotate-half's tables then move half their bytes, as in 02."""
    i = tl.arange(0, HALF)
    if INTERLEAVED:
        f_a, f_b = 2 * i, 2 * i + 1
    else:
        f_a, f_b = i, i + rot_dim // 2
    f_mask = row_mask[:, None] & (i < rot_dim // 2)[None, :]
    f_rows = rows.to(tl.int64)[:, None]
    offset_a = f_rows + f_a[None, :] * stride_fd
    read_b = tl.load(angles_shared_ptr + 0 * i)[None, :] == 0  # the flag, one copy per lane
    # Equal halves: f_b's loads take f_a's offsets again, bytes the cache already holds
    offset_b = tl.where(read_b, f_rows + f_b[None, :] * stride_fd, offset_a)
    compute = tl.float64 if IS_FP64 else tl.float32
    if TABLES:
        cos_a = tl.load(freqs_ptr + offset_a, mask=f_mask, other=0.0).to(compute)[:, None, :]
        cos_b = tl.load(freqs_ptr + offset_b, mask=f_mask, other=0.0).to(compute)[:, None, :]
        sin_a = tl.load(sin_ptr + offset_a, mask=f_mask, other=0.0).to(compute)[:, None, :]
        sin_b = tl.load(sin_ptr + offset_b, mask=f_mask, other=0.0).to(compute)[:, None, :]
    else:
        angle_a = tl.load(freqs_ptr + offset_a, mask=f_mask, other=0.0)[:, None, :]
        angle_b = tl.load(freqs_ptr + offset_b, mask=f_mask, other=0.0)[:, None, :]
        cos_a, sin_a = tl.cos(angle_a).to(compute), tl.sin(angle_a).to(compute)
        cos_b, sin_b = tl.cos(angle_b).to(compute), tl.sin(angle_b).to(compute)
    if BACKWARD:  # the transposed rotation: the sines trade halves and change sign
        sin_a, sin_b = -sin_b, -sin_a
    return cos_a, sin_a, cos_b, sin_b


@triton.jit
def rope_kernel(
    q_ptr,
    q_out_ptr,
    k_ptr,
    k_out_ptr,
    v_ptr,
    v_out_ptr,
    freqs_ptr,
    angles_shared_ptr,
    k_freqs_ptr,
    k_angles_shared_ptr,
    cu_seqlens_ptr,
    start_positions_ptr,
    n_batch,
    n_seq_blocks,
    seqlen,
    n_q_heads,
    n_k_heads,
    head_dim,
    rot_dim,
    n_positions,
    cp_size,
    cp_rank,
    k_col,
    k_out_col,
    v_col,
    v_out_col,  # fused QKV: where k and v start in the packed tensor (channels)
    stride_qb,
    stride_qs,
    stride_qh,
    stride_qd,
    stride_qob,
    stride_qos,
    stride_qoh,
    stride_qod,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_kob,
    stride_kos,
    stride_koh,
    stride_kod,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_vob,
    stride_vos,
    stride_voh,
    stride_vod,
    stride_fs,
    stride_fd,
    stride_kfs,
    stride_kfd,
    stride_fb,
    stride_pb,
    stride_ps,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    DIM: tl.constexpr,
    N_HEAD_BLOCKS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    IS_THD: tl.constexpr,
    HAS_START_POSITIONS: tl.constexpr,
    HAS_K: tl.constexpr,
    HAS_V: tl.constexpr,
    K_FREQS: tl.constexpr,
    Q_GROUP_IN: tl.constexpr,
    Q_GROUP_OUT: tl.constexpr,
    PACKED_OUT: tl.constexpr,
    COPY_PASS: tl.constexpr,
    BATCH_FASTEST: tl.constexpr,
    BACKWARD: tl.constexpr,
    IS_FP64: tl.constexpr,
    TABLES: tl.constexpr,
    POSITION_IDS: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    # A 1-D grid in memory order: in sbhd the batch index moves fastest, in bshd the position; in
    # thd the program walks the packed tokens (seqlen is then the number of tokens).
    pid = tl.program_id(0)
    if PACKED_OUT:  # fused QKV's gradient: one output tensor, passed once (see rope_kernel_tensors)
        k_out_ptr, v_out_ptr = q_out_ptr, q_out_ptr
    if IS_THD:
        s = pid * BLOCK_S + tl.arange(0, BLOCK_S)
        row_mask = s < seqlen
        batch = _sequence_of(cu_seqlens_ptr, s, n_batch, cp_size, WAYS=8)  # one sequence a token
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
    pos = tl.where(
        pos < half_local, pos + cp_rank * half_local, pos + (2 * cp_size - 2 - cp_rank) * half_local
    )
    if POSITION_IDS:  # Hugging Face's position_ids [b, s]: each token's row of the table
        ids = start_positions_ptr + batch * stride_pb + s * stride_ps
        pos = tl.load(ids, mask=row_mask, other=0)
    elif HAS_START_POSITIONS:
        pos = pos + tl.load(start_positions_ptr + batch)
    in_table = row_mask & (pos >= 0) & (pos < n_positions)  # no row outside the table: read as 0
    rows = pos.to(tl.int64) * stride_fs
    if TABLES:  # a table of its own for each batch row, or one for all (stride 0)
        rows += batch.to(tl.int64) * stride_fb
    # TABLES: q's and k's cos in freqs, their sin in k_freqs; else k_freqs: k's angles (fused QKV)
    q_angles = _cos_sin(
        freqs_ptr,
        k_freqs_ptr,
        angles_shared_ptr,
        rows,
        in_table,
        stride_fd,
        rot_dim,
        HALF,
        INTERLEAVED,
        BACKWARD,
        IS_FP64,
        TABLES,
    )
    k_angles = q_angles
    if K_FREQS:  # fused QKV: k has a table of its own
        k_angles = _cos_sin(
            k_freqs_ptr,
            k_freqs_ptr,
            k_angles_shared_ptr,
            pos.to(tl.int64) * stride_kfs,
            in_table,
            stride_kfd,
            rot_dim,
            HALF,
            INTERLEAVED,
            BACKWARD,
            IS_FP64,
            False,
        )

    tokens = s.to(tl.int64)[:, None, None]  # row offsets in int64, [BLOCK_S, 1, 1]
    batch = 0 if IS_THD else batch.to(tl.int64)  # thd's rows are the packed tokens themselves
    q_rows = q_ptr + batch * stride_qb + tokens * stride_qs
    q_out_rows = q_out_ptr + batch * stride_qob + tokens * stride_qos
    k_rows = k_ptr + k_col * stride_kd + batch * stride_kb + tokens * stride_ks
    k_out_rows = k_out_ptr + k_out_col * stride_kod + batch * stride_kob + tokens * stride_kos
    v_rows = v_ptr + v_col * stride_vd + batch * stride_vb + tokens * stride_vs
    v_out_rows = v_out_ptr + v_out_col * stride_vod + batch * stride_vob + tokens * stride_vos
    # The heads in N_HEAD_BLOCKS unrolled steps, each with a share of q's (BLOCK_H) and of k's and
    # v's (BLOCK_HK, fewer with GQA: equal shares keep as many bytes in flight at every step); all
    # loads of a step before its first store. PREFETCH: the next step's q and k are loaded before
    # this step's stores too. The compiler never moves a load above a store that may alias it, so
    # this is the code's to do; it pays where masked lanes leave a step few bytes (d2 = 80).
    tl.static_assert(Q_GROUP_IN == 1 or not PREFETCH)  # the next q tile: BLOCK_H heads on
    next_tiles = None  # PREFETCH: (q_a, q_b, k_a, k_b) of the next step
    for hb in tl.static_range(N_HEAD_BLOCKS):
        h = (hb * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)[None, :, None]
        hk = (hb * BLOCK_HK + tl.arange(0, BLOCK_HK)).to(tl.int64)[None, :, None]
        q_mask = row_mask[:, None, None] & (h < n_q_heads)
        k_mask = row_mask[:, None, None] & (hk < n_k_heads)
        q_tile = q_rows + (h // Q_GROUP_IN) * stride_qh + (h % Q_GROUP_IN) * head_dim * stride_qd
        q_out_tile = (
            q_out_rows + (h // Q_GROUP_OUT) * stride_qoh + (h % Q_GROUP_OUT) * head_dim * stride_qod
        )
        if PREFETCH and hb > 0:  # loaded by the step before, ahead of its stores
            q_a, q_b, k_a, k_b = next_tiles
        else:
            q_a, q_b, k_a, k_b = _load_qk(
                q_tile,
                k_rows,
                hk,
                stride_qd,
                stride_kh,
                stride_kd,
                q_mask,
                k_mask,
                rot_dim,
                BLOCK_S,
                BLOCK_H,
                BLOCK_HK,
                HALF,
                INTERLEAVED,
                IS_FP64,
                HAS_K,
            )
        if PREFETCH and hb + 1 < N_HEAD_BLOCKS:  # the next step's tiles too (Q_GROUP_IN is 1)
            next_tiles = _load_qk(
                q_tile + BLOCK_H * stride_qh,
                k_rows,
                hk + BLOCK_HK,
                stride_qd,
                stride_kh,
                stride_kd,
                row_mask[:, None, None] & (h + BLOCK_H < n_q_heads),
                row_mask[:, None, None] & (hk + BLOCK_HK < n_k_heads),
                rot_dim,
                BLOCK_S,
                BLOCK_H,
                BLOCK_HK,
                HALF,
                INTERLEAVED,
                IS_FP64,
                HAS_K,
            )
        if (
            HAS_V
        ):  # fused QKV: v (or its gradient) copied whole, loaded with q and k, before any store
            c = tl.arange(0, DIM)[None, None, :]
            v = tl.load(v_rows + hk * stride_vh + c * stride_vd, mask=k_mask & (c < head_dim))
        _store_rotated(
            q_out_tile,
            stride_qod,
            q_mask,
            q_a,
            q_b,
            q_angles,
            rot_dim,
            BLOCK_S,
            BLOCK_H,
            HALF,
            INTERLEAVED,
        )
        if HAS_K:
            _store_rotated(
                k_out_rows + hk * stride_koh,
                stride_kod,
                k_mask,
                k_a,
                k_b,
                k_angles,
                rot_dim,
                BLOCK_S,
                BLOCK_HK,
                HALF,
                INTERLEAVED,
            )
        if COPY_PASS:  # channels d2..d-1 pass through (the gradient too: dx = dy there)
            _copy_pass_through(
                q_tile, q_out_tile, stride_qd, stride_qod, q_mask, head_dim, rot_dim, PASS
            )
            if HAS_K:
                _copy_pass_through(
                    k_rows + hk * stride_kh,
                    k_out_rows + hk * stride_koh,
                    stride_kd,
                    stride_kod,
                    k_mask,
                    head_dim,
                    rot_dim,
                    PASS,
                )
        if HAS_V:
            tl.store(v_out_rows + hk * stride_voh + c * stride_vod, v, mask=k_mask & (c < head_dim))


# %%
# The launch
# ----------
# One program a token on a GPU (BLOCK_S = 1) with all its heads, the grid in memory order (thd: the
# packed tokens); q's heads in about four unrolled steps of BLOCK_H, k's and v's in as many of
# BLOCK_HK. Many small programs of few warps keep the most bytes in flight per multiprocessor (the
# sweeps: results/02_rope_fwd_sweep.log, results/03_rope_bwd_sweep.log); with TABLES, each step
# loads the next step's q and k before its own stores, in two steps, or four where masked lanes
# leave a step few bytes (d2 = 80) (results/03_hf_launch_sweep_H200.log). The kernel takes every
# tensor argument whether it is used or not: its flags (HAS_K, HAS_V, K_FREQS, IS_THD,
# HAS_START_POSITIONS) say which are real, and a tensor that is passed but never read stands in for
# each absent one.


def _layout(t, tensor_format):
    """t's (batch, seqlen, heads, head_dim) and its strides in that order; thd: batch None, batch
    stride 0 (the rows are the packed tokens). "bhsd": Hugging Face's [b, h, s, d]."""
    if tensor_format == "thd":
        return (None, *t.shape), (0, *t.stride())
    order = {"sbhd": (1, 0, 2, 3), "bhsd": (0, 2, 1, 3)}.get(tensor_format, (0, 1, 2, 3))
    return tuple(t.shape[i] for i in order), tuple(t.stride(i) for i in order)


def _pow2(n):  # the next power of 2 (int(): a traced size is specialized, as the kernel is)
    return triton.next_power_of_2(int(n))


def rope_kernel_tensors(
    q,
    q_out,
    k,
    k_out,
    v,
    v_out,
    freqs,
    angles_shared,
    k_freqs,
    k_shared,
    cu_seqlens,
    start_positions,
    packed_out=False,
):
    """rope_kernel's twelve tensor arguments, in its order, with a stand-in for each absent (None)
    one: q's pair for k's and v's, freqs for k_freqs, angles_shared for the rest."""
    if k is None:
        k = q
        k_out = q_out
    if v is None:
        v = q
        v_out = q_out
    if packed_out:
        # Fused QKV's gradient: q_out is dqkv, and the kernel writes dk and dv into it too
        # (PACKED_OUT). Under torch.compile each tensor argument that a kernel writes gets a copy
        # of its own (wrap_triton's functional form), so dqkv is passed once: the inputs k and v,
        # never written, take the places of k_out and v_out.
        k_out = k
        v_out = v
    if k_freqs is None:
        k_freqs = freqs
    if k_shared is None:
        k_shared = angles_shared
    if cu_seqlens is None:
        cu_seqlens = angles_shared
    if start_positions is None:
        start_positions = angles_shared
    return (
        q,
        q_out,
        k,
        k_out,
        v,
        v_out,
        freqs,
        angles_shared,
        k_freqs,
        k_shared,
        cu_seqlens,
        start_positions,
    )


def rope_launch_args(
    q,
    q_out,
    k,
    k_out,
    freqs,
    angles_shared,
    cu_seqlens,
    start_positions,
    tensor_format,
    interleaved,
    backward,
    cp_size=1,
    cp_rank=0,
    v=None,
    v_out=None,
    k_freqs=None,
    k_shared=None,
    q_groups=(1, 1),
    cols=(0, 0, 0, 0),
    tables=False,
):
    """rope_kernel's launch as (grid, tensors, scalars, constexprs), for
    ``rope_kernel[grid](*tensors, *scalars, **constexprs)``: rotate q into q_out and k into k_out
    (backward=True: the transposed rotation) and copy v into v_out. k, cu_seqlens and
    start_positions may be None. Fused QKV: v, k's table (k_freqs, k_shared); q_groups, the q
    heads a group as q is read and as q_out is written (split: (g, 1), merge: (1, g)); cols, the
    channel where k, k_out, v and v_out start in the packed qkv. tables: freqs and k_freqs are
    cos and sin [s2, b or 1, 1, d2] of one layout, and a 2-D start_positions is position_ids."""
    packed_out = cols[1] > 0  # fused QKV's gradient: dq, dk and dv written into one dqkv
    tensors = rope_kernel_tensors(
        q,
        q_out,
        k,
        k_out,
        v,
        v_out,
        freqs,
        angles_shared,
        k_freqs,
        k_shared,
        cu_seqlens,
        start_positions,
        packed_out,
    )

    # Sizes, from the tensor that holds q's heads (split: q_out, as q is the packed qkv)
    q_heads = q_out if cols[0] else q
    batch, seqlen, n_q_heads, head_dim = _layout(q_heads, tensor_format)[0]
    n_k_heads = _layout(tensors[2], tensor_format)[0][2]  # k's, or its stand-in's
    rot_dim = freqs.shape[3]
    BLOCK_S = TOKENS_A_PROGRAM
    n_seq_blocks = triton.cdiv(seqlen, BLOCK_S)
    if tensor_format == "thd":  # seqlen: the packed tokens, each program finds its sequence
        batch = cu_seqlens.shape[0] - 1
        grid = (n_seq_blocks,)
    else:
        grid = (batch * n_seq_blocks,)
    HALF = _pow2(rot_dim // 2)
    steps = 4  # the heads in about four steps
    prefetch = tables  # cos and sin loaded, not computed: each step loads the next step's q, k
    if tables and 2 * HALF == rot_dim:  # and without masked lanes, two steps pay
        steps = 2
    BLOCK_H = max(1, _pow2(n_q_heads) // steps)
    BLOCK_HK = max(1, _pow2(n_k_heads) // steps)
    n_head_blocks = max(triton.cdiv(n_q_heads, BLOCK_H), triton.cdiv(n_k_heads, BLOCK_HK))

    table_batch_stride = 0  # one table for every batch row
    if freqs.shape[1] > 1:  # a table of each batch row's
        table_batch_stride = freqs.stride(1)
    position_strides = (0, 0)
    if start_positions is not None and start_positions.dim() == 2:  # position_ids [b, s]
        position_strides = start_positions.stride()

    def strides(x, stand_in):  # (batch, seqlen, heads, head_dim); x absent: its stand-in's
        if x is None:
            x = stand_in
        return _layout(x, tensor_format)[1]

    scalars = (
        batch,
        n_seq_blocks,
        seqlen,
        n_q_heads,
        n_k_heads,
        head_dim,
        rot_dim,
        freqs.shape[0],  # n_positions: rows of the angle tables
        cp_size,
        cp_rank,
        *cols,  # k_col, k_out_col, v_col, v_out_col
        *strides(q, q),
        *strides(q_out, q_out),
        *strides(k, q),
        *strides(k_out, q_out),  # packed: q_out's, through which the kernel writes
        *strides(v, q),
        *strides(v_out, q_out),
        *freqs.stride()[::3],  # (position, channel)
        *tensors[8].stride()[::3],  # k_freqs, or freqs
        table_batch_stride,
        *position_strides,
    )
    if tables and HALF < 64:  # tables of up to 64 rotated channels: two warps
        num_warps = 2
    elif BLOCK_H * HALF > 128:  # big tiles of q
        num_warps = 4
    elif v is not None and (BLOCK_H + 2 * BLOCK_HK) * HALF < 256:  # fused QKV's small tiles
        num_warps = 1
    else:
        num_warps = 2
    constexprs = dict(
        BLOCK_S=BLOCK_S,
        BLOCK_H=BLOCK_H,
        BLOCK_HK=BLOCK_HK,
        HALF=HALF,
        PASS=_pow2(max(head_dim - rot_dim, 1)),
        DIM=_pow2(head_dim),
        N_HEAD_BLOCKS=n_head_blocks,
        INTERLEAVED=interleaved,
        IS_THD=tensor_format == "thd",
        HAS_START_POSITIONS=start_positions is not None,
        HAS_K=k is not None,
        HAS_V=v is not None,
        K_FREQS=k_shared is not None,
        Q_GROUP_IN=q_groups[0],
        Q_GROUP_OUT=q_groups[1],
        PACKED_OUT=packed_out,
        COPY_PASS=rot_dim < head_dim,
        BATCH_FASTEST=tensor_format == "sbhd",
        BACKWARD=backward,
        IS_FP64=q.dtype == torch.float64,
        TABLES=tables,
        POSITION_IDS=start_positions is not None and start_positions.dim() == 2,
        PREFETCH=prefetch,
        num_warps=num_warps,  # a launch option, not a kernel argument
    )
    return grid, tensors, scalars, constexprs


def launch_rope(
    q,
    k,
    freqs,
    tensor_format="sbhd",
    interleaved=False,
    backward=False,
    cu_seqlens=None,
    start_positions=None,
    cp_size=1,
    cp_rank=0,
):
    """RoPE of q and k (k may be None) in one launch, into new contiguous tensors; backward=True:
    their gradients from the outputs' (the transposed rotation). q, k: [s, b, h, d] | [b, s, h, d]
    | [total_tokens, h, d] as tensor_format says; freqs: float32 angles [s2, 1, 1, d2]; cu_seqlens:
    int32 [b + 1] (thd); start_positions: int [b]; cp_size, cp_rank: context parallelism; all
    unchecked (Part 2 checks). Returns (q_out, k_out). The kernel reads both angles of
    every pair (angles_shared = 0: right for any table); Part 2 tells it when the table's halves
    are equal, so that it reads one."""
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = None
    if k is not None:
        k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    angles_shared = torch.zeros(1, dtype=torch.int32, device=q.device)  # read both angles a pair
    grid, tensors, scalars, constexprs = rope_launch_args(
        q,
        q_out,
        k,
        k_out,
        freqs,
        angles_shared,
        cu_seqlens,
        start_positions,
        tensor_format,
        interleaved,
        backward,
        cp_size,
        cp_rank,
    )
    rope_kernel[grid](*tensors, *scalars, **constexprs)
    return q_out, k_out


# %% Part 2 - the drop-in
# Part 1's kernel as a drop-in for TransformerEngine's fused RoPE. Each piece, and what it buys
# (the timings: results/03_rope_bwd_H100.md; the host cost of an eager call: results/host_cost.py):
# - argument checks, once per call signature: errors that name the argument, not paid per call;
# - the launch cache around rope_launch_args: a signature's later launches go straight to the
#   compiled kernel, past Triton's binding of its 74 arguments;
# - values read once per tensor: cu_seqlens and start_positions cost one host sync, not one a call,
#   and the "halves equal" flag of an angle table, or of cos and sin (the kernel then reads one
#   value a pair), one computation (compiled code, which cannot keep it, passes 0: both read);
# - a torch.library op: torch.compile(fullgraph=True) captures the launch without a graph break;
# - an autograd Function: gradients and double backward, saving only the angle tables, their
#   flags and the index tensors;
# - TransformerEngine's three entry points and its contract: contiguous outputs, context
#   parallelism, fused QKV, ``fused=`` accepted and ignored; rope_freqs builds its angle tables.

# %%
# Remembered per signature, and per tensor
# ----------------------------------------
# The checks and the launch parameters depend only on the call's signature (each tensor's shape,
# strides, dtype, device and 16-byte alignment, on which Triton specializes pointers; the other
# arguments): computed once per signature. Values on the GPU (cu_seqlens, start_positions) cost a
# host sync to read: their verdict is kept for the last tensors seen (as the "halves equal" flag
# is), and compiled code skips them (the kernel masks angle rows past the table).

_checked = {}
_launches = {}
_last_results = {}
_read_both = {}  # per device: the flag with which the kernel reads both halves of the tables


def _signature(*args):
    """Each tensor's shape, strides, dtype, device and 16-byte alignment; other arguments as is."""
    return tuple(  # of a list: faster than of a generator
        [
            (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16)
            if isinstance(x, torch.Tensor)
            else (type(x), x)
            for x in args
        ]
    )


def _once(cache, key, compute, *args):
    """compute(*args), once per key; not kept if it raised (or the key is unhashable: a bad
    argument, named by the check)."""
    try:
        return cache[key]
    except (KeyError, TypeError):
        pass
    if len(cache) >= 4096:  # a workload of ever new shapes starts over
        cache.clear()
    cache[key] = value = compute(*args)
    return value


def _remember(what, tensors, extra_key, compute, *args):
    """compute(*args), or its result for the same tensors at the same versions."""
    if any([x.is_inference() for x in tensors]):  # no version counter: computed every time
        return compute(*args)
    key = tuple([(id(x), x._version) for x in tensors]) + extra_key
    last = _last_results.get(what)
    if last is None or last[0] != key or not all(ref() is x for ref, x in zip(last[1], tensors)):
        with torch.inference_mode(False):  # a result autograd may save later
            result = compute(*args)
        _last_results[what] = (key, tuple(weakref.ref(x) for x in tensors), result)
    return _last_results[what][2]


# %%
# The launch cache, and the op registered with torch.library
# -----------------------------------------------------------
# torch.compile cannot see inside a plain Python call to a Triton kernel; it would break the graph
# there. ``torch.library.triton_op`` registers the launcher as an operator and ``wrap_triton`` lets
# the compiler trace the kernel itself. Where torch lacks triton_op, or in the interpreter, a
# ``custom_op`` with a "fake" (output shapes only) keeps the graph whole, the kernel opaque. Either
# way: pure tensor work, no host syncs. Eager calls skip the op: they launch directly.


def _as_angle_rows(table):
    """Hugging Face's cos or sin [b or 1, s, d2] (with position_ids, a cache [max_positions, d2])
    as rope_launch_args' tables [s2, b or 1, 1, d2]: a view, rows by position."""
    if table.dim() == 2:
        return table[:, None, None, :]
    return table.transpose(0, 1).unsqueeze(2)


def _launch(
    kernel,
    q,
    q_out,
    k,
    k_out,
    freqs,
    angles_shared,
    cu_seqlens,
    start_positions,
    tensor_format,
    interleaved,
    backward,
    cp_size,
    cp_rank,
    v=None,
    v_out=None,
    k_freqs=None,
    k_shared=None,
    q_groups=(1, 1),
    cols=(0, 0, 0, 0),
    tables=False,
):
    """rope_launch_args' launch (the same arguments), remembered: in eager mode a signature's
    first call goes through Triton, later ones straight to the compiled kernel with the
    remembered scalars and constexprs. kernel: rope_kernel (eager), wrap_triton's (traced: nothing
    remembered) or None (the op's fake: nothing launched)."""
    if kernel is None:
        return
    if q.numel() == 0 and (k is None or k.numel() == 0):  # nothing to rotate
        return
    key = None
    if kernel is rope_kernel:  # eager: the inputs decide (the outputs are new)
        key = (
            _signature(q, k, v, freqs, k_freqs, cu_seqlens, start_positions),
            tensor_format,  # the other arguments are checked: their values decide
            interleaved,
            backward,
            cp_size,
            cp_rank,
            q_groups,
            cols,
            tables,
        )
        launch = _launches.get(key)
        if launch is not None:
            compiled, args = launch
            tensors = rope_kernel_tensors(
                q,
                q_out,
                k,
                k_out,
                v,
                v_out,
                freqs,
                angles_shared,
                k_freqs,
                k_shared,
                cu_seqlens,
                start_positions,
                cols[1] > 0,
            )
            compiled(*tensors, *args)
            return
    if tables:  # views made here, once per signature, not on every call
        freqs = _as_angle_rows(freqs)
        k_freqs = _as_angle_rows(k_freqs)
    grid, tensors, scalars, constexprs = rope_launch_args(
        q,
        q_out,
        k,
        k_out,
        freqs,
        angles_shared,
        cu_seqlens,
        start_positions,
        tensor_format,
        interleaved,
        backward,
        cp_size,
        cp_rank,
        v,
        v_out,
        k_freqs,
        k_shared,
        q_groups,
        cols,
        tables,
    )
    compiled = kernel[grid](*tensors, *scalars, **constexprs)  # always, in the interpreter
    if key is not None and isinstance(compiled, triton.compiler.CompiledKernel):

        def remembered():  # the compiled kernel takes every argument in order, constexprs too
            names = [name for name in rope_kernel.arg_names if name in constexprs]
            values = [constexprs[name] for name in names]
            return compiled[(*grid, 1, 1)], (*scalars, *values)

        _once(_launches, key, remembered)


def _rope_impl(
    x: torch.Tensor,
    k: Optional[torch.Tensor],
    v: Optional[torch.Tensor],
    freqs: torch.Tensor,
    k_freqs: Optional[torch.Tensor],
    angles_shared: Optional[torch.Tensor],
    k_shared: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    start_positions: Optional[torch.Tensor],
    tensor_format: str,
    interleaved: bool,
    backward: bool,
    cp_size: int,
    cp_rank: int,
    q_width: int,
    tables: bool,
    kernel=rope_kernel,
) -> List[torch.Tensor]:
    """RoPE (backward=True: the transposed rotation) into new contiguous tensors, as
    TransformerEngine's. q_width = 0: x is q, k optional. Fused QKV (q_width > 0): k None splits
    x = qkv [.., h, q_width + 2 d] into q [.., h g, d], k and v [.., h, d]; else x, k, v (dq, dk,
    dv) are merged into one [.., h, q_width + 2 d] (no concatenation). tensor_format "bhsd":
    Hugging Face's q and k [b, h, s, d], the outputs with their strides (for views of [b, s, h, d]
    memory, as transformers' formula returns them). tables: freqs and k_freqs are Hugging Face's
    cos and sin as they are, [b or 1, s, d2] (with position_ids, [max_positions, d2])."""
    args = (
        freqs,
        angles_shared,
        cu_seqlens,
        start_positions,
        tensor_format,
        interleaved,
        backward,
        cp_size,
        cp_rank,
    )
    if not q_width:
        memory_format = torch.contiguous_format
        if tensor_format == "bhsd":
            memory_format = torch.preserve_format
        q_out = torch.empty_like(x, memory_format=memory_format)
        if k is None:
            _launch(kernel, x, q_out, None, None, *args, k_freqs=k_freqs, tables=tables)
            return [q_out]
        k_out = torch.empty_like(k, memory_format=memory_format)
        _launch(kernel, x, q_out, k, k_out, *args, k_freqs=k_freqs, tables=tables)
        return [q_out, k_out]
    if k is None:  # split: qkv passed whole as q, k and v (no views), k at q_width, v after
        d = (x.shape[-1] - q_width) // 2
        g = q_width // d  # q heads a group
        q_out = x.new_empty(*x.shape[:2], x.shape[2] * g, d)
        k_out = x.new_empty(*x.shape[:3], d)
        v_out = x.new_empty(*x.shape[:3], d)
        cols = (q_width, 0, q_width + d, 0)
        _launch(kernel, x, q_out, x, k_out, *args, x, v_out, k_freqs, k_shared, (g, 1), cols)
        return [q_out, k_out, v_out]
    d = k.shape[-1]  # merge: dq, dk and dv written into one dqkv, at the same channels
    qkv = x.new_empty(*k.shape[:3], q_width + 2 * d)
    cols = (0, q_width, 0, q_width + d)
    _launch(kernel, x, qkv, k, qkv, *args, v, qkv, k_freqs, k_shared, (1, q_width // d), cols)
    return [qkv]


def _register(name, impl):
    """impl as the op rope_tutorial::<name> (a fresh name if this file was loaded before), and a
    call that takes the op where torch.compile traces, impl itself in eager mode (where the
    dispatcher, the op's autograd and alias checks cost time). The call's .op is the op."""
    n = 0
    while hasattr(torch.ops.rope_tutorial, f"{name}{n or ''}"):
        n += 1
    qualified_name = f"rope_tutorial::{name}{n or ''}"
    kernel = rope_kernel
    if _USE_TRITON_OP:
        kernel = torch.library.wrap_triton(rope_kernel)

    def body(*args):
        return impl(*args, kernel=kernel)

    def fake(*args):  # outputs allocated, nothing launched
        return impl(*args, kernel=None)

    signature = inspect.signature(impl)  # the op's schema: impl's annotated arguments, not kernel
    body.__signature__ = signature.replace(parameters=list(signature.parameters.values())[:-1])
    if _USE_TRITON_OP:
        op = torch.library.triton_op(qualified_name, body, mutates_args=())
    else:
        op = torch.library.custom_op(qualified_name, body, mutates_args=())
        op.register_fake(fake)

    def call(*args):
        if torch.compiler.is_compiling():
            return op(*args)
        return impl(*args)

    call.op = op
    return call


_USE_TRITON_OP = hasattr(torch.library, "triton_op") and os.environ.get("TRITON_INTERPRET") != "1"
_rope = _register("rope", _rope_impl)


# %%
# Argument checks
# ---------------
# The checks run outside the op: in eager mode (once per signature), and traced by torch.compile.


def _read_values(cu_seqlens, start_positions, seqlen, n_tokens, max_positions, cp_size):
    """The checks of the values of cu_seqlens and start_positions: a host sync."""
    if cu_seqlens is not None:
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu[:8]}...")
        if cu[-1] != n_tokens * cp_size:
            raise ValueError(
                f"cu_seqlens[-1] = {cu[-1]} must be t's number of tokens times cp_size, "
                f"{n_tokens * cp_size}"
            )
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        if cp_size > 1 and any(n % (2 * cp_size) for n in lengths):
            raise ValueError(
                f"with cp_size = {cp_size}, the sequence lengths in cu_seqlens must be multiples "
                f"of 2 * cp_size (padded), got {lengths[:8]}"
            )
    else:
        lengths = [seqlen * cp_size] * start_positions.numel()
    starts = [0] * len(lengths)
    if start_positions is not None:
        starts = start_positions.tolist()
    if min(starts, default=0) < 0:
        raise ValueError(f"start_positions must be >= 0, got {min(starts)}")
    needed = max((s + n for s, n in zip(starts, lengths)), default=0)
    if needed > max_positions:
        raise ValueError(
            f"positions up to {needed - 1} are needed, but freqs has only {max_positions} rows (s2)"
        )
    return True


def _halves_equal(tables, interleaved):
    """int32 [1]: 1 if in each of the tables every pair's two values are equal."""
    equal = []
    for f in tables:
        if interleaved:
            f_a = f[..., 0::2]
            f_b = f[..., 1::2]
        else:
            f_a, f_b = f.chunk(2, dim=-1)
        equal.append((f_a == f_b).all())
    return torch.stack(equal).all().to(torch.int32).reshape(1)


def _read_both_flag(device):
    return torch.zeros(1, dtype=torch.int32, device=device)


def _angles_shared(tables, interleaved, what="angles shared"):
    """int32 [1]: 1 if in each of the tables (angles; or cos and sin) every pair's two values are
    equal (f_b == f_a, as in a model's table), so that the kernel reads f_a only. No host sync:
    the flag stays on the device; eager calls remember it for the last tables seen. Compiled code
    cannot remember it, nor can a call on inference tensors (no version counter), and a pass over
    the table each call costs more than the kernel's reading both halves: 0 there."""
    if torch.compiler.is_compiling():
        return _read_both_flag(tables[0].device)
    if any([f.is_inference() for f in tables]):  # one flag a device, not an allocation a call
        return _once(_read_both, tables[0].device, _read_both_flag, tables[0].device)
    return _remember(what, tables, (interleaved,), _halves_equal, tables, interleaved)


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check(tensors, names, freqs, tensor_format, cu_seqlens, start_positions, cp_size=1, cp_rank=0):
    """Raises on a bad argument, naming it; returns (seqlen, t.shape[0], rows of freqs)."""
    if tensor_format not in TENSOR_FORMATS:
        raise ValueError(f"tensor_format must be one of {TENSOR_FORMATS}, got {tensor_format!r}")
    if not (isinstance(cp_size, int) and isinstance(cp_rank, int) and 0 <= cp_rank < cp_size):
        raise ValueError(
            "cp_size and cp_rank: ints, 0 <= cp_rank < cp_size; "
            f"got cp_size={cp_size!r}, cp_rank={cp_rank!r}"
        )
    rank = 3 if tensor_format == "thd" else 4
    t = tensors[0]
    for x, name in zip(tensors, names):
        if getattr(x, "dtype", None) not in _FLOAT_DTYPES:
            raise TypeError(
                f"{name} must be float32, float16, bfloat16 or float64 (a torch.Tensor), got "
                f"{getattr(x, 'dtype', type(x).__name__)}"
            )
        if x.dim() != rank:
            raise ValueError(
                f"{name} must have {rank} dims for tensor_format='{tensor_format}', "
                f"got shape {tuple(x.shape)}"
            )
        if x.dtype != t.dtype or x.shape[:-2] != t.shape[:-2] or x.shape[-1] != t.shape[-1]:
            raise ValueError(
                f"{name} must match {names[0]} in dtype and in every dim but heads: got "
                f"{tuple(x.shape)} {x.dtype}, {names[0]} is {tuple(t.shape)} {t.dtype}"
            )
    if getattr(freqs, "dtype", None) != torch.float32:
        raise TypeError(
            "freqs must be float32 angles in a torch.Tensor (cos/sin are taken inside the "
            f"kernel), got {getattr(freqs, 'dtype', type(freqs).__name__)}"
        )
    if freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1:
        raise ValueError(f"freqs must have shape [s2, 1, 1, d2], got {tuple(freqs.shape)}")
    batch, seqlen, _, head_dim = _layout(t, tensor_format)[0]
    max_positions = freqs.shape[0]
    rot_dim = freqs.shape[3]
    if rot_dim % 2 or not 2 <= rot_dim <= head_dim:
        raise ValueError(
            f"freqs' last dim d2 = {rot_dim} must be even and between 2 and the head dim {head_dim}"
        )
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head dim {head_dim} is over the supported {MAX_HEAD_DIM}")
    others = [(freqs, "freqs"), (cu_seqlens, "cu_seqlens"), (start_positions, "start_positions")]
    for x, name in [*zip(tensors, names), *others]:
        if isinstance(x, torch.Tensor) and x.device != t.device:
            raise ValueError(f"{name} is on {x.device} but {names[0]} is on {t.device}")
    if tensor_format == "thd":
        if cu_seqlens is None:
            raise ValueError("cu_seqlens is required for tensor_format='thd'")
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32:
            raise TypeError(
                "cu_seqlens must be an int32 tensor, got "
                f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens))}"
            )
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(
                f"cu_seqlens must have shape [b + 1] with b >= 1, got {tuple(cu_seqlens.shape)}"
            )
        batch = cu_seqlens.numel() - 1
    elif cu_seqlens is not None:
        raise ValueError(
            f"cu_seqlens is only for tensor_format='thd', got tensor_format={tensor_format!r}"
        )
    elif cp_size > 1 and seqlen % 2:
        raise ValueError(
            f"with cp_size > 1 the local sequence length must be even (two chunks), got {seqlen}"
        )
    elif seqlen * cp_size > max_positions:
        raise ValueError(
            f"sequence length {seqlen} (times cp_size) is over the {max_positions} rows (s2) "
            "of freqs"
        )
    if start_positions is not None:
        int_types = (torch.int32, torch.int64)
        if not isinstance(start_positions, torch.Tensor) or start_positions.dtype not in int_types:
            raise TypeError("start_positions must be an int32 or int64 tensor")
        if start_positions.shape != (batch,):
            raise ValueError(
                f"start_positions must have shape [b] = [{batch}], "
                f"got {tuple(start_positions.shape)}"
            )
    return seqlen, t.shape[0], max_positions


# %%
# The autograd Function and the public API
# ----------------------------------------
# The forward saves nothing but the (small) angle tables and index tensors: the backward needs
# only dy and the angles, not x. That is the whole memory cost of RoPE in training.


class _ApplyRoPE(torch.autograd.Function):
    """_rope_impl; each direction's gradient is the other (rotation and transpose, split and
    merge): double backward. Its arguments: the three inputs and the six other tensors of
    _rope_impl, then the rest as one tuple."""

    @staticmethod
    def forward(
        ctx, x, k, v, freqs, k_freqs, shared, k_shared, cu_seqlens, start_positions, options
    ):
        tables = (freqs, k_freqs, shared, k_shared, cu_seqlens, start_positions)
        ctx.save_for_backward(*tables)
        tensor_format, interleaved, backward, *rest = options
        ctx.options = (tensor_format, interleaved, not backward, *rest)  # the other direction
        return tuple(_rope(x, k, v, *tables, *options))

    @staticmethod
    def backward(ctx, *grads):
        args = (*grads, *[None] * (3 - len(grads)), *ctx.saved_tensors)
        if torch.is_grad_enabled():  # create_graph=True: the gradient's own gradient
            dx = _ApplyRoPE.apply(*args, ctx.options)
        else:
            dx = _rope(*args, *ctx.options)
        return (*dx, *[None] * (len(ctx.needs_input_grad) - len(dx)))


def _apply(
    tensors,
    names,
    freqs,
    tensor_format,
    start_positions,
    interleaved,
    cu_seqlens,
    cp_size=1,
    cp_rank=0,
    k_freqs=None,
    split=(0,),
    check=None,
):
    """Checks (once per signature; values once per tensor), then RoPE, through autograd where a
    gradient is wanted. k_freqs, split and check: fused QKV's."""
    tracing = torch.compiler.is_compiling()
    if check is None:  # (not `check or ...`: torch 2.11's Dynamo cannot take a function's truth)

        def check():
            return _check(
                tensors, names, freqs, tensor_format, cu_seqlens, start_positions, cp_size, cp_rank
            )

    if tracing:
        sizes = check()
    else:
        key = _signature(
            *tensors,
            freqs,
            k_freqs,
            cu_seqlens,
            start_positions,
            tensor_format,
            cp_size,
            cp_rank,
            *split,
        )
        sizes = _once(_checked, key, check)
    if not tracing and (cu_seqlens is not None or start_positions is not None):
        given = [x for x in (cu_seqlens, start_positions) if x is not None]
        read = functools.partial(_read_values, cu_seqlens, start_positions, *sizes, cp_size)
        _remember("values checked", given, (*sizes, cp_size), read)  # a host sync, remembered
    freqs_name = "freqs" if k_freqs is None else "q_freqs"
    for f, name in ((freqs, freqs_name), (k_freqs, "k_freqs")):  # no silent loss of a gradient
        if f is not None and f.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{name} requires grad, but no gradient flows to the angle table here (as in "
                f"TransformerEngine's fused RoPE); pass {name}.detach()"
            )
    if k_freqs is freqs:  # one table for q and k: read once (and autograd takes no tensor twice)
        k_freqs = None
    shared = _angles_shared((freqs,), interleaved)
    k_shared = None
    if k_freqs is not None:
        k_shared = _angles_shared((k_freqs,), interleaved, "k angles shared")
    padding = [None] * (3 - len(tensors))  # the inputs: q, k, v (or qkv, None, None)
    args = (*tensors, *padding, freqs, k_freqs, shared, k_shared, cu_seqlens, start_positions)
    options = (tensor_format, interleaved, False, cp_size, cp_rank, split[0], False)
    if tracing or torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
        return _ApplyRoPE.apply(*args, options)
    return tuple(_rope(*args, *options))  # no graph to record


def rope_freqs(max_seq_len, rotary_dim, base=10000.0, interleaved=False, device=None):
    """float32 angles [max_seq_len, 1, 1, rotary_dim], as TE's ``RotaryPositionEmbedding``
    (halves or pairs)."""
    channels = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device)
    inv_freq = base ** (-channels / rotary_dim)
    positions = torch.arange(max_seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)
    if interleaved:
        angles = angles.repeat_interleave(2, dim=-1)
    else:
        angles = torch.cat((angles, angles), dim=-1)
    return angles.view(max_seq_len, 1, 1, rotary_dim)


def apply_rotary_pos_emb(
    t,
    freqs,
    tensor_format="sbhd",
    start_positions=None,
    interleaved=False,
    fused=True,
    cu_seqlens=None,
    cp_size=1,
    cp_rank=0,
):
    """Differentiable RoPE; TransformerEngine's ``apply_rotary_pos_emb`` arguments, in its order.

    t: [s, b, h, d] (sbhd) | [b, s, h, d] (bshd) | [total_tokens, h, d] (thd); fp32, fp16, bf16
        (fp64 for gradcheck), any strides, d <= 256.
    freqs: float32 angles [s2, 1, 1, d2], d2 even, d2 <= d. Only t[..., :d2] is rotated. No
        gradient flows to freqs: one that requires grad is refused (pass freqs.detach()).
    start_positions: int [b]: sequence i uses angle rows start_positions[i] onwards.
    interleaved: rotate pairs (x0, x1), (x2, x3), ... (RoFormer, GPT-J) instead of halves.
    fused: accepted for TE compatibility and ignored: this is always one fused kernel.
    cu_seqlens: int32 [b + 1], thd only; with cp_size > 1 the full sequences' offsets (lengths
        multiples of 2 cp_size).
    cp_size, cp_rank: context parallelism: t holds rank cp_rank's two chunks of each sequence
        (see above); start_positions shift the whole sequences' positions (TE refuses
        start_positions with cp_size > 1).
    Returns a new contiguous tensor shaped like t. Works under torch.compile(fullgraph=True) and
    autocast.
    """
    outs = _apply(
        [t],
        ("t",),
        freqs,
        tensor_format,
        start_positions,
        interleaved,
        cu_seqlens,
        cp_size,
        cp_rank,
    )
    return outs[0]


def apply_rotary_pos_emb_qk(
    q,
    k,
    freqs,
    tensor_format="sbhd",
    start_positions=None,
    interleaved=False,
    cu_seqlens=None,
    cp_size=1,
    cp_rank=0,
):
    """``apply_rotary_pos_emb`` on q and k in one launch each way; k may have fewer heads (GQA).
    Returns (q, k)."""
    return _apply(
        [q, k],
        ("q", "k"),
        freqs,
        tensor_format,
        start_positions,
        interleaved,
        cu_seqlens,
        cp_size,
        cp_rank,
    )


def apply_fused_qkv_rotary_pos_emb(
    qkv,
    q_freqs,
    k_freqs,
    qkv_split_arg_list,
    tensor_format="sbhd",
    start_positions=None,
    interleaved=False,
    cu_seqlens=None,
    cp_size=1,
    cp_rank=0,
):
    """TransformerEngine's ``apply_fused_qkv_rotary_pos_emb``: RoPE of q and k straight out of a
    fused projection.

    qkv: [s, b, h, q_width + 2 d] (sbhd) | [b, s, h, q_width + 2 d] (bshd), any strides; each of
        the h groups holds q_width / d q heads, one k head and one v head (Megatron's GQA layout).
        qkv_split_arg_list: [q_width, d, d].
    q_freqs, k_freqs: float32 angle tables [s2, 1, 1, d2] of one shape. cu_seqlens: None (no thd,
        as in TE).
    Returns contiguous q [s, b, h q_width / d, d], k and v [s, b, h, d] (bshd: [b, s, ...]); one
    launch each way."""

    def check():
        if tensor_format not in ("sbhd", "bshd") or cu_seqlens is not None:
            raise ValueError(
                "fused QKV takes tensor_format 'sbhd' or 'bshd' and cu_seqlens=None, "
                f"got {tensor_format!r}"
            )
        widths = len(split) == 3 and all(type(w) is int and w > 0 for w in split)
        if not widths or split[2] != split[1] or split[0] % split[1]:
            raise ValueError(
                "qkv_split_arg_list must be [q_width, d, d], q_width a multiple of d, "
                f"got {qkv_split_arg_list!r}"
            )
        if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[-1] != sum(split):
            raise ValueError(
                f"qkv must be a 4-dim tensor whose last dim is {sum(split)}, "
                "the sum of qkv_split_arg_list"
            )
        if not isinstance(k_freqs, torch.Tensor) or (
            k_freqs.shape,
            k_freqs.dtype,
            k_freqs.device,
        ) != (q_freqs.shape, q_freqs.dtype, q_freqs.device):
            raise ValueError("k_freqs must be a tensor of q_freqs' shape, dtype and device")
        k = qkv[..., split[0] : split[0] + split[1]]
        return _check(
            [k], ("qkv",), q_freqs, tensor_format, None, start_positions, cp_size, cp_rank
        )

    split = []
    if isinstance(qkv_split_arg_list, (list, tuple)):
        split = list(qkv_split_arg_list)
    return _apply(
        [qkv],
        ("qkv",),
        q_freqs,
        tensor_format,
        start_positions,
        interleaved,
        cu_seqlens,
        cp_size,
        cp_rank,
        k_freqs,
        split,
        check,
    )


# %%
# Hugging Face's entry points
# ---------------------------
# transformers' attention calls apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1) with the
# tables that the model's rotary module built: cos and sin [b or 1, s, d2] in the model's dtype,
# already scaled by the RoPE type's attention factor (yarn, longrope), so not always a rotation.
# The kernel reads them as they are (TABLES), a row per (batch row, position), and computes in
# float32, rounding once: where transformers multiplies in bf16 the two differ by about one bf16
# ulp. position_ids picks rows of a [max_positions, d2] cache instead (packing, decoding).


def _check_hf(q, k, cos, sin, unsqueeze_dim, position_ids):
    """The checks of hf_apply_rotary_pos_emb that read no values; returns the table's rows and the
    dtype in which q and k are rotated (q's, promoted with the tables', as transformers' q * cos
    promotes)."""
    if type(unsqueeze_dim) is not int or unsqueeze_dim not in (1, 2):
        raise ValueError(
            f"unsqueeze_dim must be 1 ([b, h, s, d]) or 2 ([b, s, h, d]), got {unsqueeze_dim!r} "
            "(position_ids is keyword-only)"
        )
    for x, name in zip((q, k, cos, sin), ("q", "k", "cos", "sin")):
        if getattr(x, "dtype", None) not in _FLOAT_DTYPES:
            raise TypeError(
                f"{name} must be a float32, float16, bfloat16 or float64 torch.Tensor, got "
                f"{getattr(x, 'dtype', type(x).__name__)}"
            )
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
    if q.dim() != 4 or k.dim() != 4 or q.dtype != k.dtype:
        raise ValueError(
            f"q and k must be 4-D of one dtype, got {tuple(q.shape)} {q.dtype} and "
            f"{tuple(k.shape)} {k.dtype}"
        )
    b, s, d = q.shape[0], q.shape[3 - unsqueeze_dim], q.shape[3]
    if (k.shape[0], k.shape[3 - unsqueeze_dim], k.shape[3]) != (b, s, d):
        raise ValueError(f"k {tuple(k.shape)} must match q {tuple(q.shape)} in every dim but heads")
    if cos.shape != sin.shape:
        raise ValueError(
            f"cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    dtype = torch.promote_types(q.dtype, torch.promote_types(cos.dtype, sin.dtype))
    rows = s
    if position_ids is None and (cos.dim() != 3 or cos.shape[0] not in (1, b) or cos.shape[1] != s):
        raise ValueError(
            f"cos and sin must have shape [{b} or 1, {s}, d2] (batch, sequence), got "
            f"{tuple(cos.shape)}"
        )
    if position_ids is not None:
        if cos.dim() != 2:
            raise ValueError(
                f"with position_ids, cos and sin must be a cache [max_positions, d2], got "
                f"{tuple(cos.shape)}"
            )
        rows = cos.shape[0]
        int_types = (torch.int32, torch.int64)
        if not isinstance(position_ids, torch.Tensor) or position_ids.dtype not in int_types:
            raise TypeError("position_ids must be an int32 or int64 tensor")
        if (
            position_ids.device != q.device
            or position_ids.dim() != 2
            or position_ids.shape[0] not in (1, b)
            or position_ids.shape[1] != s
        ):
            raise ValueError(
                f"position_ids must have shape [{b} or 1, {s}] on {q.device}, got "
                f"{tuple(position_ids.shape)} on {position_ids.device}"
            )
    if d > MAX_HEAD_DIM:
        raise ValueError(f"q's head dim {d} is over the supported {MAX_HEAD_DIM}")
    d2 = cos.shape[-1]
    if d2 % 2 or not 2 <= d2 <= d:
        raise ValueError(f"cos' last dim {d2} must be even and between 2 and q's head dim {d}")
    return rows, dtype


def _read_position_ids(position_ids, rows):  # a host sync, once per tensor
    if position_ids.numel() == 0:
        return
    low, high = position_ids.aminmax()
    if low < 0 or high >= rows:
        raise ValueError(
            f"position_ids must be in [0, {rows}) (the rows of cos and sin), got {int(low)} to "
            f"{int(high)}"
        )


def hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, *, position_ids=None):
    """transformers' ``apply_rotary_pos_emb``: ``q * cos + rotate_half(q) * sin`` on the first d2
    channels (the rest pass through), with gradients to q and k; returns (q_embed, k_embed), new
    tensors of q's and k's shapes.

    q, k: [b, h, s, d] (unsqueeze_dim=1; often transposed views of [b, s, h, d] memory, read
        through their strides) or [b, s, h, d] (unsqueeze_dim=2); k may have fewer heads.
    cos, sin: [b or 1, s, d2], any float dtype, as the model's rotary module returns them
        (scaled by its attention factor); or, with position_ids, a cache [max_positions, d2].
    position_ids: int [b or 1, s], keyword only (an extension): token (i, j) uses row
        position_ids[i, j] of cos and sin.
    """
    return _hf_apply(q, k, cos, sin, unsqueeze_dim, position_ids, (cos, sin))


def _hf_apply(q, k, cos, sin, unsqueeze_dim, position_ids, flag_tables):
    """hf_apply_rotary_pos_emb, with the halves-equal flag of flag_tables (M-RoPE's: the tables
    before recomposing, which a model passes to every layer, so the flag is computed once)."""
    tracing = torch.compiler.is_compiling()
    args = (q, k, cos, sin, unsqueeze_dim, position_ids)
    if tracing:
        rows, dtype = _check_hf(*args)
    else:
        rows, dtype = _once(_checked, _signature(*args), _check_hf, *args)
        if position_ids is not None:
            _remember(  # a host sync, once per tensor
                "position ids checked",
                (position_ids,),
                (rows,),
                _read_position_ids,
                position_ids,
                rows,
            )
    for table, name in ((cos, "cos"), (sin, "sin")):  # no silent loss of a gradient
        if table.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{name} requires grad, but no gradient flows to the tables here (as in "
                f"Liger's and TransformerEngine's fused RoPE); pass {name}.detach()"
            )
    shared = _angles_shared(flag_tables, False, "tables shared")  # of the caller's tensors: kept
    if q.dtype != dtype:  # as transformers' q * cos promotes (an fp32 table under autocast)
        q = q.to(dtype)
        k = k.to(dtype)
    if cos.stride() != sin.stride():  # the kernel reads both with cos' strides
        cos = cos.contiguous()
        sin = sin.contiguous()
    if position_ids is not None:
        position_ids = position_ids.expand(q.shape[0], -1)
    tensor_format = "bshd"
    if unsqueeze_dim == 1:
        tensor_format = "bhsd"
    args = (q, k, None, cos, sin, shared, None, None, position_ids)
    options = (tensor_format, False, False, 1, 0, 0, True)
    if tracing or torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _ApplyRoPE.apply(*args, options)
    return tuple(_rope(*args, *options))


def hf_apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """Qwen2-VL's ``apply_multimodal_rotary_pos_emb`` (M-RoPE): cos, sin [3, b, s, d], one table
    per position stream (time, height, width); channel section i of ``mrope_section * 2`` takes
    stream i mod 3. The tables are recomposed (a copy of 1/h of q's bytes), then rotated as
    ``hf_apply_rotary_pos_emb``."""
    for table, name in ((cos, "cos"), (sin, "sin")):
        if not isinstance(table, torch.Tensor) or table.dim() != 4 or table.shape[0] != 3:
            got = tuple(getattr(table, "shape", ())) or type(table).__name__
            raise ValueError(f"{name} must have shape [3, b, s, d], got {got}")
    if sin.shape != cos.shape:
        raise ValueError(
            f"cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if isinstance(q, torch.Tensor) and q.dim() == 4 and unsqueeze_dim in (1, 2):  # else: below
        b, s = q.shape[0], q.shape[3 - unsqueeze_dim]
        if cos.shape[1] not in (1, b) or cos.shape[2] != s:
            raise ValueError(
                f"cos and sin must have shape [3, {b} or 1, {s}, d] (streams, batch, sequence), "
                f"got {tuple(cos.shape)}"
            )
    section_ok = isinstance(mrope_section, (list, tuple)) and len(mrope_section) == 3
    if not section_ok or not all(type(n) is int and n >= 0 for n in mrope_section):
        raise ValueError(f"mrope_section must be 3 non-negative ints, got {mrope_section!r}")
    if 2 * sum(mrope_section) != cos.shape[-1]:
        raise ValueError(
            f"mrope_section {list(mrope_section)} must sum to half the tables' last dim, "
            f"{cos.shape[-1] // 2}"
        )
    sections = list(mrope_section) * 2  # halves of equal sections: equal halves stay equal
    cos_t = torch.cat([m[i % 3] for i, m in enumerate(cos.split(sections, dim=-1))], dim=-1)
    sin_t = torch.cat([m[i % 3] for i, m in enumerate(sin.split(sections, dim=-1))], dim=-1)
    return _hf_apply(q, k, cos_t, sin_t, unsqueeze_dim, None, (cos, sin))


# %% Part 3 - check and benchmark
# The self-check compares values and gradients with autograd through the reference, every feature
# at once (tests/test_03_rope_bwd.py covers the whole matrix, context parallelism, gradcheck in
# float64 and torch.compile). The benchmark times the backward alone, forward + backward against
# TE's unfused formula, and fused QKV against the three calls it replaces, each against a
# same-run copy of the bytes that must move.


def _unfused_qkv(rope, qkv, q_freqs, k_freqs, split, *args, **kwargs):
    """TE's unfused reading of a fused qkv: split, q copied out as heads, q and k rotated by rope
    (the reference in the self-check; in the benchmark, three calls of ours)."""
    q, k, v = qkv.split(split, dim=-1)
    q = q.reshape(*k.shape[:2], -1, split[1])  # a copy
    return rope(q, q_freqs, *args, **kwargs), rope(k, k_freqs, *args, **kwargs), v


def _agree(outs, refs, inputs):
    """The outputs equal the reference's, and so do their gradients with respect to inputs."""
    grads = [torch.randn_like(y) for y in outs]
    got = (*outs, *torch.autograd.grad(outs, inputs, grads))
    want = (*refs, *torch.autograd.grad(refs, inputs, grads))
    for y, ref in zip(got, want):
        torch.testing.assert_close(y, ref)


def self_check():
    torch.manual_seed(0)
    b, s, h, d = (3, 36, 5, 80) if DEVICE.type == "cuda" else (2, 8, 3, 80)
    freqs = torch.randn(2 * b * s, 1, 1, 48, device=DEVICE)  # partial rotary, halves differ
    cu = torch.tensor([0, *range(1, (b - 1) * s, s), b * s], device=DEVICE, dtype=torch.int32)
    cases = itertools.product((torch.float32, torch.bfloat16), TENSOR_FORMATS, (False, True))
    for dtype, fmt, interleaved in cases:
        x = torch.randn(b, s, 3, h, d, device=DEVICE, dtype=dtype)
        x = {"sbhd": x.transpose(0, 1), "bshd": x, "thd": x.flatten(0, 1)}[fmt]
        q = x[..., 0, :, :].requires_grad_()  # strided views
        k = x[..., 1, :2, :].requires_grad_()  # with fewer heads
        kw = dict(tensor_format=fmt, start_positions=torch.randint(0, 5, (b,), device=DEVICE))
        kw.update(interleaved=interleaved, cu_seqlens=cu if fmt == "thd" else None)
        refs = [rope_reference(y, freqs, **kw) for y in (q, k)]
        _agree(apply_rotary_pos_emb_qk(q, k, freqs, **kw), refs, (q, k))
        if fmt != "thd":  # fused QKV, 2 q heads a group, k with an angle table of its own
            qkv = torch.randn(*q.shape[:2], 2, 4 * d, device=DEVICE, dtype=dtype)
            args = (qkv.requires_grad_(), freqs, freqs / 3, [2 * d, d, d])
            refs = _unfused_qkv(rope_reference, *args, **kw)
            _agree(apply_fused_qkv_rotary_pos_emb(*args, **kw), refs, (qkv,))
    print(
        f"self-check passed: forward and gradients, fp32/bf16 x sbhd/bshd/thd x half/interleaved, "
        f"d={d}, d2=48, GQA, strided views, start_positions, fused QKV (device: {DEVICE.type})"
    )


PACKINGS = {  # thd, about 65K tokens of 8 heads of 128 channels: the sequences' lengths
    "64 x 1024": [1024] * 64,
    "2048 x 32": [32] * 2048,
    "1023 x 32 + 1 x 32768": [32] * 1023 + [32768],
    "4000 x 1-32": torch.randint(1, 33, (4000,), generator=torch.Generator().manual_seed(0)),
}
HF_SHAPES = [  # (b, s, h, d, k heads)
    (4, 4096, 32, 128, 32),
    (4, 4096, 32, 128, 8),
    (32, 512, 12, 64, 12),
    (1, 32768, 8, 128, 8),
    (8, 2048, 32, 80, 32),
]
TIMED = (
    "Hugging Face's: q and k [b, h, s, d] views of [b, s, h, d] memory, cos and sin bf16 [1, s, "
    "d]; transformers: its formula, eager and compiled; liger: Liger-Kernel's LigerRopeFunction. "
    "bf16, bshd; packed: thd, the sequence lengths shown, 8 heads, head dim 128. Fused QKV: qkv "
    '[b, s, h / 4, 6 d], 4 q heads a group; "three calls": split, q copied out, q and k rotated '
    "by `apply_rotary_pos_emb`. eager, torch.compile: TE's unfused formula; compiled: per shape, "
    'fullgraph. A cell: median GPU time (`do_bench_cudagraph`) or ("eager call") of ten calls in '
    "a row (`do_bench`), per call, host cost included; (x%): a same-run copy of the bytes that "
    "must move (x2 forward + backward) over the cell's time."
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


def _eager(q, k, freqs, tensor_format, start_positions=None, interleaved=False, cu_seqlens=None):
    """TransformerEngine's unfused formula; apply_rotary_pos_emb_qk's arguments."""
    kwargs = dict(start_positions=start_positions, interleaved=interleaved, cu_seqlens=cu_seqlens)
    return [rope_reference(x, freqs, tensor_format, compute_dtype=None, **kwargs) for x in (q, k)]


def _hf_formula(q, k, cos, sin):  # transformers' apply_rotary_pos_emb, as models run it
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    half = q.shape[-1] // 2
    return [x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin for x in (q, k)]


def _liger_peer():
    """{name: call} of Liger's RoPE (its q and k only) if liger_kernel is importable, else {}."""
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except ImportError as e:
        print(f"(liger_kernel is not importable, its columns are skipped: {e})")
        return {}

    def liger(q, k, cos, sin):  # rotates q and k in place (their memory, through the views)
        return LigerRopeFunction.apply(q, k, cos, sin)[:2]

    return {"liger": liger, "liger, eager call": liger}


def _backward(dq, dk, freqs):  # the backward kernel alone, launched as autograd launches it
    flag = _angles_shared((freqs,), False)  # as autograd's call has it: 1, a model's table
    args = (freqs, None, flag, None, None, None, "bshd", False, True, 1, 0, 0, False)
    return _rope(dq, dk, None, *args)


def _copy(src, dst, times):
    for _ in range(times):
        dst.copy_(src)


def _run(fn, args, inputs, grads):  # fn(*args); given its outputs' gradients, the backward too
    outs = fn(*args)
    if grads is None:
        return outs
    return torch.autograd.grad(outs, inputs, grads)


def _time_tables(pages, row, tables, on_gpu):
    """Time each table's calls on one row (shape or packing), against a same-run copy of the bytes
    that must move; print the row, add it to its table in pages."""
    for table, (fns, args, inputs, grads) in tables.items():
        ways = 1 if grads is None else 2  # forward; forward and backward
        copy = "copy" if ways == 1 else "copy x2"
        src = torch.cat([x.detach().flatten() for x in inputs])  # the bytes that move
        calls = {copy: functools.partial(_copy, src, torch.empty_like(src), ways)}
        for name, fn in fns.items():
            calls[name] = functools.partial(_run, fn, args, inputs, grads)
        us = {name: time_us(call, "eager call" in name) for name, call in calls.items()}
        cells = [f"{t:.1f} us" for t in us.values()]
        if on_gpu:  # (x%): the copy's time over the cell's
            cells = [f"{c} ({100 * us[copy] / t:.0f}%)" for c, t in zip(cells, us.values())]
        first = "shape (b, s, h, d)"
        if "thd" in table:
            first = "sequence lengths"
        elif "Hugging" in table:
            first = "shape (b, s, h, d, k heads)"
        if table not in pages:  # a new table: its title and header, printed too
            pages[table] = [f"| {first} | {' | '.join(us)} |", "|---" * len(us) + "|---|"]
            print(f"\n{table}", *pages[table], sep="\n")
        pages[table].append(f"| {row} | {' | '.join(cells)} |")
        print(pages[table][-1], flush=True)


def benchmark():
    """Prints each row as measured; returns {table: its lines} for the page."""
    on_gpu = DEVICE.type == "cuda"
    ours = apply_rotary_pos_emb_qk
    fused = apply_fused_qkv_rotary_pos_emb
    qk = {"ours": ours, "ours, eager call": ours, "eager": _eager}
    qkv_fns = {"fused": fused, "fused, eager call": fused}
    qkv_fns["three calls"] = functools.partial(_unfused_qkv, apply_rotary_pos_emb)
    shapes = [(4, 4096, 32, 128), (32, 512, 12, 64), (1, 32768, 8, 128)]
    packings = PACKINGS
    if on_gpu:
        torch._dynamo.config.cache_size_limit = 64  # a graph per shape (dynamic=False)
        qk["ours, compiled"] = torch.compile(ours, fullgraph=True, dynamic=False)
        qk["torch.compile"] = torch.compile(_eager, dynamic=False)
        qkv_fns["fused, compiled"] = torch.compile(fused, fullgraph=True, dynamic=False)
    else:
        shapes = [(2, 8, 4, 64)]
        packings = {"3 x 1-5 + 1 x 24": [3, 1, 5, 24]}
        print(
            "\nNO GPU: the kernels run in Triton's interpreter on the CPU. The timings below "
            "only show that the benchmark runs; they say nothing about speed."
        )
    randn = functools.partial(torch.randn, device=DEVICE, dtype=torch.bfloat16)
    pages = {}
    for b, s, h, d in shapes:
        freqs = rope_freqs(s, d, device=DEVICE)
        q, k = (randn(b, s, h, d, requires_grad=True) for _ in "qk")
        qkv = randn(b, s, h // 4, 6 * d, requires_grad=True)
        dq, dk = randn(2, b, s, h, d)  # the outputs' gradients
        dkv = randn(b, s, h // 4, d)  # fused QKV's dk and dv
        qkv_args = (qkv, freqs, freqs, [4 * d, d, d], "bshd")
        tables = {  # the calls, their arguments, the inputs and (with a backward) the gradients
            "q and k, backward": ({"ours": _backward}, (dq, dk, freqs), (dq, dk), None),
            "q and k, forward + backward": (qk, (q, k, freqs, "bshd"), (q, k), (dq, dk)),
            "fused QKV, forward": (qkv_fns, qkv_args, (qkv,), None),
            "fused QKV, forward + backward": (qkv_fns, qkv_args, (qkv,), (dq, dkv, dkv)),
        }
        _time_tables(pages, (b, s, h, d), tables, on_gpu)
    hf_fns = {"ours": hf_apply_rotary_pos_emb, "ours, eager call": hf_apply_rotary_pos_emb}
    hf_fns["transformers"] = _hf_formula
    if on_gpu:
        hf_fns["transformers, compiled"] = torch.compile(_hf_formula, dynamic=False)
        hf_fns.update(_liger_peer())
    for b, s, h, d, h_k in HF_SHAPES if on_gpu else [(2, 8, 4, 64, 2)]:
        q = randn(b, s, h, d).transpose(1, 2).requires_grad_()  # [b, h, s, d] views, as models
        k = randn(b, s, h_k, d).transpose(1, 2).requires_grad_()
        angles = rope_freqs(s, d, device=DEVICE)[None, :, 0, 0]
        args = (q, k, angles.cos().bfloat16(), angles.sin().bfloat16())
        dq = torch.randn_like(q)
        dk = torch.randn_like(k)
        tables = {  # the tables' bytes not counted
            "Hugging Face's, forward": (hf_fns, args, (q, k), None),
            "Hugging Face's, forward + backward": (hf_fns, args, (q, k), (dq, dk)),
        }
        _time_tables(pages, (b, s, h, d, h_k), tables, on_gpu)
    for packing, lengths in packings.items():  # q and k packed (thd), 8 heads of 128 channels
        lengths = torch.as_tensor(lengths, device=DEVICE)
        cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        freqs = rope_freqs(int(lengths.max()), 128, device=DEVICE)
        q, k = (randn(int(cu_seqlens[-1]), 8, 128, requires_grad=True) for _ in "qk")
        dq, dk = randn(2, *q.shape)
        args = (q, k, freqs, "thd", None, False, cu_seqlens)
        table = "packed q and k (thd), forward + backward"
        _time_tables(pages, packing, {table: (qk, args, (q, k), (dq, dk))}, on_gpu)
    return pages


def write_page(results_dir, pages):
    """results/<script>_<GPU kind>.md: title, environment, command, what is timed, the tables
    ({title: lines}), the raw log's name."""
    here, script = os.path.split(os.path.abspath(__file__))
    gpu = torch.cuda.get_device_name()
    kind = gpu.split()[1]  # the model: H100 in "NVIDIA H100 80GB HBM3"
    stem = f"{script[:-3]}_{kind}"
    git = f'git -C "{here}" rev-parse --short HEAD 2>{os.devnull}'
    commit = os.popen(git).read().strip() or "n/a"
    with open(__file__, "rb") as f:
        md5 = hashlib.md5(f.read()).hexdigest()[:8]
    environment = (
        f"device: {gpu}; date: {time.strftime('%Y-%m-%d')}; torch {torch.__version__}; "
        f"triton {triton.__version__}; python {sys.version.split()[0]}; commit {commit}; "
        f"{script} md5 {md5}"
    )
    tables = "".join(
        f"## {title}\n\n" + "\n".join(lines) + "\n\n" for title, lines in pages.items()
    )
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, stem + ".md"), "w") as f:
        f.write(f"# {__doc__.splitlines()[1]}\n\n{environment}\n\n")
        f.write(f"Command: `python {' '.join(sys.argv)}`\n\n{TIMED}\n\n{tables}")
        f.write(f"Raw log: `{stem}.log`.\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    parser.add_argument(
        "--results", default=results, help="folder for the page (written only on a GPU)"
    )
    args = parser.parse_args()
    self_check()
    pages = benchmark()
    if DEVICE.type == "cuda":
        write_page(args.results, pages)
