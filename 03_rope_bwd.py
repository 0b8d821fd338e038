"""
RoPE backward, and a differentiable RoPE that drops into real models
====================================================================

In this tutorial, you will learn about:

* deriving RoPE's backward, element by element: it is the forward with each half's sine moved to
  the other half and negated, so one kernel with a direction flag serves both ways;
* why that is "the forward with the angle negated" only for true rotation tables, and what goes
  wrong for arbitrary angles if you assume it;
* a ``torch.autograd.Function`` with TransformerEngine's ``apply_rotary_pos_emb`` signature, for q
  alone or q and k (grouped-query attention) in one launch each way;
* registering Triton kernels with ``torch.library`` (``triton_op`` + ``wrap_triton``) so that
  ``torch.compile(fullgraph=True)`` captures them, and keeping host syncs out of compiled code;
* checking gradients with ``torch.autograd.gradcheck`` in float64;
* what autograd over the eager formula costs, against one read and one write.

Run ``python 03_rope_bwd.py``: it checks itself against autograd through the PyTorch reference,
then benchmarks. This file imports only torch and triton: copy it alone into your project.
"""

# %%
# Setup
# -----
# With no GPU, run the kernels through Triton's interpreter; the variable must be set before
# triton is imported.
import argparse
import contextlib
import datetime
import os
import platform
import statistics
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
# y = x * cos(f) + R(x) * sin(f) on the first d2 channels, y = x on the rest, where R pairs
# channel a with b and negates the first: rotate-half (a = i, b = i + d2/2) or interleaved pairs
# (a = 2i, b = 2i + 1). Autograd through this function is the oracle for every gradient below.


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
        pos = tokens - cu_seqlens.long()[seq]
        return pos + (start_positions.long()[seq] if start_positions is not None else 0)
    s_dim = 0 if tensor_format == "sbhd" else 1
    pos = torch.arange(t.shape[s_dim], device=t.device)
    if start_positions is None:
        return pos.view(-1, 1) if s_dim == 0 else pos.view(1, -1)
    start = start_positions.long()
    return pos[:, None] + start[None, :] if s_dim == 0 else start[:, None] + pos[None, :]


def rope_reference(t, freqs, tensor_format="sbhd", interleaved=False, cu_seqlens=None,
                   start_positions=None, compute_dtype=torch.float32):
    """Plain PyTorch RoPE, differentiable. ``compute_dtype=None`` multiplies in t's dtype, which is
    TransformerEngine's unfused formula exactly; float32 rounds once, like the kernel."""
    d2 = freqs.shape[-1]
    pos = _token_positions(t, tensor_format, cu_seqlens, start_positions)
    angles = freqs.reshape(freqs.shape[0], d2)[pos].unsqueeze(-2)  # [..., 1, d2]: one row per token
    dtype = compute_dtype or t.dtype
    x, x_pass = t[..., :d2].to(dtype), t[..., d2:]
    if interleaved:
        x_rot = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        x_rot = torch.cat((-x2, x1), dim=-1)
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
# In TE's notation: y = x cos(f) + R(x) sin(f), so dx = dy cos(f) + R^T(dy sin(f)), and R^T = -R
# for both pairings (R sends (x_a, x_b) to (-x_b, x_a), a quarter turn; its transpose is the
# quarter turn back). Now put dx in the forward's shape:
#
#     dx_a = dy_a cos(f_a) - dy_b (-sin(f_b))
#     dx_b = dy_b cos(f_b) + dy_a (-sin(f_a))
#
# It is the forward applied to dy with  sin_a <- -sin(f_b)  and  sin_b <- -sin(f_a)  (cos
# unchanged). For a true rotation table (f_a = f_b) that is the forward with the angle negated:
# the inverse rotation. For an arbitrary table the two halves' sines also trade places, and a
# backward that only negated the angle would be wrong; the tests use such tables to catch it.
# Pass-through channels (d2 < d) have y = x, so dx = dy there: copied.
#
# Memory traffic
# --------------
# The backward reads dy once and writes dx once: 2N elements for N elements of q and k, the same
# as the forward and as a copy. Autograd over the eager formula runs the backward of every op of
# the forward: two multiplications (dy cos, dy sin), the rotate-half's slices, negation and
# concatenation, the sum of the two branches, and the concatenation with the pass-through part;
# each reads and writes full tensors. The benchmark measures what that costs.
#
# The kernel
# ----------
# 02's kernel, generalised in three ways:
#   1. BACKWARD swaps and negates the sines, as derived above; nothing else changes.
#   2. float64 inputs are computed in float64 (for gradcheck); other dtypes in float32.
#   3. In thd the grid walks the packed tokens and each token finds its sequence by a binary
#      search in cu_seqlens. 02 launches (sequences x longest sequence) programs; the longest
#      sequence is known only on the host, after a sync, so compiled code must launch for a bound
#      on it. This grid needs no such number, at about 1 us more GPU time than bshd at the small
#      shape (02's forward: 0.4-0.6 us more; results/03_rope_bwd_<gpu>.md, 02_rope_fwd_<gpu>.md).
# Angle rows past the table are masked (read as 0) instead of read out of bounds: eager calls
# check positions on the host and raise, compiled calls do not check.


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
# torch.compile cannot see inside a plain Python call to a Triton kernel; it would break the
# graph there. ``torch.library.triton_op`` registers the launcher as an operator and
# ``wrap_triton`` lets the compiler trace the kernel itself (and schedule it with the rest of the
# graph). Where the installed torch lacks triton_op, or the kernel runs in the interpreter, a
# ``custom_op`` with a "fake" implementation (output shapes only) keeps the graph whole, with the
# kernel opaque. Either way the op must be pure tensor work: no host syncs, no Python state.


