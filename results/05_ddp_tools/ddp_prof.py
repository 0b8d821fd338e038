# Profile 05's bench step (fused+compile+graphs) on one GPU or under torchrun; VARIANT=base|static (DDP static_graph).
# Prints per step: window, compute-kernel busy time, NCCL time not overlapped by compute, GPU idle; top kernels.
import importlib.util, os, sys, time
import torch, torch.nn as nn
sys.argv[0] = os.path.join(os.getcwd(), "05_train_roformer_mlm.py")
spec = importlib.util.spec_from_file_location("train05", sys.argv[0]); train = importlib.util.module_from_spec(spec)
sys.modules["train05"] = train; spec.loader.exec_module(train)
variant, rank = os.environ.get("VARIANT", "base"), int(os.environ.get("RANK", 0))
DDP = nn.parallel.DistributedDataParallel
def ddp_factory(*a, **kw):
    if variant == "static":
        kw["static_graph"] = True
    return DDP(*a, **kw)
train.nn.parallel.DistributedDataParallel = ddp_factory
orig, calls, state = train.train_step, [0], {}
PROF_AT, N = 8, 5
def union(iv):
    iv, out = sorted(iv), []
    for s, e in iv:
        if out and s <= out[-1][1]: out[-1][1] = max(out[-1][1], e)
        else: out.append([s, e])
    return out
def length(iv): return sum(e - s for s, e in iv)
def minus(a, b):  # a minus b, both unions
    res, j = 0.0, 0
    for s, e in a:
        cur = s
        for bs, be in b:
            if be <= cur or bs >= e: continue
            if bs > cur: res += bs - cur
            cur = max(cur, be)
            if cur >= e: break
        if cur < e: res += e - cur
    return res
def step(*a):
    calls[0] += 1
    if calls[0] == PROF_AT:
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        state["p"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
        state["p"].__enter__(); state["t"] = time.perf_counter()
    r = orig(*a)
    if calls[0] == PROF_AT + N - 1:
        torch.cuda.synchronize() if torch.cuda.is_available() else None; wall = (time.perf_counter() - state["t"]) / N * 1e3
        p = state.pop("p"); p.__exit__(None, None, None)
        k = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
        nccl = union([(e.time_range.start, e.time_range.end) for e in k if "nccl" in e.name.lower()])
        comp = union([(e.time_range.start, e.time_range.end) for e in k if "nccl" not in e.name.lower()])
        allk = union(nccl + comp) or [[0, 0]]; win = allk[-1][1] - allk[0][0]
        f = lambda us: f"{us / N / 1e3:.3f} ms"
        print(f"[rank {rank} {variant}] wall/step {wall:.3f} ms (profiled); GPU window {f(win)}; compute busy {f(length(comp))}; "
              f"nccl busy {f(length(nccl))}; nccl not overlapped {f(minus(nccl, comp))}; idle {f(win - length(allk))}", flush=True)
        if rank == 0:
            (not k) or print(p.key_averages().table(sort_by="cuda_time_total" if hasattr(p.key_averages()[0], "cuda_time_total") else "device_time_total", row_limit=25, max_name_column_width=70), flush=True)
            gaps = []
            for (s0, e0), (s1, e1) in zip(allk, allk[1:]):
                if s1 - e0 > 20: gaps.append((s1 - e0, s1))
            print("largest GPU idle gaps (us, at):", [(round(g), round(t - allk[0][0])) for g, t in sorted(gaps)[-12:]], flush=True)
            names = sorted({(e.name[:60]) for e in k if 'nccl' in e.name.lower()})
            print("nccl kernels:", names, flush=True)
    return r
train.train_step = step
if rank == 0: print(f"# variant {variant}", flush=True)
train.main()
