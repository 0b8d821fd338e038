"""Two versions of the collection side by side on one GPU, in one run.

For each version: 02's forward (rope_fwd_qk), 03's forward + backward (apply_rotary_pos_emb_qk)
and 04's forward + backward (rope_attention) at their benchmark shapes, in bf16, as GPU time (the
median of `triton.testing.do_bench_cudagraph`) and as an eager call (ten calls in a row timed by
`triton.testing.do_bench`, per call, host cost included); the host cost of an eager call
(host_cost.py beside this file); and 05's training step at the BERT-base shape (`--bench
--bench-paths fused+compile+graphs`, each version's own script in a process of its own). The
versions take turns, in alternating order, in every round; a figure is the median of its rounds.
"after / before" above 1 means the later version is slower.

Run from the repository root, with the earlier version checked out beside it:
    git worktree add /tmp/before <commit>
    python results/compare.py --before /tmp/before | tee results/compare_H100.log
It writes results/compare_<GPU>.md. With --packed it times only q and k packed (thd) four ways,
02's forward and 03's forward + backward, each eager and under torch.compile(fullgraph=True), and
writes results/compare_thd_<GPU>.md. Without a GPU it runs tiny shapes in Triton's interpreter to
show that it runs; the timings then mean nothing.
"""

import argparse
import functools
import hashlib
import importlib.util
import os
import re
import statistics
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
SCRIPTS = ("02_rope_fwd.py", "03_rope_bwd.py", "04_rope_attention.py", "05_train_roformer_mlm.py")
ROUNDS = 3 if ON_GPU else 1
SHAPES_02_03 = [(4, 4096, 32, 128), (32, 512, 12, 64), (1, 32768, 8, 128)]  # (b, s, h, d)
PACKED = (
    "For each version: q and k packed (thd) four ways, the sequence lengths shown, 8 heads, head "
    "dim 128, bf16; 02's forward (rope_fwd_qk) and 03's forward + backward "
    "(apply_rotary_pos_emb_qk), each eager and under torch.compile(fullgraph=True, "
    "dynamic=False), as GPU time (the median of `triton.testing.do_bench_cudagraph`) and as an "
    "eager call (ten calls in a row timed by `triton.testing.do_bench`, per call, host cost "
    "included). The versions take turns, in alternating order, in every round; a figure is the "
    'median of its rounds. "after / before" above 1 means the later version is slower.'
)
SHAPES_04 = [  # (b, h, s, d, causal, padding mask)
    (32, 12, 512, 64, False, False),
    (16, 12, 512, 64, False, True),
    (8, 16, 2048, 64, False, False),
    (4, 32, 4096, 128, False, False),
    (4, 32, 4096, 128, True, False),
    (2, 16, 8192, 64, True, False),
]


