"""
Pretraining a RoFormer masked language model on the collection's kernels
========================================================================

In this tutorial, you will learn about:

* a faithful RoFormer (Hugging Face's ``RoFormerForMaskedLM``): word and token-type embeddings, no
  absolute positions, post-LN encoder layers with RoPE on q and k (interleaved pairs), an MLM
  head tied to the word embeddings; and loading a Hugging Face checkpoint into it;
* one flag, ``--attn``, that walks the collection's ladder: ``torch`` (eager RoPE and softmax),
  ``naive`` (01's RoPE + SDPA), ``triton`` (03's RoPE + SDPA; 02's forward kernel at evaluation)
  and ``fused`` (04's RoPE + attention kernel);
* BERT/RoFormer masking (15%: 80% [MASK], 10% random, 10% unchanged), the loss and accuracy on
  masked positions only, with the MLM head run on those positions only;
* a nanoGPT-style loop: AdamW, warmup then linear decay, gradient accumulation and clipping, bf16
  autocast, durable checkpoints (fsync, the previous one kept, loaded with ``weights_only=True``)
  and an exact ``--resume`` (bit for bit; on a GPU, under
  torch.use_deterministic_algorithms(True), since PyTorch's index backward otherwise adds with
  float atomics), DistributedDataParallel via torchrun;
* ``--compile`` (on with a GPU): the whole model under ``torch.compile``, the nanoGPT way, with
  03's and 04's kernels opaque to Inductor; what it fuses and what it cannot, measured by kernel
  family (``--bench --bench-profile``), against Hugging Face's model compiled; dropout drawn
  eight elements per Philox call, where Inductor's dropout makes one call per element, inside
  add-and-LayerNorm kernels that draw the mask again in the backward rather than store it;
  backward kernels for the GELU and the add-and-LayerNorm blocks that sum the bias and LayerNorm
  gradients as they make them, where Inductor reads the gradients again; GELU's erf as a
  branch-free fit; the residual stream in bf16; and the MLM loss as two kernels, an online softmax
  over the vocabulary and its gradient;
* why a model trains at the pace of Python rather than the GPU, and ``--cuda-graphs`` (on with a
  GPU): the encoder's forward and backward, compiled, replayed from two CUDA graphs (and the trap
  such graphs set for gradient accumulation).

Run ``python 05_train_roformer_mlm.py`` (a small model on the Python standard library's own source,
no download), ``--help`` for the options. It loads 01-04 from beside this file.
"""

import argparse
import array
import contextlib
import dataclasses
import gc
import importlib.util
import itertools
import json
import math
import os
import pickle
import random
import statistics
import sys
import sysconfig
import time
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (here and by 01-04)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


def load_step(filename):
    """01-04 start with digits, so they are loaded by path, once each."""
    name = "rope_step_" + filename[:2]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(os.path.abspath(__file__)), filename))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


naive_rope, rope_fwd, rope_bwd, fused = (load_step(f) for f in (
    "01_rotate_half.py", "02_rope_fwd.py", "03_rope_bwd.py", "04_rope_attention.py"))
ATTN_PATHS = ("torch", "naive", "triton", "fused")

# %%
# Dropout: eight elements from one Philox call, and a mask that is never stored
# -----------------------------------------------------------------------------
# Compiled, dropout is fused into the LayerNorm kernel after it, and Inductor draws its random
# numbers there: one Philox call (ten rounds of 32-bit multiplies) per element, of whose 128 bits
# it keeps 32. At BERT-base's shape that is 12.6M calls per dropout, enough to make the LayerNorm
# kernels wait on integer arithmetic rather than memory. Here one call makes eight elements' draws
# (16 bits each: p is rounded to a multiple of 1/65536). Seen as rows of n, element c of row r is
# draw c % 8 of call r * cdiv(n, 8) + c // 8, so a kernel that holds a row draws its mask itself.
# The mask is then a function of one seed (drawn from PyTorch's generator, so torch.manual_seed,
# checkpointed RNG states and CUDA graphs govern it as they do nn.Dropout), and the kernels that
# need it draw it again rather than read it, as Triton's low-memory dropout tutorial does: the
# add + LayerNorm kernels below, forward and backward, take the seed, and no mask of a byte per
# element is written and read twice. dropout_keep_kernel writes the same mask out, for the
# embeddings' dropout (a multiply that Inductor fuses) and for the tests. At BERT-base's shape on an
# H200 the kernel that wrote a mask took 10 us a dropout, and a compiled, graphed step is 0.3 ms
# faster without the masks (25.9 against 25.7 ms, results/05_ab.log I), with 300 MB less memory.
# Rows an add + LayerNorm kernel takes at once: one on the GPU. Triton's interpreter pays per operation
# rather than per element, so there every kernel takes many rows at once and few programs run.
ROWS_AT_ONCE = 1 if torch.cuda.is_available() else 32
# a program of dropout_keep_kernel: ROWS rows x (8 x GROUPS) columns (8 rows: 11.3 us at BERT-base's shape
# on an H200, against 13.0 for one and 11.8 for 16; results/05_ab.log K)
DROPOUT_BLOCKS = dict(ROWS=8 if ROWS_AT_ONCE == 1 else ROWS_AT_ONCE, GROUPS=128, num_warps=4)


@triton.jit
def _keep(seed, rows, first_group, n_cols, threshold, GROUPS: tl.constexpr):
    """[ROWS, GROUPS, 8] keep flags of columns c = 8 * (first_group + g) + j of rows [ROWS, 1, 1]: draw j
    of Philox call row * cdiv(n_cols, 8) + first_group + g, kept when its 16 bits are >= threshold."""
    g, j = tl.arange(0, GROUPS)[None, :, None], tl.arange(0, 8)[None, None, :]
    w0, w1, w2, w3 = tl.randint4x(seed, rows * tl.cdiv(n_cols, 8) + first_group + g)  # [ROWS, GROUPS, 1] each
    word = tl.where(j < 4, tl.where(j < 2, w0, w1), tl.where(j < 6, w2, w3))
    bits = tl.where(j % 2 == 0, word & 0xFFFF, word >> 16)
    return bits.to(tl.int32) >= threshold


@triton.jit
def _row_columns(GROUPS: tl.constexpr):
    """Column indices 8 * g + j of a [1, GROUPS, 8] tile: the layout of _keep's flags."""
    return 8 * tl.arange(0, GROUPS)[None, :, None] + tl.arange(0, 8)[None, None, :]


@triton.jit
def dropout_keep_kernel(seed_ptr, keep_ptr, n_rows, n_cols, threshold, ROWS: tl.constexpr, GROUPS: tl.constexpr):
    """keep [n_rows, n_cols]: ROWS rows from ROWS * pid0, 8 * GROUPS columns from 8 * GROUPS * pid1."""
    seed, first_group = tl.load(seed_ptr), tl.program_id(1) * GROUPS
    cols = 8 * first_group + _row_columns(GROUPS)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None, None]
    tl.store(keep_ptr + rows.to(tl.int64) * n_cols + cols, _keep(seed, rows, first_group, n_cols, threshold, GROUPS),
             mask=(cols < n_cols) & (rows < n_rows))


def _check_dropout_size(numel):
    if numel >= 2**31:
        raise ValueError(f"dropout over {numel} elements: int32 offsets reach 2^31")


