# cProfile of eager calls at (1, 128, 2, 64) bf16: where the host time of 02, 03, 04 goes.
import cProfile, importlib.util, io, pstats, sys, time, torch
def load(name):
    spec = importlib.util.spec_from_file_location(name, f"{name}.py"); m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m; spec.loader.exec_module(m); return m
m2, m3, m4 = load("02_rope_fwd"), load("03_rope_bwd"), load("04_rope_attention")
dev = torch.device("cuda"); x = torch.randn(1, 128, 2, 64, device=dev, dtype=torch.bfloat16)
f = m3.rope_freqs(128, 64, device=dev)
q, k, v = (x.clone().requires_grad_() for _ in "qkv")
cases = {
  "empty x+1": lambda: x + 1,
  "02 rope_fwd_qk": lambda: m2.rope_fwd_qk(x, x, f, "bshd"),
  "03 fwd no grad": lambda: m3.apply_rotary_pos_emb_qk(x, x, f, "bshd"),
  "03 fwd": lambda: m3.apply_rotary_pos_emb_qk(q, k, f, "bshd"),
  "03 fwd+bwd": lambda: torch.autograd.backward(m3.apply_rotary_pos_emb_qk(q, k, f, "bshd"), [x, x]),
  "04 fwd no grad": lambda: m4.rope_attention(x, x, x, f),
  "04 fwd+bwd": lambda: m4.rope_attention(q, k, v, f).backward(x),
}
N = 1000
for name, fn in cases.items():
    for _ in range(20): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(N): fn()
    torch.cuda.synchronize(); us = (time.perf_counter() - t) / N * 1e6
    pr = cProfile.Profile(); pr.enable()
    for _ in range(N): fn()
    torch.cuda.synchronize(); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    print(f"\n===== {name}: {us:.1f} us per call (no profiler)\n" + "\n".join(s.getvalue().splitlines()[4:]))
