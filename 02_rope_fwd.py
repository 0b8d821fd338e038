"""
RoPE forward in one pass over memory
====================================

In this tutorial, you will learn about:

* TransformerEngine's RoPE semantics, shared by every later step: ``sbhd`` / ``bshd`` / ``thd`` layouts, partial
  rotary (``d2 < d``), rotate-half and interleaved pairs, any per-channel angles, ``start_positions`` (KV cache);
* why the eager formula moves about 4.5x the bytes it needs, and a kernel that reads and writes each element once,
  at any strides (a slice of a packed qkv, a transposed view), with 64-bit offsets, head dims up to 256 (80 and 96
  too), any head count, and q and k (GQA) in one launch;
* checking values that live on the GPU (``cu_seqlens``) without a host sync on every call, and an eager call that
  costs about four empty ops: checks and the compiled kernel kept per signature of the arguments;
* an opaque ``torch.library.custom_op`` that writes its outputs, for ``torch.compile(fullgraph=True)``;
* measuring a memory-bound kernel against the copy bandwidth of the same GPU, in the same run.

Run ``python 02_rope_fwd.py``: it checks itself against the PyTorch reference, then benchmarks.
This file imports only torch and triton: copy it alone into your project.
"""

# %%
# Setup
# -----
# With no GPU, the kernels run in Triton's interpreter (numpy on the CPU), chosen before triton is imported.
import argparse
import hashlib
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
# Models build f with equal halves (or pairs), which makes this a true rotation; the kernel does not
# assume it: it loads f_a and f_b separately, so any float32 table works.


def rope_freqs(max_seq_len, rotary_dim, base=10000.0, interleaved=False, device=None):
    """Angle table f[pos, 0, 0, c] = pos * base**(-2*(c//2 or c mod d2/2)/d2), float32 [max_seq_len, 1, 1, rotary_dim],
    laid out as TE's ``RotaryPositionEmbedding``: the d2/2 inverse frequencies repeated as two halves (rotate-half)
    or as pairs (interleaved)."""
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
    pos = torch.arange(t.shape[0 if tensor_format == "sbhd" else 1], device=t.device)
    start = start_positions.long() if start_positions is not None else pos.new_zeros(1)
    return pos[:, None] + start[None, :] if tensor_format == "sbhd" else start[:, None] + pos[None, :]


def rope_reference(t, freqs, tensor_format="sbhd", interleaved=False, cu_seqlens=None,
                   start_positions=None, compute_dtype=torch.float32):
    """Plain PyTorch RoPE, the tests' oracle; ``rope_fwd``'s arguments. Computes in float32 (one rounding,
    like the kernel); ``compute_dtype=None`` multiplies in t's dtype: TransformerEngine's unfused formula."""
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
# Memory traffic
# --------------
# Any implementation reads and writes the N elements of q and k once, plus the angle rows (4*d2 bytes a position,
# shared through L2 by the batch). With a small batch the table counts: at (b, s, h, d) = (1, 32768, 8, 128) in
# bf16, q and k move 128 MB and the float32 table 16 MB, a cap of 128/144 = 89% of a copy. Real tables have equal
# halves, so the kernel reads one half when a flag says so (cap 128/136 = 94%); any other table works at full cost.
# The eager formula moves x*cos (N read, N written), R(x) (N, N), R(x)*sin (N, N) and the sum (2N, N): 9N, ~4.5x
# the 2N of one pass. The yardstick is a device-to-device copy of the same 2N (the table is not counted).
#
# The kernel
# ----------
# One program takes BLOCK_S tokens of one sequence and all heads of q and k, BLOCK_H at a time (any head count):
# cos and sin, which depend on the position only, are taken once for every head. Each tile is read and written
# once, in contiguous loads (_load_pairs); pass-through channels (d2 < d) are copied. Offsets come from the strides,
# in int64 (views, tensors past 2**31 elements). In thd, cu_seqlens maps the batch index to a sequence and the batch
# stride is 0: one kernel for three layouts.


