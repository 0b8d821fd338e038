"""
Pretraining a RoFormer masked language model on the collection's kernels
========================================================================

In this tutorial, you will learn about:

* a faithful RoFormer (Hugging Face's ``RoFormerForMaskedLM``, whose checkpoints load with ``--init-from``): post-LN
  layers with RoPE on q and k (interleaved pairs), an MLM head tied to the word embeddings, BERT masking;
* ``--attn``, which changes nothing but RoPE and attention: ``torch`` (03's plain-PyTorch RoPE + SDPA),
  ``naive`` (01's RoPE + SDPA), ``triton`` (03's RoPE + SDPA; 02's kernel at evaluation), ``fused`` (04);
* a nanoGPT-style loop: AdamW without decay on biases and norms, warmup then linear decay, gradient accumulation and
  clipping, bf16 autocast, durable checkpoints, an exact ``--resume``, torchrun's ranks (and DDP's copies avoided);
* ``--compile`` and ``--cuda-graphs`` (both on with a GPU): Inductor fuses all between the matmuls and our kernels,
  and two CUDA graphs replay the encoder so that Python no longer paces the GPU (and their trap for accumulation).

Run ``python 05_train_roformer_mlm.py`` (a small model on the standard library's source); it loads 01-04 from beside it.
"""

import argparse
import array
import dataclasses
import functools
import gc
import importlib.util
import itertools
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import time
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (here and by 01-04)
import triton  # noqa: E402


def load_step(filename):  # 01-04 start with digits: loaded by path, once each
    name = "rope_step_" + filename[:2]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), filename))
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


naive_rope, rope_fwd, rope_bwd, fused = (load_step(f) for f in (
    "01_rotate_half.py", "02_rope_fwd.py", "03_rope_bwd.py", "04_rope_attention.py"))
ATTN_PATHS = ("torch", "naive", "triton", "fused")
VOCAB, PAD, CLS, SEP, MASK = 260, 256, 257, 258, 259  # the tokens: the 256 bytes, then [PAD] [CLS] [SEP] [MASK]

