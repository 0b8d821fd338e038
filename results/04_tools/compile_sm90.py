"""Compile 04's forward kernel for a GPU on a machine without one: python results/04_tools/compile_sm90.py FILE [tag]
(ARCH=80 for sm_80; PYTHONPATH=<a Triton 3.6 install> to use that Triton). Per case, with the descriptors on (the
default TMA_MIN_SEQLEN) and off: compiled or the error, shared memory, Triton's global scratch, whether the PTX holds
TMA loads (cp.async.bulk.tensor), registers and spills (cuobjdump), the tile config, and an md5 of the PTX without
its debug lines, which tells whether two versions of 04 generate the same code."""
import hashlib, importlib.util, os, re, subprocess, sys, tempfile
os.environ["TRITON_INTERPRET"] = "0"
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

path = sys.argv[1]
spec = importlib.util.spec_from_file_location("attn04", path)
attn = importlib.util.module_from_spec(spec); spec.loader.exec_module(attn)
attn.DEVICE = torch.device("cuda")  # _config: the GPU's tiles
TY = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.bool: "*i1", torch.int8: "*i8"}
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")

def compile_(fn, tensors, scalars, constexprs):
    names, vals = fn.arg_names, list(tensors) + list(scalars)
    params = [n for n in names if n not in constexprs]
    sig, cx, attrs = {}, {k: v for k, v in constexprs.items() if k in names}, {}
    for i, (n, x) in enumerate(zip(params, vals)):
        idx = names.index(n)
        if isinstance(x, torch.Tensor):
            sig[n] = TY[x.dtype]
            if x.data_ptr() % 16 == 0: attrs[(idx,)] = [["tt.divisibility", 16]]
        elif isinstance(x, float): sig[n] = "fp32"
        elif x == 1: sig[n], cx[n] = "constexpr", 1
        else:
            sig[n] = "i32" if abs(x) < 2**31 else "i64"
            if x % 16 == 0: attrs[(idx,)] = [["tt.divisibility", 16]]
    for n in names:
        if n in cx: sig[n] = "constexpr"
    sig = {n: sig[n] for n in names}
    opts = {k: constexprs[k] for k in ("num_warps", "num_stages") if k in constexprs}
    return triton.compile(ASTSource(fn, sig, cx, attrs), target=GPUTarget("cuda", int(os.environ.get("ARCH", "90")), 32), options=opts)

def strip(ptx):  # the code without debug information (file names and lines)
    ptx = ptx.split(".section")[0]
    return "\n".join(l for l in ptx.splitlines() if not re.match(r"\s*(\.loc|\.file|\$L__)", l))

def usage(c):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"]); f.flush()
        out = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    return " ".join(w for w in out.split() if w.startswith(("REG:", "STACK:", "SHARED:", "LOCAL:")))

CASES = [  # b, s, h, h_kv, d, d2, causal, masked, packed, dtype
    (2, 2048, 16, 16, 64, 64, False, False, False, torch.bfloat16),
    (2, 2048, 16, 16, 64, 64, True, False, False, torch.bfloat16),
    (2, 4096, 8, 8, 128, 128, False, False, False, torch.bfloat16),
    (2, 4096, 8, 8, 128, 128, True, False, False, torch.bfloat16),
    (2, 2048, 8, 2, 80, 48, True, True, True, torch.float16),
    (2, 2048, 8, 8, 36, 36, False, True, True, torch.float16),
    (2, 512, 12, 12, 64, 64, False, False, False, torch.bfloat16),
    (2, 512, 12, 12, 128, 128, True, True, False, torch.bfloat16),
]
tag = sys.argv[2] if len(sys.argv) > 2 else ""
TMA_DEFAULT = getattr(attn, "TMA_MIN_SEQLEN", None)
for b, s, h, h_kv, d, d2, causal, masked, packed, dt in CASES:
    for tma_min in ((TMA_DEFAULT, 10**9) if TMA_DEFAULT is not None else (None,)):
        if tma_min is not None: attn.TMA_MIN_SEQLEN = tma_min
        x = torch.empty(b, s, h + 2 * h_kv, d, dtype=dt) if packed else None
        q, k, v = (x[:, :, :h], x[:, :, h:h + h_kv], x[:, :, h + h_kv:]) if packed else (
            torch.empty(b, s, n, d, dtype=dt) for n in (h, h_kv, h_kv))
        freqs = torch.empty(s, 1, 1, d2)
        mask = torch.ones(b, s, dtype=torch.bool) if masked else None
        dm = attn._dims(q, k, d2)
        o, lse, rq, rk = torch.empty_like(q.contiguous()), torch.empty(b, h, s), torch.empty(b, h, s, dm.W, dtype=dt), torch.empty(b, h_kv, s, dm.W, dtype=dt)
        trig = torch.empty(s, 4 * dm.HALF)
        tma = tma_min is not None and s > tma_min
        extra = dict(DESC_K=tma, DESC_V=tma and attn._tma_ok(v)) if tma_min is not None else {}
        grid, scalars, cx = attn._plan("fwd", dm, 0.125, causal, False, mask, (q, v, o), (q, v, o), SAVE_RQ=True, **extra)
        name = f"fwd b={b} s={s} h={h}/{h_kv} d={d}/{d2} causal={causal} mask={masked} packed={packed} {extra}"
        try:
            c = compile_(attn.rope_attn_fwd_kernel, (q, rk, v, o, lse, rq, trig, mask if masked else lse), scalars, cx)
            print(f"{tag} {name}: OK shared={c.metadata.shared} scratch={c.metadata.global_scratch_size} "
                  f"tma={'cp.async.bulk.tensor' in c.asm['ptx']} {usage(c)} ptx={hashlib.md5(strip(c.asm['ptx']).encode()).hexdigest()[:8]} "
                  f"cfg={ {k: cx[k] for k in ('BLOCK_M', 'BLOCK_N', 'num_warps', 'num_stages')} }", flush=True)
        except Exception as e:
            print(f"{tag} {name}: FAILED {type(e).__name__}: {str(e)[:1500]}", flush=True)
