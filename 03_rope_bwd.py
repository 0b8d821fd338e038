"""
RoPE backward, and a differentiable RoPE that drops into real models
====================================================================

In this tutorial, you will learn about:

* deriving RoPE's backward, element by element: the forward with each half's sine moved to the other half and
  negated (one kernel, a direction flag); why that is "the angle negated" only for true rotation tables;
* a ``torch.autograd.Function`` with TransformerEngine's ``apply_rotary_pos_emb`` signature, for q alone or q
  and k (grouped-query attention) in one launch each way;
* registering Triton kernels with ``torch.library`` (``triton_op`` + ``wrap_triton``) so that
  ``torch.compile(fullgraph=True)`` captures them, and keeping host syncs out of compiled code;
* checking gradients with ``torch.autograd.gradcheck`` in float64;
* what autograd over the eager formula costs, against one read and one write.

Run ``python 03_rope_bwd.py``: it checks itself against autograd through the PyTorch reference, then
benchmarks. This file imports only torch and triton: copy it alone into your project.
"""

# %%
# Setup: with no GPU, the kernels run in Triton's interpreter (set before triton is imported).
import argparse
import datetime
import hashlib
import itertools
import os
import pathlib
import platform
import subprocess
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
    """Angle table f[pos, 0, 0, c] (float32, [max_seq_len, 1, 1, rotary_dim]) laid out as TE's
    ``RotaryPositionEmbedding``: d2/2 inverse frequencies repeated as two halves or as pairs."""
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
    """Plain PyTorch RoPE, differentiable. ``compute_dtype=None`` multiplies in t's dtype, which is
    TransformerEngine's unfused formula exactly; float32 rounds once, like the kernel."""
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
# y is linear in x, so the gradient is the transposed map applied to dy = dL/dy:
#
#     dx_a = dy_a cos(f_a) + dy_b sin(f_b)          e.g. dt[0]    = dy[0] cos(f[0]) + dy[d2/2] sin(f[d2/2])
#     dx_b = dy_b cos(f_b) - dy_a sin(f_a)               dt[d2/2] = dy[d2/2] cos(f[d2/2]) - dy[0] sin(f[0])
#
# (In TE's notation, dx = dy cos(f) + R^T(dy sin(f)) with R^T = -R: a quarter turn back.) In the forward's shape:
#
#     dx_a = dy_a cos(f_a) - dy_b (-sin(f_b))
#     dx_b = dy_b cos(f_b) + dy_a (-sin(f_a))
#
# It is the forward applied to dy with  sin_a <- -sin(f_b)  and  sin_b <- -sin(f_a)  (cos unchanged). For a
# true rotation table (f_a = f_b) that is the forward with the angle negated: the inverse rotation. For an
# arbitrary table the two halves' sines also trade places, and a backward that only negated the angle would be
# wrong; the tests use such tables to catch it. Pass-through channels (d2 < d) have y = x, so dx = dy: copied.
#
# Memory traffic
# --------------
# The backward reads dy once and writes dx once: 2N elements for N elements of q and k, as the forward and a
# copy do. Autograd over the eager formula runs the backward of every op of the forward (the two products, the
# rotate-half's slices, negation and concatenation, the sum, the concatenation with the pass-through part),
# each reading and writing full tensors.
#
# The kernel
# ----------
# 02's kernel, generalised in three ways:
#   1. BACKWARD swaps and negates the sines, as derived above; nothing else changes.
#   2. float64 inputs are computed in float64 (for gradcheck); other dtypes in float32.
#   3. In thd the grid walks the packed tokens and each token finds its sequence by a binary search in
#      cu_seqlens. 02's grid needs the longest sequence, known on the host only after a sync; this one needs no
#      such number, so compiled code launches it exactly.
# Angle rows past the table are masked (read as 0), not read out of bounds (see the argument checks).


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
def _store_rotated(y_tile, stride_d, mask, x_a, x_b, cos_a, sin_a, cos_b, sin_b, rot_dim,
                   BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
                   INTERLEAVED: tl.constexpr):
    """y_a = x_a cos_a - x_b sin_a, y_b = x_b cos_b + x_a sin_b, stored in y's dtype."""
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
def _sequence_of(cu_seqlens_ptr, token, n_seqs):
    """The sequence each token belongs to: the last i with cu_seqlens[i] <= token, by binary
    search (about log2(n_seqs) steps; the few entries read stay in cache)."""
    lo = tl.zeros_like(token)
    hi = lo + n_seqs  # invariant: cu_seqlens[lo] <= token < cu_seqlens[hi]
    while tl.max(hi - lo, axis=0) > 1:
        mid = (lo + hi) // 2
        right = tl.load(cu_seqlens_ptr + mid) <= token
        lo, hi = tl.where(right, mid, lo), tl.where(right, hi, mid)
    return lo