# %%
# Settings: a small model that trains in minutes is the default (a tiny one on a CPU), every value checked
# --------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    """The settings, checked here before any work: a bad one ends the run with one line naming it."""
    p = argparse.ArgumentParser(description="Pretrain a RoFormer masked LM on the collection's kernels.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error, add, on_gpu = sys.exit, p.add_argument, torch.cuda.is_available()  # argparse's errors: one line, exit 1
    add("--attn", choices=ATTN_PATHS, default="fused" if on_gpu else "torch",
        help="RoPE + attention; fused with a GPU (on a CPU the kernel paths run in Triton's interpreter: slowly)")
    add("--data", type=os.path.abspath, help="a text file (its bytes are the tokens); None: the stdlib's source")
    add("--out", default="out-roformer", help="folder for one run's checkpoints and logs")
    add("--init-from", help="a Hugging Face RoFormer checkpoint directory")
    add("--resume", action="store_true", help="continue the run in --out (from ckpt.pt, or ckpt-prev.pt if need be)")
    add("--compile", action=argparse.BooleanOptionalAction, help="torch.compile the model (None: with a GPU)")
    add("--cuda-graphs", action=argparse.BooleanOptionalAction, help="replay the encoder (None: with a GPU)")
    add("--bench", action="store_true", help="time training steps at BERT-base's shape, then exit")
    add("--bench-paths", metavar="P,Q", help="--bench only these, e.g. fused+compile+graphs,hf+compile")
    numbers = (  # flag, default with a GPU, without one, the values allowed
        ("seq-len", 512, 64, "v >= 8"), ("batch-size", 32, 4, "v >= 1"), ("grad-accum", 1, 1, "v >= 1"),
        ("layers", 6, 2, "v >= 1"), ("hidden", 512, 64, "v >= 2"), ("heads", 8, 2, "v >= 1"),
        ("max-steps", 2000, 30, "v >= 1"), ("warmup", 100, 5, "v >= 0"), ("log-interval", 20, 5, "v >= 1"),
        ("eval-interval", 200, 10, "v >= 1"), ("eval-batches", 20, 2, "v >= 1"), ("ckpt-interval", 500, 10, "v >= 1"),
        ("stop-after", 0, 0, "v >= 0"), ("seed", 1337, 1337, "v >= 0"), ("bench-steps", 20, 1, "v >= 1"),
        ("bench-rounds", 2, 1, "v >= 1"), ("lr", 5e-4, 5e-4, "0 < v < inf"), ("clip", 1.0, 1.0, "0 < v < inf"),
        ("weight-decay", 0.01, 0.01, "0 <= v < inf"), ("mask-prob", 0.15, 0.15, "0 < v <= 1"),
        ("dropout", 0.1, 0.1, "0 <= v < 1"))
    for name, gpu, cpu, rule in numbers:
        add("--" + name, type=type(gpu), default=gpu if on_gpu else cpu, help=rule + f"; {gpu} on a GPU" * (gpu != cpu)
            + "; stop after this many steps, with a checkpoint (0: never)" * (name == "stop-after"))
    args = p.parse_args(argv)
    for name, *_, rule in numbers:
        if not eval(rule, {"v": (v := getattr(args, name.replace("-", "_"))), "inf": float("inf")}):  # NaN fails too
            sys.exit(f"--{name} must satisfy {rule}, got {v}")
    head = next(documents(args.data), None) if args.data and os.path.isfile(args.data) else b"-"  # its first MiB
    binary = (head.count(0) + head.decode("utf-8", "replace").count("\ufffd")) / len(head) if head else 0.0
    cfg = hf_config(args.init_from) if args.init_from else RoFormerConfig(
        VOCAB, args.hidden, args.layers, args.heads, 4 * args.hidden)
    cfg.hidden_dropout_prob = args.dropout  # a loaded model's too, as nanoGPT overrides it
    paths = [m + mode for m in ATTN_PATHS + ("hf",) for mode in ("", "+compile", "+graphs", "+compile+graphs")
             if (on_gpu and m != "hf") or "graphs" not in mode]  # --bench: each path eager, compiled, graphed and both
    d, unknown = cfg.hidden_size // cfg.num_attention_heads, {*(args.bench_paths or "").split(",")} - {"", *paths}
    if why := next((why for bad, why in (
            (args.cuda_graphs and not on_gpu, "--cuda-graphs needs a GPU (CUDA graphs); this machine has none"),
            (args.data and not os.path.isfile(args.data), f"--data {args.data}: no such file"),
            (binary > 0.1, f"--data {args.data}: {binary:.0%} of its first MiB is NUL or not UTF-8 (binary?)"),
            (args.hidden % (2 * args.heads), f"--hidden {args.hidden} must be a multiple of 2 x --heads {args.heads}"),
            (args.attn == "fused" and not 16 <= d <= 128, f"--attn fused takes head dims of 16-128, not {d}"),
            (not args.bench and args.seq_len > cfg.max_position_embeddings,  # --bench makes its own model
             f"--seq-len {args.seq_len} is over the model's {cfg.max_position_embeddings} positions"),
            (cfg.vocab_size < VOCAB, f"--init-from: a vocabulary of {cfg.vocab_size}, under 05's {VOCAB} tokens"),
            (unknown, f"--bench-paths: {', '.join(sorted(unknown))} not among {', '.join(paths)}")) if bad), None):
        sys.exit(why)
    args.bench_paths = [p for p in paths if not args.bench_paths or p in args.bench_paths.split(",")]
    args.compile, args.cuda_graphs = (on_gpu if v is None else v for v in (args.compile, args.cuda_graphs))
    if not args.bench:
        try:  # found now, not at the first checkpoint
            os.makedirs(args.out, exist_ok=True)
            tempfile.TemporaryFile(dir=args.out).close()
        except OSError as e:
            sys.exit(f"--out {args.out}: not writable ({e.strerror or e})")
        run = [f for f in ("ckpt.pt", "ckpt-prev.pt") if os.path.exists(os.path.join(args.out, f))]  # log.csv: remade
        if run and not args.resume:
            sys.exit(f"--out {args.out} holds a run ({', '.join(run)}): go on with --resume, or choose another --out")
        args.checkpoint = args.resume and read_checkpoint(args, dataclasses.asdict(cfg))  # read once
    args.config = cfg  # train() takes it and the checkpoint
    return args


# %%
# The model
# ---------
# Hugging Face's module and parameter names, so that its checkpoints load as they are. All but attention is plain
# PyTorch, which Inductor (--compile) fuses into few kernels between matmuls (results/05_train_roformer_mlm_H100.md).


@dataclasses.dataclass
class RoFormerConfig:
    vocab_size: int = VOCAB
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int = 1024
    embedding_size: int = 0  # 0: the hidden size (no projection)
    max_position_embeddings: int = 1536  # RoFormer's (an angle table, no weights)
    type_vocab_size: int = 2
    hidden_dropout_prob: float = 0.1
    layer_norm_eps: float = 1e-12
    pad_token_id: int = PAD


class RoFormerSelfAttention(nn.Module):
    """RoPE on q and k; no dropout on the attention probabilities (04 has none, so no path has)."""

    def __init__(self, cfg, attn):
        super().__init__()
        self.heads, self.attn = cfg.num_attention_heads, attn
        self.query, self.key, self.value = (nn.Linear(cfg.hidden_size, cfg.hidden_size) for _ in range(3))

    def forward(self, x, freqs, mask):  # mask: [b, s], 1 = a real token, or None: no padding
        b, s, hidden = x.shape
        # One matmul for q, k and v: x is read, cast and saved for the backward once instead of three times.
        weight, bias = (torch.cat(t) for t in zip(*((m.weight, m.bias) for m in (self.query, self.key, self.value))))
        qkv = F.linear(x, weight, bias).view(b, s, 3, self.heads, hidden // self.heads)
        if self.attn == "fused":
            # 04 rotates q and k inside attention and writes dq, dk, dv as one tensor; the triton path runs 03 both ways
            # and stacks SDPA's three (a copy), which outweighs cuDNN's lead (results/05_train_roformer_mlm_H100.md).
            dtype = qkv.dtype if qkv.dtype in (torch.float16, torch.bfloat16) else torch.float16
            out = fused.rope_attention_qkvpacked(qkv.to(dtype), freqs, attention_mask=mask, interleaved=True)
            return out.to(qkv.dtype).reshape(b, s, hidden)
        q, k, v = qkv.unbind(2)
        if self.attn == "torch":  # PyTorch alone: 03's reference RoPE (Hugging Face's model is the bench's "hf")
            q, k = (rope_bwd.rope_reference(t, freqs, "bshd", interleaved=True, compute_dtype=None) for t in (q, k))
        elif self.attn == "naive":  # 01: three passes over memory
            q, k = (naive_rope.apply_rope_naive(t, freqs, "bshd", interleaved=True) for t in (q, k))
        elif torch.is_grad_enabled():  # 03: one kernel each way, differentiable
            q, k = rope_bwd.apply_rotary_pos_emb_qk(q, k, freqs, "bshd", interleaved=True)
        else:  # evaluation: 02's forward-only kernel
            q, k = rope_fwd.rope_fwd_qk(q, k, freqs, "bshd", interleaved=True)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=None if mask is None else mask.bool()[:, None, None, :])
        return out.transpose(1, 2).reshape(b, s, hidden)


class AddNorm(nn.Module):
    """dense -> dropout -> add the residual -> LayerNorm (post-LN). The residual stream stays bf16 under autocast, as
    in Megatron-LM: compiled, the cast rides on LayerNorm's kernel, which writes half the bytes for the next matmul."""

    def __init__(self, d_in, cfg):
        super().__init__()
        self.dense, self.dropout = nn.Linear(d_in, cfg.hidden_size), nn.Dropout(cfg.hidden_dropout_prob)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, h, residual):
        return self.LayerNorm(self.dropout(self.dense(h)) + residual).to(residual.dtype)


