"""
Rotate-half: a first Triton kernel, and why RoPE built on it is slow
=====================================================================

In this tutorial, you will learn about:

* ``rotate_half``, the piece of RoPE that pairs each channel with a partner and negates one of
  the two: rotate-half (``[-x2, x1]``, GPT-NeoX/LLaMA/TransformerEngine) or rotate-pairs
  (``[-x1, x0, -x3, x2, ...]``, RoFormer/GPT-J);
* the per-element kernel a first-time Triton user writes (one lane, one output element, one
  partner index), and what it costs: at tiny sizes the launch; at large sizes nothing (it
  streams at copy speed), so the per-element structure is not where RoPE loses its time;
* a row-wise kernel that loads both halves of a row once and stores both: the bridge to 02;
* RoPE built as ``t*cos + rotate_half(t)*sin`` on top of the kernel, differentiable because
  rotate-half is linear (its transpose is ``-rotate_half``), and the memory traffic of that
  three-passes-and-more formula, which 02 removes.

How to read this file. Part 1 is the lesson (about 20 minutes): the reference, the two kernels
with their launchers, and RoPE built on them with its memory traffic. Part 2 is the drop-in:
argument checks, and the kernels registered as ``torch.library`` ops so that
``torch.compile(fullgraph=True)`` and autograd take them; skip it on a first read. Part 3
checks the kernels against PyTorch and times them against a copy of the same bytes.

Run ``python 01_rotate_half.py``: it checks itself against PyTorch, then benchmarks.
This file imports only torch and triton: copy it alone into your project.
"""

# %% Part 1 - the lesson
# With no GPU, the kernels run in Triton's interpreter (numpy on the CPU), chosen before triton
# is imported.
import argparse
import functools
import hashlib
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# %%
# The PyTorch reference
# ---------------------
# TransformerEngine's ``_rotate_half``: split the last dim into halves (x1, x2) and return
# (-x2, x1); the interleaved form pairs neighbours instead. Either way R is a linear map with
# R^T = -R (a quarter turn of every pair), which is all the backward in Part 2 needs.


def rotate_half_torch(x, interleaved=False):
    """x: [..., d], d even -> R(x), the same shape."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# %%
# Kernel 1: one lane per output element
# -------------------------------------
# The natural first kernel: a 1-D grid over all elements; each lane finds its row and column,
# computes where its partner lives, loads that one element and stores it (negated when the
# lane's column is the first of its pair). Inputs are seen as a 2-D [rows, d] view with strides.
# Every lane does an integer division and a modulo, and its load is a gather from the other
# half of its row. Neither shows at large sizes: the partner sits in the same cache lines and
# the arithmetic hides under memory time, so the kernel streams at copy speed. At tiny sizes
# the launch is the whole cost, and Triton's launcher takes more host time than PyTorch's. The
# benchmark in Part 3 measures both (results/01_rotate_half_H100.md).
# The negation happens in float32 for 16-bit inputs, like all arithmetic in this collection's
# kernels (it is exact either way; Triton 3.9's CPU interpreter gets bf16 negation wrong).
# float64 stays float64, so torch.autograd.gradcheck can check the backward.


@triton.jit
def rotate_half_naive_kernel(
    x_ptr,
    y_ptr,
    n_elements,
    n_cols,
    stride_xr,
    stride_xc,
    INTERLEAVED: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    row = offs // n_cols
    col = offs % n_cols
    if INTERLEAVED:
        first = col % 2 == 0  # pairs (2i, 2i + 1)
        partner = col ^ 1
    else:
        first = col < n_cols // 2  # pairs (i, i + d/2)
        partner = tl.where(first, col + n_cols // 2, col - n_cols // 2)
    x = tl.load(x_ptr + row * stride_xr + partner * stride_xc, mask=mask)
    if UPCAST:  # 16-bit inputs: arithmetic in float32
        x = x.to(tl.float32)
    negate = first != TRANSPOSE  # R puts the minus on the first of a pair, R^T on the second
    y = tl.where(negate, -x, x)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def launch_rotate_half(x, interleaved=False, transpose=False):
    """R(x) (or R^T(x) = -R(x) with transpose=True) with the per-element kernel.
    x: [..., d], d even; returns a new contiguous tensor of x's shape."""
    rows = x.reshape(-1, x.shape[-1])  # a view whenever the leading dims allow one
    y = torch.empty(rows.shape, device=x.device, dtype=x.dtype)
    BLOCK = 1024
    grid = (triton.cdiv(y.numel(), BLOCK),)  # an empty x: no program runs
    rotate_half_naive_kernel[grid](
        rows,
        y,
        y.numel(),
        rows.shape[1],
        rows.stride(0),
        rows.stride(1),
        INTERLEAVED=interleaved,
        TRANSPOSE=transpose,
        UPCAST=x.element_size() < 4,
        BLOCK=BLOCK,
    )
    return y.view(x.shape)