def _next_pow2(n):  # plain Python: triton.next_power_of_2 costs microseconds a call in Triton 3.9
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
    rot_dim = freqs.shape[3]
    half = _next_pow2(rot_dim // 2)
    n_heads = (q.shape[-2], k_.shape[-2])
    block_h = max(1, _next_pow2(max(n_heads)) // 4)  # from 02's sweep: one token, heads in 4 steps
    config = dict(BLOCK_S=1, BLOCK_H=block_h, num_warps=2 if block_h * half <= 128 else 4)
    n_seq_blocks = seqlen  # BLOCK_S = 1
    n_programs = n_seq_blocks * (1 if tensor_format == "thd" else batch)  # thd walks the packed tokens
    if tensor_format == "thd":
        batch = cu_seqlens.shape[0] - 1
    strides = [s for x in (q, outs[0], k_, k_out) for s in _layout(x, tensor_format)[1]]
    _launch_kernel(
        kernel, (n_programs,),
        q, outs[0], k_, k_out, freqs, angles_shared,
        cu_seqlens if cu_seqlens is not None else angles_shared,
        start_positions if start_positions is not None else angles_shared,
        batch, n_seq_blocks, seqlen, n_heads[0], n_heads[1], head_dim, rot_dim, freqs.shape[0],
        *strides, freqs.stride(0), freqs.stride(3),
        HALF=half, PASS=_next_pow2(max(head_dim - rot_dim, 1)), N_HEAD_BLOCKS=-(-max(n_heads) // block_h),
        INTERLEAVED=interleaved, IS_THD=tensor_format == "thd", HAS_START_POSITIONS=start_positions is not None,
        HAS_K=k is not None, COPY_PASS=rot_dim < head_dim, BATCH_FASTEST=tensor_format == "sbhd",
        BACKWARD=backward, IS_FP64=q.dtype == torch.float64, **config,
    )
    return outs


def _rope_op_body(q: torch.Tensor, k: Optional[torch.Tensor], freqs: torch.Tensor, angles_shared: torch.Tensor,
                  cu_seqlens: Optional[torch.Tensor], start_positions: Optional[torch.Tensor],
                  tensor_format: str, interleaved: bool, backward: bool) -> List[torch.Tensor]:
    return _rope_impl(q, k, freqs, angles_shared, cu_seqlens, start_positions, tensor_format, interleaved,
                      backward, kernel=_wrap(rope_kernel))


def _register(fn):
    """Register fn as rope_tutorial::rope (a fresh name if this file was loaded before)."""
    n = 0
    while hasattr(torch.ops.rope_tutorial, f"rope{n or ''}"):
        n += 1
    name = f"rope_tutorial::rope{n or ''}"
    if _USE_TRITON_OP:
        return torch.library.triton_op(name, fn, mutates_args=())
    op = torch.library.custom_op(name, fn, mutates_args=())
    op.register_fake(lambda q, k, *args: [torch.empty_like(x) for x in (q, k) if x is not None])
    return op


_USE_TRITON_OP = hasattr(torch.library, "triton_op") and os.environ.get("TRITON_INTERPRET") != "1"
_wrap = torch.library.wrap_triton if _USE_TRITON_OP else (lambda kernel: kernel)
rope_op = _register(_rope_op_body)


def _rope(*args):
    """The registered op where torch.compile is tracing; a direct launch in eager mode, where the
    dispatcher, the op's autograd wrapper and its aliasing checks add 15-45 us of host time to each
    call (the benchmark times both: results/03_rope_bwd_<gpu>.md)."""
    return rope_op(*args) if torch.compiler.is_compiling() else _rope_impl(*args)


# %%
# Argument checks (outside the op, so they run in eager mode and are traced by torch.compile)
# ------------------------------------------------------------------------------------------
# Shapes, dtypes and devices are checked on every call. The values of cu_seqlens and
# start_positions live on the GPU: reading them costs a host sync, so (as in 02) the verdict is
# kept for the last tensors seen, and compiled code skips the check (the kernel masks angle rows
# past the table instead of reading out of bounds). The "halves equal" flag is kept likewise.


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
# The forward saves nothing but the (small) angle table and index tensors: the backward needs
# only dy and the angles, not x. That is the whole memory cost of RoPE in training.


class _ApplyRoPE(torch.autograd.Function):
    """Rotate (backward=False) or apply the transposed rotation (backward=True). Each direction's
    gradient is the other direction, so double backward works too."""

    @staticmethod
    def forward(ctx, q, k, freqs, angles_shared, cu_seqlens, start_positions, tensor_format, interleaved, backward):
        ctx.save_for_backward(freqs, angles_shared, cu_seqlens, start_positions)
        ctx.args = tensor_format, interleaved, not backward
        ctx.has_k = k is not None
        return tuple(_rope(q, k, freqs, angles_shared, cu_seqlens, start_positions, tensor_format, interleaved,
                           backward))

    @staticmethod
    def backward(ctx, *grads):
        dq, dk = grads if ctx.has_k else (grads[0], None)
        dx = _ApplyRoPE.apply(dq, dk, *ctx.saved_tensors, *ctx.args)
        return dx[0], dx[1] if ctx.has_k else None, None, None, None, None, None, None, None


def _apply(tensors, names, freqs, tensor_format, start_positions, interleaved, cu_seqlens):
    _check(tensors, names, freqs, tensor_format, cu_seqlens, start_positions)
    if freqs.requires_grad and torch.is_grad_enabled():
        raise ValueError("freqs requires grad, but no gradient flows to the angle table here (as in "
                         "TransformerEngine's fused RoPE); pass freqs.detach()")
    k = tensors[1] if len(tensors) == 2 else None
    return _ApplyRoPE.apply(tensors[0], k, freqs, _angles_shared(freqs, interleaved), cu_seqlens,
                            start_positions, tensor_format, interleaved, False)


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


def apply_rotary_pos_emb_qk(q, k, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                            cu_seqlens=None):
    """``apply_rotary_pos_emb`` on q and k in one launch each way; k may have fewer heads (GQA).
    Returns (q_out, k_out)."""
    return _apply([q, k], ("q", "k"), freqs, tensor_format, start_positions, interleaved, cu_seqlens)


def rope_bwd(grad_out, freqs, tensor_format="sbhd", interleaved=False, cu_seqlens=None, start_positions=None):
    """The gradient of RoPE with respect to its input, given grad_out (same arguments as 02's
    ``rope_fwd``). Returns a new tensor like grad_out."""
    _check([grad_out], ("grad_out",), freqs, tensor_format, cu_seqlens, start_positions)
    return _rope(grad_out, None, freqs, _angles_shared(freqs, interleaved), cu_seqlens, start_positions,
                   tensor_format, interleaved, True)[0]


def rope_bwd_qk(grad_q, grad_k, freqs, tensor_format="sbhd", interleaved=False, cu_seqlens=None,
                start_positions=None):
    """``rope_bwd`` for q's and k's gradients in one launch. Returns (grad_q_in, grad_k_in)."""
    _check([grad_q, grad_k], ("grad_q", "grad_k"), freqs, tensor_format, cu_seqlens, start_positions)
    return tuple(_rope(grad_q, grad_k, freqs, _angles_shared(freqs, interleaved), cu_seqlens, start_positions,
                       tensor_format, interleaved, True))


# %%
# Unit test
# ---------
# Gradients of every layout, both pairings, partial rotary, arbitrary angles (halves differ),
# strided views and GQA, against autograd through the reference; then gradcheck in float64.
# tests/test_03_rope_bwd.py covers the whole matrix, torch.compile and a model-level check.


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
    for dtype in (torch.float32, torch.bfloat16):
        for fmt in TENSOR_FORMATS:
            for interleaved in (False, True):
                q, k, kwargs = _self_check_inputs(fmt, dtype, b, s, h, d)
                freqs = torch.randn(2 * b * s, 1, 1, 48, device=DEVICE)  # partial rotary, halves differ
                outs = apply_rotary_pos_emb_qk(q, k, freqs, interleaved=interleaved, **kwargs)
                grads = [torch.randn_like(y) for y in outs]
                dq, dk = torch.autograd.grad(outs, (q, k), grads)
                for x, y, dy, dx in ((q, outs[0], grads[0], dq), (k, outs[1], grads[1], dk)):
                    ref = rope_reference(x, freqs, interleaved=interleaved, **kwargs)
                    torch.testing.assert_close(y, ref)
                    torch.testing.assert_close(dx, torch.autograd.grad(ref, x, dy)[0])
    q, k, kwargs = _self_check_inputs("thd", torch.float64, 2, 3, 2, 12)
    freqs = torch.randn(16, 1, 1, 8, device=DEVICE)
    assert torch.autograd.gradcheck(lambda q, k: apply_rotary_pos_emb_qk(q, k, freqs, interleaved=True, **kwargs),
                                    (q, k), fast_mode=True)
    print(f"self-check passed: forward and gradients, fp32/bf16 x sbhd/bshd/thd x half/interleaved, d={d}, d2=48, "
          f"GQA, strided views, start_positions; gradcheck in float64 (device: {DEVICE.type})")


# %%
# Benchmark
# ---------
# bf16 q and k at 02's shapes. Backward alone: dq, dk -> dx for q and k, against a copy of the
# same bytes (one read and one write), autograd's backward through the eager formula and through
# torch.compile of it, and Liger's backward (bshd, in place) when installed. Forward + backward:
# a fresh forward and the gradients of q and k, against the same, plus the speedups that the
# targets name. GPU time from CUDA graphs, as in 02 (calls issued one by one would time the
# host at the small shape); the host cost of one eager call of ours is printed too.

BENCH_SHAPES = [(4, 4096, 32, 128), (32, 512, 12, 64), (1, 32768, 8, 128)]  # (b, s, h, d)
CPU_SHAPES = [(2, 8, 2, 64)]


def _time_ms(fn, replays=10):
    """GPU time of fn, replayed from a CUDA graph of many calls: the median over replays. Call
    it on a side stream: graphs are captured there, and a backward must run on the stream that
    ran its forward."""
    if DEVICE.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def elapsed_ms(run):
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    fn()  # warm up: compilation, memos
    calls = max(1, min(200, int(20 / max(elapsed_ms(fn), 1e-3))))  # about 20 ms a replay
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.current_stream()):
        for _ in range(calls):
            fn()
    return statistics.median(elapsed_ms(graph.replay) / calls for _ in range(replays))


def _host_us_per_call(fn, calls=50):
    """Host time to issue one call, the GPU not waited for (what a Python loop pays per call)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host_s = time.perf_counter() - start
    torch.cuda.synchronize()
    return host_s / calls * 1e6


def _providers(q, k, freqs, fmt, kwargs, liger, compiled):
    """{mode: {name: fn}} for mode 'backward' and 'fwd+bwd'; q and k require grad."""
    dq_out, dk_out = torch.randn_like(q), torch.randn_like(k)
    src = torch.randn(q.numel() + k.numel(), device=DEVICE, dtype=q.dtype)
    dst = torch.empty_like(src)
    eager = lambda: (rope_reference(q, freqs, compute_dtype=None, **kwargs),  # noqa: E731
                     rope_reference(k, freqs, compute_dtype=None, **kwargs))
    fwd = {"triton (ours)": lambda: apply_rotary_pos_emb_qk(q, k, freqs, **kwargs), "eager": eager}
    if compiled is not None:
        fwd["torch.compile"] = lambda: compiled(q, k, freqs, **kwargs)
    backward = {"copy": lambda: dst.copy_(src),
                "triton (ours)": lambda: rope_bwd_qk(dq_out, dk_out, freqs, **kwargs),
                "ours, via the op": lambda: rope_op(dq_out, dk_out, freqs, _angles_shared(freqs, False),  # as compiled
                                                    kwargs.get("cu_seqlens"), None, fmt, False, True)}
    for name, f in fwd.items():
        if name != "triton (ours)":
            outs = f()  # one forward, its graph kept: the backward alone is timed
            backward[name] = lambda outs=outs: torch.autograd.grad(outs, (q, k), (dq_out, dk_out), retain_graph=True)
    both = {"copy x2": lambda: (dst.copy_(src), src.copy_(dst))}
    both.update({name: lambda f=f: torch.autograd.grad(f(), (q, k), (dq_out, dk_out)) for name, f in fwd.items()})
    if liger is not None and fmt == "bshd":  # [b, h, s, d] views of bshd memory; bf16 [1, s, d] tables
        angles = freqs[: q.shape[1], 0, 0]
        cos, sin = angles.cos().to(q.dtype)[None], angles.sin().to(q.dtype)[None]
        g_q, g_k = dq_out.transpose(1, 2).clone(), dk_out.transpose(1, 2).clone()
        backward["liger (in place)"] = lambda: liger.rope_backward(g_q, g_k, cos, sin)
        both["liger"] = lambda: torch.autograd.grad(
            liger.LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin),
            (q, k), (dq_out.transpose(1, 2), dk_out.transpose(1, 2)))
    return {"backward": backward, "fwd+bwd": both}


def _bench_layout(shape, fmt, q, k, freqs, kwargs, liger, compiled):
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    gbytes = 2 * (q.numel() + k.numel()) * q.element_size() / 1e9  # one read + one write of q and k
    rows = []
    for mode, fns in _providers(q, k, freqs, fmt, kwargs, liger, compiled).items():
        times = {name: _time_ms(fn) for name, fn in fns.items()}
        base = times["copy" if mode == "backward" else "copy x2"]
        for name, ms in times.items():
            row = dict(shape=shape, layout=fmt, mode=mode, provider=name, us=ms * 1e3, pct_copy=100 * base / ms,
                       gbps=gbytes * (1 if mode == "backward" else 2) / (ms * 1e-3))
            if mode == "fwd+bwd" and name == "triton (ours)":
                row.update({"x " + other: times[other] / ms for other in ("eager", "torch.compile") if other in times})
            if DEVICE.type == "cuda" and name in ("triton (ours)", "ours, via the op"):
                row["host_us"] = _host_us_per_call(fns[name])
            rows.append(row)
            speedups = "".join(f"  {key} {row[key]:.1f}" for key in ("x eager", "x torch.compile") if key in row)
            host = f"  host {row['host_us']:.0f} us/call" if "host_us" in row else ""
            print(f"{str(shape):>20} {fmt:>5} {mode:>8} {name:>17} {row['us']:9.1f} us "
                  f"{row['gbps']:7.0f} GB/s {row['pct_copy']:6.1f}% of copy{speedups}{host}")
    return rows


def benchmark():
    shapes = BENCH_SHAPES if DEVICE.type == "cuda" else CPU_SHAPES
    if DEVICE.type != "cuda":
        print("\nNO GPU: the kernels run in Triton's interpreter on the CPU. The timings below only "
              "show that the benchmark runs; they say nothing about speed.")
    liger, compiled = None, None
    if DEVICE.type == "cuda":
        try:
            import liger_kernel.ops.rope as liger
        except ImportError as e:
            print(f"(Liger-Kernel not installed, its rows are skipped: {e})")
        torch._dynamo.config.cache_size_limit = 64
        compiled = torch.compile(lambda q, k, freqs, **kw: (rope_reference(q, freqs, compute_dtype=None, **kw),
                                                            rope_reference(k, freqs, compute_dtype=None, **kw)))
    rows = []
    for b, s, h, d in shapes:
        freqs = rope_freqs(s, d, device=DEVICE)
        q, k = (torch.randn(b, s, h, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
        layouts = {"bshd": (q, k, {}),
                   "thd": (q.flatten(0, 1), k.flatten(0, 1),
                           {"cu_seqlens": torch.arange(0, b * s + 1, s, dtype=torch.int32, device=DEVICE)})}
        for fmt, (q_fmt, k_fmt, extra) in layouts.items():
            with torch.cuda.stream(torch.cuda.Stream()) if DEVICE.type == "cuda" else contextlib.nullcontext():
                rows += _bench_layout((b, s, h, d), fmt, q_fmt, k_fmt, freqs, dict(tensor_format=fmt, **extra),
                                      liger, compiled if fmt == "bshd" else None)
    return rows


def markdown_table(rows, mode):
    """One line per (shape, layout); a column per provider: GPU time and % of the copy's speed."""
    rows = [r for r in rows if r["mode"] == mode]
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    extra = ["x eager", "x torch.compile"] if mode == "fwd+bwd" else []
    host = "ours / via the op: host us / call" if mode == "backward" else "ours: host us / call"
    lines = ["| shape (b, s, h, d) | layout | " + " | ".join(providers + [f"ours: {e}" for e in extra])
             + f" | {host} |", "|---|---|" + "---|" * (len(providers) + len(extra) + 1)]
    for key in dict.fromkeys((r["shape"], r["layout"]) for r in rows):
        here = [r for r in rows if (r["shape"], r["layout"]) == key]
        cells = {r["provider"]: f"{r['us']:.1f} us ({r['pct_copy']:.0f}%)" for r in here}
        ours = next(r for r in here if r["provider"] == "triton (ours)")
        host = " / ".join(f"{r['host_us']:.0f}" for r in here if "host_us" in r)
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells.get(p, "n/a") for p in providers)
                     + "".join(f" | {ours[e]:.1f}x" if e in ours else " | n/a" for e in extra) + f" | {host} |")
    return "\n".join(lines)