class RoFormerEncoder(nn.Module):
    def __init__(self, cfg, attn):
        super().__init__()
        self.layer = nn.ModuleList(nn.Module() for _ in range(cfg.num_hidden_layers))
        for layer in self.layer:  # plain modules as containers: Hugging Face's names
            layer.attention, layer.intermediate = nn.Module(), nn.Module()
            layer.attention.self = RoFormerSelfAttention(cfg, attn)
            layer.attention.output, layer.output = AddNorm(cfg.hidden_size, cfg), AddNorm(cfg.intermediate_size, cfg)
            layer.intermediate.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.register_buffer("freqs", rope_bwd.rope_freqs(  # RoFormer's angles: base 10000, interleaved pairs
            cfg.max_position_embeddings, cfg.hidden_size // cfg.num_attention_heads, 1e4, True), persistent=False)

    def forward(self, x, mask=None):
        for layer in self.layer:
            x = layer.attention.output(layer.attention.self(x, self.freqs, mask), x)
            x = layer.output(F.gelu(layer.intermediate.dense(x)), x)
        return x


def capture_cuda_graphs(model, batch_size, seq_len, compiled=False):
    """The encoder's forward and backward as two CUDA graphs (compiled first if compiled): a replay issues hundreds of
    kernels in one call, where each eager op costs the host microseconds. Others (shape, padding, eval): the layers."""
    shape, rng = (batch_size, seq_len, model.cfg.hidden_size), torch.cuda.get_rng_state()
    sample = torch.zeros(shape, device=model.roformer.encoder.freqs.device, dtype=torch.bfloat16, requires_grad=True)
    if hasattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch"):  # the warm-up's: a false alarm
        torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(False)
    gc.collect()  # a graph freed during another's capture breaks it: collect now, and not during the capture
    gc.disable()
    try:
        # one compiled graph (Inductor fuses across the seams) in a plain module, whose forward the graphs take over
        encoder = nn.Sequential(torch.compile(model.roformer.encoder) if compiled else model.roformer.encoder)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):  # graphs need the cache off
            replay = torch.cuda.make_graphed_callables(encoder, (sample,))
    finally:
        gc.enable()
    torch.cuda.set_rng_state(rng)  # the warm-up drew dropout masks; a resumed run must not depend on that
    # A tuple, no submodule: the state dict is unchanged. torch.compile of the model breaks at the replay.
    model.graphed = (torch._dynamo.disable(replay.forward), shape)
    # The trap: a replay hands out weight gradients in its own buffers, which the next one overwrites; a parameter with
    # no .grad adopts one, and a 2nd micro-batch would overwrite the 1st's (tests/test_05): each .grad starts allocated.
    for param in model.parameters():
        param.grad = torch.zeros_like(param)


class RoFormerForMaskedLM(nn.Module):
    def __init__(self, cfg, attn="torch"):
        super().__init__()
        if attn not in ATTN_PATHS:  # the command line checks it too; a direct call must not run another path
            raise ValueError(f"attn must be one of {ATTN_PATHS}, got {attn!r}")
        self.cfg, emb, self.graphed = cfg, cfg.embedding_size or cfg.hidden_size, None
        self.roformer = nn.Module()
        e = self.roformer.embeddings = nn.Module()
        e.word_embeddings = nn.Embedding(cfg.vocab_size, emb, padding_idx=cfg.pad_token_id)
        e.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, emb)
        e.LayerNorm, e.dropout = nn.LayerNorm(emb, eps=cfg.layer_norm_eps), nn.Dropout(cfg.hidden_dropout_prob)
        self.roformer.embeddings_project = nn.Linear(emb, cfg.hidden_size) if emb != cfg.hidden_size else nn.Identity()
        self.roformer.encoder = RoFormerEncoder(cfg, attn)
        self.cls = nn.Module()
        p = self.cls.predictions = nn.Module()
        t = p.transform = nn.Module()
        t.dense, t.LayerNorm = nn.Linear(cfg.hidden_size, emb), nn.LayerNorm(emb, eps=cfg.layer_norm_eps)
        p.decoder = nn.Linear(emb, cfg.vocab_size)
        p.decoder.weight = e.word_embeddings.weight  # tied
        for m in self.modules():  # BERT's init: normal(0, 0.02), zero biases, unit LayerNorm
            nn.init.normal_(m.weight, std=0.02) if isinstance(m, (nn.Linear, nn.Embedding)) else None
            nn.init.zeros_(m.bias) if isinstance(m, nn.Linear) else None

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None, positions=None):
        """Logits [b, s, vocab]; with labels (-100: not masked), (loss, accuracy) of the masked positions
        (positions: masked_positions(labels), if the caller has them). attention_mask: [b, s] or None."""
        e = self.roformer.embeddings
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        # token types as a sum of rows: a column sum in the backward, not atomic adds of every token onto one row
        x = e.word_embeddings(input_ids) + sum(torch.where((types == t)[..., None], row, 0.0)
                                               for t, row in enumerate(e.token_type_embeddings.weight))
        x = self.roformer.embeddings_project(e.dropout(e.LayerNorm(x)))
        if torch.is_autocast_enabled(x.device.type):  # the residual stream's dtype (AddNorm)
            x = x.to(torch.get_autocast_dtype(x.device.type))
        replay, shape = self.graphed or (None, None)
        graphable = (x.shape, x.dtype) == (shape, torch.bfloat16) and attention_mask is None and self.training
        x = replay(x) if graphable and torch.is_grad_enabled() else self.roformer.encoder(x, attention_mask)
        if labels is not None:
            positions = masked_positions(labels) if positions is None else positions
            x, labels = x.flatten(0, 1)[positions], labels.flatten()[positions]
        p = self.cls.predictions
        h = p.transform.LayerNorm(F.gelu(p.transform.dense(x)))
        # The decoder's rows padded to a multiple of 64, as nanoGPT pads GPT-2's: a bf16 row of 30522 logits is not
        # 16-byte aligned, and cuBLAS then runs without TMA (results/05_ab.log, M); compiled, the pad rides on the cast.
        pad = -p.decoder.weight.shape[0] % 64
        logits = F.linear(h, F.pad(p.decoder.weight, (0, 0, 0, pad)), F.pad(p.decoder.bias, (0, pad)))
        logits = logits[..., :logits.shape[-1] - pad]
        if labels is None:
            return logits
        return F.cross_entropy(logits.float(), labels), (logits.argmax(-1) == labels).float().mean()


