"""A/B of versions of 04: python results/04_tools/ab_files.py NAME=FILE[:KERNEL,SHAPE=BM,BN,WARPS,STAGES] ...

Each argument loads FILE as its own module (a version of 04_rope_attention.py, e.g. `git show REV:04_rope_attention.py`
saved aside), optionally with one CONFIGS entry replaced. Per shape, rope_attention's forward and forward + backward
(bf16, bshd, inputs requiring grad) are timed by triton.testing.do_bench (eager calls, median), the versions
alternated for three rounds; prints each round and each version's median over rounds against the first's."""
import hashlib
import importlib.util
import sys

import torch
import triton

SHAPES = [(32, 12, 512, 64, True), (8, 16, 2048, 64, True), (4, 32, 4096, 128, False), (4, 32, 4096, 128, True),
          (2, 16, 8192, 64, True)]


def load(arg):
    name, spec = arg.split("=", 1)
    path, _, override = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location(f"v_{name}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if override:
        key, cfg = override.split("=")
        kernel, shape = key.split(",", 1)
        if (kernel, shape) not in module.CONFIGS:  # e.g. "fwd,d>64, causal" (quoted): CONFIGS' keys as written
            raise SystemExit(f"{arg}: no CONFIGS key {(kernel, shape)}; the keys: {sorted(module.CONFIGS)}")
        module.CONFIGS[(kernel, shape)] = dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"),
                                                   map(int, cfg.split(","))))
    print(f"# {name}: {path} md5 {hashlib.md5(open(path, 'rb').read()).hexdigest()[:8]} {override}")
    return name, module


def main():
    versions = [load(a) for a in sys.argv[1:]]
    print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}", flush=True)
    for b, h, s, d, causal in SHAPES:
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
        dout = torch.randn_like(q)
        times = {name: ([], []) for name, _ in versions}
        outs = {}
        for name, m in versions:
            freqs = m.rope_freqs(s, d, device="cuda")
            outs[name] = m.rope_attention(q, k, v, freqs, causal=causal).float()
        diff = max((o - outs[versions[0][0]]).abs().max().item() for o in outs.values())
        for _ in range(3):
            for name, m in versions:
                freqs = m.rope_freqs(s, d, device="cuda")
                fwd = lambda: m.rope_attention(q, k, v, freqs, causal=causal)  # noqa: E731
                both = lambda: torch.autograd.grad(fwd(), (q, k, v), dout)  # noqa: E731
                for t, fn in zip(times[name], (fwd, both)):
                    t.append(triton.testing.do_bench(fn, return_mode="median") * 1e3)
        base = [sorted(t)[1] for t in times[versions[0][0]]]
        for name, (f, fb) in times.items():
            med = sorted(f)[1], sorted(fb)[1]
            print(f"{(b, h, s, d)} causal={causal} {name:>14}: fwd us {' '.join(f'{x:.0f}' for x in f)}; fwd+bwd us "
                  f"{' '.join(f'{x:.0f}' for x in fb)} | /first {med[0] / base[0]:.3f} {med[1] / base[1]:.3f} "
                  f"(max diff of outputs {diff:.3g})", flush=True)


if __name__ == "__main__":
    main()