@triton.jit
def rope_kernel(
    q_ptr, q_out_ptr, k_ptr, k_out_ptr, freqs_ptr, angles_shared_ptr, cu_seqlens_ptr, start_positions_ptr,
    n_batch, n_seq_blocks, seqlen, n_q_heads, n_k_heads, head_dim, rot_dim, n_positions,
    stride_qb, stride_qs, stride_qh, stride_qd, stride_qob, stride_qos, stride_qoh, stride_qod,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_kob, stride_kos, stride_koh, stride_kod,
    stride_fs, stride_fd,
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr,
    N_HEAD_BLOCKS: tl.constexpr, INTERLEAVED: tl.constexpr, IS_THD: tl.constexpr,
    HAS_START_POSITIONS: tl.constexpr, HAS_K: tl.constexpr, COPY_PASS: tl.constexpr,
    BATCH_FASTEST: tl.constexpr, BACKWARD: tl.constexpr, IS_FP64: tl.constexpr,
):
    # A 1-D grid in memory order: in sbhd the batch index moves fastest, in bshd the position; in
    # thd the program walks the packed tokens (seqlen is then the number of tokens).
    pid = tl.program_id(0)
    if IS_THD:
        s = pid * BLOCK_S + tl.arange(0, BLOCK_S)
        row_mask = s < seqlen
        batch = _sequence_of(cu_seqlens_ptr, s, n_batch)  # one sequence per token
        pos = s - tl.load(cu_seqlens_ptr + batch)
    else:
        if BATCH_FASTEST:
            pid_s, batch = pid // n_batch, pid % n_batch
        else:
            pid_s, batch = pid % n_seq_blocks, pid // n_seq_blocks
        s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
        row_mask = s < seqlen
        pos = s
    if HAS_START_POSITIONS:
        pos = pos + tl.load(start_positions_ptr + batch)

    # Angles once per token, shared by every head of q and k. The second half is read only when
    # the table's halves differ (a device-side flag, computed once per table, as in 02).
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

    tokens = s.to(tl.int64)[:, None, None]  # row offsets in int64, [BLOCK_S, 1, 1]
    batch = 0 if IS_THD else batch.to(tl.int64)  # thd's rows are the packed tokens themselves
    q_rows, q_out_rows = q_ptr + batch * stride_qb + tokens * stride_qs, q_out_ptr + batch * stride_qob + tokens * stride_qos
    k_rows, k_out_rows = k_ptr + batch * stride_kb + tokens * stride_ks, k_out_ptr + batch * stride_kob + tokens * stride_kos
    rows = row_mask[:, None, None]
    # Heads BLOCK_H at a time, unrolled; every load of a step (q and k) before its first store.
    for hb in tl.static_range(N_HEAD_BLOCKS):
        h = (hb * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)[None, :, None]
        q_mask = rows & (h < n_q_heads)
        q_a, q_b = _load_pairs(q_rows + h * stride_qh, stride_qd, q_mask, rot_dim, BLOCK_S, BLOCK_H, HALF,
                               INTERLEAVED, IS_FP64)
        if HAS_K:
            k_mask = rows & (h < n_k_heads)
            k_a, k_b = _load_pairs(k_rows + h * stride_kh, stride_kd, k_mask, rot_dim, BLOCK_S, BLOCK_H, HALF,
                                   INTERLEAVED, IS_FP64)
        _store_rotated(q_out_rows + h * stride_qoh, stride_qod, q_mask, q_a, q_b, cos_a, sin_a, cos_b, sin_b,
                       rot_dim, BLOCK_S, BLOCK_H, HALF, INTERLEAVED)
        if HAS_K:
            _store_rotated(k_out_rows + h * stride_koh, stride_kod, k_mask, k_a, k_b, cos_a, sin_a, cos_b,
                           sin_b, rot_dim, BLOCK_S, BLOCK_H, HALF, INTERLEAVED)
        if COPY_PASS:  # channels d2: pass through (the gradient too: dx = dy there)
            _copy_pass_through(q_rows + h * stride_qh, q_out_rows + h * stride_qoh, stride_qd, stride_qod, q_mask,
                               head_dim, rot_dim, PASS)
            if HAS_K:
                _copy_pass_through(k_rows + h * stride_kh, k_out_rows + h * stride_koh, stride_kd, stride_kod,
                                   k_mask, head_dim, rot_dim, PASS)


