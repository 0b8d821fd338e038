"""Host cost of eager calls of 04_rope_attention.py against an empty op, autograd alone, SDPA and 03's RoPE + SDPA,
as a Markdown table: python results/04_tools/host_cost.py (on a GPU). It lives beside 04, not in it, to keep 04's
harness small."""
import importlib.util
import itertools
import os
import time
import timeit

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load(name):
    """ROOT/name.py as a module, or None where it is missing (03 is the unfused path's RoPE)."""
    path = os.path.join(ROOT, f"{name}.py")
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    spec.loader.exec_module(module := importlib.util.module_from_spec(spec))
    return module


attn = load("04_rope_attention")
DEVICE, DTYPE, rope_freqs, rope_attention = attn.DEVICE, attn.DTYPE, attn.rope_freqs, attn.rope_attention


def host_cost(rope03):
    """Eager calls on tensors so small that the GPU waits for the host: wall time per call of 200 calls in a row and
    one sync, the median of 7 interleaved rounds. 03's RoPE is apply_rotary_pos_emb_qk; SDPA its default backend."""
    class Identity(torch.autograd.Function):  # autograd's own cost: a Function that launches nothing
        forward = staticmethod(lambda ctx, *xs: tuple(x.new_empty(x.shape) for x in xs))
        backward = staticmethod(lambda ctx, *grads: grads)
    x, freqs = torch.randn(1, 128, 2, 64, device=DEVICE, dtype=DTYPE), rope_freqs(128, 64, device=DEVICE)
    q, k, v = (x.clone().requires_grad_() for _ in "qkv")
    sdpa = lambda q, k: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    fns = {"empty op (x + 1)": lambda: x + 1, "autograd alone: identity Function on q, k, v": lambda: Identity.apply(
        q, k, v)[0], "SDPA": lambda: sdpa(q, k), "03 RoPE + SDPA": rope03 and (lambda: sdpa(
            *rope03.apply_rotary_pos_emb_qk(q, k, freqs, "bshd"))), "ours": lambda: rope_attention(q, k, v, freqs)}
    fns = {name: fn for name, fn in fns.items() if fn}  # 03's row only where 03 sits beside this file
    fns = {**{f"{n}, forward": f for n, f in fns.items()}, "ours, forward, no grad": lambda: rope_attention(
        x, x, x, freqs), **{f"{n}, forward + backward": lambda f=f: f().backward(x) for n, f in list(fns.items())[1:]}}
    times, clock = {name: [] for name in fns}, lambda: torch.cuda.synchronize() or time.perf_counter()
    for _, (name, fn) in itertools.product(range(7), fns.items()):  # rounds: a busy moment of the host touches all
        fn()  # warm; timeit reads the clock (a sync) before and after; garbage collection stays on, as for a user
        times[name].append(timeit.Timer(fn, "gc.enable()", clock).timeit(200) / 200 * 1e6)
    us = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    return ["| eager call, (1, 128, 2, 64) bf16 | host us per call | empty ops |", "|---|---|---|"] + [
        f"| {name} | {t:.1f} | {t / us['empty op (x + 1), forward']:.1f} |" for name, t in us.items()]


if __name__ == "__main__":
    print(f"device: {torch.cuda.get_device_name() if DEVICE.type == 'cuda' else 'cpu (interpreter)'}; torch "
          f"{torch.__version__}\n\n{' '.join(host_cost.__doc__.split())}\n")
    print(*host_cost(load("03_rope_bwd")), sep="\n")
