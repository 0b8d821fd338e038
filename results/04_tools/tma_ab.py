"""A/B of 04's forward on tensor descriptors (TMA loads) against its pointer loads, and against RoPE + cuDNN attention.

python results/04_tools/tma_ab.py [--configs] [--profile]   (on a GPU; prints a Markdown table)

It runs against 04_rope_attention.py as at 8d8f457 (md5 77b0d811: the forward on tensor descriptors past
TMA_MIN_SEQLEN tokens, a variant not kept; results/04_hopper.md): `git show 8d8f457:04_rope_attention.py`.

04 chooses descriptors per call when s > TMA_MIN_SEQLEN (a module constant) on Hopper or later: this script sets it
to 0 (descriptors on) or 10**9 (off: the pointer loads and tile configs of the shorter sequences). The backward is the
same code either way. Unfused path: RoPE on q and k (03's apply_rotary_pos_emb_qk where 03 sits beside 04, else a
plain torch rotate-half formula), then SDPA pinned to cuDNN; "cuDNN alone" times attention on pre-rotated q, k.
Times: triton.testing.do_bench medians (eager calls); TF/s count 4*b*h*s^2*d FLOPs, halved when causal, x3.5 for
forward + backward. "warp-specialized" is 04 with its forward loop written tl.range(..., warp_specialize=True) (a
patched copy of the source, loaded as its own module). --configs also times the descriptor forward under other tile
configs (BLOCK_M, BLOCK_N, warps, stages; BLOCK_N must divide BLOCK_M). --profile prints torch.profiler's GPU time
per kernel of one forward + backward call, ours (descriptors) and RoPE + cuDNN, mean of 10 calls."""
import argparse
import hashlib
import importlib.util
import os
import subprocess
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPES = [(8, 16, 2048, 64, False), (4, 32, 4096, 128, False), (4, 32, 4096, 128, True), (2, 16, 8192, 64, True)]
CONFIGS = [(128, 128, 8, 3), (128, 128, 4, 3), (128, 64, 4, 3), (128, 64, 8, 4), (64, 64, 4, 4)]


