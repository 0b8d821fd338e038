import torch, torch.nn as nn, torch.nn.functional as F
class Chunk(nn.Module):
    def __init__(self, layers, encoder):
        super().__init__()
        self.layers, self.encoder = layers, [encoder]
    def forward(self, x):
        for layer in self.layers:
            x = layer.attention.output(layer.attention.self(x, self.encoder[0].freqs, None), x)
            x = layer.output(F.gelu(layer.intermediate.dense(x)), x)
        return x

def capture_chunks(model, batch_size, seq_len, compiled=False, chunks=2):
    import gc
    shape, rng = (batch_size, seq_len, model.cfg.hidden_size), torch.cuda.get_rng_state()
    enc = model.roformer.encoder
    n = len(enc.layer)
    parts = [Chunk(nn.ModuleList(enc.layer[i * n // chunks:(i + 1) * n // chunks]), enc) for i in range(chunks)]
    samples = tuple((torch.zeros(shape, device=enc.freqs.device, dtype=torch.bfloat16, requires_grad=True),) for _ in parts)
    torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(False)
    gc.collect(); gc.disable()
    try:
        mods = tuple(nn.Sequential(torch.compile(p) if compiled else p) for p in parts)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            graphed = torch.cuda.make_graphed_callables(mods, samples)
    finally:
        gc.enable()
    torch.cuda.set_rng_state(rng)
    def replay(x):
        for g in graphed:
            x = g(x)
        return x
    model.graphed = (torch._dynamo.disable(replay), shape)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