@torch.library.custom_op("roformer_mlm::dropout_keep", mutates_args=())
def dropout_keep(seed: torch.Tensor, shape: List[int], threshold: int) -> torch.Tensor:
    """A bool mask of `shape`, True with probability 1 - threshold / 65536: the draws of _keep from the
    int64 seed[0], `shape` seen as rows of shape[-1]."""
    keep = torch.empty(shape, dtype=torch.bool, device=seed.device)
    _check_dropout_size(keep.numel())
    if keep.numel():
        n_cols = shape[-1]
        groups = min(DROPOUT_BLOCKS["GROUPS"], triton.next_power_of_2(triton.cdiv(n_cols, 8)))
        rows = DROPOUT_BLOCKS["ROWS"]
        grid = (triton.cdiv(keep.numel() // n_cols, rows), triton.cdiv(n_cols, 8 * groups))
        dropout_keep_kernel[grid](seed, keep, keep.numel() // n_cols, n_cols, threshold, ROWS=rows, GROUPS=groups,
                                  num_warps=DROPOUT_BLOCKS["num_warps"])
    return keep


dropout_keep.register_fake(lambda seed, shape, threshold: seed.new_empty(shape, dtype=torch.bool))


class Dropout(nn.Dropout):
    """nn.Dropout with its mask drawn eight elements per Philox call, from a seed."""

    def seed_and_scale(self, device):
        """(seed, threshold, scale): this dropout of x keeps the elements whose draw from seed (_keep)
        is >= threshold and multiplies them by scale; seed is None when every element is kept
        (evaluation, p = 0: scale 1) or none is (p = 1: scale 0)."""
        if not self.training or self.p == 0.0:
            return None, 0, 1.0
        if self.p == 1.0:
            return None, 0, 0.0
        threshold = round(self.p * 65536)
        return torch.randint(2**62, (1,), device=device), threshold, 65536 / (65536 - threshold)

    def forward(self, x):
        if not self.training or self.p in (0.0, 1.0):
            return super().forward(x)
        seed, threshold, scale = self.seed_and_scale(x.device)
        return x * dropout_keep(seed, list(x.shape), threshold) * scale


# %%
# Bias gradients summed where they are made
# -----------------------------------------
# A Linear layer's bias gradient is its output's gradient summed over the tokens. Inductor sums it
# in a kernel of its own, which reads that gradient again (100 MB a layer after the GELU at
# BERT-base's shape), and it sums LayerNorm's weight and bias gradients from a workspace with two
# more launches. Here the kernel that makes a gradient also sums its columns, per tile (GELU) or
# per band of rows (AddNorm), into a few rows of partial sums that the caller adds up (compiled,
# in one small Inductor kernel). Two blocks of each layer get such a backward, on every path but
# "torch" (PyTorch as Hugging Face writes it):
# - dense, then bias + GELU: the matmul runs without its bias; the backward writes dh and sums it;
# - dense, then bias, dropout, the residual and LayerNorm (AddNorm): one kernel for the backward
#   of all four, with three column sums (LayerNorm's weight and bias, the dense layer's bias).
# The residual stream (AddNorm's output: the next block's residual and the next matmul's input) is
# kept in the matmuls' dtype, bf16 under autocast, as Megatron-LM keeps it (fp32_residual_connection
# is off by default there); Hugging Face's model under autocast keeps it in float32, the dtype of
# LayerNorm's output. Every element is still added and normalized in float32 inside the kernels:
# what changes is that the residual and its gradient are rounded to bf16 between blocks, as the
# matmuls' copy already was. AddNorm returns y twice, the second a view of the first, for the
# residual and for the next matmul: autograd then hands the backward the two gradients apart and
# the kernel adds them as it reads them (one tensor used twice would have its two gradients summed
# by autograd first, in a kernel of its own: 75 MB more a block).
# AddNorm's forward is a kernel too, a row at a time like its backward, so that both draw dropout's
# mask from the seed (above) instead of writing and reading it. It reads a and the residual and
# writes y, xhat = (z - mean) * rstd and rstd: 8 bytes an element, 100 MB at BERT-base's shape, in
# 33 us on an H200; the backward reads two gradients and xhat and writes two, in 49 us. With a
# float32 stream, which also wrote y rounded for the matmul, they moved 14 bytes an element each, in
# 46 and 55 us, and a compiled, graphed step took 0.4-0.6 ms longer (with the masked rows' number
# dynamic, as training runs, 0.8 ms: results/05_ab.log N); Inductor's forward, with the mask and
# xhat in float32, took 55 us plus 10 for the mask's kernel (I and K). It wants more programs than
# the backward, whose programs each add a row of partial sums for the caller to sum.
# xhat is saved in the matmuls' dtype too, as TransformerEngine saves a bf16 LayerNorm's input: the
# backward's gradients carry bf16's rounding of xhat (a relative 2^-9), and each kernel moves 2
# bytes an element less than with float32 (K).
# GELU's forward is a kernel too, though Inductor would fuse it (with nothing: a matmul on either
# side). Both kernels are bound by instructions rather than bytes, and the costliest is erf:
# libdevice's erff picks one of two polynomials by |x|, and a warp whose elements fall on both sides
# (most of them, for activations near 0) runs both. Phi(x) here is one branch-free fit of erfc and
# one exponential, with no 1 + erf(x) to cancel in the negative tail (1.2% of Inductor's bf16
# outputs are not float64 GELU correctly rounded, 0.002% of these). At BERT-base's shape the forward
# takes 63 us where Inductor's takes 75 on an H200 (72 and 79 on an H100), the backward 100 where
# libdevice's erf took 109 (114 and 120); a copy of the forward's bytes takes 49 (68) us
# (results/05_ab.log G).


@triton.jit
def _normal_cdf(x):
    """Phi(x) = erfc(-x / sqrt(2)) / 2, erfc from Numerical Recipes' Chebyshev fit (relative error
    under 1.2e-7 for every x: the negative tail keeps its digits)."""
    z = tl.abs(x) * 0.7071067811865476
    t = 1.0 / (1.0 + 0.5 * z)
    fit = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    half_erfc = 0.5 * t * tl.exp(fit - z * z)  # erfc(z) / 2
    return tl.where(x >= 0, 1.0 - half_erfc, half_erfc)


@triton.jit
def _tile_plus_bias(h_ptr, bias_ptr, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's [BLOCK_M, BLOCK_N] tile of h plus bias, in float32 (0 off the edges), with its
    offsets, mask and columns."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    x = tl.load(h_ptr + offs, mask=ok, other=0.0).to(tl.float32) + tl.load(bias_ptr + cols, mask=cols < n_cols)[None, :]
    return x, offs, ok, cols


@triton.jit
def bias_gelu_fwd_kernel(h_ptr, bias_ptr, g_ptr, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """g = GELU(h + bias) (the exact, erf GELU) for one tile, in float32, stored in g's dtype."""
    x, offs, ok, _ = _tile_plus_bias(h_ptr, bias_ptr, n_rows, n_cols, BLOCK_M, BLOCK_N)
    tl.store(g_ptr + offs, (x * _normal_cdf(x)).to(g_ptr.dtype.element_ty), mask=ok)


@triton.jit
def bias_gelu_bwd_kernel(dg_ptr, h_ptr, bias_ptr, dh_ptr, partial_ptr, n_rows, n_cols,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dh = dg * GELU'(h + bias) for one tile, and the tile's column sums of dh (in float32, before
    dh is rounded) into row program_id(0) of the partial sums."""
    x, offs, ok, cols = _tile_plus_bias(h_ptr, bias_ptr, n_rows, n_cols, BLOCK_M, BLOCK_N)
    dg = tl.load(dg_ptr + offs, mask=ok, other=0.0).to(tl.float32)  # 0 off the edges: so is dh
    pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
    dh = dg * (_normal_cdf(x) + x * pdf)
    tl.store(dh_ptr + offs, dh.to(dh_ptr.dtype.element_ty), mask=ok)
    tl.store(partial_ptr + tl.program_id(0) * n_cols + cols, tl.sum(dh, 0), mask=cols < n_cols)


@triton.jit
def add_norm_fwd_kernel(a_ptr, bias_ptr, residual_ptr, seed_ptr, gamma_ptr, beta_ptr, y_ptr, xhat_ptr, rstd_ptr,
                        n_rows, n_cols, rows_per_program, threshold, scale, eps, HAS_DROPOUT: tl.constexpr,
                        ROWS: tl.constexpr, GROUPS: tl.constexpr, NUM_STAGES: tl.constexpr):
    """y = LayerNorm(z), z = (a + bias) * keep * scale + residual, keep drawn from the seed (_keep), for
    one band of rows, ROWS at a time (8 * GROUPS >= n_cols), computed in float32: y, and for the
    backward xhat = (z - mean) * rstd and rstd, each stored in its tensor's dtype."""
    band, cols = tl.program_id(0), _row_columns(GROUPS)
    ok = cols < n_cols
    bias = tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    gamma = tl.load(gamma_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        seed = tl.load(seed_ptr)
    first = band * rows_per_program
    n_band = tl.minimum(rows_per_program, n_rows - first)
    start = first.to(tl.int64) * n_cols  # the band's first element; offsets within a band are int32
    a_ptr, residual_ptr, xhat_ptr = a_ptr + start, residual_ptr + start, xhat_ptr + start
    y_ptr, rstd_ptr = y_ptr + start, rstd_ptr + first
    for row0 in tl.range(0, n_band, ROWS, num_stages=NUM_STAGES):
        rows = row0 + tl.arange(0, ROWS)
        row_ok = rows < n_band
        offs, in_row = rows[:, None, None] * n_cols + cols, ok & row_ok[:, None, None]
        branch = (tl.load(a_ptr + offs, mask=in_row, other=0.0).to(tl.float32) + bias) * scale
        if HAS_DROPOUT:
            branch = tl.where(_keep(seed, first + rows[:, None, None], 0, n_cols, threshold, GROUPS), branch, 0.0)
        z = branch + tl.load(residual_ptr + offs, mask=in_row, other=0.0).to(tl.float32)
        mean = tl.sum(tl.sum(z, 2), 1) / n_cols
        centred = tl.where(ok, z - mean[:, None, None], 0.0)  # 0 past n_cols
        rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(centred * centred, 2), 1) / n_cols + eps)
        xhat = centred * rstd[:, None, None]
        tl.store(y_ptr + offs, (xhat * gamma + beta).to(y_ptr.dtype.element_ty), mask=in_row)
        tl.store(xhat_ptr + offs, xhat.to(xhat_ptr.dtype.element_ty), mask=in_row)
        tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def add_norm_bwd_kernel(dy_ptr, dy_mm_ptr, xhat_ptr, rstd_ptr, seed_ptr, gamma_ptr, dz_ptr, da_ptr, partial_ptr,
                        n_rows, n_cols, rows_per_program, threshold, scale, HAS_DY: tl.constexpr,
                        HAS_DY_MM: tl.constexpr, HAS_DROPOUT: tl.constexpr, ROWS: tl.constexpr, GROUPS: tl.constexpr,
                        NUM_STAGES: tl.constexpr):
    """The backward of add_norm_fwd_kernel for one band of rows, ROWS at a time: dz (the residual's
    gradient), da = dz * keep * scale (keep drawn again from the seed), and the band's column sums of
    dy * xhat, dy and da. dy is the sum of the two outputs' gradients."""
    band, cols = tl.program_id(0), _row_columns(GROUPS)
    ok = cols < n_cols
    gamma = tl.load(gamma_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        seed = tl.load(seed_ptr)
    sum_dgamma = tl.zeros((1, GROUPS, 8), tl.float32)
    sum_dbeta = tl.zeros((1, GROUPS, 8), tl.float32)
    sum_dbias = tl.zeros((1, GROUPS, 8), tl.float32)
    first = band * rows_per_program
    n_band = tl.minimum(rows_per_program, n_rows - first)
    start = first.to(tl.int64) * n_cols
    dy_ptr, dy_mm_ptr, xhat_ptr = dy_ptr + start, dy_mm_ptr + start, xhat_ptr + start
    dz_ptr, da_ptr, rstd_ptr = dz_ptr + start, da_ptr + start, rstd_ptr + first
    # the loads of the next rows are issued while these are worked on (NUM_STAGES iterations in flight)
    for row0 in tl.range(0, n_band, ROWS, num_stages=NUM_STAGES):
        rows = row0 + tl.arange(0, ROWS)
        row_ok = rows < n_band
        offs, in_row = rows[:, None, None] * n_cols + cols, ok & row_ok[:, None, None]
        dy = tl.zeros((ROWS, GROUPS, 8), tl.float32)
        if HAS_DY:
            dy += tl.load(dy_ptr + offs, mask=in_row, other=0.0).to(tl.float32)
        if HAS_DY_MM:
            dy += tl.load(dy_mm_ptr + offs, mask=in_row, other=0.0).to(tl.float32)
        xhat = tl.load(xhat_ptr + offs, mask=in_row, other=0.0).to(tl.float32)
        g = dy * gamma  # 0 past n_cols and past the band, as is xhat
        mean_g, mean_gx = tl.sum(tl.sum(g, 2), 1) / n_cols, tl.sum(tl.sum(g * xhat, 2), 1) / n_cols
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)  # 0 past the band: so are dz and da
        dz = (g - mean_g[:, None, None] - xhat * mean_gx[:, None, None]) * rstd[:, None, None]
        tl.store(dz_ptr + offs, dz.to(dz_ptr.dtype.element_ty), mask=in_row)
        da = dz * scale
        if HAS_DROPOUT:
            da = tl.where(_keep(seed, first + rows[:, None, None], 0, n_cols, threshold, GROUPS), da, 0.0)
        tl.store(da_ptr + offs, da.to(da_ptr.dtype.element_ty), mask=in_row)
        sum_dgamma += tl.sum(dy * xhat, 0, keep_dims=True)
        sum_dbeta += tl.sum(dy, 0, keep_dims=True)
        sum_dbias += tl.sum(da, 0, keep_dims=True)  # (past n_cols: -mean_g * rstd, never stored)
    partial = partial_ptr + band * 3 * n_cols + cols
    tl.store(partial, sum_dgamma, mask=ok)
    tl.store(partial + n_cols, sum_dbeta, mask=ok)
    tl.store(partial + 2 * n_cols, sum_dbias, mask=ok)


# Tiles from sweeps at BERT-base's shape on an H100 and an H200 (results/05_ab.log). The caller sums
# the partial sums: compiled, Inductor's reduction does it several times faster than a call of torch.sum.
BIAS_GELU_FWD_BLOCKS = dict(BLOCK_M=8, BLOCK_N=512, num_warps=4)
BIAS_GELU_BLOCKS = dict(BLOCK_M=32, BLOCK_N=128, num_warps=4)
ADD_NORM_FWD_BLOCKS = dict(bands=4096, num_warps=4, NUM_STAGES=4)  # bands: programs (at most)
ADD_NORM_BWD_BLOCKS = dict(bands=256, num_warps=4, NUM_STAGES=4)  # (more: more partial sums to add)


def _gelu_tiles(blocks, h):
    """(grid, tile arguments) of a bias + GELU kernel over h [..., n] seen as [rows, n]: a tile is
    never wider than the next power of two of n."""
    n_cols = h.shape[-1]
    block_n = min(blocks["BLOCK_N"], triton.next_power_of_2(n_cols))
    return ((triton.cdiv(h.numel() // n_cols, blocks["BLOCK_M"]), triton.cdiv(n_cols, block_n)),
            dict(n_rows=h.numel() // n_cols, n_cols=n_cols, BLOCK_M=blocks["BLOCK_M"], BLOCK_N=block_n,
                 num_warps=blocks["num_warps"]))


@torch.library.custom_op("roformer_mlm::bias_gelu", mutates_args=())
def bias_gelu(h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """GELU(h + bias) in h's dtype, computed in float32; h [..., n], bias [n]."""
    h, g = h.contiguous(), torch.empty(h.shape, dtype=h.dtype, device=h.device)
    grid, tiles = _gelu_tiles(BIAS_GELU_FWD_BLOCKS, h)
    bias_gelu_fwd_kernel[grid](h, bias, g, **tiles)
    return g


bias_gelu.register_fake(lambda h, bias: torch.empty(h.shape, dtype=h.dtype, device=h.device))


def _bias_gelu_outputs(h):
    """Empty (dh, partial sums [row tiles, n] in float32)."""
    n_cols = h.shape[-1]
    return (torch.empty(h.shape, dtype=h.dtype, device=h.device),
            h.new_empty(triton.cdiv(h.numel() // n_cols, BIAS_GELU_BLOCKS["BLOCK_M"]), n_cols, dtype=torch.float32))


@torch.library.custom_op("roformer_mlm::bias_gelu_backward", mutates_args=())
def bias_gelu_backward(dg: torch.Tensor, h: torch.Tensor, bias: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(dh, partial sums of dh [row tiles, n] in float32) of gelu(h + bias), h [..., n] and bias [n]."""
    dg, h = dg.contiguous(), h.contiguous()
    dh, partial = _bias_gelu_outputs(h)
    grid, tiles = _gelu_tiles(BIAS_GELU_BLOCKS, h)
    bias_gelu_bwd_kernel[grid](dg, h, bias, dh, partial, **tiles)
    return dh, partial


bias_gelu_backward.register_fake(lambda dg, h, bias: _bias_gelu_outputs(h))


def _add_norm_bands(n_rows, blocks):
    """(rows per program, programs) of an add + LayerNorm kernel; the interpreter runs at most 4 programs."""
    rows = max(1, triton.cdiv(n_rows, blocks["bands"] if ROWS_AT_ONCE == 1 else 4))
    return rows, triton.cdiv(n_rows, rows)


def _add_norm_launch(n_cols, blocks):
    """An add + LayerNorm kernel's tile and launch arguments for rows of n_cols."""
    return dict(ROWS=ROWS_AT_ONCE, GROUPS=triton.next_power_of_2(triton.cdiv(n_cols, 8)),
                NUM_STAGES=blocks["NUM_STAGES"], num_warps=blocks["num_warps"])


def _add_norm_outputs(residual, dtype):
    """Empty (y and xhat in dtype, rstd in float32)."""
    new = lambda shape, dtype: torch.empty(shape, dtype=dtype, device=residual.device)  # noqa: E731
    return new(residual.shape, dtype), new(residual.shape, dtype), new(residual.shape[:-1], torch.float32)


@torch.library.custom_op("roformer_mlm::add_norm", mutates_args=())
def add_norm(a: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, seed: Optional[torch.Tensor], threshold: int,
             scale: float, gamma: torch.Tensor, beta: torch.Tensor, eps: float,
             dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, xhat, rstd) of y = LayerNorm((a + bias) * keep * scale + residual), keep drawn from seed
    (None: no dropout) as dropout_keep draws it, computed in float32; y and xhat in dtype; a and
    residual [..., n]."""
    y, xhat, rstd = _add_norm_outputs(residual, dtype)
    n_cols = residual.shape[-1]
    n_rows = residual.numel() // max(n_cols, 1)
    _check_dropout_size(residual.numel())
    if n_rows:
        rows, bands = _add_norm_bands(n_rows, ADD_NORM_FWD_BLOCKS)
        add_norm_fwd_kernel[(bands,)](
            a.contiguous(), bias, residual.contiguous(), seed if seed is not None else bias, gamma, beta, y, xhat, rstd,
            n_rows, n_cols, rows, threshold, scale, eps, HAS_DROPOUT=seed is not None,
            **_add_norm_launch(n_cols, ADD_NORM_FWD_BLOCKS))
    return y, xhat, rstd


add_norm.register_fake(lambda a, bias, residual, seed, threshold, scale, gamma, beta, eps, dtype:
                       _add_norm_outputs(residual, dtype))


def _add_norm_grads(xhat, a_dtype, residual_dtype):
    """Empty (da, dresidual, partial sums [bands, 3, n] in float32) of add_norm_backward."""
    n_cols = xhat.shape[-1]
    bands = _add_norm_bands(xhat.numel() // n_cols, ADD_NORM_BWD_BLOCKS)[1]
    return (torch.empty(xhat.shape, dtype=a_dtype, device=xhat.device),
            torch.empty(xhat.shape, dtype=residual_dtype, device=xhat.device),
            torch.empty(bands, 3, n_cols, dtype=torch.float32, device=xhat.device))


@torch.library.custom_op("roformer_mlm::add_norm_backward", mutates_args=())
def add_norm_backward(dy: Optional[torch.Tensor], dy_mm: Optional[torch.Tensor], xhat: torch.Tensor,
                      rstd: torch.Tensor, seed: Optional[torch.Tensor], threshold: int, gamma: torch.Tensor,
                      scale: float, a_dtype: torch.dtype,
                      residual_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(da, dresidual, partial sums [bands, 3, n] of dgamma, dbeta and dbias in float32) of add_norm;
    the gradient of y is dy + dy_mm (either may be None)."""
    da, dz, partial = _add_norm_grads(xhat, a_dtype, residual_dtype)
    n_cols = xhat.shape[-1]
    n_rows = xhat.numel() // n_cols
    present = dict(HAS_DY=dy is not None, HAS_DY_MM=dy_mm is not None, HAS_DROPOUT=seed is not None)
    dy, dy_mm, seed = (t.contiguous() if t is not None else xhat for t in (dy, dy_mm, seed))  # (xhat: never read)
    if n_rows:
        rows, bands = _add_norm_bands(n_rows, ADD_NORM_BWD_BLOCKS)
        add_norm_bwd_kernel[(bands,)](dy, dy_mm, xhat.contiguous(), rstd.contiguous(), seed, gamma, dz, da, partial,
                                      n_rows, n_cols, rows, threshold, scale, **present,
                                      **_add_norm_launch(n_cols, ADD_NORM_BWD_BLOCKS))
    return da, dz, partial


add_norm_backward.register_fake(lambda dy, dy_mm, xhat, rstd, seed, threshold, gamma, scale, a_dtype, residual_dtype:
                                _add_norm_grads(xhat, a_dtype, residual_dtype))


class BiasGELU(torch.autograd.Function):
    """gelu(h + bias), h a matmul's output without its bias, computed in float32 and rounded to h's
    dtype: one kernel each way."""

    @staticmethod
    def forward(ctx, h, bias):
        ctx.save_for_backward(h, bias)
        return bias_gelu(h, bias)

    @staticmethod
    def backward(ctx, dg):
        h, bias = ctx.saved_tensors
        dh, partial = bias_gelu_backward(dg, h, bias)
        return dh, partial.sum(0).to(bias.dtype)


class AddNormFunction(torch.autograd.Function):
    """y = LayerNorm((a + bias) * keep * scale + residual), a a matmul's output without its bias and
    keep drawn from seed (None: no dropout), y in dtype; returns (y, y) for the residual and the next
    matmul, the second a view of the first. One kernel each way."""

    @staticmethod
    def forward(ctx, a, bias, residual, seed, threshold, scale, gamma, beta, eps, dtype):
        y, xhat, rstd = add_norm(a, bias, residual, seed, threshold, scale, gamma, beta, eps, dtype)
        ctx.set_materialize_grads(False)  # the encoder's last output has one consumer
        ctx.save_for_backward(xhat, rstd, seed, gamma)
        ctx.threshold, ctx.scale, ctx.a_dtype, ctx.residual_dtype = threshold, scale, a.dtype, residual.dtype
        return y, y.view_as(y)

    @staticmethod
    def backward(ctx, dy, dy_mm):
        xhat, rstd, seed, gamma = ctx.saved_tensors
        da, dz, partial = add_norm_backward(dy, dy_mm, xhat, rstd, seed, ctx.threshold, gamma, ctx.scale, ctx.a_dtype,
                                            ctx.residual_dtype)
        dgamma, dbeta, dbias = partial.sum(0).unbind(0)
        return da, dbias, dz, None, None, None, dgamma, dbeta, None, None


# %%
# The MLM loss: cross-entropy over the vocabulary, one row per masked token
# --------------------------------------------------------------------------
# Compiled, Inductor turns F.cross_entropy(logits.float()) and the accuracy's argmax into two
# reductions over the rows of logits: at BERT-base's shape (2377 masked rows of 30528 bf16 logits,
# 145 MB) they took 0.17 ms forward and 0.29-0.34 ms backward on an H200, about 1 TB/s. The loss
# needs little: the forward reads each row once, keeping a running maximum and a running sum of
# exponentials rescaled as the maximum grows (the online softmax of FlashAttention), and the argmax,
# and writes three numbers a row (loss, log-sum-exp, argmax); the backward reads the row again and
# writes its gradient, (softmax - one_hot(label)) * dloss, with softmax = exp(logit - lse), as
# flash-attention's cross-entropy kernels do (Liger-Kernel's write the gradient in the forward, over
# the logits, and scale it in the backward). Alone they take 73 and 89 us there, where a copy of
# the logits takes 76 (the forward, a row per program, is bound by its loop rather than by bytes:
# results/05_ab.log N). The columns past n_classes (the decoder's padding, below) are no class:
# their gradient is 0. A label of IGNORE_INDEX (-100) counts for nothing, as in F.cross_entropy;
# any other label outside [0, n_classes) gives a NaN loss (F.cross_entropy raises, which needs the
# label on the host).
IGNORE_INDEX = -100
# Columns a program reads at a time (forward: a row per program; backward: a tile per program), from a sweep at
# BERT-base's shape on an H200 (results/05_ab.log N).
CROSS_ENTROPY_FWD_BLOCKS = dict(BLOCK=2048, num_warps=8)
CROSS_ENTROPY_BWD_BLOCKS = dict(BLOCK=4096, num_warps=8)


@triton.jit
def cross_entropy_fwd_kernel(logits_ptr, labels_ptr, loss_ptr, lse_ptr, argmax_ptr, n_classes, n_cols, ignore_index,
                             BLOCK: tl.constexpr):
    """For one row: loss = lse - logits[label] (0 if the label is ignore_index, NaN if it is out of
    range), lse = log(sum(exp(logits))) and the first column of the row's maximum, over n_classes.
    Each lane keeps its own running maximum m, sum of exp(logit - m) and argmax, one exponential a
    logit: exp(-|x - m|) is the new term if x <= m, else the factor for the old sum. The lanes meet once,
    at the end."""
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * n_cols
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], -3.4e38, tl.float32)  # finite: a lane with no logit yet adds exp(-inf) = 0, not NaN
    sum_exp, first = tl.zeros([BLOCK], tl.float32), cols
    for start in range(0, n_classes, BLOCK):
        x = tl.load(row_ptr + start + cols, mask=start + cols < n_classes, other=float("-inf")).to(tl.float32)
        bigger = x > m  # strictly: a lane keeps its first column of a tie
        e = tl.exp(-tl.abs(x - m))
        sum_exp = tl.where(bigger, sum_exp * e + 1.0, sum_exp + e)
        first = tl.where(bigger, start + cols, first)
        m = tl.maximum(m, x)
    row_max = tl.max(m, 0)
    lse = row_max + tl.log(tl.sum(sum_exp * tl.exp(m - row_max), 0))
    label = tl.load(labels_ptr + row)
    in_range = (label >= 0) & (label < n_classes)
    picked = tl.load(row_ptr + label, mask=in_range, other=0.0).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(label == ignore_index, 0.0, tl.where(in_range, lse - picked, float("nan"))))
    tl.store(lse_ptr + row, lse)
    tl.store(argmax_ptr + row, tl.min(tl.where(m == row_max, first, n_classes), 0).to(tl.int64))


@triton.jit
def cross_entropy_bwd_kernel(dloss_ptr, logits_ptr, lse_ptr, labels_ptr, dlogits_ptr, n_classes, n_cols, ignore_index,
                             BLOCK: tl.constexpr):
    """One tile of a row of dlogits = (exp(logits - lse) - one_hot(label)) * dloss, 0 past n_classes
    (up to n_cols) and in the rows whose label is ignore_index."""
    row, cols = tl.program_id(0), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    offs = row.to(tl.int64) * n_cols + cols
    x = tl.load(logits_ptr + offs, mask=cols < n_classes, other=float("-inf")).to(tl.float32)
    label = tl.load(labels_ptr + row)
    scale = tl.where(label == ignore_index, 0.0, tl.load(dloss_ptr + row))
    grad = (tl.exp(x - tl.load(lse_ptr + row)) - tl.where(cols == label, 1.0, 0.0)) * scale
    tl.store(dlogits_ptr + offs, grad.to(dlogits_ptr.dtype.element_ty), mask=cols < n_cols)


def _cross_entropy_outputs(logits):
    """Empty (loss, lse, argmax) of cross_entropy, a number per row of logits [rows, n_cols]."""
    rows = logits.shape[0]
    return (logits.new_empty(rows, dtype=torch.float32), logits.new_empty(rows, dtype=torch.float32),
            logits.new_empty(rows, dtype=torch.int64))


@torch.library.custom_op("roformer_mlm::cross_entropy", mutates_args=())
def cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                  n_classes: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, lse, argmax) of each row of logits [rows, n_cols] over its first n_classes columns, in
    float32 (argmax int64), against labels [rows] (IGNORE_INDEX: loss 0)."""
    if not 0 < n_classes <= logits.shape[-1]:
        raise ValueError(f"n_classes must be in [1, {logits.shape[-1]}] (the logits' width), got {n_classes}")
    loss, lse, argmax = _cross_entropy_outputs(logits)
    if logits.shape[0]:
        cross_entropy_fwd_kernel[(logits.shape[0],)](logits.contiguous(), labels.contiguous(), loss, lse, argmax,
                                                     n_classes, logits.shape[1], IGNORE_INDEX,
                                                     **CROSS_ENTROPY_FWD_BLOCKS)
    return loss, lse, argmax


cross_entropy.register_fake(lambda logits, labels, n_classes: _cross_entropy_outputs(logits))


@torch.library.custom_op("roformer_mlm::cross_entropy_backward", mutates_args=())
def cross_entropy_backward(dloss: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor,
                           n_classes: int) -> torch.Tensor:
    """The gradient of cross_entropy's loss with respect to logits [rows, n_cols], given dloss [rows]."""
    dlogits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if logits.numel():
        grid = (logits.shape[0], triton.cdiv(logits.shape[1], CROSS_ENTROPY_BWD_BLOCKS["BLOCK"]))
        cross_entropy_bwd_kernel[grid](dloss.contiguous(), logits.contiguous(), lse, labels.contiguous(), dlogits,
                                       n_classes, logits.shape[1], IGNORE_INDEX, **CROSS_ENTROPY_BWD_BLOCKS)
    return dlogits


cross_entropy_backward.register_fake(lambda dloss, logits, lse, labels, n_classes: torch.empty_like(logits))


class CrossEntropyFunction(torch.autograd.Function):
    """(loss, argmax) of each row of logits [rows, n_cols] over its first n_classes columns (see
    cross_entropy); differentiable in the loss."""

    @staticmethod
    def forward(ctx, logits, labels, n_classes):
        loss, lse, argmax = cross_entropy(logits, labels, n_classes)
        ctx.mark_non_differentiable(argmax)
        ctx.save_for_backward(logits, lse, labels)
        ctx.n_classes = n_classes
        return loss, argmax

    @staticmethod
    def backward(ctx, dloss, dargmax):
        logits, lse, labels = ctx.saved_tensors
        return cross_entropy_backward(dloss, logits, lse, labels, ctx.n_classes), None, None


# %%
# The model
# ---------
# Module and parameter names follow Hugging Face's RoFormer, so its checkpoints load as they are.


@dataclasses.dataclass
class RoFormerConfig:
    vocab_size: int = 260
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int = 1024
    embedding_size: int = 0  # 0: the hidden size (no projection)
    max_position_embeddings: int = 1536
    type_vocab_size: int = 2
    hidden_dropout_prob: float = 0.1
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 256

    @classmethod
    def from_hf(cls, hf):
        if hf.get("model_type") != "roformer":
            raise ValueError(f"not a RoFormer checkpoint: config.json says model_type={hf.get('model_type')!r}")
        if hf.get("rotary_value") or hf.get("is_decoder") or hf.get("hidden_act", "gelu") != "gelu":
            raise ValueError("only encoder RoFormers with rotary_value=False and hidden_act='gelu' are supported")
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in hf.items() if k in fields and v is not None})


class RoFormerSelfAttention(nn.Module):
    """Self-attention with RoPE on q and k. There is no dropout on the attention probabilities: 04's
    kernel has none, so every path leaves it out and the ladder compares like with like (the hidden
    dropout stays). Hugging Face's model, in eval mode or with attention_probs_dropout_prob=0, is
    the same function."""

    def __init__(self, cfg, attn):
        super().__init__()
        self.heads, self.attn = cfg.num_attention_heads, attn
        self.query, self.key, self.value = (nn.Linear(cfg.hidden_size, cfg.hidden_size) for _ in range(3))

    def forward(self, x, freqs, mask):
        """mask: [b, s], 1 = a real token, or None when there is no padding (packed text): every path
        then runs without one (SDPA can pick a fused backend, cuDNN on an H200; 04 its unmasked kernel)."""
        b, s, hidden = x.shape
        # One matmul for q, k and v (the checkpoint keeps three Linear layers): x is read, cast to bf16
        # under autocast and saved for the backward once instead of three times.
        weight = torch.cat((self.query.weight, self.key.weight, self.value.weight))
        bias = torch.cat((self.query.bias, self.key.bias, self.value.bias))
        qkv = F.linear(x, weight, bias).view(b, s, 3, self.heads, hidden // self.heads)
        if self.attn == "fused":  # 04: RoPE inside the attention kernel (fp16/bf16 only), q, k, v packed: the
            # backward writes their gradients as one tensor (three would be stacked, a copy). Against the triton
            # path, a compiled and graphed step at BERT-base's shape takes 0.8 ms less on an H100 (0.3 ms on an
            # H200): cuDNN's attention kernels are 0.6 ms faster than 04's, but 03's RoPE kernels (0.9 ms) and
            # the stack of SDPA's three gradients (0.6 ms) are gone (results/05_ab.log, E: one step by kernel).
            dtype = qkv.dtype if qkv.dtype in (torch.float16, torch.bfloat16) else torch.float16
            out = fused.rope_attention_qkvpacked(qkv.to(dtype), freqs, attention_mask=mask, interleaved=True)
            return out.to(qkv.dtype).reshape(b, s, hidden)
        q, k, v = qkv.unbind(2)
        if self.attn == "torch":  # eager PyTorch, as Hugging Face writes it
            q, k = (rope_bwd.rope_reference(t, freqs, "bshd", interleaved=True, compute_dtype=None) for t in (q, k))
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
            if mask is not None:
                scores = scores.masked_fill(~mask.bool()[:, None, None, :], torch.finfo(scores.dtype).min)
            out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
            return out.reshape(b, s, hidden)
        if self.attn == "naive":  # 01: three passes over memory
            q, k = (naive_rope.apply_rope_naive(t, freqs, "bshd", interleaved=True) for t in (q, k))
        elif torch.is_grad_enabled():  # 03: one kernel each way, differentiable
            q, k = rope_bwd.apply_rotary_pos_emb_qk(q, k, freqs, "bshd", interleaved=True)
        else:  # evaluation: 02's forward-only kernel
            q, k = rope_fwd.rope_fwd_qk(q, k, freqs, "bshd", interleaved=True)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=None if mask is None else mask.bool()[:, None, None, :])
        return out.transpose(1, 2).reshape(b, s, hidden)


class AddNorm(nn.Module):
    """dense -> dropout -> add the residual -> LayerNorm (RoFormer's post-LN "output" blocks). Returns
    (y, y for the next matmul): with own_kernels, y in the matmuls' dtype and a view of it (see
    AddNormFunction), else y itself twice."""

    def __init__(self, d_in, cfg, own_kernels=False):
        super().__init__()
        self.dense = nn.Linear(d_in, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = Dropout(cfg.hidden_dropout_prob)
        self.own_kernels = own_kernels

    def forward(self, x, residual):
        if not self.own_kernels:
            y = self.LayerNorm(self.dropout(self.dense(x)) + residual)
            return y, y
        seed, threshold, scale = self.dropout.seed_and_scale(residual.device)
        device = residual.device.type
        mm_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else residual.dtype
        norm = self.LayerNorm
        return AddNormFunction.apply(F.linear(x, self.dense.weight), self.dense.bias, residual, seed, threshold, scale,
                                     norm.weight, norm.bias, norm.eps, mm_dtype)


class RoFormerLayer(nn.Module):
    def __init__(self, cfg, attn):
        super().__init__()
        own_kernels = attn != "torch"  # 05's backward kernels for the blocks around attention
        self.attention = nn.Module()
        self.attention.self = RoFormerSelfAttention(cfg, attn)
        self.attention.output = AddNorm(cfg.hidden_size, cfg, own_kernels)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.output = AddNorm(cfg.intermediate_size, cfg, own_kernels)
        self.own_kernels = own_kernels

    def forward(self, x, freqs, mask, x_mm=None):
        """x: the layer's input; x_mm: the same for the matmuls (AddNorm's second output), or None."""
        x_mm = x if x_mm is None else x_mm
        x, x_mm = self.attention.output(self.attention.self(x_mm, freqs, mask), x)
        dense = self.intermediate.dense
        h = BiasGELU.apply(F.linear(x_mm, dense.weight), dense.bias) if self.own_kernels else F.gelu(dense(x_mm))
        return self.output(h, x)


class _Encoder(nn.Module):
    """What the CUDA graphs capture: every encoder layer, on a batch without padding (no mask)."""

    def __init__(self, layers, freqs):
        super().__init__()
        self.layers, self.freqs = layers, freqs

    def forward(self, x):
        x_mm = None
        for layer in self.layers:
            x, x_mm = layer(x, self.freqs, None, x_mm)
        return x


@torch._dynamo.disable
def _replay(replay, x):
    """The encoder's CUDA graphs, replayed as they are: torch.compile of the whole model stops here and
    goes on after (the head, whose shapes change with the number of masked tokens, stays compiled)."""
    return replay(x)


def capture_cuda_graphs(model, batch_size, seq_len, compiled=False):
    """--cuda-graphs: capture the encoder's forward and its backward as two CUDA graphs
    (torch.cuda.make_graphed_callables), compiled by Inductor first with --compile. Every eager op
    costs the host microseconds, and every call of 03's and 04's kernels more (argument checks,
    Triton's launcher): a small model waits for the host, and a replay issues the encoder's hundreds
    of kernels in one call. Graphs keep the shapes they were captured with: batches with padding,
    evaluation and other shapes run the layers as usual, on the same weights."""
    shape = (batch_size, seq_len, model.cfg.hidden_size)
    dtype = torch.bfloat16 if model.own_kernels else torch.float32  # the embeddings' output under autocast
    rng = torch.cuda.get_rng_state()
    sample = torch.zeros(shape, device=model.freqs.device, dtype=dtype, requires_grad=True)
    # The warm-up passes run on a side stream and make the parameters' AccumulateGrad nodes there; recent PyTorch
    # then warns once a process that their stream is not the replays' (older versions have no such warning or
    # switch). The gradients are the eager ones (tested).
    silence = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
    if silence is not None:
        silence(False)
    # A graph freed while another is being captured breaks the capture, and graphed modules are freed only by
    # the garbage collector (they refer to themselves): collect now, and not during the capture.
    gc.collect()
    gc.disable()
    try:
        encoder = _Encoder(model.roformer.encoder.layer, model.freqs)
        # Compiled as one graph rather than layer by layer, Inductor also fuses across the layers' seams (a
        # layer's bf16 cast of its input into the LayerNorm before it). The graphs are made of a plain module
        # around the compiled one: handed the compiled module itself, the replays ran the layers uncompiled.
        encoder = nn.Sequential(torch.compile(encoder)) if compiled else encoder
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):  # graphs need autocast's cache off
            replay = torch.cuda.make_graphed_callables(encoder, (sample,))
    finally:
        gc.enable()
    torch.cuda.set_rng_state(rng)  # the warm-up passes drew dropout masks; a resumed run must not depend on that
    model.graphed = (replay, shape, dtype)  # a tuple: not registered as a submodule, the state dict is unchanged
    # A replay hands out its weight gradients in the graph's own buffers, which the next replay overwrites. A
    # parameter without a .grad would adopt such a buffer as its .grad, and with gradient accumulation the
    # second micro-batch would overwrite the first's (tests/test_05 catches it). So every .grad starts
    # allocated, and a loop that accumulates zeroes it in place (zero_grad(set_to_none=False)). With one
    # micro-batch a step, the optimizer has read the adopted buffer before the next replay.
    for param in model.parameters():
        param.grad = torch.zeros_like(param)


class RoFormerForMaskedLM(nn.Module):
    def __init__(self, cfg, attn="torch"):
        super().__init__()
        if attn not in ATTN_PATHS:
            raise ValueError(f"attn must be one of {ATTN_PATHS}, got {attn!r}")
        self.cfg, emb = cfg, cfg.embedding_size or cfg.hidden_size
        self.own_kernels = attn != "torch"
        self.roformer = nn.Module()
        e = self.roformer.embeddings = nn.Module()
        e.word_embeddings = nn.Embedding(cfg.vocab_size, emb, padding_idx=cfg.pad_token_id)
        e.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, emb)
        e.LayerNorm, e.dropout = nn.LayerNorm(emb, eps=cfg.layer_norm_eps), Dropout(cfg.hidden_dropout_prob)
        if emb != cfg.hidden_size:
            self.roformer.embeddings_project = nn.Linear(emb, cfg.hidden_size)
        self.roformer.encoder = nn.Module()
        self.roformer.encoder.layer = nn.ModuleList(RoFormerLayer(cfg, attn) for _ in range(cfg.num_hidden_layers))
        self.cls = nn.Module()
        p = self.cls.predictions = nn.Module()
        p.transform = nn.Module()
        p.transform.dense, p.transform.LayerNorm = nn.Linear(cfg.hidden_size, emb), nn.LayerNorm(emb, eps=cfg.layer_norm_eps)
        p.decoder = nn.Linear(emb, cfg.vocab_size)
        p.decoder.weight = e.word_embeddings.weight  # tied
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.graphed = None  # (replay, input shape, input dtype) once capture_cuda_graphs has run
        self.register_buffer("freqs", rope_bwd.rope_freqs(cfg.max_position_embeddings, head_dim, interleaved=True),
                             persistent=False)  # RoFormer's sinusoidal angles, base 10000, interleaved pairs
        self.apply(self._init_weights)

    def _init_weights(self, module):  # BERT's: normal(0, 0.02), zero biases, unit LayerNorm
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None, positions=None):
        """Logits [b, s, vocab] without labels; with labels (-100 = not masked): (loss, accuracy), the
        head run on the masked positions only (the loss needs nothing else). attention_mask: [b, s],
        1 = a real token, 0 = padding; None = no padding. positions: masked_positions(labels), when the
        caller made the labels on the host and has them there (see masked_positions)."""
        b, s = input_ids.shape
        if s > self.freqs.shape[0]:
            raise ValueError(f"sequence length {s} is over max_position_embeddings = {self.freqs.shape[0]}")
        e = self.roformer.embeddings
        types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
        table = e.token_type_embeddings.weight
        if self.own_kernels and table.shape[0] <= 8:
            # BERT has two token types. An embedding's backward adds each token's gradient onto its row of
            # the table with atomics: at BERT-base's shape all 16384 onto the same 768 addresses, one after
            # the other. As a sum of rows where the type matches, the rows' gradients are column sums: the
            # embeddings' backward took 0.22 ms on an H200, 0.14 ms so (results/05_ab.log N).
            x = e.word_embeddings(input_ids) + sum(torch.where((types == t)[..., None], table[t], 0.0)
                                                   for t in range(table.shape[0]))
        else:
            x = e.word_embeddings(input_ids) + e.token_type_embeddings(types)
        x = e.dropout(e.LayerNorm(x))
        if hasattr(self.roformer, "embeddings_project"):
            x = self.roformer.embeddings_project(x)
        if self.own_kernels and torch.is_autocast_enabled(x.device.type):  # AddNorm's stream dtype from here on
            x = x.to(torch.get_autocast_dtype(x.device.type))
        replay, shape, dtype = self.graphed or (None, None, None)
        if replay is not None and attention_mask is None and self.training and torch.is_grad_enabled() and x.shape == shape \
                and x.dtype == dtype:
            x = _replay(replay, x)
        else:
            x_mm = None
            for layer in self.roformer.encoder.layer:
                x, x_mm = layer(x, self.freqs, attention_mask, x_mm)
        if labels is not None:
            if positions is None:
                positions = masked_positions(labels)
            x, labels = x.flatten(0, 1)[positions], labels.flatten()[positions]
        p = self.cls.predictions
        h = p.transform.LayerNorm(F.gelu(p.transform.dense(x)))
        # The decoder's rows are padded to a multiple of 64 for its matmuls, as nanoGPT pads GPT-2's
        # vocabulary (50257 -> 50304); the loss kernels read the padded logits as they are (n_classes =
        # vocab), logits are returned sliced back. Unpadded, a row of 30522 bf16 logits takes 61044
        # bytes, not a multiple of 16, and cuBLAS falls back to kernels without Hopper's TMA loads:
        # 480 us for each of the head's three matmuls on an H200, against 170 padded. Inductor pads
        # them itself when every shape is static, as in --bench's step, but not with the masked rows'
        # number dynamic, as training marks it: there this makes a compiled step 0.2-0.3 ms faster on
        # an H200 (results/05_ab.log M). Compiled, the padding rides on the weight's cast.
        vocab = p.decoder.weight.shape[0]
        pad = -vocab % 64
        logits = F.linear(h, F.pad(p.decoder.weight, (0, 0, 0, pad)), F.pad(p.decoder.bias, (0, pad)))
        if labels is None:
            return logits[..., :vocab]
        if self.own_kernels:
            loss, argmax = CrossEntropyFunction.apply(logits, labels, vocab)
            return loss.sum() / (labels != IGNORE_INDEX).sum(), (argmax == labels).float().mean()
        logits = logits[..., :vocab]
        return F.cross_entropy(logits.float(), labels), (logits.argmax(-1) == labels).float().mean()


def load_hf_checkpoint(path, attn):
    """A Hugging Face RoFormer directory (config.json + model.safetensors or pytorch_model.bin)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"--init-from {path}: no config.json there")
    with open(os.path.join(path, "config.json")) as f:
        model = RoFormerForMaskedLM(RoFormerConfig.from_hf(json.load(f)), attn)
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise SystemExit("model.safetensors needs the safetensors package: pip install safetensors")
        state = load_file(os.path.join(path, "model.safetensors"))
    elif os.path.isfile(os.path.join(path, "pytorch_model.bin")):
        state = torch.load(os.path.join(path, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"--init-from {path}: no model.safetensors or pytorch_model.bin")
    state = {k: v for k, v in state.items() if "embed_positions" not in k}  # sinusoidal: recomputed
    state.setdefault("cls.predictions.decoder.bias", state.get("cls.predictions.bias"))
    state.pop("cls.predictions.bias", None)
    state.setdefault("cls.predictions.decoder.weight", state["roformer.embeddings.word_embeddings.weight"])
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match RoFormerForMaskedLM: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model


# %%
# Data: text to packed, masked sequences
# --------------------------------------
# Bytes are the default tokens (256 of them, then [PAD] [CLS] [SEP] [MASK]). Documents stream in
# order, are concatenated with [SEP] and cut into [CLS] + (seq_len - 2) tokens + [SEP]; the
# last sequence is padded. Sequence i goes to the held-out set if i % 50 == 0, else to rank
# i % world_size's training stream. The position in that stream is what a checkpoint stores.

PAD, CLS, SEP, MASK = 256, 257, 258, 259


class ByteTokenizer:
    vocab_size, pad, cls, sep, mask = 260, PAD, CLS, SEP, MASK
    n_regular = 256  # masking's random replacements are drawn from ids below this (bytes, no specials)

    def encode(self, text):
        return list(text.encode("utf-8", errors="replace"))


class WordPieceTokenizer:
    """A checkpoint's vocab.txt, through the `tokenizers` package."""

    def __init__(self, vocab_path):
        try:
            from tokenizers import BertWordPieceTokenizer
        except ImportError:
            raise SystemExit("a checkpoint's vocab.txt needs the tokenizers package: pip install tokenizers")
        self.tok = BertWordPieceTokenizer(vocab_path, lowercase=False)
        ids = {t: self.tok.token_to_id(t) for t in ("[PAD]", "[CLS]", "[SEP]", "[MASK]")}
        self.vocab_size, (self.pad, self.cls, self.sep, self.mask) = self.tok.get_vocab_size(), ids.values()
        self.n_regular = self.vocab_size  # as BERT: a random replacement may be any id

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids


def documents(path, block_chars=1 << 20):
    """Texts from a file, a folder of .txt, JSON lines with a "text" field, or (path None) the Python
    standard library's own source, found at run time. Streamed: pieces of at most about block_chars
    characters (whole lines), then None at the end of each document."""
    if path is None:
        root = sysconfig.get_paths()["stdlib"]
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
                       if f.endswith(".py") and "site-packages" not in d)
    elif os.path.isdir(path):
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".txt"))
    elif os.path.isfile(path):
        files = [path]
    else:
        raise FileNotFoundError(f"--data {path}: no such file or folder")
    if not files:
        raise FileNotFoundError(f"--data {path}: no .txt files found")
    for name in files:
        with open(name, encoding="utf-8", errors="replace") as f:
            if name.endswith((".jsonl", ".json")):
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            yield json.loads(line)["text"]
                        except (ValueError, KeyError, TypeError):
                            raise ValueError(f"{name}, line {n}: not a JSON object with a 'text' field")
                        yield None
                continue
            piece, size = [], 0
            for line in f:  # a file of any size, never read whole
                piece.append(line)
                size += len(line)
                if size >= block_chars:
                    yield "".join(piece)
                    piece, size = [], 0
            yield "".join(piece)
            yield None