def load(name, path=None):
    path = path or os.path.join(ROOT, f"{name}.py")
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    sys.modules[name] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plain_rope(q, k, freqs):  # rotate-half RoPE in torch, in q's dtype: [b, s, h, d]
    cos, sin = (f(freqs[:q.shape[1]]).view(1, q.shape[1], 1, -1).to(q.dtype) for f in (torch.cos, torch.sin))
    rot = lambda x: torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), -1)  # noqa: E731
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", action="store_true", help="time the descriptor forward under other tile configs")
    parser.add_argument("--profile", action="store_true", help="GPU time per kernel of one forward + backward")
    args = parser.parse_args()
    attn, rope03 = load("04_rope_attention"), load("03_rope_bwd")
    loop = "for start_n in range(lo, end, BLOCK_N):"
    source = open(os.path.join(ROOT, "04_rope_attention.py")).read()
    assert source.count(loop) == 1
    ws_path = os.path.join(ROOT, "results", "04_tools", "_attn04_ws.py")
    with open(ws_path, "w") as f:
        f.write(source.replace(loop, "for start_n in tl.range(lo, end, BLOCK_N, warp_specialize=True):"))
    attn_ws = load("attn04_ws", ws_path)
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    md5 = hashlib.md5(open(os.path.join(ROOT, "04_rope_attention.py"), "rb").read()).hexdigest()[:8]
    print(f"device: {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))}); "
          f"torch {torch.__version__}; triton {triton.__version__}; commit {commit.stdout.strip() or 'n/a'}; "
          f"04_rope_attention.py md5 {md5}; RoPE of the unfused path: {'03' if rope03 else 'plain torch'}\n")
    rope = ((lambda q, k, f: rope03.apply_rotary_pos_emb_qk(q, k, f, tensor_format="bshd")) if rope03 else plain_rope)
    cudnn = sdpa_kernel(SDPBackend.CUDNN_ATTENTION)(lambda q, k, v, causal: torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2))
    default = dict(attn.CONFIGS[("fwd", "descriptors")])
    print("| (b, h, s, d) | causal | provider | fwd ms | fwd TF/s | fwd+bwd ms | fwd+bwd TF/s | max abs diff to cuDNN |")
    print("|---" * 8 + "|", flush=True)
    for b, h, s, d, causal in SHAPES:
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
        freqs, dout = attn.rope_freqs(s, d, device="cuda"), torch.randn_like(q)
        with torch.no_grad():
            rq, rk = (x.detach().requires_grad_() for x in rope(q, k, freqs))
        ours = lambda: attn.rope_attention(q, k, v, freqs, causal=causal)  # noqa: E731
        ours_ws = lambda: attn_ws.rope_attention(q, k, v, freqs, causal=causal)  # noqa: E731
        providers = [("04, descriptors", ours, 0, None), ("04, pointer loads", ours, 10**9, None),
                     ("04, descriptors, warp-specialized", ours_ws, 0, None),
                     ("RoPE + SDPA cuDNN", lambda: cudnn(*rope(q, k, freqs), v, causal), None, None),
                     ("SDPA cuDNN alone (q, k pre-rotated)", lambda: cudnn(rq, rk, v, causal), None, None)]
        if args.configs:
            providers[1:1] = [(f"04, descriptors, {c}", ours, 0, c) for c in CONFIGS[1:]]
        with torch.no_grad():
            reference = cudnn(*rope(q, k, freqs), v, causal).float()
        for name, fn, tma_min, config in providers:
            attn.TMA_MIN_SEQLEN = attn_ws.TMA_MIN_SEQLEN = tma_min if tma_min is not None else 1024
            attn.CONFIGS[("fwd", "descriptors")] = dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), config)
                                                       ) if config else default
            attn._launches.clear()  # launches are remembered per signature, not per config
            inputs = (rq, rk, v) if "alone" in name else (q, k, v)
            try:
                with torch.no_grad():
                    diff = (fn().float() - reference).abs().max().item()
                both = lambda: torch.autograd.grad(fn(), inputs, dout)  # noqa: E731
                both()
                ms = [triton.testing.do_bench(f, return_mode="median") for f in (fn, both)]
                tfs = [n * 4 * b * h * s * s * d * (0.5 if causal else 1) / m / 1e9 for n, m in zip((1, 3.5), ms)]
                cells = f"{ms[0]:.3f} | {tfs[0]:.0f} | {ms[1]:.3f} | {tfs[1]:.0f} | {diff:.3g}"
            except Exception as e:  # noqa: BLE001  (a config that does not fit shared memory, for one)
                cells = f"n/a ({type(e).__name__}: {str(e)[:80]}) | | | |"
            print(f"| {(b, h, s, d)} | {causal} | {name} | {cells} |", flush=True)
        if args.profile:
            attn.TMA_MIN_SEQLEN, attn.CONFIGS[("fwd", "descriptors")] = 0, default
            attn._launches.clear()
            for name, fn in (("04, descriptors", ours), ("RoPE + SDPA cuDNN", providers[-2][1])):
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        torch.autograd.grad(fn(), (q, k, v), dout)
                    torch.cuda.synchronize()
                events = [e for e in prof.key_averages() if e.device_time_total > 0]
                total = sum(e.device_time_total for e in events) / 10
                print(f"\nprofile {(b, h, s, d)} causal={causal} {name}: {total:.0f} us of GPU time per forward + backward")
                for e in sorted(events, key=lambda e: -e.device_time_total)[:8]:
                    print(f"  {e.device_time_total / 10:9.1f} us  {e.count // 10:3d}x  {e.key[:100]}")
            print(flush=True)
    attn.TMA_MIN_SEQLEN, attn.CONFIGS[("fwd", "descriptors")] = 1024, default
    os.remove(ws_path)


if __name__ == "__main__":
    main()