# %%
# The op: one launch, registered with torch.library
# -------------------------------------------------
# torch.compile cannot see inside a plain Python call to a Triton kernel; it would break the graph there.
# ``torch.library.triton_op`` registers the launcher as an operator and ``wrap_triton`` lets the compiler trace
# the kernel itself (and schedule it with the rest of the graph). Where torch lacks triton_op, or the kernel
# runs in the interpreter, a ``custom_op`` with a "fake" implementation (output shapes only) keeps the graph
# whole, the kernel opaque. Either way the op must be pure tensor work: no host syncs, no Python state.


def _next_pow2(n):  # plain Python: triton.next_power_of_2 is slow to call in Triton 3.9
    return 1 << (int(n) - 1).bit_length()


def _layout(t, tensor_format):
    """(batch, seqlen, heads, head_dim) and the strides in that order; thd has batch stride 0."""
    if tensor_format == "sbhd":
        return (t.shape[1], t.shape[0], t.shape[2], t.shape[3]), (t.stride(1), t.stride(0), t.stride(2), t.stride(3))
    if tensor_format == "bshd":
        return tuple(t.shape), tuple(t.stride())
    return (None, t.shape[0], t.shape[1], t.shape[2]), (0, t.stride(0), t.stride(1), t.stride(2))


def _launch_kernel(kernel, grid, *args, **kwargs):
    kernel[grid](*args, **kwargs)