def sequences(data, tokenizer, seq_len):
    """Packed token sequences of exactly seq_len (the last one padded) and their real lengths. The
    tokens wait in one flat int32 array and are cut out with slices done in C: cutting a Python list
    (buf = buf[body:]) copies the whole rest of the piece for every sequence, and torch.tensor on
    nested lists converts one Python int at a time."""
    body, buf, start = seq_len - 2, array.array("i"), 0
    cls, sep = array.array("i", [tokenizer.cls]), array.array("i", [tokenizer.sep])
    for piece in documents(data):
        if piece is None:  # the end of a document
            buf.append(tokenizer.sep)
        else:
            buf.extend(tokenizer.encode(piece))
        while len(buf) - start >= body:
            yield cls + buf[start:start + body] + sep, seq_len
            start += body
        del buf[:start]  # fewer than `body` tokens are left: cheap to move
        start = 0
    if buf:
        yield cls + buf + sep + array.array("i", [tokenizer.pad] * (body - len(buf))), len(buf) + 2


def batches(data, tokenizer, seq_len, batch_size, rank, world, start=0, held_out=False):
    """Endless batches (input_ids, attention_mask) of this rank's training sequences, after skipping
    its first `start` (a resumed run's position, across epochs); held_out=True: the held-out
    sequences, one pass."""
    to_skip = start
    while True:
        ids, lengths, found, train_index = array.array("i"), [], False, -1
        for i, (seq, n) in enumerate(sequences(data, tokenizer, seq_len)):
            if (i % 50 == 0) != held_out:
                continue
            if not held_out:
                train_index += 1
                if train_index % world != rank:
                    continue
            found = True
            if to_skip:
                to_skip -= 1
                continue
            ids.extend(seq)
            lengths.append(n)
            if len(lengths) == batch_size:
                yield (torch.frombuffer(ids, dtype=torch.int32).view(batch_size, seq_len).long(),
                       torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None])
                ids, lengths = array.array("i"), []
        if held_out:
            return
        if not found:
            raise ValueError(f"--data has too little text: rank {rank} of {world} gets no sequence of {seq_len} tokens")


