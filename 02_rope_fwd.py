"""
RoPE forward in one pass over memory
====================================

In this tutorial, you will learn about:

* TransformerEngine's RoPE semantics, shared by every later step: ``sbhd`` / ``bshd`` / ``thd``
  layouts, partial rotary (``d2 < d``), rotate-half and interleaved pairs, any per-channel angles,
  ``start_positions`` (KV cache);
* why the eager formula moves about 6x the bytes it needs, and a kernel that reads and writes
  each element once, at any strides (a slice of a packed qkv, a transposed view), with 64-bit
  offsets, head dims up to 256 (80 and 96 too), any head count, and q and k (GQA) in one launch;
* angle tables against Hugging Face's cos and sin tables (per batch row, scaled by an attention
  factor, or rows of a cache picked by ``position_ids``): what each costs in bytes, and the same
  kernel reading either;
* checking values that live on the GPU (``cu_seqlens``) without a host sync on every call, and an
  eager call that costs a few empty ops: checks and the compiled kernel kept per signature of the
  arguments;
* an opaque ``torch.library.custom_op`` that writes its outputs, for
  ``torch.compile(fullgraph=True)``;
* measuring a memory-bound kernel against the copy bandwidth of the same GPU, in the same run.

How to read this file. Part 1 is the lesson (about 35 minutes): the math and the PyTorch
reference, the memory traffic, the kernel, and ``launch_rope_fwd``, a plain launcher built on
``rope_fwd_launch_args``. Part 2 is the drop-in: argument checks, values and launches remembered
so that an eager call is cheap, the ``torch.library`` op for ``torch.compile``, and the public
``rope_fwd`` and ``rope_fwd_qk`` (TransformerEngine's arguments) and ``hf_rope_fwd`` (Hugging
Face's, for inference); skip it on a first read. Part 3 checks the kernel against the
reference on irregular shapes and times it against a copy of the same bytes and the usual
alternatives.

Run ``python 02_rope_fwd.py``: it checks itself against the PyTorch reference, then benchmarks.
This file imports only torch and triton: copy it alone into your project.
"""

# %% Part 1 - the lesson
# With no GPU, the kernels run in Triton's interpreter (numpy on the CPU), chosen before triton
# is imported.
import argparse
import functools
import hashlib
import importlib
import itertools
import os
import sys
import time
import weakref
from typing import Optional

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
# The math and the PyTorch reference
# ----------------------------------
# RoPE rotates each pair of channels (x_a, x_b) of a head by an angle that grows with the token's
# position. TransformerEngine writes it element by element, for any angle table f[pos, :d2]:
#
#     y = x * cos(f) + R(x) * sin(f)          on the first d2 channels; y = x on the rest
#
# where R pairs channel a with its partner b and negates the first of the two:
#
#     rotate-half (GPT-NeoX, LLaMA, TE's default):  a = i,    b = i + d2/2   (i < d2/2)
#     interleaved (RoFormer, GPT-J):                a = 2i,   b = 2i + 1
#
#     y_a = x_a * cos(f_a) - x_b * sin(f_a)
#     y_b = x_b * cos(f_b) + x_a * sin(f_b)
#
# Models build f with equal halves (or pairs), which makes this a true rotation; the kernel does
# not assume it: it loads f_a and f_b separately, so any float32 table works.


def rope_freqs(max_seq_len, rotary_dim, base=10000.0, interleaved=False, device=None):
    """Angle table f[pos, 0, 0, c] = pos * base**(-2 j / d2), j the pair of channel c, float32
    [max_seq_len, 1, 1, rotary_dim], laid out as TE's ``RotaryPositionEmbedding``: the d2/2
    inverse frequencies repeated as two halves (rotate-half) or as pairs (interleaved)."""
    channels = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device)
    inv_freq = base ** (-channels / rotary_dim)
    positions = torch.arange(max_seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)
    if interleaved:
        angles = angles.repeat_interleave(2, dim=-1)
    else:
        angles = torch.cat((angles, angles), dim=-1)
    return angles.view(max_seq_len, 1, 1, rotary_dim)


def _token_positions(t, tensor_format, cu_seqlens, start_positions):
    """Position of every token, shaped to broadcast against t[..., 0, 0]."""
    if tensor_format == "thd":
        tokens = torch.arange(t.shape[0], device=t.device)
        seq = torch.searchsorted(cu_seqlens[1:].long(), tokens, right=True)
        pos = tokens - cu_seqlens.long()[seq]
        if start_positions is not None:
            pos = pos + start_positions.long()[seq]
        return pos
    pos = torch.arange(t.shape[0 if tensor_format == "sbhd" else 1], device=t.device)
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
    """Plain PyTorch RoPE, the tests' oracle; ``rope_fwd``'s arguments. Computes in float32 (one
    rounding, like the kernel); ``compute_dtype=None`` multiplies in t's dtype: TransformerEngine's
    unfused formula."""
    d2 = freqs.shape[-1]
    pos = _token_positions(t, tensor_format, cu_seqlens, start_positions)
    angles = freqs.reshape(freqs.shape[0], d2)[pos].unsqueeze(-2)  # [..., 1, d2]: a row a token
    dtype = compute_dtype or t.dtype
    x = t[..., :d2].to(dtype)
    if interleaved:
        x_rot = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        x_a, x_b = x.chunk(2, dim=-1)
        x_rot = torch.cat((-x_b, x_a), dim=-1)
    y = x * angles.cos().to(dtype) + x_rot * angles.sin().to(dtype)
    return torch.cat((y.to(t.dtype), t[..., d2:]), dim=-1)