def _rope_impl(q, k, freqs, angles_shared, cu_seqlens, start_positions, tensor_format, interleaved, backward,
               kernel=rope_kernel):
    """Rotate q (and k) by freqs, forward or (backward=True) by the transposed rotation."""
    outs = [torch.empty_like(x) for x in (q, k) if x is not None]
    if q.numel() == 0:
        return outs
    k_, k_out = (k, outs[1]) if k is not None else (q, outs[0])
    (batch, seqlen, _, head_dim), _ = _layout(q, tensor_format)
    rot_dim, n_heads = freqs.shape[3], (q.shape[-2], k_.shape[-2])
    half, block_h = _next_pow2(rot_dim // 2), max(1, _next_pow2(max(n_heads)) // 4)  # 02's sweep: heads in 4 steps
    n_programs = seqlen * (1 if tensor_format == "thd" else batch)  # one token each; thd walks the packed tokens
    if tensor_format == "thd":
        batch = cu_seqlens.shape[0] - 1
    strides = [s for x in (q, outs[0], k_, k_out) for s in _layout(x, tensor_format)[1]]
    _launch_kernel(
        kernel, (n_programs,), q, outs[0], k_, k_out, freqs, angles_shared,
        cu_seqlens if cu_seqlens is not None else angles_shared,
        start_positions if start_positions is not None else angles_shared,
        batch, seqlen, seqlen, n_heads[0], n_heads[1], head_dim, rot_dim, freqs.shape[0],
        *strides, freqs.stride(0), freqs.stride(3),
        BLOCK_S=1, BLOCK_H=block_h, HALF=half, PASS=_next_pow2(max(head_dim - rot_dim, 1)),
        N_HEAD_BLOCKS=-(-max(n_heads) // block_h), INTERLEAVED=interleaved, IS_THD=tensor_format == "thd",
        HAS_START_POSITIONS=start_positions is not None, HAS_K=k is not None, COPY_PASS=rot_dim < head_dim,
        BATCH_FASTEST=tensor_format == "sbhd", BACKWARD=backward, IS_FP64=q.dtype == torch.float64,
        num_warps=2 if block_h * half <= 128 else 4)
    return outs


def _rope_op_body(q: torch.Tensor, k: Optional[torch.Tensor], freqs: torch.Tensor, angles_shared: torch.Tensor,
                  cu_seqlens: Optional[torch.Tensor], start_positions: Optional[torch.Tensor],
                  tensor_format: str, interleaved: bool, backward: bool) -> List[torch.Tensor]:
    return _rope_impl(q, k, freqs, angles_shared, cu_seqlens, start_positions, tensor_format, interleaved,
                      backward, kernel=_wrap(rope_kernel))


_USE_TRITON_OP = hasattr(torch.library, "triton_op") and os.environ.get("TRITON_INTERPRET") != "1"
_wrap = torch.library.wrap_triton if _USE_TRITON_OP else (lambda kernel: kernel)
_n = next(n for n in itertools.count() if not hasattr(torch.ops.rope_tutorial, f"rope{n or ''}"))
rope_op = (torch.library.triton_op if _USE_TRITON_OP else torch.library.custom_op)(
    f"rope_tutorial::rope{_n or ''}", _rope_op_body, mutates_args=())  # a fresh name if this file was loaded before
if not _USE_TRITON_OP:
    rope_op.register_fake(lambda q, k, *args: [torch.empty_like(x) for x in (q, k) if x is not None])


def _rope(*args):
    """The registered op where torch.compile is tracing; a direct launch in eager mode, where the dispatcher, the
    op's autograd wrapper and its aliasing checks would add host time (timed: results/03_rope_bwd_H100.md)."""
    return rope_op(*args) if torch.compiler.is_compiling() else _rope_impl(*args)


# %%
# Argument checks (outside the op, so they run in eager mode and are traced by torch.compile)
# ------------------------------------------------------------------------------------------
# Shapes, dtypes and devices are checked on every call. The values of cu_seqlens and start_positions live on
# the GPU: reading them costs a host sync, so (as in 02) the verdict is kept for the last tensors seen, and
# compiled code skips the check (the kernel masks angle rows past the table). The "halves equal" flag likewise.


_last_results = {}  # what -> (key, weak references to the tensors, result)


def _remember(what, tensors, extra_key, compute):
    """compute(), or its result for the same tensors last time (same identity and version counter)."""
    key = tuple((id(x), x._version) for x in tensors) + extra_key
    last = _last_results.get(what)
    if last is None or last[0] != key or not all(ref() is x for ref, x in zip(last[1], tensors)):
        _last_results[what] = (key, tuple(weakref.ref(x) for x in tensors), compute())
    return _last_results[what][2]


def _read_values(cu_seqlens, start_positions, seqlen, n_tokens, max_positions):
    if cu_seqlens is not None:
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu[:8]}...")
        if cu[-1] != n_tokens:
            raise ValueError(f"cu_seqlens[-1] = {cu[-1]} must equal the number of tokens of t, {n_tokens}")
        lengths = [b - a for a, b in zip(cu, cu[1:])]
    else:
        lengths = [seqlen] * start_positions.numel()
    starts = start_positions.tolist() if start_positions is not None else [0] * len(lengths)
    if min(starts, default=0) < 0:
        raise ValueError(f"start_positions must be >= 0, got {min(starts)}")
    needed = max((s + n for s, n in zip(starts, lengths)), default=0)
    if needed > max_positions:
        raise ValueError(f"positions up to {needed - 1} are needed (start_positions + sequence length) "
                         f"but freqs has only {max_positions} rows (s2)")
    return True


def _angles_shared(freqs, interleaved):
    """int32 [1] on the device: 1 if f_b == f_a everywhere (a true rotation table), no sync."""
    def compute():
        f = freqs[:, 0, 0]
        f_a, f_b = (f[:, 0::2], f[:, 1::2]) if interleaved else f.chunk(2, dim=-1)
        return (f_a == f_b).all().to(torch.int32).reshape(1)
    if torch.compiler.is_compiling():  # traced into the graph; the memo is eager-only
        return compute()
    return _remember("angles shared", (freqs,), (interleaved,), compute)


def _check(tensors, names, freqs, tensor_format, cu_seqlens, start_positions):
    if tensor_format not in TENSOR_FORMATS:
        raise ValueError(f"tensor_format must be one of {TENSOR_FORMATS}, got {tensor_format!r}")
    rank = 3 if tensor_format == "thd" else 4
    for x, name in zip(tensors, names):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise TypeError(f"{name} must be float32, float16, bfloat16 or float64, got {x.dtype}")
        if x.dim() != rank:
            raise ValueError(f"{name} must have {rank} dims for tensor_format='{tensor_format}', got shape {tuple(x.shape)}")
    t = tensors[0]
    if not isinstance(freqs, torch.Tensor):
        raise TypeError(f"freqs must be a torch.Tensor, got {type(freqs).__name__}")
    if freqs.dtype != torch.float32:
        raise TypeError(f"freqs must be float32 angles (cos/sin are taken inside the kernel), got {freqs.dtype}")
    if freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1:
        raise ValueError(f"freqs must have shape [s2, 1, 1, d2], got {tuple(freqs.shape)}")
    (batch, seqlen, _, head_dim), _ = _layout(t, tensor_format)
    max_positions, rot_dim = freqs.shape[0], freqs.shape[3]
    if rot_dim % 2 or not 2 <= rot_dim <= head_dim:
        raise ValueError(f"freqs' last dim d2 = {rot_dim} must be even and between 2 and the head dim {head_dim}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head dim {head_dim} is over the supported {MAX_HEAD_DIM}")
    for x, name in zip(tensors[1:], names[1:]):
        (xb, xs, _, xd), _ = _layout(x, tensor_format)
        if x.dtype != t.dtype or (xb, xs, xd) != (batch, seqlen, head_dim):
            raise ValueError(f"{name} must match {names[0]} in dtype and in every dim but heads: got "
                             f"{tuple(x.shape)} {x.dtype}, {names[0]} is {tuple(t.shape)} {t.dtype}")
    extras = [(freqs, "freqs"), (cu_seqlens, "cu_seqlens"), (start_positions, "start_positions")]
    for x, name in list(zip(tensors, names)) + extras:
        if isinstance(x, torch.Tensor) and x.device != t.device:
            raise ValueError(f"{name} is on {x.device} but {names[0]} is on {t.device}")
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
    elif seqlen > max_positions:
        raise ValueError(f"sequence length {seqlen} is over the {max_positions} rows (s2) of freqs")
    if start_positions is not None:
        if not isinstance(start_positions, torch.Tensor) or start_positions.dtype not in (torch.int32, torch.int64):
            raise TypeError("start_positions must be an int32 or int64 tensor")
        if start_positions.shape != (batch,):
            raise ValueError(f"start_positions must have shape [b] = [{batch}], got {tuple(start_positions.shape)}")
    if (cu_seqlens is not None or start_positions is not None) and not torch.compiler.is_compiling():
        args = (cu_seqlens, start_positions, seqlen, t.shape[0], max_positions)
        _remember("values checked", [x for x in args[:2] if x is not None], args[2:], lambda: _read_values(*args))


# %%
# The autograd Function and the public API
# ----------------------------------------
# The forward saves nothing but the (small) angle table and index tensors: the backward needs only dy and the
# angles, not x. That is the whole memory cost of RoPE in training.


class _ApplyRoPE(torch.autograd.Function):
    """Rotate (backward=False) or apply the transposed rotation (backward=True). Each direction's
    gradient is the other direction, so double backward works too."""

    @staticmethod
    def forward(ctx, q, k, freqs, angles_shared, cu_seqlens, start_positions, tensor_format, interleaved, backward):
        ctx.save_for_backward(freqs, angles_shared, cu_seqlens, start_positions)
        ctx.args, ctx.has_k = (tensor_format, interleaved, not backward), k is not None
        return tuple(_rope(q, k, freqs, angles_shared, cu_seqlens, start_positions, tensor_format, interleaved, backward))

    @staticmethod
    def backward(ctx, *grads):
        dq, dk = grads if ctx.has_k else (grads[0], None)
        dx = _ApplyRoPE.apply(dq, dk, *ctx.saved_tensors, *ctx.args)
        return dx[0], dx[1] if ctx.has_k else None, None, None, None, None, None, None, None


def _apply(tensors, names, freqs, tensor_format, start_positions, interleaved, cu_seqlens, backward=False):
    """Checks, then the autograd Function (forward) or the kernel alone (rope_bwd, rope_bwd_qk)."""
    _check(tensors, names, freqs, tensor_format, cu_seqlens, start_positions)
    args = (tensors[0], tensors[1] if len(tensors) == 2 else None, freqs, _angles_shared(freqs, interleaved),
            cu_seqlens, start_positions, tensor_format, interleaved, backward)
    if backward:
        return tuple(_rope(*args))
    if freqs.requires_grad and torch.is_grad_enabled():
        raise ValueError("freqs requires grad, but no gradient flows to the angle table here (as in "
                         "TransformerEngine's fused RoPE); pass freqs.detach()")
    return _ApplyRoPE.apply(*args)


def apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                         fused=True, cu_seqlens=None, cp_size=1, cp_rank=0):
    """Differentiable RoPE; TransformerEngine's ``apply_rotary_pos_emb`` arguments, in its order.

    t: [s, b, h, d] (sbhd) | [b, s, h, d] (bshd) | [total_tokens, h, d] (thd); fp32, fp16, bf16
        (fp64 for gradcheck), any strides, d <= 256.
    freqs: float32 angles [s2, 1, 1, d2], d2 even, d2 <= d. Only t[..., :d2] is rotated. No
        gradient flows to freqs: a freqs that requires grad is refused (pass freqs.detach()).
    start_positions: int [b]: sequence i uses angle rows start_positions[i] onwards.
    interleaved: rotate pairs (x0, x1), (x2, x3), ... (RoFormer, GPT-J) instead of halves.
    fused: accepted for TE compatibility and ignored: this is always one fused kernel.
    cu_seqlens: int32 [b + 1], thd only. cp_size, cp_rank: context parallelism is not supported
        (cp_size must be 1).
    Returns a new tensor like t. Works under torch.compile(fullgraph=True) and autocast.
    """
    if cp_size != 1 or cp_rank != 0:
        raise ValueError(f"context parallelism is not supported: cp_size must be 1 and cp_rank 0, got {cp_size}, {cp_rank}")
    return _apply([t], ("t",), freqs, tensor_format, start_positions, interleaved, cu_seqlens)[0]


