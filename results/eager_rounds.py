"""Eager calls of 03's forward + backward in interleaved rounds, against Liger-Kernel and
transformers' formula compiled, and against a same-run copy of the bytes.

An eager call's time (ten calls in a row timed by `triton.testing.do_bench`, per call, host cost
included: 03's own `time_us`) is bound by the host at medium shapes, and the host's speed drifts
within a run. Here every case of every row is timed once per round, the rounds visit the cases in
turn, and a figure is the median of the rounds (with their range). Rows:
- Hugging Face's entry point, `hf_apply_rotary_pos_emb`, at the benchmark's shapes: bf16 q and k
  [b, h, s, d] views of [b, s, h, d] memory, cos and sin bf16 [1, s, d]; against Liger-Kernel's
  `LigerRopeFunction` (in place, when importable) and transformers' formula under
  `torch.compile(dynamic=False)`;
- q and k packed (thd), 8 heads of 128 channels, the four packings of 03's benchmark:
  `apply_rotary_pos_emb_qk` eager and under `torch.compile(fullgraph=True, dynamic=False)`.
"copy x2": two device-to-device copies of q's and k's bytes (forward + backward move them twice).

Run from the repository root on a GPU (Liger through PYTHONPATH, optional):
    python results/eager_rounds.py | tee results/eager_rounds_H200.log
It writes results/eager_rounds_<GPU>.md.
"""

import argparse
import functools
import hashlib
import importlib.util
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUNDS = 7


def load_03():
    """03_rope_bwd.py as a module (its name starts with a digit: loaded by path; sys.modules
    holds it for torch.compile's sake)."""
    spec = importlib.util.spec_from_file_location("rope03", os.path.join(ROOT, "03_rope_bwd.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["rope03"] = module
    spec.loader.exec_module(module)
    return module


def forward_backward(fn, args, inputs, grads):
    outs = fn(*args)
    return torch.autograd.grad(outs, inputs, grads)


def copy_twice(src, dst):
    dst.copy_(src)
    dst.copy_(src)


def hf_rows(rope):
    """{row: {case: a forward + backward call}} at 03's Hugging Face shapes."""
    randn = functools.partial(torch.randn, device="cuda", dtype=torch.bfloat16)
    peers = {"transformers, compiled": torch.compile(rope._hf_formula, dynamic=False)}
    liger = rope._liger_peer()
    if liger:
        peers["liger"] = liger["liger"]
    rows = {}
    for b, s, h, d, h_k in rope.HF_SHAPES:
        q = randn(b, s, h, d).transpose(1, 2).requires_grad_()
        k = randn(b, s, h_k, d).transpose(1, 2).requires_grad_()
        angles = rope.rope_freqs(s, d, device="cuda")[None, :, 0, 0]
        args = (q, k, angles.cos().bfloat16(), angles.sin().bfloat16())
        grads = (torch.randn_like(q), torch.randn_like(k))
        src = torch.cat([q.detach().flatten(), k.detach().flatten()])
        cases = {"copy x2": functools.partial(copy_twice, src, torch.empty_like(src))}
        for name, fn in {"ours": rope.hf_apply_rotary_pos_emb, **peers}.items():
            cases[name] = functools.partial(forward_backward, fn, args, (q, k), grads)
        rows[f"Hugging Face's {(b, s, h, d, h_k)}"] = cases
    return rows


def thd_rows(rope):
    """{row: {case: a forward + backward call}} at 03's four packings."""
    ours = rope.apply_rotary_pos_emb_qk
    compiled = torch.compile(ours, fullgraph=True, dynamic=False)
    rows = {}
    for packing, lengths in rope.PACKINGS.items():
        lengths = torch.as_tensor(lengths, device="cuda")
        cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        freqs = rope.rope_freqs(int(lengths.max()), 128, device="cuda")
        tokens = int(cu_seqlens[-1])
        q, k = torch.randn(2, tokens, 8, 128, device="cuda", dtype=torch.bfloat16)
        q.requires_grad_()
        k.requires_grad_()
        grads = (torch.randn_like(q), torch.randn_like(k))
        args = (q, k, freqs, "thd")
        src = torch.cat([q.detach().flatten(), k.detach().flatten()])
        cases = {"copy x2": functools.partial(copy_twice, src, torch.empty_like(src))}
        for name, fn in {"ours": ours, "ours, compiled": compiled}.items():
            fn = functools.partial(fn, cu_seqlens=cu_seqlens)
            cases[name] = functools.partial(forward_backward, fn, args, (q, k), grads)
        rows[f"packed {packing}"] = cases
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=os.path.join(ROOT, "results"))
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("eager_rounds.py needs a GPU: eager calls' host cost is what it measures")
    rope = load_03()
    torch._dynamo.config.cache_size_limit = 64  # a graph per shape
    rows = {**hf_rows(rope), **thd_rows(rope)}
    for cases in rows.values():  # compiled, warmed up
        for call in cases.values():
            call()
    times = {row: {name: [] for name in cases} for row, cases in rows.items()}
    for round_ in range(args.rounds):
        for row, cases in rows.items():
            for name, call in cases.items():
                times[row][name].append(rope.time_us(call, eager_call=True))
        print(f"round {round_ + 1} of {args.rounds} done", flush=True)
    gpu = torch.cuda.get_device_name()
    kind = gpu.split()[1]
    with open(os.path.join(ROOT, "03_rope_bwd.py"), "rb") as f:
        md5 = hashlib.md5(f.read()).hexdigest()[:8]
    lines = [
        f"# Eager calls of 03's forward + backward, {args.rounds} interleaved rounds",
        "",
        f"device: {gpu}; date: {time.strftime('%Y-%m-%d')}; torch {torch.__version__}; "
        f"triton {sys.modules['triton'].__version__}; 03_rope_bwd.py md5 {md5}",
        "",
        f"Command: `python results/{os.path.basename(__file__)}`",
        "",
        " ".join(__doc__.split("\n\n")[1].split()),
        "",
        "A cell: the median over rounds of the eager call's us per call [the rounds' range]; "
        "(x%): the row's copy x2 (median) over the cell's median.",
        "",
    ]
    names = list(dict.fromkeys(name for cases in rows.values() for name in cases))
    lines += [f"| row | {' | '.join(names)} |", "|---" * (len(names) + 1) + "|"]
    for row, cases in times.items():
        copy = statistics.median(cases["copy x2"])
        cells = []
        for name in names:
            if name not in cases:
                cells.append("n/a")
                continue
            median = statistics.median(cases[name])
            spread = f"[{min(cases[name]):.0f}-{max(cases[name]):.0f}]"
            cells.append(f"{median:.1f} us {spread} ({100 * copy / median:.0f}%)")
        lines.append(f"| {row} | {' | '.join(cells)} |")
    lines += ["", f"Raw log: `eager_rounds_{kind}.log`.", ""]
    print("\n".join(lines))
    with open(os.path.join(args.results, f"eager_rounds_{kind}.md"), "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