# %%
# Kernel 2: one program per block of rows
# ---------------------------------------
# Give each program whole rows instead: load the first half and the second half once (each a
# contiguous, vectorisable load), store (-x2, x1). No division, no gather. For interleaved
# pairs, load the row contiguously and split it into even and odd channels in registers. On its
# own it is no faster than kernel 1 (see the results page); its value is its structure. A
# program that holds both halves of a head can apply the whole RoPE formula, cos and sin
# included, in one pass: that is 02's kernel.


@triton.jit
def rotate_half_rows_kernel(
    x_ptr,
    y_ptr,
    n_rows,
    half,
    stride_xr,
    stride_xc,
    INTERLEAVED: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HALF: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xr
    y_rows = y_ptr + rows.to(tl.int64)[:, None] * (2 * half)  # y is contiguous
    if INTERLEAVED:
        c = tl.arange(0, 2 * HALF)[None, :]
        mask = (rows[:, None] < n_rows) & (c < 2 * half)
        x = tl.load(x_rows + c * stride_xc, mask=mask)
        if UPCAST:
            x = x.to(tl.float32)
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_R, HALF, 2)))
        y = tl.reshape(tl.join(-x_odd, x_even), (BLOCK_R, 2 * HALF))
        tl.store(y_rows + c, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        c = tl.arange(0, HALF)[None, :]
        mask = (rows[:, None] < n_rows) & (c < half)
        x1 = tl.load(x_rows + c * stride_xc, mask=mask)
        x2 = tl.load(x_rows + (c + half) * stride_xc, mask=mask)
        if UPCAST:
            x2 = x2.to(tl.float32)
        tl.store(y_rows + c, (-x2).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_rows + c + half, x1, mask=mask)


def launch_rotate_half_rows(x, interleaved=False):
    """R(x) with the row-wise kernel. x: [..., d], d even; returns a new contiguous tensor."""
    rows = x.reshape(-1, x.shape[-1])
    y = torch.empty(rows.shape, device=x.device, dtype=x.dtype)
    half = rows.shape[1] // 2
    HALF = triton.next_power_of_2(half)
    BLOCK_R = max(1, 2048 // HALF)  # about 2048 pairs (4096 elements) a program
    grid = (triton.cdiv(rows.shape[0], BLOCK_R),)
    rotate_half_rows_kernel[grid](
        rows,
        y,
        rows.shape[0],
        half,
        rows.stride(0),
        rows.stride(1),
        INTERLEAVED=interleaved,
        UPCAST=x.element_size() < 4,
        BLOCK_R=BLOCK_R,
        HALF=HALF,
    )
    return y.view(x.shape)


# %%
# RoPE on top of the kernel
# -------------------------
# y = t*cos + R(t)*sin, with R the Triton kernel. R is linear, so its backward is its transpose,
# R^T = -R: the kernel's TRANSPOSE flag moves the minus sign instead of paying a negation pass
# (Part 2 registers it as R's backward). The rest is eager PyTorch, and that is the lesson: each
# operator is a pass over memory.
#
# Memory traffic, counting elements of t (N of them; cos and sin broadcast and are small):
#   t*cos        reads N, writes N
#   R(t)         reads N, writes N
#   R(t)*sin     reads N, writes N
#   sum          reads 2N, writes N
#   = 5N read + 4N written = 9N, plus a concatenation (2N more) when only d2 < d channels
# rotate. A single fused pass reads N and writes N: 2N. 02 builds that kernel; the traffic count
# predicts ~4.5x. Eager ops run below copy speed, so the gap the benchmark in Part 3 measures is
# larger (results/01_rotate_half_H100.md).


def rope_naive(t, freqs, tensor_format="sbhd", interleaved=False, rotate=launch_rotate_half):
    """RoPE as t*cos + rotate(t)*sin on the first d2 channels; the rest pass through.
    t: [s, b, h, d] (sbhd) | [b, s, h, d] (bshd); freqs: float32 angles [s2, 1, 1, d2], s2 >= s.
    rotate(x, interleaved): the rotate-half to use, the per-element kernel by default."""
    seqlen = t.shape[0] if tensor_format == "sbhd" else t.shape[1]
    d2 = freqs.shape[-1]
    angles = freqs[:seqlen]  # [s, 1, 1, d2] broadcasts against sbhd
    if tensor_format == "bshd":
        angles = angles.transpose(0, 1)
    cos = angles.cos().to(t.dtype)
    sin = angles.sin().to(t.dtype)
    x = t[..., :d2]
    y = x * cos + rotate(x, interleaved) * sin
    if d2 == t.shape[-1]:
        return y
    return torch.cat((y, t[..., d2:]), dim=-1)


# %% Part 2 - the drop-in
# The public functions check their arguments, then launch. Under torch.compile(fullgraph=True)
# a Triton launch must be an operator the compiler knows, so each kernel is registered as a
# torch.library custom op (one opaque node; 04 explains custom ops), R's backward R^T with it:
# apply_rope_naive is differentiable, eager and compiled.


def _check(x, name="x"):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(
            f"{name}'s last dim must be even (channels come in pairs), got shape {tuple(x.shape)}"
        )
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def _custom_op(name, launch):
    """launch as the op rope_tutorial_01::<name>, a fresh name if this file was loaded before."""
    n = 0
    while hasattr(torch.ops.rope_tutorial_01, f"{name}{n or ''}"):
        n += 1
    op = torch.library.custom_op(f"rope_tutorial_01::{name}{n or ''}", launch, mutates_args=())

    @op.register_fake
    def _(x, *flags):  # the output's shape and dtype, for the compiler
        return x.new_empty(x.shape)

    return op


def _rotate_half_launch(x: torch.Tensor, interleaved: bool, transpose: bool) -> torch.Tensor:
    return launch_rotate_half(x, interleaved, transpose)


def _rotate_half_rows_launch(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return launch_rotate_half_rows(x, interleaved)


rotate_half_op = _custom_op("rotate_half", _rotate_half_launch)
rotate_half_rows_op = _custom_op("rotate_half_rows", _rotate_half_rows_launch)


def _rotate_half_setup_context(ctx, inputs, output):
    ctx.interleaved = inputs[1]
    ctx.transpose = inputs[2]


def _rotate_half_backward(ctx, grad_out):  # R is linear: its gradient is R^T (and R^T's is R)
    grad_in = rotate_half_op(grad_out.contiguous(), ctx.interleaved, not ctx.transpose)
    return grad_in, None, None


rotate_half_op.register_autograd(_rotate_half_backward, setup_context=_rotate_half_setup_context)


def rotate_half(x, interleaved=False, transpose=False):
    """R(x) (or R^T(x) = -R(x) with transpose=True) with the per-element kernel.
    x: [..., d], d even, float32/float16/bfloat16/float64, any strides. Returns a new tensor."""
    _check(x)
    if torch.compiler.is_compiling():  # traced: one opaque node
        return rotate_half_op(x, interleaved, transpose)
    return launch_rotate_half(x, interleaved, transpose)


def rotate_half_rows(x, interleaved=False):
    """R(x) with the row-wise kernel. x: [..., d], d even, as for rotate_half."""
    _check(x)
    if torch.compiler.is_compiling():
        return rotate_half_rows_op(x, interleaved)
    return launch_rotate_half_rows(x, interleaved)


def _rotate_half_differentiable(x, interleaved):
    return rotate_half_op(x, interleaved, False)


def apply_rope_naive(t, freqs, tensor_format="sbhd", interleaved=False):
    """RoPE as t*cos + rotate_half(t)*sin, differentiable with respect to t.

    t: [s, b, h, d] (sbhd) | [b, s, h, d] (bshd). freqs: float32 [s2, 1, 1, d2], s2 >= s, d2 even,
    d2 <= d; channels d2: pass through. Positions start at 0 (02 adds thd and start_positions).
    """
    if tensor_format not in ("sbhd", "bshd"):
        raise ValueError(
            f"tensor_format must be 'sbhd' or 'bshd' here (02 adds 'thd'), got {tensor_format!r}"
        )
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        shape = getattr(t, "shape", t)
        raise ValueError(f"t must be a 4-D tensor [s, b, h, d] or [b, s, h, d], got {shape}")
    if not isinstance(freqs, torch.Tensor) or freqs.dtype != torch.float32 or freqs.dim() != 4:
        raise TypeError("freqs must be a float32 tensor [s2, 1, 1, d2]")
    seqlen = t.shape[0] if tensor_format == "sbhd" else t.shape[1]
    d2 = freqs.shape[-1]
    if seqlen > freqs.shape[0]:
        raise ValueError(f"sequence length {seqlen} is over the {freqs.shape[0]} rows of freqs")
    if d2 % 2 or not 2 <= d2 <= t.shape[-1]:
        raise ValueError(
            f"freqs' last dim d2 = {d2} must be even and at most the head dim {t.shape[-1]}"
        )
    return rope_naive(t, freqs, tensor_format, interleaved, rotate=_rotate_half_differentiable)


# %% Part 3 - check and benchmark
# The self-check runs irregular shapes (odd row counts, a strided view, d = 80), both pairings,
# three dtypes. The benchmark times rotate_half from a tiny (2, 1, 2, 4) tensor, where the launch
# is the whole cost, to growing [s, 1, 32, 128] ones: PyTorch and both kernels, GPU time and an
# eager call's cost; then the RoPE built on the kernel. Each against a device-to-device copy of
# the same bytes, in the same run.


def self_check():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for interleaved in (False, True):
            x = torch.randn(7, 3, 5, 2 * 80, device=DEVICE, dtype=dtype)[..., ::2]  # d = 80
            expected = rotate_half_torch(x, interleaved)
            assert torch.equal(rotate_half(x, interleaved), expected)
            assert torch.equal(rotate_half_rows(x, interleaved), expected)
            assert torch.equal(rotate_half(x, interleaved, transpose=True), -expected)
    t = torch.randn(5, 2, 1, 12, device=DEVICE, dtype=torch.float64, requires_grad=True)
    freqs = torch.randn(6, 1, 1, 8, device=DEVICE)  # partial rotary: 8 of 12 channels
    rope = functools.partial(apply_rope_naive, freqs=freqs, interleaved=True)
    assert torch.autograd.gradcheck(rope, (t,))
    print(
        "self-check passed: naive and row kernels equal PyTorch bit for bit; apply_rope_naive "
        f"passes gradcheck (device: {DEVICE.type})"
    )


TIMED = (
    "bf16. Each cell is GPU time, the median of `triton.testing.do_bench_cudagraph` (work "
    'replayed from a CUDA graph), except "eager call": the median of `triton.testing.do_bench` '
    "over ten calls in a row, per call, host cost included. (x%): the speed as a fraction of a "
    "device-to-device copy of the same bytes, same run."
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


def benchmark():
    """Prints the table as it is measured; returns it, and GB/s by MB moved for the plot."""
    on_gpu = DEVICE.type == "cuda"
    if not on_gpu:
        print(
            "\nNO GPU: the kernels run in Triton's interpreter on the CPU. The timings below "
            "only show that the benchmark runs; they say nothing about speed."
        )
    names = ("copy", "torch", "naive", "rows")
    table = ["| shape | MB moved | " + " | ".join(names) + " | eager call: torch / naive / rows |"]
    table.append("|---" * 7 + "|")
    print(*table, sep="\n")
    curves = {}
    seqlens = [2**k for k in range(6, 15)] if on_gpu else [4, 16]
    for shape in [(2, 1, 2, 4)] + [(s, 1, 32, 128) for s in seqlens]:
        x = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
        out = torch.empty_like(x)
        mb = 2 * x.numel() * x.element_size() / 1e6  # read + write of x
        fns = {
            "copy": functools.partial(out.copy_, x),
            "torch": functools.partial(rotate_half_torch, x),
            "naive": functools.partial(rotate_half, x),
            "rows": functools.partial(rotate_half_rows, x),
        }
        us = {name: time_us(fn) for name, fn in fns.items()}
        curves[mb] = us
        cells = [f"{us[name]:.1f} us" for name in names]
        if on_gpu:  # the fraction of the copy's speed
            cells = [
                f"{cell} ({100 * us['copy'] / us[name]:.0f}%)" for cell, name in zip(cells, names)
            ]
        eager = [f"{time_us(fns[name], eager_call=True):.1f} us" for name in names[1:]]
        table.append(
            f"| {shape} | {mb:.3g} | " + " | ".join(cells) + " | " + " / ".join(eager) + " |"
        )
        print(table[-1])
    s, b, h, d = (4096, 4, 32, 128) if on_gpu else (16, 1, 2, 64)
    t = torch.randn(s, b, h, d, device=DEVICE, dtype=torch.bfloat16)
    freqs = torch.randn(s, 1, 1, d, device=DEVICE)
    out = torch.empty_like(t)
    copy_us = time_us(functools.partial(out.copy_, t))
    naive_us = time_us(functools.partial(apply_rope_naive, t, freqs))
    table.append(
        f"\napply_rope_naive on sbhd {(s, b, h, d)}: {naive_us:.0f} us = "
        f"{naive_us / copy_us:.1f}x a copy of t ({copy_us:.0f} us); "
        "the traffic count predicts 9N / 2N = 4.5x"
    )
    print(table[-1])
    return "\n".join(table), curves


def write_page(results_dir, table):
    """results/<script>_<GPU kind>.md: title, environment, command, what is timed, the table,
    the raw log's name. Returns the path without its extension (the plot's too)."""
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
    return os.path.join(results_dir, stem)


def plot(curves, stem):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    mbs = sorted(curves)[1:]  # the tiny tensor is off the scale
    for name in curves[mbs[0]]:
        ax.plot(mbs, [mb * 1e3 / curves[mb][name] for mb in mbs], marker="o", label=name)
    ax.set(xscale="log", xlabel="MB moved (read + write)", ylabel="GB/s (GPU time)")
    ax.set_title(os.path.basename(stem))
    ax.legend()
    fig.savefig(stem + ".png", dpi=120)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    parser.add_argument(
        "--results", default=results, help="folder for the page and plot (written only on a GPU)"
    )
    args = parser.parse_args()
    self_check()
    table, curves = benchmark()
    if DEVICE.type == "cuda":
        plot(curves, write_page(args.results, table))