def apply_rotary_pos_emb_qk(q, k, freqs, tensor_format="sbhd", start_positions=None, interleaved=False, cu_seqlens=None):
    """``apply_rotary_pos_emb`` on q and k in one launch each way; k may have fewer heads (GQA).
    Returns (q_out, k_out)."""
    return _apply([q, k], ("q", "k"), freqs, tensor_format, start_positions, interleaved, cu_seqlens)


def rope_bwd(grad_out, freqs, tensor_format="sbhd", interleaved=False, cu_seqlens=None, start_positions=None):
    """The gradient of RoPE with respect to its input, given grad_out (same arguments as 02's
    ``rope_fwd``). Returns a new tensor like grad_out."""
    return _apply([grad_out], ("grad_out",), freqs, tensor_format, start_positions, interleaved, cu_seqlens, True)[0]


def rope_bwd_qk(grad_q, grad_k, freqs, tensor_format="sbhd", interleaved=False, cu_seqlens=None, start_positions=None):
    """``rope_bwd`` for q's and k's gradients in one launch. Returns (grad_q_in, grad_k_in)."""
    return _apply([grad_q, grad_k], ("grad_q", "grad_k"), freqs, tensor_format, start_positions, interleaved,
                  cu_seqlens, True)


# %%
# Unit test
# ---------
# Gradients of every layout, both pairings, partial rotary, arbitrary angles (halves differ), strided views and
# GQA, against autograd through the reference. tests/test_03_rope_bwd.py covers the whole matrix, gradcheck in
# float64, torch.compile and a model-level check.