def to_device(batch_tensor, device):
    """A tensor of the host's batch, copied to the device without making the host wait. From pageable
    memory a copy to the GPU ends in a stream synchronize, so the host could not queue the next
    step's work while the GPU runs this one; from pinned (page-locked) memory it is asynchronous, as in
    nanoGPT. PyTorch keeps the pinned block from reuse until the copy is done."""
    if device.type != "cuda":
        return batch_tensor.to(device)
    return batch_tensor.pin_memory().to(device, non_blocking=True)


def device_mask(attention_mask, device):
    """The batch's padding mask on the device, or None when it has no padding: packed text has none
    but in its last sequence, and Hugging Face drops an all-ones mask the same way for SDPA. The
    check costs nothing: the mask is still on the host."""
    return None if bool(attention_mask.all()) else to_device(attention_mask, device)


def masked_positions(labels):
    """Flat indices of the labelled tokens (labels != -100), the rows the MLM head runs on. Their number
    sets the shapes that follow, so finding them on the GPU makes the host wait for it, and the host can
    no longer queue work ahead of the GPU across steps. Training finds them on the host, where it made
    the labels. (Indexing with the boolean mask itself waits three times: twice in the forward, once in
    the backward.)"""
    return (labels.flatten() != -100).nonzero().squeeze(1)