@triton.jit
def _load_pairs(x_tile, stride_d, mask, rot_dim, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
                HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
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
def _store_rotated(y_tile, stride_d, mask, x_a, x_b, cos_a, sin_a, cos_b, sin_b, rot_dim, BLOCK_S: tl.constexpr,
                   BLOCK_H: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """y_a = x_a cos(f_a) - x_b sin(f_a), y_b = x_b cos(f_b) + x_a sin(f_b), stored where x came from."""
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
def rope_fwd_kernel(
    q_ptr, q_out_ptr, k_ptr, k_out_ptr, freqs_ptr, angles_shared_ptr, cu_seqlens_ptr, start_positions_ptr,
    n_batch, n_seq_blocks, seqlen, n_q_heads, n_k_heads, head_dim, rot_dim, n_positions,
    stride_qb, stride_qs, stride_qh, stride_qd, stride_qob, stride_qos, stride_qoh, stride_qod,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_kob, stride_kos, stride_koh, stride_kod, stride_fs, stride_fd,
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr, N_HEAD_BLOCKS: tl.constexpr,
    INTERLEAVED: tl.constexpr, IS_THD: tl.constexpr, HAS_START_POSITIONS: tl.constexpr, HAS_K: tl.constexpr,
    COPY_PASS: tl.constexpr, BATCH_FASTEST: tl.constexpr,
):
    # A 1-D grid, numbered so that programs running side by side touch neighbouring memory: in
    # sbhd the batch index moves fastest, in bshd and thd the position does.
    pid = tl.program_id(0)
    if BATCH_FASTEST:
        pid_s, batch = pid // n_batch, pid % n_batch
    else:
        pid_s, batch = pid % n_seq_blocks, pid // n_seq_blocks
    first_token = 0
    if IS_THD:  # sequence `batch` owns tokens cu_seqlens[batch] .. cu_seqlens[batch + 1] - 1
        first_token = tl.load(cu_seqlens_ptr + batch)
        seqlen = tl.load(cu_seqlens_ptr + batch + 1) - first_token
    if pid_s * BLOCK_S >= seqlen:
        return
    s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    row_mask = s < seqlen
    pos = s
    if HAS_START_POSITIONS:
        pos = s + tl.load(start_positions_ptr + batch)

    # The angles of these tokens, turned into cos/sin once for every q and k head. When the table's halves
    # are equal (the flag), the second half is not loaded: a masked-off load moves no bytes.
    i = tl.arange(0, HALF)
    if INTERLEAVED:
        f_a, f_b = 2 * i, 2 * i + 1
    else:
        f_a, f_b = i, i + rot_dim // 2
    f_mask = (row_mask & (pos < n_positions))[:, None] & (i < rot_dim // 2)[None, :]  # no row past the table
    f_rows = freqs_ptr + pos.to(tl.int64)[:, None] * stride_fs
    angle_a = tl.load(f_rows + f_a[None, :] * stride_fd, mask=f_mask, other=0.0)
    read_b = tl.load(angles_shared_ptr + 0 * i)[None, :] == 0  # the flag, one copy per lane
    angle_b = tl.load(f_rows + f_b[None, :] * stride_fd, mask=f_mask & read_b, other=0.0)
    angle_a, angle_b = angle_a[:, None, :], tl.where(read_b, angle_b, angle_a)[:, None, :]
    cos_a, sin_a = tl.cos(angle_a), tl.sin(angle_a)
    cos_b, sin_b = tl.cos(angle_b), tl.sin(angle_b)

    # Row offsets in int64 (thd passes batch strides of 0), as [BLOCK_S, 1, 1] for the tiles.
    tokens = (first_token + s).to(tl.int64)[:, None, None]
    batch = batch.to(tl.int64)
    q_rows, q_out_rows = q_ptr + batch * stride_qb + tokens * stride_qs, q_out_ptr + batch * stride_qob + tokens * stride_qos
    k_rows, k_out_rows = k_ptr + batch * stride_kb + tokens * stride_ks, k_out_ptr + batch * stride_kob + tokens * stride_kos
    rows = row_mask[:, None, None]
    # Walk the heads BLOCK_H at a time, each step issuing every load (q and k) before its first store:
    # the compiler may not move a load above a store that could alias it, so this order keeps two tiles
    # in flight instead of one. Unrolled (static_range), the first tiles' loads need not wait for the
    # angle loads and the cos/sin above: their latencies overlap.
    for hb in tl.static_range(N_HEAD_BLOCKS):
        h = (hb * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)[None, :, None]
        q_mask = rows & (h < n_q_heads)
        q_a, q_b = _load_pairs(q_rows + h * stride_qh, stride_qd, q_mask, rot_dim, BLOCK_S, BLOCK_H, HALF, INTERLEAVED)
        if HAS_K:
            k_mask = rows & (h < n_k_heads)
            k_a, k_b = _load_pairs(k_rows + h * stride_kh, stride_kd, k_mask, rot_dim, BLOCK_S, BLOCK_H, HALF, INTERLEAVED)
        _store_rotated(q_out_rows + h * stride_qoh, stride_qod, q_mask, q_a, q_b, cos_a, sin_a, cos_b, sin_b,
                       rot_dim, BLOCK_S, BLOCK_H, HALF, INTERLEAVED)
        if HAS_K:
            _store_rotated(k_out_rows + h * stride_koh, stride_kod, k_mask, k_a, k_b, cos_a, sin_a, cos_b,
                           sin_b, rot_dim, BLOCK_S, BLOCK_H, HALF, INTERLEAVED)
        if COPY_PASS:  # channels d2: pass through unchanged
            _copy_pass_through(q_rows + h * stride_qh, q_out_rows + h * stride_qoh, stride_qd, stride_qod, q_mask,
                               head_dim, rot_dim, PASS)
            if HAS_K:
                _copy_pass_through(k_rows + h * stride_kh, k_out_rows + h * stride_koh, stride_kd, stride_kod,
                                   k_mask, head_dim, rot_dim, PASS)


# %%
# The wrapper: argument checks, then one launch
# ---------------------------------------------
# A bad argument fails here with a message naming it, never inside the kernel or as a wrong result. Reading the
# values of cu_seqlens and start_positions costs a host sync; q, k and every layer of a batch share those tensors,
# so the verdict is kept for the last tensors seen (by identity and version counter, which in-place writes bump),
# as is the table's "halves equal" flag: a batch pays once.
#
# On small tensors the GPU waits for the host: the kernel runs for microseconds, the Python before its launch for
# longer. Triton's ``kernel[grid](...)`` binds and specializes its 45 arguments on every call, and our checks and
# launch parameters would be rebuilt each time, yet all of it depends only on the call's signature (the tensors'
# shapes, strides, dtypes, devices and 16-byte alignment, on which Triton specializes pointers): so the checks run
# once per signature, and later calls launch the compiled kernel directly.
#
# Under torch.compile the launch is a torch.library.custom_op that writes its outputs (mutates_args), one opaque
# node for fullgraph=True. A graph must not sync, so compiled calls skip the value checks, and in thd the grid
# covers a bound on the longest sequence, min(tokens, rows of freqs): programs past a sequence's end return at once.

_checked, _launches, _last_results = {}, {}, {}


def _signature(*args):
    """Each tensor's shape, strides, dtype, device and alignment; any other argument with its type."""
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


def _remember(what, tensors, extra_key, compute):
    """compute(), or its result for the same tensors last time (same identity and version counter)."""
    key = tuple((id(x), x._version) for x in tensors) + extra_key
    last = _last_results.get(what)
    if last is None or last[0] != key or not all(ref() is x for ref, x in zip(last[1], tensors)):
        _last_results[what] = (key, tuple(weakref.ref(x) for x in tensors), compute())
    return _last_results[what][2]


def _read_values(cu_seqlens, start_positions, seqlen, n_tokens, max_positions):
    """Check the values of cu_seqlens and start_positions (a host sync); return the longest sequence."""
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
    return max(lengths, default=0)


def _angles_shared(freqs, interleaved):
    """int32 [1], computed on the device: 1 if f_b == f_a everywhere (the kernel then reads half the table)."""
    def compute():  # traced into the graph under torch.compile; the memo is eager-only
        f_a, f_b = (freqs[..., 0::2], freqs[..., 1::2]) if interleaved else freqs.chunk(2, dim=-1)
        return (f_a == f_b).all().to(torch.int32).reshape(1)
    return compute() if torch.compiler.is_compiling() else _remember("angles shared", (freqs,), (interleaved,), compute)


def _layout(t, tensor_format):
    """(batch, seqlen, heads, head_dim) and the strides in that order; thd has batch stride 0."""
    if tensor_format == "thd":
        return (None, *t.shape), (0, *t.stride())
    order = (1, 0, 2, 3) if tensor_format == "sbhd" else (0, 1, 2, 3)
    return tuple(t.shape[i] for i in order), tuple(t.stride(i) for i in order)


def _next_pow2(n):  # plain Python: triton.next_power_of_2 is slow on the host in Triton 3.9
    return 1 << (n - 1).bit_length()


def _check(tensors, names, freqs, tensor_format, cu_seqlens, start_positions):
    """The checks that read no tensor's values. Returns the sequence length and whether some channels pass through."""
    if tensor_format not in TENSOR_FORMATS:
        raise ValueError(f"tensor_format must be one of {TENSOR_FORMATS}, got {tensor_format!r}")
    rank, t = 3 if tensor_format == "thd" else 4, tensors[0]
    for x, name in zip(tensors, names):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
        if x.dim() != rank:
            raise ValueError(f"{name} must have {rank} dims for tensor_format='{tensor_format}', got shape {tuple(x.shape)}")
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
            raise ValueError(f"{name} must match q in dtype and in every dim but heads: got {tuple(x.shape)} "
                             f"{x.dtype}, q is {tuple(t.shape)} {t.dtype}")
    for x, name in [*zip(tensors, names), (freqs, "freqs"), (cu_seqlens, "cu_seqlens"),
                    (start_positions, "start_positions")]:
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
    return seqlen, rot_dim < head_dim


def _rope(tensors, freqs, tensor_format, interleaved, cu_seqlens, start_positions):
    names, tracing = ("t",) if len(tensors) == 1 else ("q", "k"), torch.compiler.is_compiling()
    check = lambda: _check(tensors, names, freqs, tensor_format, cu_seqlens, start_positions)  # noqa: E731
    seqlen, partial = check() if tracing else _once(_checked, _signature(
        *tensors, freqs, cu_seqlens, start_positions, tensor_format), check)
    for x, name in zip(tensors, names):
        if x.requires_grad and torch.is_grad_enabled():  # the output could not carry a gradient back to x
            raise ValueError(f"{name} requires grad, but 02 has no backward: use 03's apply_rotary_pos_emb, or no_grad")
    t, k, max_positions = tensors[0], tensors[1] if len(tensors) == 2 else None, freqs.shape[0]
    if tracing:  # no host sync in a graph: values unchecked, the longest sequence bounded
        seqlen = min(t.shape[0], max_positions) if tensor_format == "thd" else seqlen
    elif cu_seqlens is not None or start_positions is not None:
        checked = tuple(x for x in (cu_seqlens, start_positions) if x is not None)
        args = (cu_seqlens, start_positions, seqlen, t.shape[0], max_positions)
        seqlen = _remember("values checked", checked, args[2:], lambda: _read_values(*args))
    outs = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in tensors]  # contiguous, as TE's
    if t.numel() and seqlen:
        args = (t, outs[0], k, outs[-1] if k is not None else None, freqs, _angles_shared(freqs, interleaved),
                cu_seqlens, start_positions, seqlen, tensor_format, interleaved, partial)
        (_rope_op if tracing else _launch)(*args)
    return outs


def _launch(q: torch.Tensor, q_out: torch.Tensor, k: Optional[torch.Tensor], k_out: Optional[torch.Tensor],
            freqs: torch.Tensor, angles_shared: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
            start_positions: Optional[torch.Tensor], seqlen: int, tensor_format: str, interleaved: bool,
            copy_pass: bool) -> None:
    """Write RoPE(q) into q_out (and RoPE(k) into k_out); seqlen: the longest sequence, or a bound on it."""
    has_k, (k, k_out) = k is not None, (k, k_out) if k is not None else (q, q_out)
    tensors = (q, q_out, k, k_out, freqs, angles_shared, cu_seqlens if cu_seqlens is not None else freqs,
               start_positions if start_positions is not None else freqs)  # (freqs stands in for those absent)

    def plan():  # the grid, the integer arguments and the constexprs
        (batch, _, _, head_dim), _ = _layout(q, tensor_format)
        batch = cu_seqlens.numel() - 1 if tensor_format == "thd" else batch
        rot_dim, half, n_heads = freqs.shape[3], _next_pow2(freqs.shape[3] // 2), (q.shape[-2], k.shape[-2])
        # One token per program, its heads in four unrolled steps, few warps: many small programs keep the most
        # bytes in flight per multiprocessor (a sweep of BLOCK_S x BLOCK_H x warps: results/02_rope_fwd_sweep.log).
        block_h = max(1, _next_pow2(max(n_heads)) // 4)
        return (batch * seqlen,), (
            batch, seqlen, seqlen, *n_heads, head_dim, rot_dim, freqs.shape[0],
            *[s for x in tensors[:4] for s in _layout(x, tensor_format)[1]], freqs.stride(0), freqs.stride(3)), dict(
            BLOCK_S=1, BLOCK_H=block_h, num_warps=2 if block_h * half <= 128 else 4, HALF=half,
            PASS=_next_pow2(max(head_dim - rot_dim, 1)), N_HEAD_BLOCKS=-(-max(n_heads) // block_h),
            INTERLEAVED=interleaved, IS_THD=tensor_format == "thd", HAS_START_POSITIONS=start_positions is not None,
            HAS_K=has_k, COPY_PASS=copy_pass, BATCH_FASTEST=tensor_format == "sbhd")
    _launch_cached(rope_fwd_kernel, _signature(q, q_out, k, k_out, freqs, cu_seqlens, start_positions, has_k, seqlen,
                                               tensor_format, interleaved, copy_pass), tensors, plan)


# _launch as the op rope_fwd_tutorial::rope (a fresh name if this file was loaded before), writing into the fresh
# outputs that it is given (mutates_args).
_name = next(f"rope{n or ''}" for n in itertools.count() if not hasattr(torch.ops.rope_fwd_tutorial, f"rope{n or ''}"))
_rope_op = torch.library.custom_op(f"rope_fwd_tutorial::{_name}", _launch, mutates_args=("q_out", "k_out"))
_rope_op.register_fake(lambda *args: None)


def rope_fwd(t, freqs, tensor_format="sbhd", interleaved=False, cu_seqlens=None, start_positions=None):
    """Apply RoPE to t in one Triton kernel (TransformerEngine's ``apply_rotary_pos_emb`` forward).

    t: [s, b, h, d] (sbhd) | [b, s, h, d] (bshd) | [total_tokens, h, d] (thd); fp32/fp16/bf16, any strides, d <= 256.
    freqs: float32 angles [s2, 1, 1, d2], d2 even, d2 <= d, s2 >= every position used. Only t[..., :d2] is rotated;
        t[..., d2:] passes through.
    interleaved: rotate pairs (x0, x1), (x2, x3), ... (RoFormer, GPT-J) instead of halves.
    cu_seqlens: int32 [b + 1], thd only: sequence i is tokens cu_seqlens[i]:cu_seqlens[i + 1], from position 0.
    start_positions: int [b]: sequence i uses angle rows start_positions[i] onwards (KV cache).
    Returns a new contiguous tensor. Works under torch.compile(fullgraph=True).
    """
    return _rope([t], freqs, tensor_format, interleaved, cu_seqlens, start_positions)[0]


def rope_fwd_qk(q, k, freqs, tensor_format="sbhd", interleaved=False, cu_seqlens=None, start_positions=None):
    """Apply RoPE to q and k in a single launch; k may have fewer heads than q (GQA).

    q: like ``rope_fwd``'s t; k: the same layout, batch, sequence and head dim, any head count.
    Returns (q_out, k_out), new contiguous tensors.
    """
    return tuple(_rope([q, k], freqs, tensor_format, interleaved, cu_seqlens, start_positions))


# %%
# Unit test
# ---------
# Irregular shapes (odd sequence lengths and head counts, head dim 80, partial rotary), random angles
# whose halves differ, strided views, GQA: every feature at once (tests/ covers the whole matrix).


def self_check():
    torch.manual_seed(0)
    b, s, h, d = (3, 37, 5, 80) if DEVICE.type == "cuda" else (2, 7, 3, 80)
    cu_seqlens = torch.arange(0, b * s + 1, s, dtype=torch.int32, device=DEVICE)
    for dtype, fmt, interleaved in itertools.product((torch.float32, torch.bfloat16), TENSOR_FORMATS, (False, True)):
        qkv = torch.randn(b, s, 3, h, d, device=DEVICE, dtype=dtype)
        q, k = qkv[:, :, 0], qkv[:, :, 1, :2]  # strided views; k has fewer heads
        q, k = (x.transpose(0, 1) if fmt == "sbhd" else x.flatten(0, 1) if fmt == "thd" else x for x in (q, k))
        freqs = torch.randn(s + 4, 1, 1, 48, device=DEVICE)  # partial rotary, halves differ
        kwargs = dict(tensor_format=fmt, interleaved=interleaved, cu_seqlens=cu_seqlens if fmt == "thd" else None,
                      start_positions=torch.randint(0, 5, (b,), device=DEVICE))
        for x, y in zip((q, k), rope_fwd_qk(q, k, freqs, **kwargs)):
            torch.testing.assert_close(y, rope_reference(x, freqs, **kwargs))
    print(f"self-check passed: fp32/bf16 x sbhd/bshd/thd x half/interleaved, d={d}, d2=48, GQA, "
          f"strided views, start_positions (device: {DEVICE.type})")


# %%
# Benchmark
# ---------
# Ours three ways, TransformerEngine's unfused formula eager and compiled, Liger's and flash-attention's kernels if
# importable, against a copy of the same bytes; then an eager call's host cost (results/02_rope_fwd_H100.md).
BENCH_SHAPES = [(4, 4096, 32, 128), (32, 512, 12, 64), (1, 32768, 8, 128)]  # (b, s, h, d)
CPU_SHAPES = [(2, 16, 4, 64)]
TIMED = ("bf16 q and k. Each cell is GPU time, the median of `triton.testing.do_bench_cudagraph` (work replayed from a "
         "CUDA graph), except \"ours: eager call\": the median of `triton.testing.do_bench` over ten calls in a row, per "
         "call, host cost included. eager, torch.compile: TransformerEngine's unfused formula. (x%): the speed as a "
         "fraction of a device-to-device copy of the same bytes, in the same run.")


def _us(fn, eager_call=False):  # median us: a CUDA-graph replay, or ten eager calls in a row (do_bench's clearing of
    if DEVICE.type != "cuda":  # L2 would otherwise hide their host cost); no GPU: one call, timed
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    if eager_call:
        return triton.testing.do_bench(lambda: [fn() for _ in range(10)], return_mode="median") * 100
    return triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3


def benchmark():
    on_gpu, table, liger, flash = DEVICE.type == "cuda", [], None, None
    eager = lambda q, k, f, **kw: [rope_reference(x, f, compute_dtype=None, **kw) for x in (q, k)]  # noqa: E731 (TE's)
    columns = {"ours": rope_fwd_qk, "ours: eager call": rope_fwd_qk, "eager": eager}
    if on_gpu:  # compiled per shape and layout (dynamic=False: a shape seen second would get dynamic-shape kernels)
        torch._dynamo.config.cache_size_limit = 64
        columns.update({"ours: torch.compile": torch.compile(rope_fwd_qk, fullgraph=True, dynamic=False),
                        "torch.compile": torch.compile(eager, fullgraph=True, dynamic=False)})
        try:
            from liger_kernel.ops.rope import rope_forward as liger
        except ImportError as e:
            print(f"(Liger-Kernel not importable, its column is skipped: {e})")
        try:
            from flash_attn.ops.triton.rotary import apply_rotary as flash
        except ImportError as e:
            print(f"(flash-attention's rotary not importable, its column is skipped: {e})")
    else:
        print("\nNO GPU: the kernels run in Triton's interpreter on the CPU. The timings below only "
              "show that the benchmark runs; they say nothing about speed.")
    names = ["copy", *columns] + ["liger (in place)"] * bool(liger) + ["flash-attn"] * bool(flash)
    emit = lambda line: print(line) or table.append(line)  # noqa: E731
    emit(f"| shape (b, s, h, d) | layout | {' | '.join(names)} |\n" + "|---" * (len(names) + 2) + "|")
    for b, s, h, d in BENCH_SHAPES if on_gpu else CPU_SHAPES:
        qk, freqs = torch.randn(2, b, s, h, d, device=DEVICE, dtype=torch.bfloat16), rope_freqs(s, d, device=DEVICE)
        dst, cu_seqlens = torch.empty_like(qk), torch.arange(0, b * s + 1, s, dtype=torch.int32, device=DEVICE)
        cos, sin = (f(freqs[:, 0, 0]).to(qk.dtype)[None] for f in (torch.cos, torch.sin))  # peers' tables, untimed:
        h_cos, h_sin = cos[0, :, : d // 2].contiguous(), sin[0, :, : d // 2].contiguous()  # bf16 [1, s, d], [s, d/2]
        for fmt, (q, k) in {"bshd": qk, "sbhd": qk.transpose(1, 2).contiguous(), "thd": qk.flatten(1, 2)}.items():
            kw = dict(tensor_format=fmt, cu_seqlens=cu_seqlens if fmt == "thd" else None)
            fns = {"copy": lambda: dst.copy_(qk), **{n: lambda f=f: f(q, k, freqs, **kw) for n, f in columns.items()}}
            if liger and fmt == "bshd":  # in place, on [b, h, s, d] views of bshd memory
                fns["liger (in place)"] = lambda: liger(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            if flash:  # bshd (any strides) or thd
                fa_kw = dict(cu_seqlens=cu_seqlens, max_seqlen=s) if fmt == "thd" else {}
                fns["flash-attn"] = lambda: [flash(x.transpose(0, 1) if fmt == "sbhd" else x, h_cos, h_sin, **fa_kw)
                                             for x in (q, k)]
            us = {name: _us(fn, name == "ours: eager call") for name, fn in fns.items()}
            emit(f"| {(b, s, h, d)} | {fmt} | " + " | ".join(f"{us[n]:.1f} us" + f" ({100 * us['copy'] / us[n]:.0f}%)"
                                                           * on_gpu if n in us else "n/a" for n in names) + " |")
    if on_gpu:  # host cost, where the GPU waits for the host: 200 calls in a row, one sync; 7 rounds, interleaved
        x, freqs = torch.randn(1, 128, 2, 64, device=DEVICE, dtype=torch.bfloat16), rope_freqs(128, 64, device=DEVICE)
        times = {lambda: x + 1: [], lambda: rope_fwd_qk(x, x, freqs, "bshd"): []}
        for _, fn in itertools.product(range(7), times):
            fn(), torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(200):
                fn()
            torch.cuda.synchronize()
            times[fn].append((time.perf_counter() - start) / 200 * 1e6)
        empty, ours = (sorted(t)[3] for t in times.values())
        emit(f"\nHost cost of an eager call at (1, 128, 2, 64) bf16, bshd (200 calls in a row, one sync, median of 7 "
             f"interleaved rounds): rope_fwd_qk {ours:.1f} us, an empty op (x + 1) {empty:.1f} us: {ours / empty:.1f} "
             "empty ops.")
    return "\n".join(table)


def write_page(results_dir, table):
    """results/<script>_<GPU kind>.md: title, environment, command, what is timed, the table, the raw log's name."""
    (here, script), gpu = os.path.split(os.path.abspath(__file__)), torch.cuda.get_device_name()
    stem = script[:-3] + "_" + next((w for w in gpu.split() if w[:1] in "ABHL" and w[1:2].isdigit()), "gpu")
    commit = os.popen(f'git -C "{here}" rev-parse --short HEAD 2>{os.devnull}').read().strip() or "n/a"
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, stem + ".md"), "w") as f:
        f.write(f"# {__doc__.splitlines()[1]}\n\ndevice: {gpu}; date: {time.strftime('%Y-%m-%d')}; torch "
                f"{torch.__version__}; triton {triton.__version__}; python {sys.version.split()[0]}; commit {commit}; "
                f"{script} md5 {hashlib.md5(open(__file__, 'rb').read()).hexdigest()[:8]}\n\nCommand: `python "
                f"{' '.join(sys.argv)}`\n\n{TIMED}\n\n{table}\n\nRaw log: `{stem}.log`.\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                        help="folder for the page (written only on a GPU)")
    args, _, table = parser.parse_args(), self_check(), benchmark()
    if DEVICE.type == "cuda":
        write_page(args.results, table)