def hf_config(path):
    """The RoFormerConfig of a Hugging Face RoFormer folder; anything wrong ends the run with one line."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:  # no folder, no file, no JSON
        sys.exit(f"--init-from {path}: " + ("no such folder" if not os.path.isdir(path) else f"config.json: {e}"))
    if why := next((why for bad, why in (
            (hf.get("model_type") != "roformer", f"not a RoFormer (model_type {hf.get('model_type')!r})"),
            (hf.get("rotary_value") or hf.get("is_decoder") or hf.get("hidden_act", "gelu") != "gelu",
             "only encoder RoFormers with rotary_value=False and hidden_act='gelu' are supported"),
            (not any(os.path.isfile(os.path.join(path, f)) for f in ("model.safetensors", "pytorch_model.bin")),
             "no model.safetensors or pytorch_model.bin")) if bad), None):
        sys.exit(f"--init-from {path}: {why}")
    fields = {f.name for f in dataclasses.fields(RoFormerConfig)}
    return RoFormerConfig(**{k: v for k, v in hf.items() if k in fields and v is not None})


def load_hf_checkpoint(path, attn, cfg=None):
    model, st = RoFormerForMaskedLM(cfg or hf_config(path), attn), os.path.join(path, "model.safetensors")
    state = (importlib.import_module("safetensors.torch").load_file(st) if os.path.isfile(st)  # with transformers
             else torch.load(os.path.join(path, "pytorch_model.bin"), map_location="cpu", weights_only=True))
    state = {k: v for k, v in state.items() if "embed_positions" not in k}  # sinusoidal: recomputed
    state.setdefault("cls.predictions.decoder.bias", state.pop("cls.predictions.bias", None))
    state.setdefault("cls.predictions.decoder.weight", state.get("roformer.embeddings.word_embeddings.weight"))
    missing, unexpected = model.load_state_dict({k: v for k, v in state.items() if v is not None}, strict=False)
    if missing or unexpected:
        sys.exit(f"--init-from {path}: the weights do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model


# %%
# Data: text to packed, masked sequences
# --------------------------------------
# Bytes are the tokens. Documents (by default the Python standard library's source) stream in pieces, joined with
# [SEP] and cut into [CLS] + (seq_len - 2) tokens + [SEP] from one flat int32 array (slices done in C: a Python list
# would be copied at every cut). Sequence i is held out if i % 50 == 0; the others go to the ranks a batch each in
# turn, masked by the batch's place, so that `world` ranks train on what one rank with `world` times the accumulation
# would; a rank's position in its stream is what a checkpoint stores.


def documents(path, block_bytes=1 << 20):
    """A document's bytes in pieces of block_bytes (a file that is one long line streams too), then None."""
    files = [path] if path else sorted(os.path.join(d, f) for d, _, fs in os.walk(sysconfig.get_paths()["stdlib"])
                                       for f in fs if f.endswith(".py") and "site-packages" not in d)
    for name in files:
        with open(name, "rb") as f:
            yield from iter(lambda: f.read(block_bytes), b"")
        yield None


def sequences(data, seq_len):
    """Packed token sequences of exactly seq_len and their real lengths."""
    body, buf, cls, sep = seq_len - 2, array.array("i"), array.array("i", [CLS]), array.array("i", [SEP])
    for piece in documents(data):
        buf.extend(piece if piece is not None else [SEP])
        cut = len(buf) - len(buf) % body
        for start in range(0, cut, body):
            yield cls + buf[start:start + body] + sep, seq_len
        del buf[:cut]
    if buf:
        yield cls + buf + sep + array.array("i", [PAD] * (body - len(buf))), len(buf) + 2