def mask_tokens(input_ids, attention_mask, tokenizer, mask_prob, generator):
    """BERT masking: mask_prob of the real, non-special tokens are chosen; of those 80% become
    [MASK], 10% a random token, 10% stay. Returns (inputs, labels) with -100 where not chosen."""
    special = (input_ids == tokenizer.cls) | (input_ids == tokenizer.sep) | ~attention_mask
    chosen = (torch.rand(input_ids.shape, generator=generator) < mask_prob) & ~special
    labels = torch.where(chosen, input_ids, -100)
    r = torch.rand(input_ids.shape, generator=generator)
    random_tokens = torch.randint(0, tokenizer.n_regular, input_ids.shape, generator=generator)
    inputs = torch.where(chosen & (r < 0.8), tokenizer.mask, input_ids)
    inputs = torch.where(chosen & (r >= 0.8) & (r < 0.9), random_tokens, inputs)
    return inputs, labels


# %%
# Training
# --------


def parse_args(argv=None):
    on_gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description="Pretrain a RoFormer masked LM on the collection's kernels.")
    p.add_argument("--attn", choices=ATTN_PATHS, default="fused" if on_gpu else "torch",
                   help="attention path (default: fused on a GPU; torch on a CPU, where Triton is interpreted)")
    p.add_argument("--data", default=None, help="text file, folder of .txt, or .jsonl with a 'text' field "
                   "(default: the Python standard library's source)")
    p.add_argument("--out", default="out-roformer", help="folder for checkpoints, logs and the plot")
    p.add_argument("--init-from", default=None, help="a Hugging Face RoFormer checkpoint directory")
    p.add_argument("--resume", action="store_true", help="continue from --out/ckpt.pt (from ckpt-prev.pt, with a "
                   "warning, when ckpt.pt is missing or unreadable)")
    p.add_argument("--seq-len", type=int, default=512 if on_gpu else 64)
    p.add_argument("--batch-size", type=int, default=32 if on_gpu else 4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--layers", type=int, default=6 if on_gpu else 2)
    p.add_argument("--hidden", type=int, default=512 if on_gpu else 64)
    p.add_argument("--heads", type=int, default=8 if on_gpu else 2)
    p.add_argument("--max-steps", type=int, default=2000 if on_gpu else 30)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=100 if on_gpu else 5)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--mask-prob", type=float, default=0.15)
    p.add_argument("--log-interval", type=int, default=20 if on_gpu else 5)
    p.add_argument("--eval-interval", type=int, default=200 if on_gpu else 10)
    p.add_argument("--eval-batches", type=int, default=20 if on_gpu else 2)
    p.add_argument("--ckpt-interval", type=int, default=500 if on_gpu else 10)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model as a whole (default: on with a GPU, off on the CPU)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None, help="replay the "
                   "encoder's forward and backward from CUDA graphs, so that the host's per-op cost no longer paces "
                   "the GPU (default: on with a GPU, off under torchrun; needs a GPU)")
    p.add_argument("--bench", action="store_true", help="time training steps of a BERT-base-shaped model on random "
                   "tokens for every --attn path and Hugging Face's RoFormer (when installed), eager and compiled "
                   "(and with --cuda-graphs, both with graphs), then exit")
    p.add_argument("--bench-paths", default=None, metavar="P,Q", help="--bench only these, e.g. fused,fused+compile "
                   "(a path, then +compile, +graphs or +compile+graphs; hf is Hugging Face's model)")
    p.add_argument("--bench-profile", action="store_true", help="--bench: also profile one step of each path and "
                   "print its GPU time by kernel family (matmuls, our kernels, Inductor's fused kernels, the rest; "
                   "on the CPU, its ops' CPU time)")
    p.add_argument("--bench-steps", type=int, default=20 if on_gpu else 1, help="timed steps per path and round")
    p.add_argument("--bench-rounds", type=int, default=2 if on_gpu else 1,
                   help="rounds over all paths, in alternating order (clock or heat drift then hits every path alike)")
    p.add_argument("--compare", default=None, metavar="A,B", help="train twice from the same seed with two --attn "
                   "paths (e.g. torch,fused) and print the largest difference of their loss curves")
    p.add_argument("--stop-after", type=int, default=0,
                   help="stop (with a checkpoint) after this many steps of this invocation, as an interruption "
                        "would; --resume continues on the same schedule")
    args = p.parse_args(argv)
    if args.seq_len < 8:
        p.error(f"--seq-len must be at least 8, got {args.seq_len}")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    if args.cuda_graphs and not on_gpu:
        p.error("--cuda-graphs needs a GPU (CUDA graphs); this machine has none")
    if args.compile is None:
        args.compile = on_gpu
    if args.cuda_graphs is None:  # under torchrun, off: DDP with the graphs is not measured here
        args.cuda_graphs = on_gpu and "RANK" not in os.environ
    if args.data is not None and not os.path.exists(args.data):
        p.error(f"--data {args.data}: no such file or folder")
    if args.data is not None and os.path.isdir(args.data) and not any(
            f.endswith(".txt") for _, _, fs in os.walk(args.data) for f in fs):
        p.error(f"--data {args.data}: no .txt files in this folder")
    return args


