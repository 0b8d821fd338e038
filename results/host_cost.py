"""Host cost of an eager call of 02, 03 and 04, next to an empty op, autograd alone and SDPA.

On tensors so small that the GPU waits for the host, (1, 128, 2, 64) bf16 bshd, each case runs
200 calls in a row between two synchronizes (wall time per call); 7 rounds visit every case in
turn, and a case's figure is its median round. "empty ops" divides by an empty op's time (x + 1)
in the same run. With --profile, each case then runs 1000 calls under cProfile and the largest
parts by own time are printed: cProfile slows every Python call, so they show the split, not the
cost.

Run from the repository root: python results/host_cost.py | tee results/host_cost_H100.log
It writes results/host_cost_<GPU>.md. It needs a GPU.
"""

import argparse
import cProfile
import hashlib
import importlib
import importlib.util
import io
import os
import pstats
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("02_rope_fwd.py", "03_rope_bwd.py", "04_rope_attention.py")
ROUNDS = 7
CALLS = 200


def load_scripts(folder, prefix):
    """02, 03 and 04 from folder, as modules named prefix + '02' and so on (names start with a
    digit, so they are loaded by path; sys.modules holds them for torch.compile's sake)."""
    modules = []
    for script in SCRIPTS:
        name = prefix + script[:2]
        spec = importlib.util.spec_from_file_location(name, os.path.join(folder, script))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        modules.append(module)
    return modules


class Identity(torch.autograd.Function):
    """Autograd's own cost: a Function that launches nothing."""

    @staticmethod
    def forward(ctx, *xs):
        return tuple(x.new_empty(x.shape) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        return grads


def cases(rope02, rope03, rope04):
    """{name: a call}, each as a user makes it, on tensors of (1, 128, 2, 64) bf16."""
    x = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
    freqs = rope03.rope_freqs(128, 64, device="cuda")
    q, k, v = (x.clone().requires_grad_() for _ in range(3))
    qkv = x.repeat(1, 1, 1, 3).requires_grad_()

    def sdpa(q, k, v):
        qkv_bhsd = (t.transpose(1, 2) for t in (q, k, v))
        return torch.nn.functional.scaled_dot_product_attention(*qkv_bhsd).transpose(1, 2)

    def rope03_sdpa():
        return sdpa(*rope03.apply_rotary_pos_emb_qk(q, k, freqs, "bshd"), v)

    def fused_qkv():
        return rope03.apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, [64, 64, 64], "bshd")

    def backward_of(forward):
        def forward_and_backward():
            outputs = forward()
            if isinstance(outputs, torch.Tensor):
                outputs = (outputs,)
            torch.autograd.backward(outputs, [x] * len(outputs))

        return forward_and_backward

    forwards = {
        "autograd alone: identity Function on q, k, v": lambda: Identity.apply(q, k, v),
        "SDPA": lambda: sdpa(q, k, v),
        "03, q and k": lambda: rope03.apply_rotary_pos_emb_qk(q, k, freqs, "bshd"),
        "03, fused QKV": fused_qkv,
        "03 RoPE + SDPA": rope03_sdpa,
        "04": lambda: rope04.rope_attention(q, k, v, freqs),
    }
    table = {
        "empty op (x + 1)": lambda: x + 1,
        "02, q and k (no autograd)": lambda: rope02.rope_fwd_qk(x, x, freqs, "bshd"),
        "03, q and k, forward, no grad": lambda: rope03.apply_rotary_pos_emb_qk(
            x, x, freqs, "bshd"
        ),
        "04, forward, no grad": lambda: rope04.rope_attention(x, x, x, freqs),
    }
    for name, forward in forwards.items():
        table[f"{name}, forward"] = forward
        table[f"{name}, forward + backward"] = backward_of(forward)
    return table


def time_calls(fn, calls=CALLS):
    """Wall time per call of `calls` calls in a row after a warm one, between two synchronizes."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def host_cost(fns_by_version):
    """{version: {case: median us}}: every case of every version visited once per round."""
    times = {version: {name: [] for name in fns} for version, fns in fns_by_version.items()}
    for _ in range(ROUNDS):
        for version, fns in fns_by_version.items():
            for name, fn in fns.items():
                times[version][name].append(time_calls(fn))
    return {
        version: {name: sorted(t)[len(t) // 2] for name, t in by_case.items()}
        for version, by_case in times.items()
    }


def profile(fns, calls=1000, top=12):
    for name, fn in fns.items():
        profiler = cProfile.Profile()
        time_calls(fn, 20)
        profiler.enable()
        time_calls(fn, calls)
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
        print(f"\n===== {name}\n" + "\n".join(out.getvalue().splitlines()[4:]))


def environment():
    """One line: device, date, versions."""
    return (
        f"device: {torch.cuda.get_device_name()}; date: {time.strftime('%Y-%m-%d')}; "
        f"torch {torch.__version__}; triton {importlib.import_module('triton').__version__}; "
        f"python {sys.version.split()[0]}"
    )


def md5s(folder):
    """The md5 of each of 02-04 in folder, for the page."""
    sums = []
    for script in SCRIPTS:
        with open(os.path.join(folder, script), "rb") as f:
            sums.append(f"{script[:2]} {hashlib.md5(f.read()).hexdigest()[:8]}")
    return ", ".join(sums)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true", help="then each case under cProfile")
    parser.add_argument("--results", default=os.path.join(ROOT, "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("host_cost.py measures a GPU's host cost: it needs a GPU")
    fns = cases(*load_scripts(ROOT, "host_cost_"))
    us = host_cost({"": fns})[""]
    empty = us["empty op (x + 1)"]
    rows = ["| eager call, (1, 128, 2, 64) bf16 | host us per call | empty ops |", "|---|---|---|"]
    rows += [f"| {name} | {t:.1f} | {t / empty:.1f} |" for name, t in us.items()]
    print(environment(), *rows, sep="\n")
    kind = next((w for w in torch.cuda.get_device_name().split() if w[:1] == "H"), "gpu")
    with open(os.path.join(args.results, f"host_cost_{kind}.md"), "w") as f:
        f.write(f"# {__doc__.splitlines()[0]}\n\n{environment()}; md5 {md5s(ROOT)}\n\n")
        f.write(
            "Command: `python results/host_cost.py`\n\n"
            + " ".join(__doc__.split("\n\n")[1].split())
        )
        f.write("\n\n" + "\n".join(rows) + f"\n\nRaw log: `host_cost_{kind}.log`.\n")
    if args.profile:
        profile(fns)


if __name__ == "__main__":
    main()