def batches(data, seq_len, batch_size, rank, world, start=0, held_out=False):
    """Endless batches (input_ids, attention_mask) of this rank's share of the training sequences after its first
    `start` (across epochs; a batch runs on over an epoch's end: none dropped); held_out=True: the held-out, once."""
    ids, lengths, index = array.array("i"), [], itertools.count()  # index: of a sequence in the stream of epochs
    for _ in range(1) if held_out else itertools.count():  # held out: one pass; training: epoch after epoch
        found = 0
        split = (s for i, s in enumerate(sequences(data, seq_len)) if (i % 50 == 0) == held_out)
        for found, (seq, n) in enumerate(split, 1):
            if next(index) // batch_size % world != rank or (start := start - 1) >= 0:  # another rank's, or seen
                continue
            ids.extend(seq)
            lengths.append(n)
            if len(lengths) == batch_size:
                yield (torch.frombuffer(ids, dtype=torch.int32).view(batch_size, seq_len).long(),
                       torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None])
                ids, lengths = array.array("i"), []
        if not found:
            sys.exit(f"--data has too little text: no sequence of {seq_len} tokens")


def to_device(batch_tensor, device):
    """Through pinned memory, as in nanoGPT: a copy from pageable memory ends in a synchronize (a host stall)."""
    return batch_tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else batch_tensor.to(device)


def masked_positions(labels):
    """The MLM head's rows: their number sets the shapes that follow, so training finds them on the host."""
    return (labels.flatten() != -100).nonzero().squeeze(1)


def device_batch(ids, mask, args, generator, device):
    """The model's arguments for a batch (ids, attention mask [b, s]), BERT-masked, on the device: --mask-prob of the
    real tokens but [CLS] and [SEP] are chosen, 80% become [MASK], 10% a random byte, 10% stay; labels -100 elsewhere.
    No mask for a batch without padding (packed text pads its last sequence), as Hugging Face drops it for SDPA."""
    chosen = (torch.rand(ids.shape, generator=generator) < args.mask_prob) & mask & (ids != CLS) & (ids != SEP)
    r = torch.rand(ids.shape, generator=generator)
    inputs = torch.where(chosen & (r >= 0.8) & (r < 0.9), torch.randint(0, 256, ids.shape, generator=generator), ids)
    inputs, labels = torch.where(chosen & (r < 0.8), MASK, inputs), torch.where(chosen, ids, -100)
    positions = to_device(masked_positions(labels), device)
    torch._dynamo.maybe_mark_dynamic(positions, 0)  # their number changes every batch: compiled once for all
    return dict(input_ids=to_device(inputs, device), labels=to_device(labels, device), positions=positions,
                attention_mask=None if bool(mask.all()) else to_device(mask, device))


# %%
# Training
# --------
# Checkpoints: a temporary file, fsynced, then ckpt.pt renamed to ckpt-prev.pt and the new one to ckpt.pt, and the
# folder fsynced: a kill at any point leaves ckpt.pt or ckpt-prev.pt whole. torch.load(weights_only=True) refuses
# all but tensors, numbers, strings and containers: a checkpoint from elsewhere runs no code.