def environment():
    gpu = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "none (Triton interpreter)"
    return (f"device: {gpu}; date: {datetime.date.today()}; torch {torch.__version__}; "
            f"triton {triton.__version__}; python {platform.python_version()}")


def save_results(rows, results_dir):
    """results/03_rope_bwd_<gpu kind>.md (environment + both tables) and, with matplotlib, the plot."""
    os.makedirs(results_dir, exist_ok=True)
    gpu_kind = next((w for w in torch.cuda.get_device_name().split() if w[:1] in "ABHL" and w[1:2].isdigit()), "gpu")
    stem = os.path.join(results_dir, f"03_rope_bwd_{gpu_kind}")
    with open(stem + ".md", "w") as f:
        f.write(f"# RoPE backward, q and k\n\n{environment()}\n\nbf16 q and k of equal shape; GPU time per call, the "
                "median of 10 replays of a CUDA graph of about 20 ms of calls; (x%): the speed as a fraction of a "
                "device-to-device copy of the same bytes (fwd+bwd: two copies), in the same run. Last column: host "
                "time of one eager call of ours (backward: and through the torch.library op, as compiled code calls "
                f"it). Raw log: `{os.path.basename(stem)}.log`.\n\n"
                f"## Backward alone\n\n{markdown_table(rows, 'backward')}\n\n"
                f"## Forward + backward\n\n{markdown_table(rows, 'fwd+bwd')}\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    for ax, mode in zip(axes, ("backward", "fwd+bwd")):
        mode_rows = [r for r in rows if r["mode"] == mode and not r["provider"].startswith(("copy", "ours, via"))]
        groups = list(dict.fromkeys((r["shape"], r["layout"]) for r in mode_rows))
        providers = list(dict.fromkeys(r["provider"] for r in mode_rows))
        width = 0.8 / len(providers)
        for n, provider in enumerate(providers):
            pct = {(r["shape"], r["layout"]): r["pct_copy"] for r in mode_rows if r["provider"] == provider}
            ax.bar([g + n * width for g in range(len(groups))], [pct.get(g, 0) for g in groups], width, label=provider)
        ax.axhline(100, color="black", lw=0.8, ls="--")
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
        ax.set_xticklabels([f"{shape}\n{layout}" for shape, layout in groups], fontsize=7)
        ax.set_ylabel("% of device-to-device copy bandwidth")
        ax.set_title(f"RoPE {mode}, bf16 q and k ({environment().split(';')[0].removeprefix('device: ')})", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=120)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                        help="folder for the table and plot (written only on a GPU)")
    args = parser.parse_args()
    print(environment())
    self_check()
    rows = benchmark()
    if DEVICE.type == "cuda":
        save_results(rows, args.results)
        print("\n## Backward alone\n\n" + markdown_table(rows, "backward") + "\n\n## Forward + backward\n\n"
              + markdown_table(rows, "fwd+bwd"))