# %%
# Memory traffic
# --------------
# Any implementation reads and writes the N elements of q and k once, plus the angle rows (4 d2
# bytes a position, loaded once for all heads and shared through L2 by the batch). With a small
# batch the table counts: at (b, s, h, d) = (1, 32768, 8, 128) in bf16, q and k are 64 MiB each,
# read and written: 256 MiB; the float32 table [32768, 128] is 16 MiB, so a kernel that reads it
# whole can reach at most 256/272 = 94% of a copy of q and k. Real tables have equal halves, so the
# kernel skips the second half when a flag says so: with rotate-half's table that half is 8 MiB of
# rows of its own, a cap of 256/264 = 97%; interleaved angles share their memory sectors, so the
# whole table moves (94%). Any other table works at full cost.
# Angles or cos/sin tables. Hugging Face's models pass cos and sin, [b or 1, s, d2] in the model's
# dtype: in bf16 2 + 2 bytes a channel, as much as a float32 angle (and twice what the kernel
# reads of rotate-half's angles), but a table for each batch row multiplies it by b: at (4, 4096,
# 32, 128), 2 MiB, or 8 MiB per row, beside 512 MiB of q and k read and written. And a table can
# carry what an angle cannot: yarn and longrope scale cos and sin by an attention factor (so
# cos^2 + sin^2 != 1), which a kernel taking angles would have to multiply back in, another pass
# over q and k. So the kernel takes either (TABLES: cos and sin read as they are, in their dtype,
# a table for each batch row or one for all, or rows of a cache that Hugging Face's position_ids
# pick); 03's kernel adds their backward.
# The eager formula as TransformerEngine writes it (rope_reference with compute_dtype=None, the
# benchmark's "eager" column) moves x*cos (N read, N written); R(x), a negated copy of half the
# channels and then the halves joined (N/2, N/2, then N, N); R(x)*sin (N, N); the sum (2N, N); and
# the join with the pass-through channels, made even when there are none (N, N): 12N, 6x the 2N of
# one pass, before the cos and sin of the angle rows. The yardstick is a device-to-device copy of
# the same 2N (the table not counted): results/02_rope_fwd_H100.md shows how close the kernel comes.
#
# The kernel
# ----------
# The kernel is written for a block of BLOCK_S tokens a program; the launch below gives each program
# one token (BLOCK_S = 1; on a CPU, 16: TOKENS_A_PROGRAM) and all heads of q and k, BLOCK_H at a
# time in at most four unrolled steps (any head count). cos and sin, which depend on the position
# only, are taken once for every head: computed from the angles, or (TABLES) loaded from cos and sin
# tables, with a row per batch row and position, or the row that position_ids names. Each tile is
# read and written once, in contiguous loads (_load_pairs); pass-through channels (d2 < d) are
# copied. Offsets come from the strides, in int64 (views, tensors past 2**31 elements). In thd a
# program's tokens are rows of the packed tensor (batch stride 0), each finding its sequence, and so
# its position, in cu_seqlens: one kernel for three layouts (and Hugging Face's [b, h, s, d]).


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
):
    """Load the rotated channels of a [BLOCK_S, BLOCK_H] tile of heads as (x_a, x_b), float32."""
    if INTERLEAVED:  # one contiguous load of d2 channels, split into even and odd in registers
        j = tl.arange(0, 2 * HALF)[None, None, :]
        x = tl.load(x_tile + j * stride_d, mask=mask & (j < rot_dim), other=0.0)
        x_a, x_b = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_S, BLOCK_H, HALF, 2)))
    else:  # two contiguous loads: the first and the second half of the d2 channels
        a = tl.arange(0, HALF)[None, None, :]
        m = mask & (a < rot_dim // 2)
        x_a = tl.load(x_tile + a * stride_d, mask=m, other=0.0).to(tl.float32)
        x_b = tl.load(x_tile + (a + rot_dim // 2) * stride_d, mask=m, other=0.0).to(tl.float32)
    return x_a, x_b


@triton.jit
def _store_rotated(
    y_tile,
    stride_d,
    mask,
    x_a,
    x_b,
    cos_a,
    sin_a,
    cos_b,
    sin_b,
    rot_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """y_a = x_a cos(f_a) - x_b sin(f_a), y_b = x_b cos(f_b) + x_a sin(f_b), stored where x came
    from."""
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
def _table_pairs(rows_ptr, offset_a, offset_b, mask, read_b):
    """A table's values at both channels of each pair of its rows, float32, [BLOCK_S, 1, HALF]
    each. Where the flag says the halves are equal, the second load takes the first's offsets
    again: bytes the cache already holds, and no mask that varies with a loaded value."""
    f_a = tl.load(rows_ptr + offset_a, mask=mask, other=0.0).to(tl.float32)
    f_b = tl.load(rows_ptr + tl.where(read_b, offset_b, offset_a), mask=mask, other=0.0)
    return f_a[:, None, :], f_b.to(tl.float32)[:, None, :]


@triton.jit
def _sequence_of(cu_seqlens_ptr, token, n_seqs, WAYS: tl.constexpr):
    """The sequence that holds each packed token: the last i with cu_seqlens[i] <= token (so
    empty sequences are skipped), by a WAYS-ary search. Each step loads WAYS probes at once and
    keeps the slice between the last probe at or below the token and the next: log_WAYS(b) steps
    that wait on one another's loads, not a binary search's log2(b)."""
    lo = tl.zeros_like(token)
    width = lo + n_seqs  # invariant: the answer is one of lo .. lo + width - 1
    while tl.max(width, axis=0) > 1:
        step = (width + WAYS - 1) // WAYS
        probe = lo[:, None] + step[:, None] * (tl.arange(0, WAYS) + 1)[None, :]
        inside = probe < (lo + width)[:, None]
        cu = tl.load(cu_seqlens_ptr + probe, mask=inside, other=0)
        count = tl.sum((inside & (cu <= token[:, None])).to(tl.int32), axis=1)  # a prefix
        lo = lo + count * step
        width = tl.minimum(step, width - count * step)
    return lo


@triton.jit
def rope_fwd_kernel(
    q_ptr,
    q_out_ptr,
    k_ptr,
    k_out_ptr,
    freqs_ptr,
    sin_ptr,
    angles_shared_ptr,
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
    stride_fs,
    stride_fd,
    stride_fb,
    stride_pb,
    stride_ps,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    N_HEAD_BLOCKS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    IS_THD: tl.constexpr,
    HAS_START_POSITIONS: tl.constexpr,
    HAS_K: tl.constexpr,
    COPY_PASS: tl.constexpr,
    BATCH_FASTEST: tl.constexpr,
    TABLES: tl.constexpr,
    POSITION_IDS: tl.constexpr,
):
    # A 1-D grid, numbered so that programs running side by side touch neighbouring memory: in
    # sbhd the batch index moves fastest, in bshd the block of positions does; in thd the programs
    # walk the packed tokens (seqlen is then their number), each finding its token's sequence.
    pid = tl.program_id(0)
    if IS_THD:
        s = pid * BLOCK_S + tl.arange(0, BLOCK_S)  # packed tokens
        batch = _sequence_of(cu_seqlens_ptr, s, n_batch, WAYS=8)
        pos = s - tl.load(cu_seqlens_ptr + batch)
    else:
        if BATCH_FASTEST:
            pid_s, batch = pid // n_batch, pid % n_batch
        else:
            pid_s, batch = pid % n_seq_blocks, pid // n_seq_blocks
        s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
        pos = s
    row_mask = s < seqlen
    if POSITION_IDS:  # Hugging Face's position_ids [b, s]: each token's row of the table
        ids = start_positions_ptr + batch * stride_pb + s * stride_ps
        pos = tl.load(ids, mask=row_mask, other=0)
    elif HAS_START_POSITIONS:
        pos = pos + tl.load(start_positions_ptr + batch)

    # The angles of these tokens, turned into cos/sin once for every q and k head (TABLES: cos and
    # sin loaded). When the table's halves are equal (the flag), the second half's bytes are not
    # read (for rotate-half's table; interleaved pairs share sectors, which move anyway).
    i = tl.arange(0, HALF)
    if INTERLEAVED:
        f_a, f_b = 2 * i, 2 * i + 1
    else:
        f_a, f_b = i, i + rot_dim // 2
    # No row outside the table: such rows read as 0, never memory around it
    in_table = row_mask & (pos >= 0) & (pos < n_positions)
    f_mask = in_table[:, None] & (i < rot_dim // 2)[None, :]
    rows = pos.to(tl.int64) * stride_fs  # each token's row, in 64 bits; within a row, 32
    if TABLES:  # a table of its own for each batch row, or one for all (stride 0)
        rows += batch.to(tl.int64) * stride_fb
    rows = rows[:, None]
    offset_a = f_a[None, :] * stride_fd
    offset_b = f_b[None, :] * stride_fd
    read_b = tl.load(angles_shared_ptr + 0 * i)[None, :] == 0  # the flag, one copy per lane
    if TABLES:
        cos_a, cos_b = _table_pairs(freqs_ptr + rows, offset_a, offset_b, f_mask, read_b)
        sin_a, sin_b = _table_pairs(sin_ptr + rows, offset_a, offset_b, f_mask, read_b)
    else:
        angle_a, angle_b = _table_pairs(freqs_ptr + rows, offset_a, offset_b, f_mask, read_b)
        cos_a, sin_a = tl.cos(angle_a), tl.sin(angle_a)
        cos_b, sin_b = tl.cos(angle_b), tl.sin(angle_b)

    # Row offsets in int64, as [BLOCK_S, 1, 1] for the tiles.
    tokens = s.to(tl.int64)[:, None, None]
    batch = 0 if IS_THD else batch.to(tl.int64)  # thd's rows are the packed tokens themselves
    q_rows = q_ptr + batch * stride_qb + tokens * stride_qs
    q_out_rows = q_out_ptr + batch * stride_qob + tokens * stride_qos
    k_rows = k_ptr + batch * stride_kb + tokens * stride_ks
    k_out_rows = k_out_ptr + batch * stride_kob + tokens * stride_kos
    rows = row_mask[:, None, None]
    # Walk the heads BLOCK_H at a time, each step issuing every load (q and k) before its first
    # store: the compiler may not move a load above a store that could alias it, so this order keeps
    # two tiles in flight instead of one. Unrolled (static_range), the first tiles' loads need not
    # wait for the angle loads and the cos/sin above: their latencies overlap.
    for hb in tl.static_range(N_HEAD_BLOCKS):
        h = (hb * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)[None, :, None]
        q_mask = rows & (h < n_q_heads)
        q_a, q_b = _load_pairs(
            q_rows + h * stride_qh, stride_qd, q_mask, rot_dim, BLOCK_S, BLOCK_H, HALF, INTERLEAVED
        )
        if HAS_K:
            k_mask = rows & (h < n_k_heads)
            k_a, k_b = _load_pairs(
                k_rows + h * stride_kh,
                stride_kd,
                k_mask,
                rot_dim,
                BLOCK_S,
                BLOCK_H,
                HALF,
                INTERLEAVED,
            )
        _store_rotated(
            q_out_rows + h * stride_qoh,
            stride_qod,
            q_mask,
            q_a,
            q_b,
            cos_a,
            sin_a,
            cos_b,
            sin_b,
            rot_dim,
            BLOCK_S,
            BLOCK_H,
            HALF,
            INTERLEAVED,
        )
        if HAS_K:
            _store_rotated(
                k_out_rows + h * stride_koh,
                stride_kod,
                k_mask,
                k_a,
                k_b,
                cos_a,
                sin_a,
                cos_b,
                sin_b,
                rot_dim,
                BLOCK_S,
                BLOCK_H,
                HALF,
                INTERLEAVED,
            )
        if COPY_PASS:  # channels d2: pass through unchanged
            _copy_pass_through(
                q_rows + h * stride_qh,
                q_out_rows + h * stride_qoh,
                stride_qd,
                stride_qod,
                q_mask,
                head_dim,
                rot_dim,
                PASS,
            )
            if HAS_K:
                _copy_pass_through(
                    k_rows + h * stride_kh,
                    k_out_rows + h * stride_koh,
                    stride_kd,
                    stride_kod,
                    k_mask,
                    head_dim,
                    rot_dim,
                    PASS,
                )


# %%
# The launch
# ----------
# One token a program on a GPU (BLOCK_S = 1), its heads in at most four unrolled steps of BLOCK_H (a
# quarter of the head count's next power of 2), two warps (four for big tiles): many small programs
# keep the most bytes in flight per multiprocessor (the sweep of BLOCK_S x BLOCK_H x warps:
# results/02_rope_fwd_sweep.log). So the grid is batch x seqlen programs, or in thd one program a
# packed token. cos and sin tables, loaded rather than computed, take the heads in two steps when
# the rotated channels fill the HALF lanes (d2/2 a power of 2) and in four when some lanes are
# masked off (d = 80), with two warps up to 64 rotated channels (the sweep of table loads, steps and
# warps on Hugging Face's tables: results/02_hf_sweep_H200.log).
#
# Why thd walks the packed tokens. A grid of (sequence, position up to the longest sequence) is
# the obvious one, but it is sized by the longest sequence: with one sequence of 32,768 tokens
# packed among 1,023 of 32, it has 1,024 x 32,768 programs for 65,504 tokens, almost all of which
# return at once. It also needs the longest sequence on the host, a sync that a compiled graph
# cannot make, so a graph must bound it (by the tokens, or the table's rows). Walking the tokens,
# a program finds its token's sequence in cu_seqlens instead: a search whose steps wait on one
# another's loads, so an 8-way search (4 steps for 4,000 sequences) rather than a binary one (12).
# On an H200, at that packing, the first grid took 20.3 ms and this one 0.14 ms, eager and
# compiled (results/compare_thd_H200.md); the search's ways: results/02_thd_search_H200.log.


def _layout(t, tensor_format):
    """t's (batch, seqlen, heads, head_dim) and its strides in that order; thd: batch None, batch
    stride 0 (a sequence's rows are found through cu_seqlens). "bhsd": Hugging Face's [b, h, s,
    d]."""
    if tensor_format == "thd":
        return (None, *t.shape), (0, *t.stride())
    order = {"sbhd": (1, 0, 2, 3), "bhsd": (0, 2, 1, 3)}.get(tensor_format, (0, 1, 2, 3))
    return tuple(t.shape[i] for i in order), tuple(t.stride(i) for i in order)


def _pow2(n):  # plain Python: triton.next_power_of_2 is slow on the host in Triton 3.9
    return 1 << (n - 1).bit_length()


def _as_angle_rows(table):
    """Hugging Face's cos or sin [b or 1, s, d2] (with position_ids, a cache [max_positions, d2])
    as rows by position, [s2, b or 1, 1, d2], the angle table's layout: a view."""
    if table.dim() == 2:
        return table[:, None, None, :]
    return table.transpose(0, 1).unsqueeze(2)


def rope_fwd_tensors(q, q_out, k, k_out, freqs, sin, angles_shared, cu_seqlens, start_positions):
    """rope_fwd_kernel's nine tensor arguments in its order, a stand-in for each absent (None)
    one, never read (its flag says so): q and q_out for k and k_out, freqs for the rest."""
    if k is None:
        k = q
        k_out = q_out
    tensors = (q, q_out, k, k_out, freqs, sin, angles_shared, cu_seqlens, start_positions)
    return tuple([freqs if x is None else x for x in tensors])


def rope_fwd_launch_args(
    q,
    q_out,
    k,
    k_out,
    freqs,
    sin,
    angles_shared,
    cu_seqlens,
    start_positions,
    tensor_format,
    interleaved,
):
    """rope_fwd_kernel's launch as (grid, tensors, scalars, constexprs), for
    ``rope_fwd_kernel[grid](*tensors, *scalars, **constexprs)``: RoPE(q) into q_out and RoPE(k)
    into k_out; the tensors in the kernel's order. k, cu_seqlens and start_positions may be None;
    angles_shared: int32 [1], 1 if the tables' halves are equal. sin None: freqs holds angles.
    With sin (TABLES), freqs and sin are Hugging Face's cos and sin of one layout, [b or 1, s, d2],
    or a cache [max_positions, d2] whose rows a 2-D start_positions (position_ids [b, s]) picks."""
    tensors = rope_fwd_tensors(
        q, q_out, k, k_out, freqs, sin, angles_shared, cu_seqlens, start_positions
    )
    if sin is not None:  # the tables' shape and strides as the angles' (sin: cos' strides)
        freqs = _as_angle_rows(freqs)
    (batch, seqlen, n_q_heads, head_dim), q_strides = _layout(q, tensor_format)
    n_k_heads = _layout(tensors[2], tensor_format)[0][2]
    rot_dim = freqs.shape[3]
    BLOCK_S = TOKENS_A_PROGRAM
    n_seq_blocks = triton.cdiv(seqlen, BLOCK_S)
    HALF = _pow2(rot_dim // 2)
    steps = 4  # the heads in at most four steps
    if sin is not None and 2 * HALF == rot_dim:  # tables filling their lanes: two (the sweep)
        steps = 2
    BLOCK_H = max(1, _pow2(max(n_q_heads, n_k_heads)) // steps)
    if tensor_format == "thd":  # seqlen: the packed tokens, each program finds its sequence
        batch = cu_seqlens.numel() - 1
        grid = (n_seq_blocks,)
    else:
        grid = (batch * n_seq_blocks,)
    table_batch_stride = 0  # one table for every batch row
    if freqs.shape[1] > 1:  # a table of each batch row's
        table_batch_stride = freqs.stride(1)
    position_strides = (0, 0)
    position_ids = start_positions is not None and start_positions.dim() == 2
    if position_ids:
        position_strides = start_positions.stride()
    num_warps = 4 if BLOCK_H * HALF > 128 else 2  # big tiles: four
    if sin is not None and HALF < 64:  # tables of up to 64 rotated channels: two
        num_warps = 2
    scalars = (
        batch,
        n_seq_blocks,
        seqlen,
        n_q_heads,
        n_k_heads,
        head_dim,
        rot_dim,
        freqs.shape[0],  # n_positions: rows of the table
        *q_strides,
        *_layout(q_out, tensor_format)[1],
        *_layout(tensors[2], tensor_format)[1],
        *_layout(tensors[3], tensor_format)[1],
        freqs.stride(0),
        freqs.stride(3),
        table_batch_stride,
        *position_strides,
    )
    constexprs = dict(
        BLOCK_S=BLOCK_S,
        BLOCK_H=BLOCK_H,
        HALF=HALF,
        PASS=_pow2(max(head_dim - rot_dim, 1)),
        N_HEAD_BLOCKS=triton.cdiv(max(n_q_heads, n_k_heads), BLOCK_H),
        INTERLEAVED=interleaved,
        IS_THD=tensor_format == "thd",
        HAS_START_POSITIONS=start_positions is not None,
        HAS_K=k is not None,
        COPY_PASS=rot_dim < head_dim,
        BATCH_FASTEST=tensor_format == "sbhd",
        TABLES=sin is not None,
        POSITION_IDS=position_ids,
        num_warps=num_warps,  # a launch option, not a kernel argument
    )
    return grid, tensors, scalars, constexprs


def launch_rope_fwd(
    q,
    k,
    freqs,
    tensor_format="sbhd",
    interleaved=False,
    cu_seqlens=None,
    start_positions=None,
    sin=None,
):
    """RoPE of q and k (k may be None) in one launch, into new contiguous tensors. q, k: [s, b, h,
    d] | [b, s, h, d] | [total_tokens, h, d] | [b, h, s, d] as tensor_format says ("bhsd": Hugging
    Face's); freqs: float32 angles [s2, 1, 1, d2], or with sin, cos: tables [b or 1, s, d2] or a
    cache [max_positions, d2]; cu_seqlens: int32 [b + 1] (thd); start_positions: int [b], or
    position_ids [b, s] with a cache; unchecked (Part 2 checks). Returns (q_out, k_out). It reads
    both values of every pair (right for any table); Part 2 tells the kernel when the halves are
    equal, so that it reads one."""
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = None
    if k is not None:
        k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    angles_shared = torch.zeros(1, dtype=torch.int32, device=q.device)  # read both angles
    grid, tensors, scalars, constexprs = rope_fwd_launch_args(
        q,
        q_out,
        k,
        k_out,
        freqs,
        sin,
        angles_shared,
        cu_seqlens,
        start_positions,
        tensor_format,
        interleaved,
    )
    rope_fwd_kernel[grid](*tensors, *scalars, **constexprs)
    return q_out, k_out


# %% Part 2 - the drop-in
# Part 1's kernel as the public rope_fwd and rope_fwd_qk (TransformerEngine's angle tables) and
# hf_rope_fwd (Hugging Face's cos and sin tables, for inference). Each piece, and what it buys
# (the host cost of an eager call: results/host_cost.py, measured on results/compare_H100.md):
# - argument checks, once per call signature: a bad argument fails with a message naming it, never
#   inside the kernel or as a wrong result, and a good one is not checked again;
# - values read once per tensor: cu_seqlens and start_positions cost a host sync to check; q, k
#   and every layer of a batch share them, so the verdict is kept for the last tensors seen, by
#   identity and version counter, which in-place writes bump; so is the table's "halves equal"
#   flag, computed on the device (compiled code, which cannot keep it, passes 0: both halves read);
# - the launch cache around rope_fwd_launch_args: Triton's ``kernel[grid](...)`` binds and
#   specializes its 51 arguments on every call, yet all of it depends on the signature only (the
#   tensors' shapes, strides, dtypes, devices and 16-byte alignment, on which Triton specializes
#   pointers); a signature's later calls go straight to the compiled kernel;
# - a torch.library.custom_op that writes its outputs (mutates_args): one opaque node for
#   torch.compile(fullgraph=True). A graph must not sync, so compiled calls skip the value checks;
#   the launch is the eager call's (thd's grid needs the token count only).

_checked = {}
_launches = {}
_last_results = {}
_read_both = {}  # per device: the flag with which the kernel reads both halves of the table


def _signature(*args):
    """Each tensor's shape, strides, dtype, device and alignment; any other argument with its
    type."""
    return tuple(  # of a list: faster than of a generator
        [
            (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16)
            if isinstance(x, torch.Tensor)
            else (type(x), x)
            for x in args
        ]
    )


def _once(cache, key, compute):
    """compute(), once per key; not kept if it raised (or the key is unhashable: a bad argument,
    named by the check)."""
    try:
        return cache[key]
    except (KeyError, TypeError):
        pass
    if len(cache) >= 4096:  # a workload of ever new shapes starts over
        cache.clear()
    cache[key] = value = compute()
    return value


def _remember(what, tensors, extra_key, compute):
    """compute(), or its result for the same tensors at the same versions last time."""
    if any(x.is_inference() for x in tensors):  # no version counter: computed every time
        return compute()
    key = tuple((id(x), x._version) for x in tensors) + extra_key
    last = _last_results.get(what)
    if last is None or last[0] != key or not all(ref() is x for ref, x in zip(last[1], tensors)):
        with torch.inference_mode(False):  # kept for later calls, in any mode
            result = compute()
        _last_results[what] = (key, tuple(weakref.ref(x) for x in tensors), result)
    return _last_results[what][2]


def _read_values(cu_seqlens, start_positions, seqlen, n_tokens, max_positions):
    """Check the values of cu_seqlens and start_positions (a host sync)."""
    if cu_seqlens is not None:
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu[:8]}...")
        if cu[-1] != n_tokens:
            raise ValueError(
                f"cu_seqlens[-1] = {cu[-1]} must equal the number of tokens of t, {n_tokens}"
            )
        lengths = [b - a for a, b in zip(cu, cu[1:])]
    else:
        lengths = [seqlen] * start_positions.numel()
    starts = [0] * len(lengths)
    if start_positions is not None:
        starts = start_positions.tolist()
    if min(starts, default=0) < 0:
        raise ValueError(f"start_positions must be >= 0, got {min(starts)}")
    needed = max((s + n for s, n in zip(starts, lengths)), default=0)
    if needed > max_positions:
        raise ValueError(
            f"positions up to {needed - 1} are needed (start_positions + sequence length) "
            f"but freqs has only {max_positions} rows (s2)"
        )


def _halves_equal(tables, interleaved):
    equal = []
    for f in tables:
        if interleaved:
            f_a, f_b = f[..., 0::2], f[..., 1::2]
        else:
            f_a, f_b = f.chunk(2, dim=-1)
        equal.append((f_a == f_b).all())
    return torch.stack(equal).all().to(torch.int32).reshape(1)


def _angles_shared(tables, interleaved, what="angles shared"):
    """int32 [1], computed on the device: 1 if f_b == f_a everywhere in each of the tables (the
    angles; or cos and sin): the kernel then reads half of each; remembered per tables in eager
    mode. Compiled code cannot remember it, nor can a call on inference tensors (no version
    counter), and a pass over the tables each call costs more than the kernel's reading both
    halves: 0 there."""
    device = tables[0].device
    read_both = functools.partial(torch.zeros, 1, dtype=torch.int32, device=device)
    if torch.compiler.is_compiling():
        return read_both()
    if any([f.is_inference() for f in tables]):  # one flag a device, not an allocation a call
        return _once(_read_both, device, read_both)
    compute = functools.partial(_halves_equal, tables, interleaved)
    return _remember(what, tables, (interleaved,), compute)


def _check(tensors, names, freqs, tensor_format, cu_seqlens, start_positions):
    """The checks that read no tensor's values. Returns the sequence length."""
    if tensor_format not in TENSOR_FORMATS:
        raise ValueError(f"tensor_format must be one of {TENSOR_FORMATS}, got {tensor_format!r}")
    rank = 3 if tensor_format == "thd" else 4
    t = tensors[0]
    for x, name in zip(tensors, names):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
        if x.dim() != rank:
            raise ValueError(
                f"{name} must have {rank} dims for tensor_format='{tensor_format}', "
                f"got shape {tuple(x.shape)}"
            )
    if not isinstance(freqs, torch.Tensor):
        raise TypeError(f"freqs must be a torch.Tensor, got {type(freqs).__name__}")
    if freqs.dtype != torch.float32:
        raise TypeError(
            f"freqs must be float32 angles (cos/sin are taken inside the kernel), got {freqs.dtype}"
        )
    if freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1:
        raise ValueError(f"freqs must have shape [s2, 1, 1, d2], got {tuple(freqs.shape)}")
    (batch, seqlen, _, head_dim), _ = _layout(t, tensor_format)
    max_positions = freqs.shape[0]
    rot_dim = freqs.shape[3]
    if rot_dim % 2 or not 2 <= rot_dim <= head_dim:
        raise ValueError(
            f"freqs' last dim d2 = {rot_dim} must be even and between 2 and the head dim {head_dim}"
        )
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head dim {head_dim} is over the supported {MAX_HEAD_DIM}")
    for x, name in zip(tensors[1:], names[1:]):
        (xb, xs, _, xd), _ = _layout(x, tensor_format)
        if x.dtype != t.dtype or (xb, xs, xd) != (batch, seqlen, head_dim):
            raise ValueError(
                f"{name} must match q in dtype and in every dim but heads: got {tuple(x.shape)} "
                f"{x.dtype}, q is {tuple(t.shape)} {t.dtype}"
            )
    others = [(freqs, "freqs"), (cu_seqlens, "cu_seqlens"), (start_positions, "start_positions")]
    for x, name in [*zip(tensors, names), *others]:
        if isinstance(x, torch.Tensor) and x.device != t.device:
            raise ValueError(f"{name} is on {x.device} but {names[0]} is on {t.device}")
    if tensor_format == "thd":
        if cu_seqlens is None:
            raise ValueError("cu_seqlens is required for tensor_format='thd'")
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32:
            got = getattr(cu_seqlens, "dtype", type(cu_seqlens))
            raise TypeError(f"cu_seqlens must be an int32 tensor, got {got}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(
                f"cu_seqlens must have shape [b + 1] with b >= 1, got {tuple(cu_seqlens.shape)}"
            )
        batch = cu_seqlens.numel() - 1
    elif cu_seqlens is not None:
        raise ValueError(
            f"cu_seqlens is only for tensor_format='thd', got tensor_format={tensor_format!r}"
        )
    elif seqlen > max_positions:
        raise ValueError(f"sequence length {seqlen} is over the {max_positions} rows (s2) of freqs")
    if start_positions is not None:
        int_types = (torch.int32, torch.int64)
        if not isinstance(start_positions, torch.Tensor) or start_positions.dtype not in int_types:
            raise TypeError("start_positions must be an int32 or int64 tensor")
        if start_positions.shape != (batch,):
            raise ValueError(
                f"start_positions must have shape [b] = [{batch}], "
                f"got {tuple(start_positions.shape)}"
            )
    return seqlen


def _launch_cached(key, *args):
    """rope_fwd_launch_args' launch (its arguments), remembered by key: a key's first call goes
    through Triton, later ones straight to the compiled kernel with the remembered scalars and
    constexprs (in the interpreter, always through Triton)."""
    launch = _launches.get(key)
    if launch is not None:  # Hugging Face's tables as they are: the kernel takes their addresses
        compiled, scalars = launch
        compiled(*rope_fwd_tensors(*args[:9]), *scalars)
        return
    grid, tensors, scalars, constexprs = rope_fwd_launch_args(*args)
    compiled = rope_fwd_kernel[grid](*tensors, *scalars, **constexprs)
    if isinstance(compiled, triton.compiler.CompiledKernel):

        def remembered():  # the compiled kernel takes every argument in order, constexprs too
            names = [name for name in rope_fwd_kernel.arg_names if name in constexprs]
            values = [constexprs[name] for name in names]
            return compiled[(*grid, 1, 1)], (*scalars, *values)

        _once(_launches, key, remembered)


def _launch(
    q: torch.Tensor,
    q_out: torch.Tensor,
    k: Optional[torch.Tensor],
    k_out: Optional[torch.Tensor],
    freqs: torch.Tensor,
    sin: Optional[torch.Tensor],
    angles_shared: torch.Tensor,
    cu_seqlens: Optional[torch.Tensor],
    start_positions: Optional[torch.Tensor],
    tensor_format: str,
    interleaved: bool,
) -> None:
    """Write RoPE(q) into q_out (and RoPE(k) into k_out): the op's body, rope_fwd_launch_args'
    arguments."""
    tensors = (q, q_out, k, k_out, freqs, sin, angles_shared, cu_seqlens, start_positions)
    key = (*_signature(*tensors), tensor_format, interleaved)
    _launch_cached(key, *tensors, tensor_format, interleaved)


def _register():
    """_launch as the op rope_fwd_tutorial::rope (a fresh name if this file was loaded before),
    writing into the outputs that it is given."""
    n = 0
    while hasattr(torch.ops.rope_fwd_tutorial, f"rope{n or ''}"):
        n += 1
    op = torch.library.custom_op(
        f"rope_fwd_tutorial::rope{n or ''}", _launch, mutates_args=("q_out", "k_out")
    )

    @op.register_fake
    def _(*args):  # writes its outputs, returns nothing
        return None

    return op


_rope_op = _register()


def _refuse_gradients(tensors, names, differentiable):
    """02 has no backward: no output could carry an input's gradient, so an input that requires
    grad where autograd records is refused (not its training stopped silently)."""
    for x, name in zip(tensors, names):
        if x.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{name} requires grad, but 02 has no backward: use 03's {differentiable}, or "
                "no_grad"
            )


def _launch_op(key, *args):
    """The launch into the outputs: the op where torch.compile traces; else the eager launch,
    past the op's dispatch, keyed by the checks' key (the signature decides both)."""
    if torch.compiler.is_compiling():
        _rope_op(*args)
    else:
        _launch_cached(key, *args)


def _rope(tensors, freqs, tensor_format, interleaved, cu_seqlens, start_positions):
    """rope_fwd and rope_fwd_qk: checks (once per signature, values once per tensor), outputs,
    one launch."""
    names = ("t",) if len(tensors) == 1 else ("q", "k")
    tracing = torch.compiler.is_compiling()
    check = functools.partial(
        _check, tensors, names, freqs, tensor_format, cu_seqlens, start_positions
    )
    key = None  # traced: no launch is remembered
    if tracing:
        seqlen = check()
    else:
        key = _signature(*tensors, freqs, cu_seqlens, start_positions, tensor_format)
        seqlen = _once(_checked, key, check)
    _refuse_gradients(tensors, names, "apply_rotary_pos_emb")
    t = tensors[0]
    k = tensors[1] if len(tensors) == 2 else None
    if not tracing and (cu_seqlens is not None or start_positions is not None):
        given = tuple(x for x in (cu_seqlens, start_positions) if x is not None)
        sizes = (seqlen, t.shape[0], freqs.shape[0])
        read = functools.partial(_read_values, cu_seqlens, start_positions, *sizes)
        _remember("values checked", given, sizes, read)
    outs = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in tensors]
    if all(x.numel() == 0 for x in tensors):
        return outs
    k_out = outs[1] if k is not None else None
    flag = _angles_shared((freqs,), interleaved)
    args = (t, outs[0], k, k_out, freqs, None, flag, cu_seqlens, start_positions)
    _launch_op((key, interleaved), *args, tensor_format, interleaved)
    return outs


def rope_fwd(
    t, freqs, tensor_format="sbhd", interleaved=False, cu_seqlens=None, start_positions=None
):
    """Apply RoPE to t in one Triton kernel (TransformerEngine's ``apply_rotary_pos_emb`` forward).

    t: [s, b, h, d] (sbhd) | [b, s, h, d] (bshd) | [total_tokens, h, d] (thd); fp32/fp16/bf16, any
        strides, d <= 256.
    freqs: float32 angles [s2, 1, 1, d2], d2 even, d2 <= d, s2 >= every position used. Only
        t[..., :d2] is rotated; t[..., d2:] passes through.
    interleaved: rotate pairs (x0, x1), (x2, x3), ... (RoFormer, GPT-J) instead of halves.
    cu_seqlens: int32 [b + 1], thd only: sequence i is tokens cu_seqlens[i]:cu_seqlens[i + 1], from
        position 0.
    start_positions: int [b]: sequence i uses angle rows start_positions[i] onwards (KV cache).
    Returns a new contiguous tensor. Works under torch.compile(fullgraph=True).
    """
    return _rope([t], freqs, tensor_format, interleaved, cu_seqlens, start_positions)[0]


def rope_fwd_qk(
    q, k, freqs, tensor_format="sbhd", interleaved=False, cu_seqlens=None, start_positions=None
):
    """Apply RoPE to q and k in a single launch; k may have fewer heads than q (GQA).

    q: like ``rope_fwd``'s t; k: the same layout, batch, sequence and head dim, any head count.
    Returns (q_out, k_out), new contiguous tensors.
    """
    return tuple(_rope([q, k], freqs, tensor_format, interleaved, cu_seqlens, start_positions))


# %%
# Hugging Face's tables
# ---------------------
# transformers' attention calls apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1) with the
# tables that the model's rotary module built: [b or 1, s, d2] in the model's dtype, scaled by the
# RoPE type's attention factor (yarn, longrope). hf_rope_fwd takes the same arguments, for
# inference: the kernel reads the tables as they are (TABLES) and computes in float32, rounding
# once, so in bf16 its results are about one bf16 ulp from transformers' own, which multiplies in
# bf16. position_ids picks rows of a [max_positions, d2] cache instead (decoding, packing). 03's
# hf_apply_rotary_pos_emb adds the backward.


def _check_hf(q, k, cos, sin, unsqueeze_dim, position_ids):
    """The checks of hf_rope_fwd that read no values; returns the rows of cos and sin and the
    results' dtype (q's promoted with the tables', as transformers' q * cos promotes)."""
    if type(unsqueeze_dim) is not int or unsqueeze_dim not in (1, 2):
        raise ValueError(
            f"unsqueeze_dim must be 1 ([b, h, s, d]) or 2 ([b, s, h, d]), got {unsqueeze_dim!r} "
            "(position_ids is keyword-only)"
        )
    float_dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    for x, name in zip((q, k, cos, sin), ("q", "k", "cos", "sin")):
        if getattr(x, "dtype", None) not in float_dtypes:
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
    if dtype == torch.float64:
        raise TypeError(
            "q, k, cos and sin must promote to float32, float16 or bfloat16 (the results' "
            "dtype; 02 computes no float64), got float64"
        )
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


def hf_rope_fwd(q, k, cos, sin, unsqueeze_dim=1, *, position_ids=None):
    """transformers' ``apply_rotary_pos_emb`` forward, for inference: ``q * cos + rotate_half(q)
    * sin`` on the first d2 channels (the rest pass through), q and k in one launch. Returns
    (q_embed, k_embed), new tensors with q's and k's shapes and strides.

    q, k: [b, h, s, d] (unsqueeze_dim=1; often transposed views of [b, s, h, d] memory, read
        through their strides) or [b, s, h, d] (unsqueeze_dim=2); k may have fewer heads.
    cos, sin: [b or 1, s, d2], any float dtype, as the model's rotary module returns them
        (scaled by its attention factor); or, with position_ids, a cache [max_positions, d2].
    position_ids: int [b or 1, s], keyword only (an extension): token (i, j) uses row
        position_ids[i, j] of cos and sin.
    No backward: an input that requires grad is refused outside no_grad (03's
    hf_apply_rotary_pos_emb takes the same arguments, with gradients). Works under
    torch.compile(fullgraph=True).
    """
    args = (q, k, cos, sin, unsqueeze_dim, position_ids)
    key = None  # traced: no launch is remembered
    if torch.compiler.is_compiling():
        rows, dtype = _check_hf(*args)
    else:
        key = _signature(*args)
        rows, dtype = _once(_checked, key, functools.partial(_check_hf, *args))
        if position_ids is not None:
            read = functools.partial(_read_position_ids, position_ids, rows)
            _remember("position ids checked", (position_ids,), (rows,), read)
    _refuse_gradients((q, k, cos, sin), ("q", "k", "cos", "sin"), "hf_apply_rotary_pos_emb")
    # The flag of the caller's tables, which every layer shares (a copy below has their values)
    flag = _angles_shared((cos, sin), False, "tables shared")
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
    q_out = torch.empty_like(q)  # q's strides, as transformers' formula keeps them
    k_out = torch.empty_like(k)
    if q.numel() == 0 and k.numel() == 0:
        return q_out, k_out
    _launch_op(key, q, q_out, k, k_out, cos, sin, flag, None, position_ids, tensor_format, False)
    return q_out, k_out


# %% Part 3 - check and benchmark
# The self-check runs irregular shapes (odd sequence lengths and head counts, head dim 80, partial
# rotary), random angles whose halves differ, strided views and GQA: every feature at once
# (tests/test_02_rope_fwd.py covers the whole matrix). The benchmark times ours three ways,
# TransformerEngine's unfused formula eager and compiled, Liger's and flash-attention's kernels if
# importable, against a copy of the same bytes (results/02_rope_fwd_H100.md).


def self_check():
    torch.manual_seed(0)
    b, s, h, d = (3, 37, 5, 80) if DEVICE.type == "cuda" else (2, 7, 3, 80)
    cu_seqlens = torch.arange(0, b * s + 1, s, dtype=torch.int32, device=DEVICE)
    dtypes = (torch.float32, torch.bfloat16)
    for dtype, fmt, interleaved in itertools.product(dtypes, TENSOR_FORMATS, (False, True)):
        qkv = torch.randn(b, s, 3, h, d, device=DEVICE, dtype=dtype)
        qkv = {"sbhd": qkv.transpose(0, 1), "bshd": qkv, "thd": qkv.flatten(0, 1)}[fmt]
        q = qkv[..., 0, :, :]  # strided views
        k = qkv[..., 1, :2, :]  # with fewer heads
        freqs = torch.randn(s + 4, 1, 1, 48, device=DEVICE)  # partial rotary, halves differ
        start_positions = torch.randint(0, 5, (b,), device=DEVICE)
        kwargs = dict(tensor_format=fmt, interleaved=interleaved, start_positions=start_positions)
        if fmt == "thd":
            kwargs["cu_seqlens"] = cu_seqlens
        for x, y in zip((q, k), rope_fwd_qk(q, k, freqs, **kwargs)):
            torch.testing.assert_close(y, rope_reference(x, freqs, **kwargs))
    for dtype in dtypes:  # Hugging Face's: per-row tables scaled by an attention factor, a cache
        q = torch.randn(b, s, h, d, device=DEVICE, dtype=dtype).transpose(1, 2)  # [b, h, s, d]
        k = q[:, :2]
        angles = torch.randn(b, s, 24, device=DEVICE).repeat(1, 1, 2)  # halves equal
        cos = (1.3 * angles.cos()).to(dtype)
        sin = (1.3 * angles.sin()).to(dtype)
        ids = torch.randint(0, s, (1, s), device=DEVICE)
        for tables, position_ids in (((cos, sin), None), ((cos[0], sin[0]), ids)):
            got = hf_rope_fwd(q, k, *tables, position_ids=position_ids)
            rows = tables
            if position_ids is not None:
                rows = (tables[0][position_ids], tables[1][position_ids])
            want = _hf_formula(*[x.float() for x in (q, k, *rows)])  # float32, rounded once
            torch.testing.assert_close(got, tuple(y.to(dtype) for y in want))
    print(
        f"self-check passed: fp32/bf16 x sbhd/bshd/thd x half/interleaved, d={d}, d2=48, GQA, "
        f"strided views, start_positions; Hugging Face's tables and position_ids (device: "
        f"{DEVICE.type})"
    )


BENCH_SHAPES = [(4, 4096, 32, 128), (32, 512, 12, 64), (1, 32768, 8, 128)]  # (b, s, h, d)
PACKINGS = {  # thd, about 65K tokens of 8 heads of 128 channels: the sequences' lengths
    "64 x 1024": [1024] * 64,
    "2048 x 32": [32] * 2048,
    "1023 x 32 + 1 x 32768": [32] * 1023 + [32768],
    "4000 x 1-32": torch.randint(1, 33, (4000,), generator=torch.Generator().manual_seed(0)),
}
HF_SHAPES = [  # (b, s, h, d, k heads): 03's Hugging Face shapes
    (4, 4096, 32, 128, 32),
    (4, 4096, 32, 128, 8),
    (32, 512, 12, 64, 12),
    (1, 32768, 8, 128, 8),
    (8, 2048, 32, 80, 32),
]
TIMED = (
    "bf16 q and k; packed: thd, the sequences' lengths shown, 8 heads, head dim 128. Each cell is "
    "GPU time, the median of `triton.testing.do_bench_cudagraph` (work replayed from a CUDA "
    'graph), except "ours: eager call": the median of `triton.testing.do_bench` over ten calls '
    "in a row, per call, host cost included. eager, torch.compile: TransformerEngine's unfused "
    "formula. (x%): the speed as a fraction of a device-to-device copy of the same bytes, in the "
    "same run. n/a: a peer not importable, or not for this layout. The second table: Hugging "
    "Face's entry point, `hf_rope_fwd`, on q and k [b, h, s, d] views of [b, s, h, d] memory "
    "with cos and sin bf16 [1, s, d] (their bytes not counted); transformers: its formula; "
    "liger: Liger-Kernel's rope_forward."
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


def _eager(q, k, freqs, **kwargs):  # TransformerEngine's unfused formula
    return [rope_reference(x, freqs, compute_dtype=None, **kwargs) for x in (q, k)]


def _hf_formula(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb as models run it ([b, h, s, d], in q's dtype); d2 < d:
    the other channels pass through, as partial-rotary models split them."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    d2 = cos.shape[-1]
    outs = []
    for x in (q, k):
        x_a, x_b = x[..., :d2].chunk(2, dim=-1)
        y = x[..., :d2] * cos + torch.cat((-x_b, x_a), dim=-1) * sin
        if d2 < x.shape[-1]:
            y = torch.cat((y, x[..., d2:]), dim=-1)
        outs.append(y)
    return outs


def _import_peer(module, name):
    """module.name, or None (its column: n/a) with the reason printed."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as e:
        print(f"({module} is not importable, its column is skipped: {e})")
        return None


def _peers(fmt, q, k, freqs, cu_seqlens, rope_forward, apply_rotary):
    """{name: call} of the peers given (Liger's rope_forward, flash-attention's apply_rotary; None:
    not importable) that take this layout, on the same q and k (their tables, cos and sin in bf16,
    built untimed)."""
    peers = {}
    cos = freqs[:, 0, 0].cos().to(q.dtype)
    sin = freqs[:, 0, 0].sin().to(q.dtype)
    if rope_forward is not None and fmt == "bshd":  # in place, on [b, h, s, d] views
        args = (q.transpose(1, 2), k.transpose(1, 2), cos[None], sin[None])
        peers["liger (in place)"] = functools.partial(rope_forward, *args)
    if apply_rotary is not None:  # bshd, any strides, or thd; tables [s, d/2]
        half = cos.shape[1] // 2
        tables = (cos[:, :half].contiguous(), sin[:, :half].contiguous())
        kwargs = {}
        if fmt == "thd":
            kwargs = dict(cu_seqlens=cu_seqlens, max_seqlen=freqs.shape[0])
        xs = (q, k)
        if fmt == "sbhd":  # as [b, s, h, d] views
            xs = (q.transpose(0, 1), k.transpose(0, 1))

        def flash():
            return [apply_rotary(x, *tables, **kwargs) for x in xs]

        peers["flash-attn"] = flash
    return peers


def _rows(on_gpu):
    """Each row's (shape or packing, layout, q and k stacked, freqs, cu_seqlens)."""
    for b, s, h, d in BENCH_SHAPES if on_gpu else [(2, 16, 4, 64)]:
        qk = torch.randn(2, b, s, h, d, device=DEVICE, dtype=torch.bfloat16)
        freqs = rope_freqs(s, d, device=DEVICE)
        cu_seqlens = torch.arange(0, b * s + 1, s, dtype=torch.int32, device=DEVICE)
        yield (b, s, h, d), "bshd", qk, freqs, None
        yield (b, s, h, d), "sbhd", qk.transpose(1, 2).contiguous(), freqs, None
        yield (b, s, h, d), "thd", qk.flatten(1, 2), freqs, cu_seqlens
    packings = PACKINGS if on_gpu else {"3 x 1-5 + 1 x 24": [3, 1, 5, 24]}
    for packing, lengths in packings.items():
        lengths = torch.as_tensor(lengths, device=DEVICE)
        cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        qk = torch.randn(2, int(cu_seqlens[-1]), 8, 128, device=DEVICE, dtype=torch.bfloat16)
        freqs = rope_freqs(int(lengths.max()), 128, device=DEVICE)
        yield f"packed: {packing}", "thd", qk, freqs, cu_seqlens


def _cells(calls, names, on_gpu):
    """A row's cells, in the order of names: us per call and, on a GPU, (x%) the copy's time over
    the cell's; n/a where a name has no call."""
    us = {name: time_us(call, "eager call" in name) for name, call in calls.items()}
    cells = []
    for name in names:
        cell = "n/a"
        if name in us:
            cell = f"{us[name]:.1f} us"
        if name in us and on_gpu:
            cell += f" ({100 * us['copy'] / us[name]:.0f}%)"
        cells.append(cell)
    return cells


def _header(names):  # a Markdown table's first two lines
    return [f"| {' | '.join(names)} |", "|---" * len(names) + "|"]


def benchmark():
    """Prints each row as measured; returns the tables' lines."""
    on_gpu = DEVICE.type == "cuda"
    columns = {"ours": rope_fwd_qk, "ours: eager call": rope_fwd_qk, "eager": _eager}
    hf_columns = {"ours": hf_rope_fwd, "ours: eager call": hf_rope_fwd, "transformers": _hf_formula}
    liger = None
    if on_gpu:  # compiled per shape and layout (dynamic=False: no dynamic-shape kernels)
        torch._dynamo.config.cache_size_limit = 64
        columns["ours: torch.compile"] = torch.compile(rope_fwd_qk, fullgraph=True, dynamic=False)
        columns["torch.compile"] = torch.compile(_eager, fullgraph=True, dynamic=False)
        hf_columns["ours: torch.compile"] = torch.compile(
            hf_rope_fwd, fullgraph=True, dynamic=False
        )
        compiled_formula = torch.compile(_hf_formula, fullgraph=True, dynamic=False)
        hf_columns["transformers: torch.compile"] = compiled_formula
        liger = _import_peer("liger_kernel.ops.rope", "rope_forward")
        flash = _import_peer("flash_attn.ops.triton.rotary", "apply_rotary")
    else:
        print(
            "\nNO GPU: the kernels run in Triton's interpreter on the CPU. The timings below "
            "only show that the benchmark runs; they say nothing about speed."
        )
    names = ["copy", *columns, "liger (in place)", "flash-attn"]
    table = _header(["shape (b, s, h, d)", "layout", *names])
    print(*table, sep="\n")
    for shape, fmt, qk, freqs, cu_seqlens in _rows(on_gpu):
        q, k = qk
        calls = {"copy": functools.partial(torch.empty_like(qk).copy_, qk)}
        kwargs = dict(tensor_format=fmt, cu_seqlens=cu_seqlens)
        for name, fn in columns.items():
            calls[name] = functools.partial(fn, q, k, freqs, **kwargs)
        if on_gpu:
            calls.update(_peers(fmt, q, k, freqs, cu_seqlens, liger, flash))
        table.append(f"| {shape} | {fmt} | {' | '.join(_cells(calls, names, on_gpu))} |")
        print(table[-1], flush=True)
    if liger is not None:
        hf_columns["liger (in place)"] = liger
    hf_table = _header(["shape (b, s, h, d, k heads)", "copy", *hf_columns])
    print("", *hf_table, sep="\n")
    randn = functools.partial(torch.randn, device=DEVICE, dtype=torch.bfloat16)
    for b, s, h, d, h_k in HF_SHAPES if on_gpu else [(2, 8, 4, 64, 2)]:
        q = randn(b, s, h, d).transpose(1, 2)  # [b, h, s, d] views, as models make them
        k = randn(b, s, h_k, d).transpose(1, 2)
        angles = rope_freqs(s, d, device=DEVICE)[None, :, 0, 0]
        args = (q, k, angles.cos().bfloat16(), angles.sin().bfloat16())
        src = torch.cat([q.flatten(), k.flatten()])  # the bytes that move
        calls = {"copy": functools.partial(torch.empty_like(src).copy_, src)}
        for name, fn in hf_columns.items():
            calls[name] = functools.partial(fn, *args)
        cells = _cells(calls, list(calls), on_gpu)
        hf_table.append(f"| {(b, s, h, d, h_k)} | {' | '.join(cells)} |")
        print(hf_table[-1], flush=True)
    return [*table, "", *hf_table]


def write_page(results_dir, table):
    """results/<script>_<GPU kind>.md: title, environment, command, what is timed, the table, the
    raw log's name."""
    here, script = os.path.split(os.path.abspath(__file__))
    gpu = torch.cuda.get_device_name()
    kind = next((w for w in gpu.split() if w[:1] in "ABHL" and w[1:2].isdigit()), "gpu")
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
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, stem + ".md"), "w") as f:
        f.write(f"# {__doc__.splitlines()[1]}\n\n{environment}\n\n")
        f.write(f"Command: `python {' '.join(sys.argv)}`\n\n{TIMED}\n\n{table}\n\n")
        f.write(f"Raw log: `{stem}.log`.\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    parser.add_argument(
        "--results", default=results, help="folder for the page (written only on a GPU)"
    )
    args = parser.parse_args()
    self_check()
    table = benchmark()
    if DEVICE.type == "cuda":
        write_page(args.results, "\n".join(table))