def save_atomic(obj, path, rotate=True):
    """rotate=False: ckpt.pt is replaced, not kept as ckpt-prev.pt (after it failed to load)."""
    try:
        with open(path + ".tmp", "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:  # Ctrl-C, a full disk: no partial file is left
        os.remove(path + ".tmp") if os.path.exists(path + ".tmp") else None
        if isinstance(e, OSError) or "unexpected pos" in str(e):  # how torch's zip writer reports a failed write
            sys.exit(f"--out: {path} not written ({getattr(e, 'strerror', 0) or 'disk full?'}); the earlier ones kept")
        raise
    os.replace(path, path[:-3] + "-prev.pt") if rotate and os.path.exists(path) else None
    os.replace(path + ".tmp", path)
    if hasattr(os, "O_DIRECTORY"):  # POSIX: the renames made durable too
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(fd)
        os.close(fd)


def read_checkpoint(args, config):
    """--out's ckpt.pt (ckpt-prev.pt if broken), whose model, ranks and data must be the run's; others may change."""
    def read(p):
        try:
            ckpt = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001  (truncated or corrupt: EOFError, RuntimeError, zip errors)
            found = [s.split()[0] for s in str(e).split("GLOBAL ")[1:]]  # weights_only refused these objects
            return None, ("no such file" if isinstance(e, FileNotFoundError) else
                          f"holds Python objects ({', '.join(found)}), which could run code: not loaded" if found else
                          f"unreadable ({type(e).__name__}: {str(e).split('. ')[0][:200]}); truncated or corrupt?")
        keys = {"model", "optimizer", "step", "seen", "rng", "history", "args", "config"}
        return (ckpt, None) if isinstance(ckpt, dict) and keys <= {*ckpt} else (None, "not a checkpoint of this script")
    (ckpt, problem), prev = read(path := os.path.join(args.out, "ckpt.pt")), os.path.join(args.out, "ckpt-prev.pt")
    if problem:
        ckpt, problem_prev = read(prev)
        if problem_prev:
            sys.exit(f"--resume: {path}: {problem}" + (f"; {prev}: {problem_prev}" if os.path.exists(prev) else ""))
        print(f"WARNING --resume: {path}: {problem}. Resuming from {prev} (step {ckpt['step']}) instead.", flush=True)
        path = prev
    old = dict(ckpt["args"], **ckpt["config"], nproc_per_node=len(ckpt["seen"]))
    new = dict(vars(args), **config, nproc_per_node=int(os.environ.get("WORLD_SIZE", 1)))
    fixed = [*config, "data", "seq_len", "batch_size", "grad_accum", "mask_prob", "seed", "nproc_per_node"]

    def differ(keys):
        return ", ".join(f"{'--' + k.replace('_', '-') if k in args else k} {old.get(k)!r} there, {new[k]!r} here"
                         for k in keys if old.get(k) != new[k])
    if bad := differ(fixed):
        sys.exit(f"--resume: {path} is of another model or data stream, where its place means nothing ({bad})")
    if changed := differ(k for k in new if k not in (*fixed, "resume", "stop_after", "bench_paths")):
        print(f"note --resume: {changed}", flush=True)
    return dict(ckpt, path=path)


def flops_per_token(n_params, cfg, seq_len):  # 6 a parameter, plus attention's QK^T and PV (PaLM's appendix B):
    # the model's FLOPs as Hugging Face's model does them, the MLM head on every token (ours runs it on the masked)
    return 6 * n_params + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq_len


def matmul_tflops(device):  # the yardstick, measured in this run: a bf16 8192^3 matmul's TF/s
    gen = torch.Generator(device).manual_seed(0)  # its own: the run's RNG stream (dropout) stays untouched
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    return 2 * 8192**3 / triton.testing.do_bench(lambda: a @ b, return_mode="median") / 1e9


class AllReduceGradients:
    """DDP's all-reduce without its copies into flat buckets (under CUDA graphs, every gradient at every step): 50 MB
    buckets in the backward's order, all-reduced where the gradients lie as one NCCL group each, once the last micro-
    batch's are in (results/05_ddp_H200x2.md). The loss is divided by the ranks' number: the sum is the mean."""

    def __init__(self, model, bucket_bytes=50 * 2**20):
        self.buckets, self.works, self.last, self.world = [[]], [], False, torch.distributed.get_world_size()
        this = weakref.proxy(self)  # a hook that held self would keep every parameter alive (C++ holds the hooks)
        for p in reversed([p for p in model.parameters() if p.requires_grad]):  # the head's gradients come first
            self.buckets += [[]] if sum(q.nbytes for q in self.buckets[-1]) >= bucket_bytes else []
            self.buckets[-1].append(p)
            p.register_post_accumulate_grad_hook(functools.partial(type(self).ready, this, len(self.buckets) - 1))
            torch.distributed.broadcast(p.detach(), 0)  # every rank starts from rank 0's weights, as under DDP

    def ready(self, bucket, param=None):  # launch the complete buckets in order: every rank makes the same calls
        self.pending[bucket] -= self.last and param is not None  # a gradient of the last micro-batch is in
        while self.last and len(self.works) < len(self.buckets) and self.pending[len(self.works)] == 0:
            with torch.distributed._coalescing_manager(async_ops=True) as group:  # one kernel for the bucket
                for p in self.buckets[len(self.works)]:
                    p.grad = torch.zeros_like(p) if p.grad is None else p.grad  # an unused parameter's: zeros
                    torch.distributed.all_reduce(p.grad)
            self.works.append(group)

    def __call__(self, last):  # before each micro-batch's backward (last: the step's last one), and None after it
        if last is None:  # every bucket goes, complete or not
            self.pending = [0] * len(self.buckets)
            self.ready(0)
            [work.wait() for work in self.works]  # NCCL: the GPU stream waits for the all-reduce, not the host
        self.last, self.pending, self.works = bool(last), [len(b) for b in self.buckets], []


def prepare(model, args, ddp, device, compiled, graphs_shape=None):
    """The model ready to step (encoder graphed, then all compiled, as in nanoGPT), AdamW, torchrun's all-reduce."""
    cuda, params = device.type == "cuda", list(model.parameters())
    torch.cuda.reset_peak_memory_stats(device) if cuda else None  # the peak counts the capture (replays allocate none)
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=args.weight_decay, fused=cuda)
    capture_cuda_graphs(model, *graphs_shape, compiled=compiled) if graphs_shape else None
    return (torch.compile(model, backend="inductor" if cuda else "aot_eager") if compiled else model, optimizer,
            AllReduceGradients(model) if ddp else None)


def train_step(model, optimizer, all_reduce, micro_batches, args):
    """One optimizer step over the micro-batches; their mean loss and masked accuracy, left on the device."""
    n, world, loss_sum, acc_sum = len(micro_batches), all_reduce.world if all_reduce else 1, 0.0, 0.0
    for i, batch in enumerate(micro_batches):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=batch["input_ids"].is_cuda):
            out = model(**batch)
        loss, acc = (out.loss, 0.0) if hasattr(out, "loss") else out  # Hugging Face's model: an output object
        all_reduce(i == n - 1) if all_reduce else None
        (loss / (n * world)).backward()
        loss_sum, acc_sum = loss_sum + loss.detach() / n, acc_sum + acc / n
    all_reduce(None) if all_reduce else None
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=not (args.cuda_graphs and n > 1))  # capture_cuda_graphs' trap
    return loss_sum, acc_sum