def load_host_cost():
    path = os.path.join(ROOT, "results", "host_cost.py")
    spec = importlib.util.spec_from_file_location("host_cost", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


host_cost = load_host_cost()


def forward_and_backward(forward, inputs, grads):
    outputs = forward()
    if isinstance(outputs, torch.Tensor):
        outputs = (outputs,)
    return torch.autograd.grad(outputs, inputs, grads)


def rows_02(rope02):
    """{row: call} for one version: q and k rotated, in three layouts."""
    shapes = SHAPES_02_03 if ON_GPU else [(2, 16, 4, 64)]
    rows = {}
    for b, s, h, d in shapes:
        qk = torch.randn(2, b, s, h, d, device=DEVICE, dtype=torch.bfloat16)
        freqs = rope02.rope_freqs(s, d, device=DEVICE)
        cu_seqlens = torch.arange(0, b * s + 1, s, dtype=torch.int32, device=DEVICE)
        layouts = {"bshd": qk, "sbhd": qk.transpose(1, 2).contiguous(), "thd": qk.flatten(1, 2)}
        for layout, (q, k) in layouts.items():
            kwargs = {"tensor_format": layout}
            if layout == "thd":
                kwargs["cu_seqlens"] = cu_seqlens
            call = functools.partial(rope02.rope_fwd_qk, q, k, freqs, **kwargs)
            rows[f"02 forward, {layout}, (b, s, h, d) = {(b, s, h, d)}"] = call
    return rows


def rows_03(rope03):
    shapes = SHAPES_02_03 if ON_GPU else [(2, 16, 4, 64)]
    rows = {}
    for b, s, h, d in shapes:
        q, k = (
            torch.randn(b, s, h, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2)
        )
        grads = [torch.randn_like(q), torch.randn_like(k)]
        freqs = rope03.rope_freqs(s, d, device=DEVICE)
        forward = functools.partial(rope03.apply_rotary_pos_emb_qk, q, k, freqs, "bshd")
        call = functools.partial(forward_and_backward, forward, (q, k), grads)
        rows[f"03 forward + backward, bshd, (b, s, h, d) = {(b, s, h, d)}"] = call
    return rows


def rows_04(rope04):
    shapes = SHAPES_04 if ON_GPU else [(1, 2, 64, 32, True, True)]
    dtype = torch.bfloat16 if ON_GPU else torch.float16  # the interpreter's bf16 dot is wrong
    rows = {}
    for b, h, s, d, causal, padded in shapes:
        q, k, v = (
            torch.randn(b, s, h, d, device=DEVICE, dtype=dtype, requires_grad=True)
            for _ in range(3)
        )
        freqs = rope04.rope_freqs(s, d, device=DEVICE)
        mask = None
        if padded:  # each sequence padded after a random length
            lengths = torch.randint(
                s // 2, s + 1, (b, 1), generator=torch.Generator().manual_seed(0)
            )
            mask = torch.arange(s)[None, :] < lengths
            mask = mask.to(DEVICE)
        forward = functools.partial(
            rope04.rope_attention, q, k, v, freqs, causal=causal, attention_mask=mask
        )
        call = functools.partial(forward_and_backward, forward, (q, k, v), torch.randn_like(q))
        name = f"04 forward + backward, (b, h, s, d) = {(b, h, s, d)}"
        rows[name + ", causal" * int(causal) + ", padding mask" * int(padded)] = call
    return rows


def rows_packed(rope02, rope03, packings):
    """{row: call} for one version: q and k packed (thd) as packings says (the later 02's
    PACKINGS), 8 heads of 128 channels, 02's forward and 03's forward + backward, eager and
    compiled."""
    if not ON_GPU:
        packings = {"3 x 1-5 + 1 x 24": [3, 1, 5, 24]}
    compiled_02 = torch.compile(rope02.rope_fwd_qk, fullgraph=True, dynamic=False)
    compiled_03 = torch.compile(rope03.apply_rotary_pos_emb_qk, fullgraph=True, dynamic=False)
    rows = {}
    for packing, lengths in packings.items():
        lengths = torch.as_tensor(lengths, device=DEVICE)
        cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        freqs = rope02.rope_freqs(int(lengths.max()), 128, device=DEVICE)
        q, k = (
            torch.randn(int(cu_seqlens[-1]), 8, 128, device=DEVICE, dtype=torch.bfloat16)
            for _ in range(2)
        )
        for way, fn in (("eager", rope02.rope_fwd_qk), ("compiled", compiled_02)):
            call = functools.partial(fn, q, k, freqs, "thd", cu_seqlens=cu_seqlens)
            rows[f"02 forward, {way}, packed {packing}"] = call
        q = q.detach().requires_grad_()  # the same values, leaves of their own
        k = k.detach().requires_grad_()
        grads = [torch.randn_like(q), torch.randn_like(k)]
        for way, fn in (("eager", rope03.apply_rotary_pos_emb_qk), ("compiled", compiled_03)):
            forward = functools.partial(fn, q, k, freqs, "thd", cu_seqlens=cu_seqlens)
            call = functools.partial(forward_and_backward, forward, (q, k), grads)
            rows[f"03 forward + backward, {way}, packed {packing}"] = call
    return rows


def load_version(folder, prefix):
    """02, 03 and 04 of one version, as modules named prefix + '02' and so on."""
    return host_cost.load_scripts(folder, prefix)


def side_by_side(calls_by_version, eager_call, time_us):
    """{row: {version: median us}}, the versions taking turns, in alternating order; time_us: the
    later version's own timer (02's), the same for both."""
    versions = list(calls_by_version)
    times = {row: {v: [] for v in versions} for row in calls_by_version[versions[0]]}
    for round_ in range(ROUNDS):
        order = versions if round_ % 2 == 0 else versions[::-1]
        for row in times:
            for version in order:
                times[row][version].append(time_us(calls_by_version[version][row], eager_call))
    return {row: {v: statistics.median(t) for v, t in by_v.items()} for row, by_v in times.items()}


def bench_05(folder):
    """05's --bench step in ms (the median of its rounds), run in a process of its own."""
    command = [
        sys.executable,
        os.path.join(folder, "05_train_roformer_mlm.py"),
        "--bench",
        "--bench-paths",
        "fused+compile+graphs",
        "--bench-steps",
        "20",
        "--bench-rounds",
        "3",
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=folder)
    print(result.stdout, result.stderr, sep="\n", flush=True)
    found = re.search(r"fused\+compile\+graphs:\s+([0-9.]+) ms/step", result.stdout)
    if found is None:
        return float("nan")
    return float(found.group(1))


def md5s(folder):
    sums = []
    for script in ("01_rotate_half.py",) + SCRIPTS:
        with open(os.path.join(folder, script), "rb") as f:
            sums.append(f"{script[:2]} {hashlib.md5(f.read()).hexdigest()[:8]}")
    return ", ".join(sums)


def table(title, by_row, names):
    lines = [f"| {title} | {names[0]}, us | {names[1]}, us | after / before |", "|---|---|---|---|"]
    for row, by_version in by_row.items():
        before, after = (by_version[name] for name in names)
        lines.append(f"| {row} | {before:.1f} | {after:.1f} | {after / before:.3f} |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a folder holding the earlier 01-05")
    parser.add_argument("--after", default=ROOT, help="a folder holding the later 01-05")
    parser.add_argument("--results", default=os.path.join(ROOT, "results"))
    parser.add_argument("--no-05", action="store_true", help="leave 05's training step out")
    parser.add_argument("--packed", action="store_true", help="only q and k packed (thd)")
    args = parser.parse_args()
    names = ("before", "after")
    folders = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    modules = {name: load_version(folder, f"{name}_") for name, folder in folders.items()}
    header = [f"{name}: {folders[name]} (md5 {md5s(folders[name])})" for name in names]
    print(*header, sep="\n")
    page = []
    if args.packed:
        torch._dynamo.config.cache_size_limit = 64  # a graph per packing and version
        packings = modules["after"][0].PACKINGS
        row_sets = {name: [rows_packed(*m[:2], packings)] for name, m in modules.items()}
    else:
        row_sets = {
            name: [rows_02(m[0]), rows_03(m[1]), rows_04(m[2])] for name, m in modules.items()
        }
    for index in range(len(row_sets["after"])):
        calls = {name: row_sets[name][index] for name in names}
        for eager_call in (False, True):
            title = "eager call" if eager_call else "GPU time"
            by_row = side_by_side(calls, eager_call, modules["after"][0].time_us)
            lines = table(title, by_row, names)
            print(*lines, sep="\n", flush=True)
            page += [""] + lines
    if ON_GPU and not args.packed:
        fns = {name: host_cost.cases(*modules[name]) for name in names}
        by_version = host_cost.host_cost(fns)
        by_row = {row: {name: by_version[name][row] for name in names} for row in fns["before"]}
        lines = table("host cost, (1, 128, 2, 64)", by_row, names)
        print(*lines, sep="\n", flush=True)
        page += [""] + lines
    if ON_GPU and not args.no_05 and not args.packed:
        ms = {name: bench_05(folders[name]) for name in names}
        line = (
            f"05 --bench fused+compile+graphs: before {ms['before']:.1f} ms/step, after "
            f"{ms['after']:.1f} ms/step, after / before {ms['after'] / ms['before']:.3f}"
        )
        print(line)
        page += ["", line]
    if not ON_GPU:
        print("NO GPU: Triton's interpreter ran tiny shapes; the timings say nothing about speed.")
        return
    kind = next((w for w in torch.cuda.get_device_name().split() if w[:1] == "H"), "gpu")
    stem = f"compare_{kind}"
    if args.packed:
        stem = f"compare_thd_{kind}"
    with open(os.path.join(args.results, f"{stem}.md"), "w") as f:
        f.write(f"# {__doc__.splitlines()[0]}\n\n{host_cost.environment()}\n\n")
        f.write("\n\n".join(header) + f"\n\nCommand: `python {' '.join(sys.argv)}`\n\n")
        description = " ".join(__doc__.split("\n\n")[1].split())
        if args.packed:
            description = PACKED
        f.write(description + "\n" + "\n".join(page))
        f.write(f"\n\nRaw log: `{stem}.log`.\n")


if __name__ == "__main__":
    main()