def _self_check_inputs(fmt, dtype, b, s, h, d):
    qkv = torch.randn(b, s, 3, h, d, device=DEVICE, dtype=dtype)
    q, k = qkv[:, :, 0], qkv[:, :, 1, :2]  # strided views; k has fewer heads
    kwargs = dict(tensor_format=fmt, start_positions=torch.randint(0, 5, (b,), device=DEVICE))
    if fmt == "sbhd":
        q, k = q.transpose(0, 1), k.transpose(0, 1)
    elif fmt == "thd":
        q, k = q.flatten(0, 1), k.flatten(0, 1)
        cu = [0] + [1 + i * s for i in range(b - 1)] + [b * s]  # uneven lengths, one of length 1
        kwargs["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    return q.detach().requires_grad_(), k.detach().requires_grad_(), kwargs


def self_check():
    torch.manual_seed(0)
    b, s, h, d = (3, 37, 5, 80) if DEVICE.type == "cuda" else (2, 7, 3, 80)
    for dtype, fmt, interleaved in itertools.product((torch.float32, torch.bfloat16), TENSOR_FORMATS, (False, True)):
        q, k, kwargs = _self_check_inputs(fmt, dtype, b, s, h, d)
        freqs = torch.randn(2 * b * s, 1, 1, 48, device=DEVICE)  # partial rotary, halves differ
        outs = apply_rotary_pos_emb_qk(q, k, freqs, interleaved=interleaved, **kwargs)
        grads = [torch.randn_like(y) for y in outs]
        for x, y, dy, dx in zip((q, k), outs, grads, torch.autograd.grad(outs, (q, k), grads)):
            ref = rope_reference(x, freqs, interleaved=interleaved, **kwargs)
            torch.testing.assert_close(y, ref)
            torch.testing.assert_close(dx, torch.autograd.grad(ref, x, dy)[0])
    print(f"self-check passed: forward and gradients, fp32/bf16 x sbhd/bshd/thd x half/interleaved, d={d}, d2=48, "
          f"GQA, strided views, start_positions (device: {DEVICE.type})")


# %%
# Benchmark
# ---------
# What is timed, as the results page says it ("eager call" shows why eager calls bypass the op):
TIMED = ("bf16 q and k at 02's shapes, bshd. Backward alone: ours, directly and through the registered op (as "
         "compiled code calls it); autograd's backward of one kept forward of ours under torch.compile(fullgraph=True), "
         "of the eager formula, of torch.compile of it; Liger's (in place) if installed. Forward + backward: a "
         "fresh forward, then the gradients of q and k. Time per call: median of `triton.testing.do_bench_cudagraph` "
         "(GPU time) or, in columns \"eager call\", of `triton.testing.do_bench` over 10 back-to-back calls (host cost "
         "included). (x%): speed as a fraction of a device-to-device copy of the same bytes (fwd+bwd: two), same run.")
BENCH_SHAPES = [(4, 4096, 32, 128), (32, 512, 12, 64), (1, 32768, 8, 128)]  # (b, s, h, d)


def _time_ms(fn, eager_call):
    if DEVICE.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    if eager_call:
        return triton.testing.do_bench(lambda: [fn() for _ in range(10)], return_mode="median") / 10
    return triton.testing.do_bench_cudagraph(fn, return_mode="median")


def _eager_qk(q, k, freqs, tensor_format):  # TransformerEngine's unfused formula
    return tuple(rope_reference(x, freqs, tensor_format, compute_dtype=None) for x in (q, k))


def _providers(q, k, freqs, liger, compiled):
    """{mode: {name: fn}} for mode 'backward' and 'fwd+bwd', the copy first."""
    q, k, dq, dk = q.detach().requires_grad_(), k.detach().requires_grad_(), torch.randn_like(q), torch.randn_like(k)
    src, dst = (torch.randn(q.numel() + k.numel(), device=DEVICE, dtype=q.dtype) for _ in range(2))
    grad = lambda outs, **kw: torch.autograd.grad(outs, (q, k), (dq, dk), **kw)  # noqa: E731
    ours = lambda: rope_bwd_qk(dq, dk, freqs, "bshd")  # noqa: E731
    op_args = (_angles_shared(freqs, False), None, None, "bshd", False, True)
    backward = {"copy": lambda: dst.copy_(src), "ours": ours, "ours, eager call": ours,
                "ours via the op, eager call": lambda: rope_op(dq, dk, freqs, *op_args)}
    fwd = {"ours": apply_rotary_pos_emb_qk, "ours, eager call": apply_rotary_pos_emb_qk, **compiled, "eager": _eager_qk}
    # A backward runs on its forward's stream, and do_bench_cudagraph captures on torch.cuda.graph's side
    # stream: the forwards kept for "backward alone" are made on that stream.
    with torch.cuda.stream(torch.cuda.graph(torch.cuda.CUDAGraph()).capture_stream if DEVICE.type == "cuda" else None):
        backward.update({name: lambda outs=f(q, k, freqs, "bshd"): grad(outs, retain_graph=True)
                         for name, f in fwd.items() if name not in backward})
    both = {"copy x2": lambda: (dst.copy_(src), src.copy_(dst))}
    both.update({name: lambda f=f: grad(f(q, k, freqs, "bshd")) for name, f in fwd.items()})
    if liger is not None:  # [b, h, s, d] views of bshd memory; bf16 [1, s, d] tables
        angles = freqs[: q.shape[1], 0, 0]
        cos, sin = angles.cos().to(q.dtype)[None], angles.sin().to(q.dtype)[None]
        g_q, g_k = dq.transpose(1, 2).clone(), dk.transpose(1, 2).clone()
        backward["liger (in place)"] = lambda: liger.rope_backward(g_q, g_k, cos, sin)
        both["liger"] = lambda: torch.autograd.grad(liger.LigerRopeFunction.apply(
            q.transpose(1, 2), k.transpose(1, 2), cos, sin), (q, k), (dq.transpose(1, 2), dk.transpose(1, 2)))
    return {"backward": backward, "fwd+bwd": both}


def benchmark():
    """{(shape, mode): {provider: ms}}."""
    liger, compiled, results = None, {}, {}
    if DEVICE.type != "cuda":
        print("\nNO GPU: the kernels run in Triton's interpreter on the CPU. The timings below only "
              "show that the benchmark runs; they say nothing about speed.")
    else:
        try:
            import liger_kernel.ops.rope as liger
        except ImportError as e:
            print(f"(Liger-Kernel not installed, its rows are skipped: {e})")
        torch._dynamo.config.cache_size_limit = 64  # a graph per shape and mode
        torch._functorch.config.donated_buffer = False  # "backward alone" runs one compiled backward many times
        compiled = {"ours, compiled": torch.compile(apply_rotary_pos_emb_qk, fullgraph=True, dynamic=False),
                    "torch.compile": torch.compile(_eager_qk, dynamic=False)}  # per shape, as 02's
    for b, s, h, d in BENCH_SHAPES if DEVICE.type == "cuda" else [(2, 8, 2, 64)]:
        freqs = rope_freqs(s, d, device=DEVICE)
        q, k = (torch.randn(b, s, h, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
        gbytes = 2 * (q.numel() + k.numel()) * q.element_size() / 1e9  # one read + one write of q and k
        for mode, fns in _providers(q, k, freqs, liger, compiled).items():
            times = results[(b, s, h, d), mode] = {n: _time_ms(f, "eager call" in n) for n, f in fns.items()}
            for name, ms in times.items():  # fwd+bwd moves the bytes twice
                gbps, pct = gbytes * len(mode.split("+")) / ms * 1e3, 100 * next(iter(times.values())) / ms
                print(f"{str((b, s, h, d)):>20} {mode:>8} {name:>27} {ms * 1e3:9.1f} us {gbps:7.0f} GB/s {pct:6.1f}% of copy")
    return results


def save_results(results, results_dir):
    """results/03_rope_bwd_<GPU kind>.md; the run's stdout, teed beside it as .log, is the raw log."""
    gpu, here = torch.cuda.get_device_name(), pathlib.Path(__file__).resolve()
    name = "03_rope_bwd_" + next((w for w in gpu.split() if w[:1] in "ABHL" and w[1:2].isdigit()), "gpu")
    commit = subprocess.run("git rev-parse --short HEAD", shell=True, cwd=here.parent, capture_output=True, text=True)
    page = [f"# RoPE backward, q and k (bshd)\n\ndevice: {gpu}; date: {datetime.date.today()}; torch {torch.__version__}; "
            f"triton {triton.__version__}; python {platform.python_version()}; commit {commit.stdout.strip() or 'n/a'}; "
            f"{here.name} md5 {hashlib.md5(here.read_bytes()).hexdigest()[:8]}", f"Command: `python {' '.join(sys.argv)}`",
            TIMED]
    for mode, title in (("backward", "Backward alone"), ("fwd+bwd", "Forward + backward")):
        times = {shape: t for (shape, m), t in results.items() if m == mode}
        names = list(next(iter(times.values())))
        rows = [["shape (b, s, h, d)", *names], ["---"] * (1 + len(names))] + [[str(shape)] + [
            f"{t[n] * 1e3:.1f} us ({100 * t[names[0]] / t[n]:.0f}%)" for n in names] for shape, t in times.items()]
        page.append(f"## {title}\n\n" + "\n".join("| " + " | ".join(row) + " |" for row in rows))
    page = "\n\n".join(page + [f"Raw log: `{name}.log`\n"])
    os.makedirs(results_dir, exist_ok=True)
    pathlib.Path(results_dir, name + ".md").write_text(page)
    print("\n" + page)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                        help="folder for the results page (written only on a GPU)")
    args = parser.parse_args()
    self_check()
    results = benchmark()
    if DEVICE.type == "cuda":
        save_results(results, args.results)