def train(args, ddp, rank, world, device):
    """The training loop; returns the logged history (list of dicts)."""
    master, cuda, ckpt, cfg = rank == 0, device.type == "cuda", vars(args).pop("checkpoint"), vars(args).pop("config")
    torch.manual_seed(args.seed + rank)
    model = load_hf_checkpoint(args.init_from, args.attn, cfg) if args.init_from else RoFormerForMaskedLM(cfg, args.attn)
    n_params, matmul_rate = sum(p.numel() for p in model.parameters()), matmul_tflops(device) if cuda else 1
    stepped, optimizer, all_reduce = prepare(  # `model` itself is saved and evaluated: no "_orig_mod." prefix
        model.to(device), args, ddp, device, args.compile, args.cuda_graphs and (args.batch_size, args.seq_len))
    ckpt_path, step, seen, history = os.path.join(args.out, "ckpt.pt"), 0, [0] * world, []
    if ckpt:
        model.load_state_dict(ckpt["model"])  # copied in place, where the graphs read the weights
        optimizer.load_state_dict(ckpt["optimizer"])
        step, seen, history, rng = ckpt["step"], ckpt["seen"], ckpt["history"], ckpt["rng"][rank]
        torch.set_rng_state(rng["torch"])
        torch.cuda.set_rng_state(rng["cuda"]) if cuda else None
    rotate = not ckpt or ckpt["path"] == ckpt_path  # a ckpt.pt that failed to load is never kept over ckpt-prev.pt
    keys = ("step", "loss", "acc", "val_loss", "val_acc", "lr", "ms", "tok_s")

    def log(*rows, mode="a"):  # log.csv: each line appended as it is made, so that a kill or a crash loses none
        with open(os.path.join(args.out, "log.csv"), mode) as f:
            f.write("".join(",".join(str(r.get(k, "")) for k in keys) + "\n" for r in rows))
        history.extend(rows if mode == "a" else ())
    if master:  # the log as of the checkpoint (a killed run's later lines go); no partial save of a killed run
        log(dict(zip(keys, keys)), *history, mode="w")
        os.remove(ckpt_path + ".tmp") if os.path.exists(ckpt_path + ".tmp") else None
    train_batches = batches(args.data, args.seq_len, args.batch_size, rank, world, start=seen[rank])
    eval_batches = list(itertools.islice(batches(args.data, args.seq_len, args.batch_size, 0, 1, held_out=True),
                                         args.eval_batches))  # read once, kept
    if not eval_batches:
        sys.exit(f"--data has too little text for one held-out batch of {args.batch_size} x {args.seq_len}")
    if master:
        counts = torch.bincount(torch.cat([ids.flatten() for ids, _ in eval_batches]), minlength=VOCAB)[:256]  # bytes
        print(f"RoFormer MLM: {n_params:,} parameters, attn={args.attn}, {world} rank(s), device {device}, "
              f"batch {args.batch_size} x seq_len {args.seq_len} x {args.grad_accum} accumulation"
              + ", CUDA graphs" * args.cuda_graphs + ", torch.compile" * args.compile
              + f"\nbaseline: the most frequent token is right on {counts.max() / counts.sum():.1%} of tokens"
              + (f"; MFU: model FLOPs over a bf16 matmul's {matmul_rate:.0f} TF/s" if cuda else ""))
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * world
    stop_at = min(args.max_steps, step + args.stop_after) if args.stop_after else args.max_steps
    t0, first_step, timed_steps = time.perf_counter(), step, 0
    while step < stop_at:
        lr = args.lr * ((step + 1) / args.warmup if step < args.warmup  # linear warmup, then linear decay to 0
                        else max(0.0, (args.max_steps - step) / max(1, args.max_steps - args.warmup)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro_batches = [device_batch(*next(train_batches), args, torch.Generator().manual_seed(
            args.seed * 1_000_003 + (step * args.grad_accum + i) * world + rank), device) for i in range(args.grad_accum)]
        seen = [n + args.batch_size * args.grad_accum for n in seen]  # as many on every rank: no need to ask them
        loss, acc = train_step(stepped, optimizer, all_reduce, micro_batches, args)
        step, timed_steps = step + 1, timed_steps + 1
        timed_apart = step == first_step + 1  # the first step (traced and compiled), logs, evaluations, saves
        if logged := step % args.log_interval == 0 or step == args.max_steps:  # the step's loss: mean over ranks
            stats = torch.stack((loss, acc)) / world
            torch.distributed.all_reduce(stats) if ddp else None  # a sum of the ranks' shares (gloo has no mean)
            (loss, acc), dt, timed_apart = stats.tolist(), (time.perf_counter() - t0) / timed_steps, True
        if master and logged:
            log(dict(step=step, loss=loss, acc=acc, lr=lr, ms=dt * 1e3, tok_s=tokens_per_step / dt))
            mfu = flops_per_token(n_params, cfg, args.seq_len) * tokens_per_step / world / dt / 1e12 / matmul_rate
            gpu = f" | MFU {mfu:.1%} | peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if cuda else ""
            print(f"step {step:5d} | loss {loss:.4f} | masked acc {acc:.3f} | lr {lr:.2e} | {dt * 1e3:.0f} ms/step | "
                  f"{tokens_per_step / dt:.0f} tok/s{gpu}", flush=True)
        if master and (step % args.eval_interval == 0 or step == args.max_steps):
            (val_loss, val_acc), timed_apart = evaluate(model, eval_batches, args, device), True
            print(f"step {step:5d} | held-out loss {val_loss:.4f} | held-out masked acc {val_acc:.3f}", flush=True)
            log(dict(step=step, val_loss=val_loss, val_acc=val_acc))
        if step % args.ckpt_interval == 0 or step == stop_at:
            rngs = [dict(torch=torch.get_rng_state(), cuda=torch.cuda.get_rng_state(device) if cuda else None)] * world
            torch.distributed.all_gather_object(rngs, rngs[0]) if ddp else None
            if master:
                save_atomic(dict(model=model.state_dict(), optimizer=optimizer.state_dict(), step=step, seen=seen,
                                 rng=rngs, history=history, args=vars(args), config=dataclasses.asdict(cfg)),
                            ckpt_path, rotate)
            rotate = timed_apart = True
        if timed_apart:
            torch.cuda.synchronize(device) if cuda else None
            t0, timed_steps = time.perf_counter(), 0
    return history


@torch.no_grad()
def evaluate(model, eval_batches, args, device):
    """Held-out loss and masked accuracy, with the same masks at every evaluation."""
    model.eval()
    gen = torch.Generator().manual_seed(args.seed + 1)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        results = [model(**device_batch(ids, mask, args, gen, device)) for ids, mask in eval_batches]
    model.train()
    return tuple(torch.stack(r).mean().item() for r in zip(*results))


# %%
# Benchmark
# ---------
# Training steps at BERT-base's shape (batch 32 x 512 random tokens, no padding) on each path eager, compiled,
# graphed and both, and Hugging Face's model eager and compiled, in rounds of alternating order, against a bf16 matmul
# of the same run. A round: --bench-steps steps between two synchronizes, as many on every rank (not do_bench's).


def bench(args, ddp, rank, world, device):
    if not (cuda := device.type == "cuda") and rank == 0:
        print("NO GPU: a tiny model in Triton's interpreter; the numbers say nothing about speed.")
    seq, batch = (args.seq_len, args.batch_size) if cuda else (32, 2)
    cfg = RoFormerConfig(*((30522, 768, 12, 12, 3072) if cuda else (300, 32, 2, 2, 64)), 0, seq, pad_token_id=0)
    gen = torch.Generator().manual_seed(args.seed + rank)
    ids = torch.randint(1, cfg.vocab_size, (batch, seq), generator=gen)
    ours = device_batch(ids, torch.ones_like(ids, dtype=torch.bool), args, gen, device)  # masked as in training
    with torch.device("meta"):  # counted without allocating anything
        flops = flops_per_token(sum(p.numel() for p in RoFormerForMaskedLM(cfg).parameters()), cfg, seq) * batch * seq
    if not (transformers := importlib.util.find_spec("transformers") and importlib.import_module("transformers")):
        print("(transformers is not installed: Hugging Face's model is not benchmarked)")
    paths = [p for p in args.bench_paths if transformers or not p.startswith("hf")]
    rate, results = cuda and matmul_tflops(device), {p: dict(path=p, ms_by_round=[], peak_gib=0.0) for p in paths}
    hf_cfg = dataclasses.asdict(cfg) | dict(embedding_size=None, attention_probs_dropout_prob=0.0)
    for round_ in range(args.bench_rounds):
        for path in paths if round_ % 2 == 0 else paths[::-1]:
            torch.cuda.empty_cache()  # (nothing without a GPU)
            times, r, hf = [time.perf_counter()], results[path], path.startswith("hf")
            torch.manual_seed(args.seed)
            model = (transformers.RoFormerForMaskedLM(transformers.RoFormerConfig(**hf_cfg)) if hf
                     else RoFormerForMaskedLM(cfg, path.split("+")[0])).to(device)
            step = (*prepare(model, args, ddp, device, "+compile" in path, (batch, seq) if "+graphs" in path else None),
                    [dict(input_ids=ours["input_ids"], labels=ours["labels"]) if hf else ours], args)
            for n in (3, args.bench_steps):  # built, compiled (in the first round) and warmed up; then timed
                for _ in range(n):
                    train_step(*step)
                torch.cuda.synchronize(device) if cuda else None
                times.append(time.perf_counter())
            r.setdefault("build_s", times[1] - times[0])
            r["ms_by_round"].append((times[2] - times[1]) / args.bench_steps * 1e3)
            r["peak_gib"] = max(r["peak_gib"], torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0)
            r["ms"] = statistics.median(r["ms_by_round"])
            r["tokens_per_s"], r["of_matmul"] = batch * seq * world / r["ms"] * 1e3, flops / r["ms"] / 1e9 / (rate or 1)
            del model, step
            gc.collect()  # a graphed encoder refers to itself: only the collector frees it and its graphs
    base = next((results[p] for p in ("hf+compile", "hf") if p in results), None)
    for r in results.values() if rank == 0 else ():
        print(f"{r['path']:>21}: {r['ms']:7.1f} ms/step (rounds " + " / ".join(f"{m:.1f}" for m in r["ms_by_round"])
              + f") {r['tokens_per_s']:8.0f} tokens/s  build + 3 steps {r['build_s']:3.0f} s"
              + (f"  peak {r['peak_gib']:5.1f} GiB  {r['of_matmul']:4.0%} of a {rate:.0f} TF/s matmul" if cuda else "")
              + (f"  {r['tokens_per_s'] / base['tokens_per_s']:.2f}x {base['path']}" if base else ""))
    return list(results.values())


def main(argv=None):
    args = parse_args(argv)
    ddp, cuda = "RANK" in os.environ, torch.cuda.is_available()  # torchrun sets RANK: NCCL on GPUs, gloo on CPUs
    torch.distributed.init_process_group("nccl" if cuda else "gloo") if ddp else None
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if ddp else (0, 1)
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if cuda else "cpu")
    torch.cuda.set_device(device) if cuda else None
    try:
        result = (bench if args.bench else train)(args, ddp, rank, world, device)
    except torch.cuda.OutOfMemoryError:  # a clear message, not a stack trace from deep inside autograd
        raise SystemExit(f"out of GPU memory with --batch-size {args.batch_size} and --seq-len {args.seq_len}: "
                         f"lower --batch-size and raise --grad-accum to keep the tokens per step") from None
    except KeyboardInterrupt:  # Ctrl-C: a note, not a traceback, and the shell's status for it
        saved = not args.bench and os.path.exists(ckpt := os.path.join(args.out, "ckpt.pt"))
        print("interrupted" + f"; --resume goes on from {ckpt}" * saved, file=sys.stderr)
        raise SystemExit(130) from None
    if ddp:  # leave together, once nothing holds the group: a gloo group torn down while a rank works can abort it
        torch.distributed.barrier()
        gc.collect()
        torch.distributed.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