def lr_at(step, args):
    """Linear warmup to --lr, then linear decay to 0 at --max-steps."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * max(0.0, (args.max_steps - step) / max(1, args.max_steps - args.warmup))


def flops_per_token(n_params, cfg, seq_len):
    """Model FLOPs of one trained token: 6 per parameter (forward + backward) plus attention's
    QK^T and PV, 12 * layers * hidden * seq_len (PaLM's appendix B)."""
    return 6 * n_params + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq_len


def matmul_tflops(device):
    """The yardstick for MFU, measured in this run: a bf16 8192^3 matmul's TF/s (None on the CPU)."""
    if device.type != "cuda":
        return None
    gen = torch.Generator(device).manual_seed(0)  # its own: the run's RNG stream (dropout) stays untouched
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    end.synchronize()
    return 2 * 8192**3 * 20 / (start.elapsed_time(end) * 1e-3) / 1e12


@contextlib.contextmanager
def out_of_memory_advice(args):
    """A batch that does not fit gets a clear message, not a stack trace from deep inside autograd."""
    try:
        yield
    except torch.cuda.OutOfMemoryError:
        raise SystemExit(f"out of GPU memory with --batch-size {args.batch_size} and --seq-len {args.seq_len}: "
                         f"lower --batch-size and raise --grad-accum to keep the tokens per step") from None


# %%
# Checkpoints
# -----------
# Saving: write a temporary file, flush it and fsync it (its bytes are on the disk), rename the
# current checkpoint to ckpt-prev.pt, rename the new one to ckpt.pt, fsync the folder (the renames
# are on the disk). A kill or a crash at any point leaves ckpt.pt or ckpt-prev.pt whole; a broken
# latest checkpoint costs at most one --ckpt-interval.
# Loading: torch.load(weights_only=True), PyTorch's default since 2.6, which unpickles tensors,
# numbers, strings and containers and refuses any other object: a checkpoint from elsewhere runs no
# code. So everything saved is of those types (the RNG states are byte tensors, Python's is a tuple
# of ints). A ckpt.pt that is missing or cannot be read is replaced, with a warning, by a readable
# ckpt-prev.pt (the run continues from one interval earlier, as an unattended restart needs); a
# checkpoint of another model configuration is refused, never loaded halfway.


def save_atomic(obj, path):
    """Write obj to path durably and atomically, keeping the checkpoint it replaces as <path>-prev."""
    tmp, folder = path + ".tmp", os.path.dirname(os.path.abspath(path))
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(path):
        os.replace(path, previous_checkpoint(path))
    os.replace(tmp, path)
    if hasattr(os, "O_DIRECTORY"):  # POSIX: make the renames durable too
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def previous_checkpoint(path):
    root, ext = os.path.splitext(path)
    return f"{root}-prev{ext}"


def read_checkpoint(path, config):
    """The checkpoint at path (or, failing that, the previous one), checked against the model config;
    anything wrong ends the run with one line naming the file."""
    def read(p):
        if not os.path.isfile(p):
            return None, "no such file"
        try:
            ckpt = torch.load(p, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:  # weights_only refused an object, or the pickle is broken
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return None, f"not loadable as plain tensors and values (weights_only=True): {first[:200]}"
        except Exception as e:  # noqa: BLE001  (truncated or corrupt: EOFError, RuntimeError, OSError, zip errors)
            return None, f"unreadable ({type(e).__name__}: {str(e).strip()[:200] or 'no detail'}); truncated or corrupt?"
        keys = {"model", "optimizer", "step", "seen", "rng", "history", "config"}
        if not isinstance(ckpt, dict) or not keys <= set(ckpt):
            return None, f"not a checkpoint of this script (it needs the entries {sorted(keys)})"
        return ckpt, None
    ckpt, problem = read(path)
    if problem:
        prev = previous_checkpoint(path)
        ckpt_prev, problem_prev = read(prev)
        if problem_prev:
            raise SystemExit(f"--resume: {path}: {problem}" + (f"; {prev}: {problem_prev}" if os.path.exists(prev)
                                                                else ""))
        print(f"WARNING --resume: {path}: {problem}. Resuming from the previous checkpoint {prev} "
              f"(step {ckpt_prev['step']}) instead.", flush=True)
        path, ckpt = prev, ckpt_prev
    if ckpt["config"] != config:
        diff = ", ".join(f"{k} {ckpt['config'].get(k)!r} there, {v!r} here" for k, v in config.items()
                         if ckpt["config"].get(k) != v)
        raise SystemExit(f"--resume: {path} was written for another model configuration ({diff})")
    return ckpt


@torch.no_grad()
def evaluate(model, eval_batches, args, tokenizer, device, autocast):
    """Held-out loss and masked accuracy, with the same masks at every evaluation."""
    model.eval()
    losses, accs = [], []
    gen = torch.Generator().manual_seed(args.seed + 1)
    for ids, mask in eval_batches:
        inputs, labels = mask_tokens(ids, mask, tokenizer, args.mask_prob, gen)
        with autocast:
            loss, acc = model(to_device(inputs, device), device_mask(mask, device), labels=to_device(labels, device),
                              positions=to_device(masked_positions(labels), device))
        losses.append(loss.item())
        accs.append(acc.item())
    model.train()
    return sum(losses) / len(losses), sum(accs) / len(accs)


def setup_distributed():
    """(ddp, rank, world, device): torchrun sets RANK; NCCL on GPUs, gloo on the CPU."""
    if "RANK" not in os.environ:
        return False, 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return True, torch.distributed.get_rank(), torch.distributed.get_world_size(), device


def main(argv=None):
    args = parse_args(argv)
    if args.compare:
        return compare(args, argv)
    ddp, rank, world, device = setup_distributed()
    result = (bench if args.bench else train)(args, ddp, rank, world, device)
    if ddp:
        # Leave together, and only once nothing holds the group: DDP's reducer keeps a reference to it, and a
        # gloo group torn down while one rank is still working (or at interpreter exit) can abort the process.
        torch.distributed.barrier()
        gc.collect()
        torch.distributed.destroy_process_group()
    return result


def train(args, ddp, rank, world, device):
    """The training loop; returns the logged history (list of dicts)."""
    master = rank == 0
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)

    if args.init_from:
        model = load_hf_checkpoint(args.init_from, args.attn)
        vocab = os.path.join(args.init_from, "vocab.txt")
        tokenizer = WordPieceTokenizer(vocab) if os.path.isfile(vocab) else ByteTokenizer()
    else:
        tokenizer = ByteTokenizer()
        cfg = RoFormerConfig(vocab_size=tokenizer.vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
                             num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
                             max_position_embeddings=max(args.seq_len, 512), pad_token_id=tokenizer.pad)
        model = RoFormerForMaskedLM(cfg, args.attn)
    if args.seq_len > model.freqs.shape[0]:
        raise SystemExit(f"--seq-len {args.seq_len} is over the model's angle table ({model.freqs.shape[0]} positions)")
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]  # no decay on LayerNorm weights and biases
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.98),
                                  eps=1e-6, fused=device.type == "cuda")
    os.makedirs(args.out, exist_ok=True)
    ckpt_path, step, seen, history = os.path.join(args.out, "ckpt.pt"), 0, [0] * world, []
    if args.resume:
        ckpt = read_checkpoint(ckpt_path, dataclasses.asdict(model.cfg))
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step, seen, history = ckpt["step"], ckpt["seen"], ckpt["history"]
        if len(seen) != world:
            raise SystemExit(f"--resume: the checkpoint was written by {len(seen)} ranks, this run has {world}")
        torch.set_rng_state(ckpt["rng"][rank]["torch"])  # (loaded to the CPU, where both setters want them)
        random.setstate(ckpt["rng"][rank]["python"])
        if device.type == "cuda":
            torch.cuda.set_rng_state(ckpt["rng"][rank]["cuda"])
    matmul_rate = matmul_tflops(device)
    if device.type == "cuda":  # the peak printed below is this run's (the capture's included: a replay allocates
        torch.cuda.reset_peak_memory_stats(device)  # nothing, its activations live in the graphs' own pool)
    if args.cuda_graphs:  # after loading a checkpoint (the graphs read the weights in place), before DDP
        start = time.perf_counter()
        capture_cuda_graphs(model, args.batch_size, args.seq_len, compiled=args.compile)
        if master:
            print(f"CUDA graphs: the encoder captured in {time.perf_counter() - start:.1f} s"
                  + (", its compilation included" if args.compile else ""), flush=True)
    raw_model = model  # saved, evaluated and checkpointed as it is: no DDP "module." or compiled "_orig_mod." prefix
    if ddp:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                                    gradient_as_bucket_view=True)  # no copy into buckets
    if args.compile:
        model = compile_model(model, device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    train_batches = batches(args.data, tokenizer, args.seq_len, args.batch_size, rank, world, start=seen[rank])
    eval_batches = list(itertools.islice(batches(args.data, tokenizer, args.seq_len, args.batch_size, 0, 1,
                                                 held_out=True), args.eval_batches))  # read once, kept
    if not eval_batches:
        raise SystemExit(f"--data has too little text for one held-out batch of {args.batch_size} x {args.seq_len}")
    if master:
        print(f"RoFormer MLM: {n_params / 1e6:.2f}M parameters, attn={args.attn}, {world} rank(s), device {device}, "
              f"seq_len {args.seq_len}, batch {args.batch_size} x {args.grad_accum} accumulation x {world}"
              + (", the encoder replayed from CUDA graphs" if args.cuda_graphs else "")
              + (", torch.compile" + (" (aot_eager on the CPU: traced, not code-generated)" if device.type == "cpu" else "")
                 if args.compile else ""))
        counts = torch.bincount(torch.cat([ids.flatten() for ids, _ in eval_batches]), minlength=tokenizer.vocab_size)
        counts[[tokenizer.pad, tokenizer.cls, tokenizer.sep]] = 0
        print(f"baseline: always predicting the most frequent token ({counts.argmax().item()}) is right on "
              f"{counts.max().item() / counts.sum().item():.1%} of tokens")
    if master and matmul_rate:
        print(f"MFU below: model FLOPs over the bf16 matmul rate measured now ({matmul_rate:.0f} TF/s)")
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * world
    t0, stop_at = time.perf_counter(), min(args.max_steps, step + args.stop_after if args.stop_after else args.max_steps)
    first_step, timed_steps = step, 0
    while step < stop_at:
        lr = lr_at(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 101 + rank)  # masks depend on the step
        loss_sum, acc_sum = 0.0, 0.0
        for micro in range(args.grad_accum):
            ids, mask = next(train_batches)
            seen = [n + args.batch_size for n in seen]  # every rank reads a batch: no need to ask the others
            inputs, labels = mask_tokens(ids, mask, tokenizer, args.mask_prob, gen)
            positions = to_device(masked_positions(labels), device)
            if args.compile:  # their number changes every batch: one graph for all, not a recompile each time
                torch._dynamo.maybe_mark_dynamic(positions, 0)
            # DDP averages the gradients across ranks on the last micro-step only
            with contextlib.nullcontext() if not ddp or micro == args.grad_accum - 1 else model.no_sync(), \
                    out_of_memory_advice(args):
                with autocast:
                    loss, acc = model(to_device(inputs, device), device_mask(mask, device),
                                      labels=to_device(labels, device), positions=positions)
                (loss / args.grad_accum).backward()
            # summed on the device: a .item() here would make the host wait for the GPU every micro-step
            loss_sum, acc_sum = loss_sum + loss.detach() / args.grad_accum, acc_sum + acc / args.grad_accum
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=not (args.cuda_graphs and args.grad_accum > 1))  # see capture_cuda_graphs
        step, timed_steps = step + 1, timed_steps + 1
        if args.compile and step == first_step + 1:  # the first call traced and compiled forward and backward
            loss_sum.item()
            first_step_s = time.perf_counter() - t0
            if master:
                print(f"torch.compile: the first step took {first_step_s:.1f} s, compilation included", flush=True)
            t0, timed_steps = time.perf_counter(), 0
        if master and sys.stdout.isatty():  # a one-line progress bar between log lines
            print(f"\r[{'#' * (30 * step // args.max_steps):<30}] step {step}/{args.max_steps}", end="", flush=True)
        if master and (step % args.log_interval == 0 or step == args.max_steps):
            loss_sum, acc_sum = loss_sum.item(), acc_sum.item()  # waits for the GPU: the time below is its time
            dt = (time.perf_counter() - t0) / timed_steps if timed_steps else first_step_s  # (logged at step 1)
            t0, timed_steps = time.perf_counter(), 0
            tflops = flops_per_token(n_params, raw_model.cfg, args.seq_len) * tokens_per_step / dt / 1e12
            mfu = f"{tflops / matmul_rate:.1%}" if matmul_rate else "n/a"
            mem = f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if device.type == "cuda" else "n/a"
            row = dict(step=step, loss=loss_sum, acc=acc_sum, lr=lr, ms=dt * 1e3, tok_s=tokens_per_step / dt)
            print(f"\rstep {step:5d} | loss {loss_sum:.4f} | masked acc {acc_sum:.3f} | lr {lr:.2e} | {dt * 1e3:.0f} ms/step "
                  f"| {tokens_per_step / dt:.0f} tok/s | MFU {mfu} | peak {mem}", flush=True)
            history.append(row)
        if master and (step % args.eval_interval == 0 or step == args.max_steps):
            val_loss, val_acc = evaluate(raw_model, eval_batches, args, tokenizer, device, autocast)
            print(f"step {step:5d} | held-out loss {val_loss:.4f} | held-out masked acc {val_acc:.3f}", flush=True)
            history.append(dict(step=step, val_loss=val_loss, val_acc=val_acc))
        if step % args.ckpt_interval == 0 or step == stop_at:
            rng = dict(torch=torch.get_rng_state(), python=random.getstate(),
                       cuda=torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
            rngs = [None] * world
            if ddp:
                torch.distributed.all_gather_object(rngs, rng)
            else:
                rngs = [rng]
            if master:
                save_atomic(dict(model=raw_model.state_dict(), optimizer=optimizer.state_dict(), step=step, seen=seen,
                                 rng=rngs, history=history, args=vars(args), config=dataclasses.asdict(raw_model.cfg)),
                            ckpt_path)
    if master:
        write_logs(history, args.out)
    return history


def compile_model(model, device):
    """torch.compile the nanoGPT way: the whole model at once, DDP's wrapper included. On the CPU
    the graph is traced and run by aot_eager (Triton's interpreter runs the kernels there; generated
    code would gain nothing).

    What Inductor fuses here: everything between the matmuls and our kernels, the embeddings' sum,
    LayerNorm and dropout, the casts to bf16 and the weights' concatenation, the head's dense layer's
    GELU and LayerNorm and the masked positions' gather (and on the torch path every LayerNorm,
    GELU, dropout and residual add, and the loss). It cannot touch our kernels (torch.library ops,
    called as they are: 03's, 04's, dropout's mask, the GELU, add + LayerNorm and loss kernels
    above) nor the matmuls' insides. --bench --bench-profile
    shows a step's GPU time by kernel family, eager and compiled (results/05_train_roformer_mlm_H100.md).

    Which to use when: compilation shrinks the GPU's work, CUDA graphs the host's. Compiled alone, a
    step still issues hundreds of kernels and every call of 03's and 04's ops from Python; the
    default run's small model then waits for the host, and at the BERT-base shape a slow host adds
    milliseconds to a step. So on a GPU both are on: the encoder is compiled, then captured
    (capture_cuda_graphs), and the embeddings and the head, whose shapes change with the number of
    masked tokens, run compiled around its replay. The results pages time every combination.

    Under DDP, Dynamo would by default split the graph at the gradient buckets (optimize_ddp) so
    that each bucket's all-reduce overlaps the rest of the backward. On two H200s that made steps
    slower (1.24x and 1.60x one GPU, split at 25 and 100 MB buckets, against 1.81-1.84x compiled
    whole: results/05_ddp_split.log), so here the gradients are all-reduced after the backward."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        torch._dynamo.config.optimize_ddp = False
    return torch.compile(model, backend="inductor" if device.type == "cuda" else "aot_eager")


def compare(args, argv):
    """Two runs from the same seed, differing only in --attn: their loss curves should agree within
    the noise of the precision used (bf16 on a GPU)."""
    if "RANK" in os.environ:
        raise SystemExit("--compare runs its two trainings one after the other in one process: run it without torchrun")
    paths = args.compare.split(",")
    if len(paths) != 2 or any(p not in ATTN_PATHS for p in paths):
        raise SystemExit(f"--compare takes two of {ATTN_PATHS}, comma-separated, got {args.compare!r}")
    given = list(sys.argv[1:] if argv is None else argv)
    rest = [a for i, a in enumerate(given)  # the same arguments, without --compare and its value
            if a != "--compare" and not a.startswith("--compare=") and (i == 0 or given[i - 1] != "--compare")]
    curves = {}
    for path in paths:
        history = main(rest + ["--attn", path, "--out", os.path.join(args.out, "compare-" + path)])
        curves[path] = {r["step"]: r["loss"] for r in history if "loss" in r}
    steps = sorted(set(curves[paths[0]]) & set(curves[paths[1]]))
    diffs = [abs(curves[paths[0]][s] - curves[paths[1]][s]) for s in steps]
    worst = max(range(len(steps)), key=lambda i: diffs[i])
    print(f"loss curves of {paths[0]} and {paths[1]} over {len(steps)} logged steps: largest difference "
          f"{diffs[worst]:.4f} at step {steps[worst]} ({curves[paths[0]][steps[worst]]:.4f} against "
          f"{curves[paths[1]][steps[worst]]:.4f}); mean difference {sum(diffs) / len(diffs):.4f}")
    return curves


def bench(args, ddp, rank, world, device):
    """Tokens/s and peak memory of training steps (forward, backward, AdamW) at the BERT-base shape
    (12 layers, hidden 768, 12 heads, FFN 3072, vocab 30522; seq 512, batch 32 by default on a GPU)."""
    on_gpu = device.type == "cuda"
    if on_gpu:
        cfg = RoFormerConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                             intermediate_size=3072, max_position_embeddings=512, pad_token_id=0)
        batch, seq = args.batch_size, args.seq_len
    else:
        if rank == 0:
            print("NO GPU: a tiny model in Triton's interpreter; the numbers say nothing about speed.")
        cfg = RoFormerConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=64, max_position_embeddings=64, pad_token_id=0)
        batch, seq = 2, 32
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if on_gpu else contextlib.nullcontext()
    gen = torch.Generator().manual_seed(args.seed + rank)
    ids = torch.randint(1, cfg.vocab_size, (batch, seq), generator=gen)
    labels = torch.where(torch.rand(batch, seq, generator=gen) < args.mask_prob, ids, -100)
    positions, labels = masked_positions(labels).to(device), labels.to(device)
    ids = ids.to(device)  # packed text: no padding, so no mask (device_mask), for Hugging Face's model too
    with torch.device("meta"):  # counted without allocating or initialising anything
        n_params = sum(p.numel() for p in RoFormerForMaskedLM(cfg).parameters())
    matmul_rate = matmul_tflops(device)
    if rank == 0:
        print(f"{n_params / 1e6:.1f}M parameters, {world} rank(s), batch {batch} x seq {seq} per rank"
              + (f"; yardstick: a bf16 matmul runs at {matmul_rate:.0f} TF/s on this GPU" if matmul_rate else ""))
    models = list(ATTN_PATHS)
    try:
        import transformers
        models.append("hf")
    except ImportError:
        print("(transformers is not installed: Hugging Face's RoFormerForMaskedLM is not benchmarked)")
    # each model eager and compiled; with --cuda-graphs, ours also with the encoder replayed from CUDA graphs
    candidates = [m + mode for m in models for mode in ("", "+compile", "+graphs", "+compile+graphs")
                  if "+graphs" not in mode or (args.cuda_graphs and m != "hf")]
    if args.bench_paths:
        unknown = set(args.bench_paths.split(",")) - set(candidates)
        if unknown:
            raise SystemExit(f"--bench-paths: {', '.join(sorted(unknown))} not among {', '.join(candidates)}")
        candidates = [c for c in candidates if c in args.bench_paths.split(",")]

    def build(candidate):
        torch.manual_seed(args.seed)
        name = candidate.split("+")[0]
        if name == "hf":
            hf_cfg = transformers.RoFormerConfig(**{k: v for k, v in dataclasses.asdict(cfg).items()
                                                    if k != "embedding_size"}, attention_probs_dropout_prob=0.0)
            model = transformers.RoFormerForMaskedLM(hf_cfg).to(device)
        else:
            model = RoFormerForMaskedLM(cfg, name).to(device)
            if candidate.endswith("+graphs"):
                capture_cuda_graphs(model, batch, seq, compiled="+compile" in candidate)
            step_loss = lambda: stepped(ids, labels=labels, positions=positions)[0]  # noqa: E731
        stepped = model
        if ddp:
            stepped = nn.parallel.DistributedDataParallel(model, device_ids=[device] if on_gpu else None,
                                                          gradient_as_bucket_view=True)
        if "+compile" in candidate:
            stepped = compile_model(stepped, device)
        if name == "hf":
            step_loss = lambda: stepped(input_ids=ids, labels=labels).loss  # noqa: E731
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=on_gpu)

        def train_step():
            with autocast:
                loss = step_loss()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)  # one micro-batch a step: safe with graphs too
        return model, optimizer, train_step

    def timed_steps(train_step):
        """Milliseconds of each step, from one step boundary to the next (GPU events on a GPU, so the
        time includes any wait for the host, as training sees it)."""
        if not on_gpu:
            times = []
            for _ in range(args.bench_steps):
                start = time.perf_counter()
                train_step()
                times.append((time.perf_counter() - start) * 1e3)
            return times
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(args.bench_steps + 1)]
        marks[0].record()
        for mark in marks[1:]:
            train_step()
            mark.record()
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]

    step_ms = {name: [] for name in candidates}  # per round
    peak, first_step_s = {}, {}
    for round_ in range(args.bench_rounds):
        for name in candidates if round_ % 2 == 0 else candidates[::-1]:
            if on_gpu:  # the peak counts the capture too: a replay allocates nothing, its graphs' pool holds all
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            model, optimizer, train_step = build(name)
            with out_of_memory_advice(args):
                train_step()  # compiles (captures), in the first round (later rounds find Inductor's cache)
                if on_gpu:
                    torch.cuda.synchronize()
                first_step_s.setdefault(name, time.perf_counter() - start)
                for _ in range(2 if on_gpu else 0):  # warm up the GPU: allocator, autotuning
                    train_step()
                if on_gpu:
                    torch.cuda.synchronize()
                step_ms[name].append(timed_steps(train_step))
            peak[name] = max(peak.get(name, 0.0), torch.cuda.max_memory_allocated() / 2**30) if on_gpu else float("nan")
            if args.bench_profile and round_ == 0:  # every rank runs the step: DDP's collectives pair up
                families = kernel_families(train_step, on_gpu)
                if rank == 0:
                    print(f"{name:>15}: one step's {'GPU' if on_gpu else 'CPU'} time by kernel family: " + ", ".join(
                        f"{family} {n} kernels {ms:.1f} ms" for family, (n, ms) in families.items()))
            del model, optimizer, train_step
            gc.collect()  # a graphed encoder refers to itself: only the collector frees it and its graphs
            if on_gpu:
                torch.cuda.empty_cache()
    results = []
    for name in candidates:
        ms = statistics.median(t for times in step_ms[name] for t in times)
        tokens_per_s = batch * seq * world / (ms / 1e3)
        row = dict(attn=name, ms_per_step=ms, ms_per_step_by_round=[statistics.median(t) for t in step_ms[name]],
                   tokens_per_s=tokens_per_s, peak_gib=peak[name], first_step_s=first_step_s[name],
                   model_tflops_per_gpu=flops_per_token(n_params, cfg, seq) * tokens_per_s / world / 1e12)
        results.append(row)
        if rank == 0:
            of_matmul = f" ({row['model_tflops_per_gpu'] / matmul_rate:.0%} of matmul)" if matmul_rate else ""
            rounds = " / ".join(f"{m:.1f}" for m in row["ms_per_step_by_round"])
            print(f"{name:>15}: {ms:8.1f} ms/step (median; by round {rounds}) {tokens_per_s:10.0f} tokens/s  "
                  f"peak {row['peak_gib']:5.1f} GiB  {row['model_tflops_per_gpu']:6.1f} model TF/s per GPU{of_matmul}"
                  f"  build + first step {row['first_step_s']:.1f} s", flush=True)
    by = {r["attn"]: r for r in results}
    base = next((b for b in ("hf+compile", "hf") if b in by), None)  # the yardstick: what a user would run
    for r in results if base else ():
        r["vs_" + base] = r["tokens_per_s"] / by[base]["tokens_per_s"]
        r["peak_vs_" + base] = r["peak_gib"] / by[base]["peak_gib"] if on_gpu else None
    if rank == 0 and base:
        print(f"against {base}: " + ", ".join(f"{r['attn']} {r['vs_' + base]:.2f}x" + (
            f" ({r['peak_vs_' + base]:.0%} of its peak memory)" if on_gpu else "") for r in results))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"bench_{world}rank.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name() if on_gpu else "cpu", world=world, batch=batch,
                           seq=seq, steps=args.bench_steps, rounds=args.bench_rounds, torch=torch.__version__,
                           matmul_tflops=matmul_rate, results=results), f, indent=1)
    return results


def kernel_families(train_step, on_gpu=True):
    """{family: (kernels, ms)} of one training step, from torch.profiler: where the GPU's time goes, and
    what torch.compile fused (Inductor's kernels are named triton_*) and what it left as it was. On
    the CPU: the ops' own CPU time, by the same names."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        train_step()
        if on_gpu:
            torch.cuda.synchronize()
    families = {}
    for e in prof.events():
        if e.device_type != (torch.autograd.DeviceType.CUDA if on_gpu else torch.autograd.DeviceType.CPU):
            continue
        name = e.name.lower()
        family = ("matmuls" if any(w in name for w in ("gemm", "nvjet", "cutlass", "xmma", "splitk")) else
                  "ours (01-05)" if name.startswith(("rope", "rotate", "dropout_keep", "add_norm", "bias_gelu",
                                                     "cross_entropy")) else
                  "attention (SDPA)" if any(w in name for w in ("flash", "fmha", "cudnn", "attention")) else
                  "Inductor's fused kernels" if name.startswith("triton_") else "other PyTorch kernels")
        n, ms = families.get(family, (0, 0.0))
        families[family] = (n + 1, ms + (e.device_time_total if on_gpu else e.self_cpu_time_total) / 1e3)
    return dict(sorted(families.items(), key=lambda kv: -kv[1][1]))


def write_logs(history, out):
    """log.json, log.csv and (with matplotlib) curves.png under --out."""
    with open(os.path.join(out, "log.json"), "w") as f:
        json.dump(history, f, indent=1)
    keys = ["step", "loss", "acc", "val_loss", "val_acc", "lr", "ms", "tok_s"]
    with open(os.path.join(out, "log.csv"), "w") as f:
        f.write(",".join(keys) + "\n")
        for row in history:
            f.write(",".join(str(row.get(k, "")) for k in keys) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key, ax, label in (("loss", ax1, "train loss"), ("val_loss", ax1, "held-out loss"),
                           ("acc", ax2, "train masked acc"), ("val_acc", ax2, "held-out masked acc")):
        pts = [(r["step"], r[key]) for r in history if key in r]
        if pts:
            ax.plot(*zip(*pts), label=label, marker="." if key.startswith("val") else None)
    for ax in (ax1, ax2):
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "curves.png"), dpi=120)


if __name__ == "__main__":
    main()
