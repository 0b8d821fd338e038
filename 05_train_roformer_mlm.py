"""
Pretraining a RoFormer masked language model on the collection's kernels
========================================================================

In this tutorial, you will learn about:

* a faithful RoFormer (Hugging Face's ``RoFormerForMaskedLM``, whose checkpoints load with
  ``--init-from``): post-LN layers with RoPE on q and k (interleaved pairs), an MLM head tied to
  the word embeddings, BERT masking;
* ``--attn``, which changes nothing but RoPE and attention: ``torch`` (03's plain-PyTorch RoPE +
  SDPA), ``naive`` (01's RoPE + SDPA), ``triton`` (03's RoPE + SDPA; 02's kernel at evaluation),
  ``fused`` (04);
* a nanoGPT-style loop: AdamW without decay on biases and norms, warmup then linear decay,
  gradient accumulation and clipping, bf16 autocast, durable checkpoints, an exact ``--resume``,
  torchrun's ranks through DDP;
* ``--compile`` and ``--cuda-graphs`` (both on with a GPU): Inductor fuses all between the matmuls
  and our kernels, and two CUDA graphs replay the encoder so that Python no longer paces the GPU
  (and their trap for gradient accumulation).

How to read this file. Part 1 is the lesson (about 30 minutes): the settings, the model with its
``--attn`` ladder, the data, the training step and the loop around it. Part 2 is the drop-in, what
a real run needs around that loop: checkpoints and an exact ``--resume``, Hugging Face checkpoints
(``--init-from``), CUDA graphs and their trap, and the model made ready to step (graphed, wrapped
in DDP under torchrun, compiled); skip it on a first read. Part 3 is the benchmark (``--bench``)
and ``main``, which starts torchrun's process group and runs the training or the benchmark.

Run ``python 05_train_roformer_mlm.py`` (a small model on the standard library's source); it loads
01-04 from beside it. Under torchrun (``torchrun --nproc_per_node=2 05_train_roformer_mlm.py``),
each GPU trains on its share of the batches with DDP.
"""

# %% Part 1 - the lesson
import argparse
import array
import contextlib
import dataclasses
import functools
import gc
import importlib.util
import itertools
import json
import math
import os
import signal
import statistics
import sys
import sysconfig
import tempfile
import time


def interrupted_while_loading(signum, frame):  # no traceback from inside torch's import
    print("interrupted", file=sys.stderr)
    os._exit(130)


if __name__ == "__main__":  # Ctrl-C while the modules load: one line, the shell's status for it
    signal.signal(signal.SIGINT, interrupted_while_loading)

import torch
import torch.nn as nn
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (here and by 01-04)
    if os.environ["TRITON_INTERPRET"] != "1":
        sys.exit("no GPU: Triton's kernels need one, or its interpreter (TRITON_INTERPRET=1)")
import triton


def load_step(filename):
    """01-04 start with digits: each is loaded by its path, once."""
    name = "rope_step_" + filename[:2]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(os.path.dirname(__file__), filename)
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before it runs, as import does: torch.compile finds it by name
        spec.loader.exec_module(module)
    return sys.modules[name]


naive_rope = load_step("01_rotate_half.py")
rope_fwd = load_step("02_rope_fwd.py")
rope_bwd = load_step("03_rope_bwd.py")
fused = load_step("04_rope_attention.py")
if __name__ == "__main__":  # loaded: Ctrl-C is KeyboardInterrupt again, which main() handles
    signal.signal(signal.SIGINT, signal.default_int_handler)
ATTN_PATHS = ("torch", "naive", "triton", "fused")  # --attn: RoPE + attention from 03, 01, 03, 04
VOCAB, PAD, CLS, SEP, MASK = 260, 256, 257, 258, 259  # the 256 bytes, then 4 special tokens

# %%
# Settings
# --------
# Plain defaults, as nanoGPT's train.py keeps them, from which parse_args builds the command line;
# each name is a flag (seq_len: --seq-len). A number has its default with a GPU (a small model that
# trains in minutes), beside it the one on a CPU (a tiny model: Triton's interpreter runs the
# kernels there), and its rule. A rule is a named check: its name is what --help and the error
# quote. NaN fails every rule, as it fails every comparison.
ON_GPU = torch.cuda.is_available()
RULES = {
    "v >= 0": lambda v: v >= 0,
    "v >= 1": lambda v: v >= 1,
    "v >= 2": lambda v: v >= 2,
    "v >= 8": lambda v: v >= 8,
    "0 < v < inf": lambda v: 0 < v < math.inf,
    "0 <= v < inf": lambda v: 0 <= v < math.inf,
    "0 < v <= 1": lambda v: 0 < v <= 1,
    "0 <= v < 1": lambda v: 0 <= v < 1,
}
NUMBERS = dict(  # name: (with a GPU, on a CPU, its rule)
    seq_len=(512, 64, "v >= 8"),
    batch_size=(32, 4, "v >= 1"),
    grad_accum=(1, 1, "v >= 1"),
    layers=(6, 2, "v >= 1"),
    hidden=(512, 64, "v >= 2"),
    heads=(8, 2, "v >= 1"),
    max_steps=(2000, 30, "v >= 1"),
    warmup=(100, 5, "v >= 0"),
    log_interval=(20, 5, "v >= 1"),
    eval_interval=(200, 10, "v >= 1"),
    eval_batches=(20, 2, "v >= 1"),
    ckpt_interval=(500, 10, "v >= 1"),
    stop_after=(0, 0, "v >= 0"),  # stop after this many steps, with a checkpoint (0: never)
    seed=(1337, 1337, "v >= 0"),
    bench_steps=(20, 1, "v >= 1"),
    bench_rounds=(2, 1, "v >= 1"),
    lr=(5e-4, 5e-4, "0 < v < inf"),
    clip=(1.0, 1.0, "0 < v < inf"),
    weight_decay=(0.01, 0.01, "0 <= v < inf"),
    mask_prob=(0.15, 0.15, "0 < v <= 1"),
    dropout=(0.1, 0.1, "0 <= v < 1"),
)


def parse_args(argv=None):
    """The settings, checked here before any work: a bad one ends the run with one line naming
    it."""
    parser = argparse.ArgumentParser(
        description="Pretrain a RoFormer masked LM on the collection's kernels.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.error = sys.exit  # argparse's errors: one line, exit status 1
    add = parser.add_argument
    add(
        "--attn",
        choices=ATTN_PATHS,
        default="fused" if ON_GPU else "torch",
        help="RoPE + attention; fused with a GPU (on a CPU the kernel paths run in Triton's "
        "interpreter: slowly)",
    )
    add(
        "--data",
        type=os.path.abspath,
        help="a text file (its bytes are the tokens); None: the stdlib's source",
    )
    add("--out", default="out-roformer", help="folder for one run's checkpoints and logs")
    add("--init-from", help="a Hugging Face RoFormer checkpoint directory")
    add(
        "--resume",
        action="store_true",
        help="continue the run in --out (from ckpt.pt, or ckpt-prev.pt if need be)",
    )
    on_off = argparse.BooleanOptionalAction
    add("--compile", action=on_off, default=ON_GPU, help="torch.compile the model (on with a GPU)")
    add("--cuda-graphs", action=on_off, default=ON_GPU, help="replay the encoder (on with a GPU)")
    add("--bench", action="store_true", help="time training steps at BERT-base's shape, then exit")
    add(
        "--bench-paths",
        metavar="P,Q",
        help="--bench only these, e.g. fused+compile+graphs,hf+compile",
    )
    for name, (gpu, cpu, rule) in NUMBERS.items():
        words = rule
        if gpu != cpu:
            words += f"; {gpu} on a GPU"
        if name == "stop_after":
            words += "; stop after this many steps, with a checkpoint (0: never)"
        default = gpu if ON_GPU else cpu
        add("--" + name.replace("_", "-"), type=type(gpu), default=default, help=words)
    args = parser.parse_args(argv)
    for name, (_, _, rule) in NUMBERS.items():
        value = getattr(args, name)
        if not RULES[rule](value):
            sys.exit(f"--{name.replace('_', '-')} must satisfy {rule}, got {value}")
    if args.init_from:
        cfg = hf_config(args.init_from)  # Part 2
    else:
        cfg = RoFormerConfig(VOCAB, args.hidden, args.layers, args.heads, 4 * args.hidden)
    cfg.hidden_dropout_prob = args.dropout  # a loaded model's too, as nanoGPT overrides it
    if args.cuda_graphs and not ON_GPU:
        sys.exit("--cuda-graphs needs a GPU (CUDA graphs); this machine has none")
    if args.data:
        check_text(args.data)
    if args.hidden % (2 * args.heads):
        sys.exit(f"--hidden {args.hidden} must be a multiple of 2 x --heads {args.heads}")
    d = cfg.hidden_size // cfg.num_attention_heads
    if args.attn == "fused" and not 16 <= d <= 128:
        sys.exit(f"--attn fused takes head dims of 16-128, not {d}")
    if not args.bench and args.seq_len > cfg.max_position_embeddings:  # --bench makes its own model
        sys.exit(
            f"--seq-len {args.seq_len} is over the model's {cfg.max_position_embeddings} positions"
        )
    if cfg.vocab_size < VOCAB:
        sys.exit(f"--init-from: a vocabulary of {cfg.vocab_size}, under 05's {VOCAB} tokens")
    args.bench_paths = bench_paths(args.bench_paths)  # Part 3
    checkpoint = None
    if not args.bench:
        check_out(args)  # Part 2
        if args.resume:
            checkpoint = read_checkpoint(args, dataclasses.asdict(cfg))  # read once, now
    args.checkpoint = checkpoint  # train() takes it and the config
    args.config = cfg
    return args


def check_text(path):
    """A text file, found now and not at the first batch; not a binary one (a model, an archive)."""
    if os.path.isdir(path):
        sys.exit(f"--data {path} is a folder: give one text file")
    if not os.path.isfile(path):
        sys.exit(f"--data {path}: no such file")
    head = next(documents(path), None) or b""  # its first MiB
    replaced = head.decode("utf-8", "replace").count("\ufffd")  # bytes that are not UTF-8
    binary = (head.count(0) + replaced) / len(head) if head else 0.0
    if binary > 0.1:
        sys.exit(f"--data {path}: {binary:.0%} of its first MiB is NUL or not UTF-8 (binary?)")


# %%
# The model
# ---------
# Hugging Face's module and parameter names, so that its checkpoints load as they are. All but
# attention is plain PyTorch, which Inductor (--compile) fuses into few kernels between matmuls
# (results/05_train_roformer_mlm_H100.md).


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
        self.heads = cfg.num_attention_heads
        self.attn = attn
        self.query, self.key, self.value = (
            nn.Linear(cfg.hidden_size, cfg.hidden_size) for _ in range(3)
        )

    def forward(self, x, freqs, mask):  # mask: [b, s], 1 = a real token, or None: no padding
        b, s, hidden = x.shape
        # One matmul for q, k and v: x is read, cast and saved for the backward once, not 3 times.
        projections = (self.query, self.key, self.value)
        weight = torch.cat([m.weight for m in projections])
        bias = torch.cat([m.bias for m in projections])
        qkv = F.linear(x, weight, bias).view(b, s, 3, self.heads, hidden // self.heads)
        if self.attn == "fused":
            # 04 rotates q and k inside attention and writes dq, dk, dv as one tensor; the triton
            # path runs 03 both ways and stacks SDPA's three (a copy), which outweighs cuDNN's lead
            # (results/05_train_roformer_mlm_H100.md).
            dtype = qkv.dtype if qkv.dtype in (torch.float16, torch.bfloat16) else torch.float16
            out = fused.rope_attention_qkvpacked(
                qkv.to(dtype), freqs, attention_mask=mask, interleaved=True
            )
            return out.to(qkv.dtype).reshape(b, s, hidden)
        q, k, v = qkv.unbind(2)
        # The other paths rotate q and k, then call SDPA. torch: PyTorch alone, 03's reference RoPE
        # (Hugging Face's own model is --bench's "hf"); naive: 01's, four passes over memory (9N);
        # triton: 03's kernel, one pass each way, and 02's forward-only kernel at evaluation.
        if self.attn == "torch":
            q, k = (
                rope_bwd.rope_reference(t, freqs, "bshd", interleaved=True, compute_dtype=None)
                for t in (q, k)
            )
        elif self.attn == "naive":
            q, k = (naive_rope.apply_rope_naive(t, freqs, "bshd", interleaved=True) for t in (q, k))
        elif torch.is_grad_enabled():
            q, k = rope_bwd.apply_rotary_pos_emb_qk(q, k, freqs, "bshd", interleaved=True)
        else:
            q, k = rope_fwd.rope_fwd_qk(q, k, freqs, "bshd", interleaved=True)
        attn_mask = None if mask is None else mask.bool()[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask
        )
        return out.transpose(1, 2).reshape(b, s, hidden)


class AddNorm(nn.Module):
    """dense -> dropout -> add the residual -> LayerNorm (post-LN). The residual stream stays bf16
    under autocast, as in Megatron-LM: compiled, the cast rides on LayerNorm's kernel, which writes
    half the bytes for the next matmul."""

    def __init__(self, d_in, cfg):
        super().__init__()
        self.dense = nn.Linear(d_in, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, h, residual):
        return self.LayerNorm(self.dropout(self.dense(h)) + residual).to(residual.dtype)


class RoFormerEncoder(nn.Module):
    def __init__(self, cfg, attn):
        super().__init__()
        self.layer = nn.ModuleList(nn.Module() for _ in range(cfg.num_hidden_layers))
        for layer in self.layer:  # plain modules as containers: Hugging Face's names
            layer.attention = nn.Module()
            layer.intermediate = nn.Module()
            layer.attention.self = RoFormerSelfAttention(cfg, attn)
            layer.attention.output = AddNorm(cfg.hidden_size, cfg)
            layer.output = AddNorm(cfg.intermediate_size, cfg)
            layer.intermediate.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        # RoFormer's angles (base 10000, interleaved pairs): a buffer, no weights
        freqs = rope_bwd.rope_freqs(cfg.max_position_embeddings, head_dim, 1e4, True)
        self.register_buffer("freqs", freqs, persistent=False)

    def forward(self, x, mask=None):
        for layer in self.layer:
            x = layer.attention.output(layer.attention.self(x, self.freqs, mask), x)
            x = layer.output(F.gelu(layer.intermediate.dense(x)), x)
        return x


class RoFormerForMaskedLM(nn.Module):
    def __init__(self, cfg, attn="torch"):
        super().__init__()
        if attn not in ATTN_PATHS:  # the command line checks it too; so must a direct call
            raise ValueError(f"attn must be one of {ATTN_PATHS}, got {attn!r}")
        self.cfg = cfg
        self.graphed = None  # Part 2's CUDA graphs: (their replay, the shape they take)
        emb = cfg.embedding_size or cfg.hidden_size
        self.roformer = nn.Module()
        e = self.roformer.embeddings = nn.Module()
        e.word_embeddings = nn.Embedding(cfg.vocab_size, emb, padding_idx=cfg.pad_token_id)
        e.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, emb)
        e.LayerNorm = nn.LayerNorm(emb, eps=cfg.layer_norm_eps)
        e.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.roformer.embeddings_project = (
            nn.Linear(emb, cfg.hidden_size) if emb != cfg.hidden_size else nn.Identity()
        )
        self.roformer.encoder = RoFormerEncoder(cfg, attn)
        self.cls = nn.Module()
        p = self.cls.predictions = nn.Module()
        t = p.transform = nn.Module()
        t.dense = nn.Linear(cfg.hidden_size, emb)
        t.LayerNorm = nn.LayerNorm(emb, eps=cfg.layer_norm_eps)
        p.decoder = nn.Linear(emb, cfg.vocab_size)
        p.decoder.weight = e.word_embeddings.weight  # tied
        for m in self.modules():  # BERT's init: normal(0, 0.02), zero biases, unit LayerNorm
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(
        self, input_ids, attention_mask=None, token_type_ids=None, labels=None, positions=None
    ):
        """Logits [b, s, vocab]; with labels (-100: not masked), (loss, accuracy) of the masked
        positions (positions: masked_positions(labels), if the caller has them).
        attention_mask: [b, s] or None."""
        e = self.roformer.embeddings
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        # token types as a sum of rows: a column sum in the backward, not atomic adds of every
        # token onto one row
        x = e.word_embeddings(input_ids) + sum(
            torch.where((types == t)[..., None], row, 0.0)
            for t, row in enumerate(e.token_type_embeddings.weight)
        )
        x = self.roformer.embeddings_project(e.dropout(e.LayerNorm(x)))
        if torch.is_autocast_enabled(x.device.type):  # the residual stream's dtype (AddNorm)
            x = x.to(torch.get_autocast_dtype(x.device.type))
        # Part 2's CUDA graphs replay the encoder in training, on unpadded batches of their shape
        replay, shape = self.graphed or (None, None)
        graphable = (x.shape, x.dtype) == (shape, torch.bfloat16) and attention_mask is None
        if graphable and self.training and torch.is_grad_enabled():
            x = replay(x)
        else:
            x = self.roformer.encoder(x, attention_mask)
        if labels is not None:
            if positions is None:
                positions = masked_positions(labels)
            x = x.flatten(0, 1)[positions]
            labels = labels.flatten()[positions]
        p = self.cls.predictions
        h = p.transform.LayerNorm(F.gelu(p.transform.dense(x)))
        # The decoder's rows padded to a multiple of 64, as nanoGPT pads GPT-2's: a bf16 row of
        # 30522 logits is not 16-byte aligned, and cuBLAS then runs without TMA (results/05_ab.log,
        # section M); compiled, the pad rides on the cast.
        pad = -p.decoder.weight.shape[0] % 64
        logits = F.linear(
            h, F.pad(p.decoder.weight, (0, 0, 0, pad)), F.pad(p.decoder.bias, (0, pad))
        )
        logits = logits[..., : logits.shape[-1] - pad]
        if labels is None:
            return logits
        return F.cross_entropy(logits.float(), labels), (logits.argmax(-1) == labels).float().mean()


# %%
# Data: text to packed, masked sequences
# --------------------------------------
# Bytes are the tokens. Documents (by default the Python standard library's source) stream in
# pieces, joined with [SEP] and cut into [CLS] + (seq_len - 2) tokens + [SEP] from one flat int32
# array (slices done in C: a Python list would be copied at every cut). Sequence i is held out if
# i % 50 == 0; the others go to the ranks a batch each in turn, masked by the batch's place, so
# that `world` ranks train on what one rank with `world` times the accumulation would; a rank's
# position in its stream is what a checkpoint stores.


def documents(path, block_bytes=1 << 20):
    """A document's bytes in pieces of block_bytes (a file that is one long line streams too),
    then None."""
    files = [path]
    if not path:  # the standard library's source
        stdlib = os.walk(sysconfig.get_paths()["stdlib"])
        files = sorted(
            os.path.join(d, f)
            for d, _, fs in stdlib
            for f in fs
            if f.endswith(".py") and "site-packages" not in d
        )
    for name in files:
        with open(name, "rb") as f:
            yield from iter(functools.partial(f.read, block_bytes), b"")
        yield None


def sequences(data, seq_len):
    """Packed token sequences of exactly seq_len and their real lengths."""
    body = seq_len - 2
    buf = array.array("i")
    cls = array.array("i", [CLS])
    sep = array.array("i", [SEP])
    for piece in documents(data):
        buf.extend(piece if piece is not None else [SEP])
        cut = len(buf) - len(buf) % body
        for start in range(0, cut, body):
            yield cls + buf[start : start + body] + sep, seq_len
        del buf[:cut]
    if buf:
        yield cls + buf + sep + array.array("i", [PAD] * (body - len(buf))), len(buf) + 2


def batches(data, seq_len, batch_size, rank, world, start=0, held_out=False):
    """Endless batches (input_ids, attention_mask) of this rank's share of the training sequences
    after its first `start` (across epochs; a batch runs on over an epoch's end: none dropped);
    held_out=True: the held-out, once."""
    ids = array.array("i")
    lengths = []
    index = itertools.count()  # of a sequence in the stream of epochs
    epochs = range(1) if held_out else itertools.count()  # training: epoch after epoch
    for _ in epochs:
        found = 0
        split = (s for i, s in enumerate(sequences(data, seq_len)) if (i % 50 == 0) == held_out)
        for seq, n in split:
            found += 1
            if next(index) // batch_size % world != rank:  # another rank's
                continue
            if start > 0:  # seen before the checkpoint
                start -= 1
                continue
            ids.extend(seq)
            lengths.append(n)
            if len(lengths) == batch_size:
                yield (
                    torch.frombuffer(ids, dtype=torch.int32).view(batch_size, seq_len).long(),
                    torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None],
                )
                ids = array.array("i")
                lengths = []
        if not found:
            sys.exit(f"--data has too little text: no sequence of {seq_len} tokens")


def to_device(batch_tensor, device):
    """Through pinned memory, as in nanoGPT: a copy from pageable memory ends in a synchronize
    (a host stall)."""
    if device.type == "cuda":
        return batch_tensor.pin_memory().to(device, non_blocking=True)
    return batch_tensor.to(device)


def masked_positions(labels):
    """The MLM head's rows: their number sets the shapes that follow, so training finds them on
    the host."""
    return (labels.flatten() != -100).nonzero().squeeze(1)


def device_batch(ids, mask, args, generator, device):
    """The model's arguments for a batch (ids, attention mask [b, s]), BERT-masked, on the device:
    --mask-prob of the real tokens but [CLS] and [SEP] are chosen, 80% become [MASK], 10% a random
    byte, 10% stay; labels -100 elsewhere. No mask for a batch without padding (packed text pads
    its last sequence), as Hugging Face drops it for SDPA."""
    chosen = (
        (torch.rand(ids.shape, generator=generator) < args.mask_prob)
        & mask
        & (ids != CLS)
        & (ids != SEP)
    )
    r = torch.rand(ids.shape, generator=generator)
    random_byte = chosen & (r >= 0.8) & (r < 0.9)
    inputs = torch.where(random_byte, torch.randint(0, 256, ids.shape, generator=generator), ids)
    inputs = torch.where(chosen & (r < 0.8), MASK, inputs)
    labels = torch.where(chosen, ids, -100)
    positions = to_device(masked_positions(labels), device)
    torch._dynamo.maybe_mark_dynamic(positions, 0)  # a number that changes: compiled once for all
    attention_mask = None if bool(mask.all()) else to_device(mask, device)
    return dict(
        input_ids=to_device(inputs, device),
        labels=to_device(labels, device),
        positions=positions,
        attention_mask=attention_mask,
    )


# %%
# Training
# --------
# The step, train_step: each micro-batch's forward and backward (the gradients add up over them),
# the clip, AdamW's step; --bench (Part 3) times this same function. The loop, train: the learning
# rate, the micro-batches dealt to the ranks, the step, then logs, evaluations and checkpoints.
# MFU is the model's FLOPs over a bf16 matmul's rate, measured in the same run.


def flops_per_token(n_params, cfg, seq_len):
    """6 a parameter, plus attention's QK^T and PV (PaLM's appendix B): the model's FLOPs as
    Hugging Face's model does them, the MLM head on every token (ours runs it on the masked)."""
    return 6 * n_params + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq_len


def matmul_tflops(device):
    """The yardstick, measured in this run: a bf16 8192^3 matmul's TF/s."""
    gen = torch.Generator(device).manual_seed(0)  # its own: the run's RNG stream stays untouched
    a, b = (
        torch.randn(8192, 8192, device=device, dtype=torch.bfloat16, generator=gen)
        for _ in range(2)
    )
    return 2 * 8192**3 / triton.testing.do_bench(lambda: a @ b, return_mode="median") / 1e9


def adamw(model, args, cuda):
    """AdamW as nanoGPT sets it up: weight decay on the matrices only (not on biases and
    norms), fused on a GPU."""
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2]},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=args.weight_decay, fused=cuda
    )


# %%
# The step and the loop
# ---------------------
# The loop trains `stepped`, the model as Part 2's prepare() hands it over: on the device, its
# encoder replayed from CUDA graphs, wrapped in DDP under torchrun (which averages the gradients
# over the ranks), compiled; the same parameters as `model`, which is saved and evaluated. One
# trap of the graphs: a replay hands out weight gradients in the graph's own buffers, so with
# accumulation each .grad must stay allocated between steps (zero_grad(set_to_none=False)). The
# step is one function, which --bench (Part 3) times as the loop runs it.


def train_step(model, optimizer, micro_batches, args, ddp):
    """One optimizer step, the loop's and the one --bench times; the mean loss and masked accuracy
    of the micro-batches, left on the device. model: prepare()'s (Part 2), wrapped in DDP under
    torchrun, which averages the gradients over the ranks during the last micro-batch's backward."""
    n = len(micro_batches)
    loss_sum = 0.0
    acc_sum = 0.0
    for i, batch in enumerate(micro_batches):
        # before the last micro-batch, the gradients add up on each rank; no all-reduce (no_sync)
        with model.no_sync() if ddp and i < n - 1 else contextlib.nullcontext():
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=batch["input_ids"].is_cuda):
                out = model(**batch)
            # Hugging Face's model (--bench's "hf") returns an object
            loss, acc = (out.loss, 0.0) if hasattr(out, "loss") else out
            (loss / n).backward()
        loss_sum += loss.detach() / n
        acc_sum += acc / n
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=not (args.cuda_graphs and n > 1))  # capture_cuda_graphs' trap
    return loss_sum, acc_sum


def stop_diverged(step, what, args):
    """A non-finite loss or parameter: the run ends before any save, with the last good
    checkpoint kept (a diverging run would otherwise overwrite both)."""
    ckpt = os.path.join(args.out, "ckpt.pt")
    kept = "no checkpoint was written"
    if os.path.exists(ckpt):
        kept = f"the last good checkpoint, {ckpt}, is kept"
    sys.exit(
        f"step {step}: {what} is not finite; stopped without saving ({kept}); "
        f"a lower --lr than {args.lr:g} may help"
    )


def train(args, ddp, rank, world, device):
    """The training run; returns the logged history (list of dicts)."""
    checkpoint = vars(args).pop("checkpoint")
    cfg = vars(args).pop("config")
    master = rank == 0
    cuda = device.type == "cuda"
    torch.manual_seed(args.seed + rank)
    # the held-out batches first: too little text is told before compiling or graph capture
    held_out = batches(args.data, args.seq_len, args.batch_size, 0, 1, held_out=True)
    eval_batches = list(itertools.islice(held_out, args.eval_batches))  # read once, kept
    if not eval_batches:  # sequence i is held out when i % 50 == 0
        needed = 50 * args.batch_size * (args.seq_len - 2)
        data = f"--data {args.data}"
        if not args.data:
            data = "the standard library's source (the default --data)"
        sys.exit(
            f"{data} has too little text for one held-out batch of --batch-size "
            f"{args.batch_size} x --seq-len {args.seq_len}: about {needed:,} bytes are needed"
        )
    if args.init_from:
        model = load_hf_checkpoint(args.init_from, args.attn, cfg)  # Part 2
    else:
        model = RoFormerForMaskedLM(cfg, args.attn)
    n_params = sum(p.numel() for p in model.parameters())
    matmul_rate = matmul_tflops(device) if cuda else 1.0  # MFU's yardstick
    # on the device, graphed, DDP under torchrun, compiled (Part 2); `model` itself is saved and
    # evaluated: no "module." or "_orig_mod." prefix
    stepped, optimizer = prepare(model, args, ddp, device, args.compile, args.cuda_graphs)
    step = 0
    seen = [0] * world  # each rank's place in its stream of training sequences
    history = []
    if checkpoint is not None:  # --resume: copied in place, where the graphs and DDP read them
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        step = checkpoint["step"]
        seen = checkpoint["seen"]
        history = checkpoint["history"]
        rng = checkpoint["rng"][rank]
        torch.set_rng_state(rng["torch"])
        if cuda:
            torch.cuda.set_rng_state(rng["cuda"])
    ckpt_path = os.path.join(args.out, "ckpt.pt")
    # rotate: ckpt.pt becomes ckpt-prev.pt at a save, unless it failed to load (then it is replaced)
    rotate = checkpoint is None or checkpoint["path"] == ckpt_path
    keys = ("step", "loss", "acc", "val_loss", "val_acc", "lr", "ms", "tok_s")

    def log(*rows, mode="a"):  # log.csv: a line appended as it is made, so that a kill loses none
        with open(os.path.join(args.out, "log.csv"), mode) as f:
            f.writelines(",".join(str(r.get(k, "")) for k in keys) + "\n" for r in rows)
        if mode == "a":
            history.extend(rows)

    # the log as of the checkpoint (a killed run's later lines go); no partial save of a killed run
    if master:
        log(dict(zip(keys, keys)), *history, mode="w")
        if os.path.exists(ckpt_path + ".tmp"):
            os.remove(ckpt_path + ".tmp")
    train_batches = batches(args.data, args.seq_len, args.batch_size, rank, world, start=seen[rank])
    if master:
        counts = torch.bincount(
            torch.cat([ids.flatten() for ids, _ in eval_batches]), minlength=VOCAB
        )[:256]
        graphs = ", CUDA graphs" if args.cuda_graphs else ""
        compiled = ", torch.compile" if args.compile else ""
        yardstick = ""
        if cuda:
            yardstick = f"; MFU: model FLOPs over a bf16 matmul's {matmul_rate:.0f} TF/s"
        else:  # measured: results/cpu_runs.log
            yardstick = (
                "\non a CPU the default 30 steps test the loop, logs and checkpoints; held-out "
                "accuracy passes the baseline after about 500 steps (try --max-steps 4000)"
            )
        print(
            f"RoFormer MLM: {n_params:,} parameters, attn={args.attn}, {world} rank(s), "
            f"device {device}, batch {args.batch_size} x seq_len {args.seq_len} x "
            f"{args.grad_accum} accumulation{graphs}{compiled}\nbaseline: the most frequent "
            f"token is right on {counts.max() / counts.sum():.1%} of tokens{yardstick}"
        )
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * world
    stop_at = min(args.max_steps, step + args.stop_after) if args.stop_after else args.max_steps
    first_step = step
    timed_steps = 0
    # SIGTERM (how schedulers and preemption stop a job): the step ends, is saved and logged, and
    # the run exits with the shell's status for it, 143
    terminated = []
    previous_handler = signal.signal(signal.SIGTERM, lambda *_: terminated.append(True))
    t0 = time.perf_counter()
    while step < stop_at and not terminated:
        if step < args.warmup:  # linear warmup, then linear decay to 0
            lr = args.lr * ((step + 1) / args.warmup)
        else:
            lr = args.lr * max(0.0, (args.max_steps - step) / max(1, args.max_steps - args.warmup))
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro_batches = []
        # masks drawn by the micro-batch's place: the same on resume, or on 1 rank
        for i in range(args.grad_accum):
            place = (step * args.grad_accum + i) * world + rank
            gen = torch.Generator().manual_seed(args.seed * 1_000_003 + place)
            micro_batches.append(device_batch(*next(train_batches), args, gen, device))
        # as many on every rank: no need to ask them
        seen = [n + args.batch_size * args.grad_accum for n in seen]
        loss, acc = train_step(stepped, optimizer, micro_batches, args, ddp)
        step += 1
        timed_steps += 1
        # timed apart from ms/step: the first step (traced and compiled), logs, evaluations, saves
        timed_apart = step == first_step + 1
        logged = step % args.log_interval == 0 or step == args.max_steps
        if logged:  # the step's loss: the mean over ranks
            stats = torch.stack((loss, acc)) / world
            if ddp:
                torch.distributed.all_reduce(stats)  # a sum of the ranks' shares (gloo has no mean)
            loss, acc = stats.tolist()
            # A diverged run is caught where the loss is read anyway (no sync of its own under
            # CUDA graphs and compile), and before each save by one check of the parameters: a
            # NaN may train on for up to --log-interval steps, but never reaches a checkpoint.
            if not math.isfinite(loss):
                stop_diverged(step, f"the loss ({loss})", args)
            dt = (time.perf_counter() - t0) / timed_steps
            timed_apart = True
        if master and logged:
            log(dict(step=step, loss=loss, acc=acc, lr=lr, ms=dt * 1e3, tok_s=tokens_per_step / dt))
            flops = flops_per_token(n_params, cfg, args.seq_len) * tokens_per_step / world
            mfu = flops / dt / 1e12 / matmul_rate
            gpu = ""
            if cuda:
                gpu = f" | MFU {mfu:.1%} | peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
            print(
                f"step {step:5d} | loss {loss:.4f} | masked acc {acc:.3f} | lr {lr:.2e} | "
                f"{dt * 1e3:.0f} ms/step | {tokens_per_step / dt:.0f} tok/s{gpu}",
                flush=True,
            )
        if master and (step % args.eval_interval == 0 or step == args.max_steps):
            val_loss, val_acc = evaluate(model, eval_batches, args, device)
            print(
                f"step {step:5d} | held-out loss {val_loss:.4f} | "
                f"held-out masked acc {val_acc:.3f}",
                flush=True,
            )
            log(dict(step=step, val_loss=val_loss, val_acc=val_acc))
            timed_apart = True
        if step % args.ckpt_interval == 0 or step == stop_at or terminated:
            # a sync beside the save's own: every rank holds the same parameters under DDP
            if not torch.stack([p.isfinite().all() for p in model.parameters()]).all():
                stop_diverged(step, "a parameter", args)
            # every rank's RNG states (its dropout masks), for an exact resume
            cuda_rng = torch.cuda.get_rng_state(device) if cuda else None
            rngs = [dict(torch=torch.get_rng_state(), cuda=cuda_rng)] * world
            if ddp:
                torch.distributed.all_gather_object(rngs, rngs[0])
            if master:
                run = dict(
                    model=model.state_dict(),
                    optimizer=optimizer.state_dict(),
                    step=step,
                    seen=seen,
                    rng=rngs,
                    history=history,
                    args=vars(args),
                    config=dataclasses.asdict(cfg),
                )
                save_atomic(run, ckpt_path, rotate)
            rotate = True
            timed_apart = True
        if timed_apart:
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            timed_steps = 0
    signal.signal(signal.SIGTERM, previous_handler)
    if master and not terminated:
        print(f"saved {ckpt_path} (step {step}) and {os.path.join(args.out, 'log.csv')}")
    if terminated:
        print(f"terminated; --resume goes on from {ckpt_path} (step {step})", file=sys.stderr)
        raise SystemExit(143)
    return history


@torch.no_grad()
def evaluate(model, eval_batches, args, device):
    """Held-out loss and masked accuracy, with the same masks at every evaluation."""
    model.eval()
    gen = torch.Generator().manual_seed(args.seed + 1)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        results = [
            model(**device_batch(ids, mask, args, gen, device)) for ids, mask in eval_batches
        ]
    model.train()
    return tuple(torch.stack(r).mean().item() for r in zip(*results))


# %% Part 2 - the drop-in
# What a real run needs around Part 1's loop, a cell each:
# - checkpoints that a kill at any moment leaves whole, and an exact --resume: a stopped run goes
#   on with the losses it would have had;
# - Hugging Face's RoFormer checkpoints (--init-from): a pretrained model to go on from;
# - CUDA graphs of the encoder (--cuda-graphs): one call replays its hundreds of kernels, so that
#   Python no longer paces the GPU; and their trap for gradient accumulation;
# - the model made ready to step: graphed, wrapped in DDP under torchrun (data parallel over the
#   GPUs, the gradients all-reduced during the backward), compiled.
# The figures are on results/05_train_roformer_mlm_H100.md, _H200.md and 05_ddp_H200x2.md.

# %%
# Checkpoints and --resume
# ------------------------
# A save writes a temporary file, fsynced, then renames ckpt.pt to ckpt-prev.pt and the new one to
# ckpt.pt, and fsyncs the folder: a kill at any point leaves ckpt.pt or ckpt-prev.pt whole. A
# checkpoint holds every rank's RNG states and place in its data: a resumed run draws what the
# uninterrupted one would. torch.load(weights_only=True) refuses all but tensors, numbers,
# strings and containers: a checkpoint from elsewhere runs no code.


def check_out(args):
    """--out writable, found now and not at the first checkpoint; a run in it (ckpt.pt or
    ckpt-prev.pt; log.csv is remade) goes on with --resume only."""
    try:
        os.makedirs(args.out, exist_ok=True)
        tempfile.TemporaryFile(dir=args.out).close()
    except OSError as e:
        sys.exit(f"--out {args.out}: not writable ({e.strerror or e})")
    run = [f for f in ("ckpt.pt", "ckpt-prev.pt") if os.path.exists(os.path.join(args.out, f))]
    if run and not args.resume:
        sys.exit(
            f"--out {args.out} holds a run ({', '.join(run)}): "
            "go on with --resume, or choose another --out"
        )


def load_checkpoint(path):
    """(the checkpoint at path, None), or (None, what is wrong with it)."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated or corrupt: EOFError, RuntimeError, zip errors
        if isinstance(e, FileNotFoundError):
            return None, "no such file"
        found = [s.split()[0] for s in str(e).split("GLOBAL ")[1:]]  # what weights_only refused
        if found:
            return (
                None,
                f"holds Python objects ({', '.join(found)}), which could run code: not loaded",
            )
        return (
            None,
            f"unreadable ({type(e).__name__}: {str(e).split('. ')[0][:200]}); "
            "truncated or corrupt?",
        )
    keys = {"model", "optimizer", "step", "seen", "rng", "history", "args", "config"}
    if not isinstance(ckpt, dict) or not keys <= set(ckpt):
        return None, "not a checkpoint of this script"
    return ckpt, None


def read_checkpoint(args, config):
    """--out's ckpt.pt (ckpt-prev.pt if it is broken), whose model, ranks and data must be this
    run's; the other settings may change, with a note."""
    path = os.path.join(args.out, "ckpt.pt")
    prev = os.path.join(args.out, "ckpt-prev.pt")
    ckpt, problem = load_checkpoint(path)
    if problem:
        ckpt, problem_prev = load_checkpoint(prev)
        if problem_prev:
            also = f"; {prev}: {problem_prev}" if os.path.exists(prev) else ""
            sys.exit(f"--resume: {path}: {problem}{also}")
        print(
            f"WARNING --resume: {path}: {problem}. "
            f"Resuming from {prev} (step {ckpt['step']}) instead.",
            flush=True,
        )
        path = prev
    old = dict(ckpt["args"], **ckpt["config"], nproc_per_node=len(ckpt["seen"]))
    new = dict(vars(args), **config, nproc_per_node=int(os.environ.get("WORLD_SIZE", 1)))
    data = ["data", "seq_len", "batch_size", "grad_accum", "mask_prob", "seed", "nproc_per_node"]
    fixed = [*config, *data]  # the model, and what places the checkpoint in the data stream

    def differ(keys):  # a setting's name: its flag, or the model config's field
        return ", ".join(
            f"{'--' + k.replace('_', '-') if k in args else k} "
            f"{old.get(k)!r} there, {new[k]!r} here"
            for k in keys
            if old.get(k) != new[k]
        )

    bad = differ(fixed)
    if bad:
        sys.exit(
            f"--resume: {path} is of another model or data stream, "
            f"where its place means nothing ({bad})"
        )
    changed = differ(k for k in new if k not in (*fixed, "resume", "stop_after", "bench_paths"))
    schedule = ("max_steps", "warmup", "lr")
    if any(f"--{k.replace('_', '-')} " in changed for k in schedule):
        changed += "; the learning-rate schedule follows the new values from here"
    if changed:
        print(f"note --resume: {changed}", flush=True)
    if ckpt["step"] >= args.max_steps:
        print(
            f"note --resume: {path} is at step {ckpt['step']}, --max-steps is {args.max_steps}: "
            "nothing to train (raise --max-steps to go on)",
            flush=True,
        )
    return dict(ckpt, path=path)


def save_atomic(obj, path, rotate=True):
    """rotate=False: ckpt.pt is replaced, not kept as ckpt-prev.pt (after it failed to load)."""
    try:
        with open(path + ".tmp", "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:  # Ctrl-C, a full disk: no partial file is left
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")
        if isinstance(e, OSError) or "unexpected pos" in str(
            e
        ):  # torch's zip writer: a failed write
            why = getattr(e, "strerror", None) or "disk full?"
            sys.exit(f"--out: {path} not written ({why}); the earlier ones kept")
        raise
    if rotate and os.path.exists(path):
        os.replace(path, path[:-3] + "-prev.pt")
    os.replace(path + ".tmp", path)
    if hasattr(os, "O_DIRECTORY"):  # POSIX: the renames made durable too
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(fd)
        os.close(fd)


# %%
# Hugging Face checkpoints (--init-from)
# --------------------------------------


def hf_config(path):
    """The RoFormerConfig of a Hugging Face RoFormer folder; anything wrong ends the run with
    one line."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:  # no folder, no file, no JSON
        if not os.path.isdir(path):
            sys.exit(f"--init-from {path}: no such folder")
        sys.exit(f"--init-from {path}: config.json: {e}")
    if hf.get("model_type") != "roformer":
        sys.exit(f"--init-from {path}: not a RoFormer (model_type {hf.get('model_type')!r})")
    if hf.get("rotary_value") or hf.get("is_decoder") or hf.get("hidden_act", "gelu") != "gelu":
        sys.exit(
            f"--init-from {path}: only encoder RoFormers with rotary_value=False and "
            "hidden_act='gelu' are supported"
        )
    if not any(
        os.path.isfile(os.path.join(path, f)) for f in ("model.safetensors", "pytorch_model.bin")
    ):
        sys.exit(f"--init-from {path}: no model.safetensors or pytorch_model.bin")
    fields = {f.name for f in dataclasses.fields(RoFormerConfig)}
    return RoFormerConfig(**{k: v for k, v in hf.items() if k in fields and v is not None})


def load_hf_checkpoint(path, attn, cfg=None):
    """Our model with the weights of a Hugging Face RoFormer folder (cfg: its hf_config, if
    read already)."""
    model = RoFormerForMaskedLM(cfg or hf_config(path), attn)
    weights = os.path.join(path, "model.safetensors")
    try:
        if os.path.isfile(weights):  # safetensors comes with transformers
            state = importlib.import_module("safetensors.torch").load_file(weights)
        else:
            weights = os.path.join(path, "pytorch_model.bin")
            state = torch.load(weights, map_location="cpu", weights_only=True)
    except ModuleNotFoundError:
        sys.exit(f"--init-from {path}: reading model.safetensors needs: pip install safetensors")
    except Exception as e:  # truncated, random or foreign bytes: safetensors' or pickle's error
        why = str(e).strip().splitlines()[0]
        sys.exit(f"--init-from {path}: {weights} is not a weights file ({type(e).__name__}: {why})")
    state = {k: v for k, v in state.items() if "embed_positions" not in k}  # sinusoidal: recomputed
    state.setdefault("cls.predictions.decoder.bias", state.pop("cls.predictions.bias", None))
    state.setdefault(
        "cls.predictions.decoder.weight", state.get("roformer.embeddings.word_embeddings.weight")
    )
    missing, unexpected = model.load_state_dict(
        {k: v for k, v in state.items() if v is not None}, strict=False
    )
    if missing or unexpected:
        sys.exit(
            f"--init-from {path}: the weights do not fit: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return model


# %%
# CUDA graphs (--cuda-graphs) and their trap
# ------------------------------------------


def capture_cuda_graphs(model, batch_size, seq_len, compiled=False):
    """The encoder's forward and backward as two CUDA graphs (compiled first if compiled): a
    replay issues hundreds of kernels in one call, where each eager op costs the host microseconds.
    Another shape, padding or evaluation runs the layers."""
    shape = (batch_size, seq_len, model.cfg.hidden_size)
    rng = torch.cuda.get_rng_state()
    sample = torch.zeros(
        shape, device=model.roformer.encoder.freqs.device, dtype=torch.bfloat16, requires_grad=True
    )
    # the warm-up's stream-mismatch warning: a false alarm
    if hasattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch"):
        torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(False)
    gc.collect()  # a graph freed during another's capture breaks it: collect now, not during it
    gc.disable()
    try:
        # one compiled graph (Inductor fuses across the seams) in a plain module, whose forward
        # the graphs take over; autocast's cache off, as graphs need
        encoder = torch.compile(model.roformer.encoder) if compiled else model.roformer.encoder
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            replay = torch.cuda.make_graphed_callables(nn.Sequential(encoder), (sample,))
    finally:
        gc.enable()
    torch.cuda.set_rng_state(rng)  # the warm-up drew dropout masks: a resumed run must not see it
    # A tuple, no submodule: the state dict is unchanged. torch.compile of the model breaks at the
    # replay.
    model.graphed = (torch._dynamo.disable(replay.forward), shape)
    # The trap: a replay hands out weight gradients in its own buffers, which the next replay
    # overwrites; a parameter with no .grad adopts them, and a 2nd micro-batch would overwrite the
    # 1st's (tests/test_05). So each .grad starts allocated, and train_step zeroes the gradients in
    # place (not set_to_none) when a step accumulates micro-batches.
    for param in model.parameters():
        param.grad = torch.zeros_like(param)


# %%
# The model ready to step: graphed, DDP under torchrun, compiled
# -------------------------------------------------------------


def prepare(model, args, ddp, device, compiled, graphed):
    """The model as train_step takes it, and its AdamW: on the device, its encoder captured
    (graphed) at --batch-size x --seq-len, then DDP's wrapper under torchrun, then torch.compile of
    the whole, DDP included (nanoGPT wraps the compiled model in DDP instead); aot_eager on the CPU,
    where Triton's interpreter runs the kernels; 03's and 04's ops stay opaque."""
    cuda = device.type == "cuda"
    model.to(device)
    if cuda:  # the peak memory counts the capture (replays allocate nothing)
        torch.cuda.reset_peak_memory_stats(device)
    optimizer = adamw(model, args, cuda)
    if graphed:
        capture_cuda_graphs(model, args.batch_size, args.seq_len, compiled=compiled)
    if ddp:
        # DDP broadcasts rank 0's weights, then all-reduces the gradients in buckets during the
        # backward, each bucket as soon as its gradients are in. gradient_as_bucket_view: each .grad
        # is a view of its bucket, not a second copy (a replay's gradients, in the graph's own
        # buffers, are copied in: results/05_ddp_H200x2.md). The one buffer, RoPE's angles, is the
        # same on every rank: none is broadcast at each step.
        model = nn.parallel.DistributedDataParallel(
            model,
            device_ids=[device] if cuda else None,
            gradient_as_bucket_view=True,
            broadcast_buffers=False,
        )
        # Dynamo compiles one graph, not one per bucket: faster (results/05_ddp_split.log)
        torch._dynamo.config.optimize_ddp = False
    if compiled:
        model = torch.compile(model, backend="inductor" if cuda else "aot_eager")
    return model, optimizer


# %% Part 3 - check and benchmark
# 05's checks are its tests (tests/test_05_train_roformer_mlm.py). The benchmark (--bench): Part 1's
# train_step at BERT-base's shape (batch 32 x 512 random tokens, no padding) on each path eager,
# compiled, graphed and both, and on Hugging Face's model eager and compiled, in rounds of
# alternating order, against a bf16 matmul of the same run. A round: --bench-steps steps between
# two synchronizes, as many on every rank (not do_bench's time budget). Then main.


def bench_paths(requested):
    """The paths --bench runs (requested: --bench-paths, "P,Q"; None: all), in its order; an
    unknown one ends the run."""
    graphed = ("+graphs", "+compile+graphs") if ON_GPU else ()  # CUDA graphs need a GPU
    modes = ("", "+compile", *graphed)
    paths = [attn + mode for attn in ATTN_PATHS for mode in modes] + ["hf", "hf+compile"]
    chosen = (requested or "").split(",")
    unknown = set(chosen) - {"", *paths}
    if unknown:
        sys.exit(f"--bench-paths: {', '.join(sorted(unknown))} not among {', '.join(paths)}")
    return [p for p in paths if not requested or p in chosen]


def bench(args, ddp, rank, world, device):
    """Each of args.bench_paths timed in rounds; a dict of results per path (ms a step, tokens/s,
    peak memory, ...)."""
    cuda = device.type == "cuda"
    if not cuda and rank == 0:
        print("NO GPU: a tiny model in Triton's interpreter; the numbers say nothing about speed.")
    seq, batch = (args.seq_len, args.batch_size) if cuda else (32, 2)
    sizes = (30522, 768, 12, 12, 3072) if cuda else (300, 32, 2, 2, 64)  # BERT-base's on a GPU
    cfg = RoFormerConfig(*sizes, 0, seq, pad_token_id=0)
    gen = torch.Generator().manual_seed(args.seed + rank)
    ids = torch.randint(1, cfg.vocab_size, (batch, seq), generator=gen)
    ours = device_batch(ids, torch.ones_like(ids, dtype=torch.bool), args, gen, device)  # masked
    with torch.device("meta"):  # counted without allocating anything
        n_params = sum(p.numel() for p in RoFormerForMaskedLM(cfg).parameters())
    flops = flops_per_token(n_params, cfg, seq) * batch * seq
    try:
        import transformers
    except ImportError:
        transformers = None
        print("(transformers is not installed: Hugging Face's model is not benchmarked)")
    paths = [p for p in args.bench_paths if transformers or not p.startswith("hf")]
    rate = matmul_tflops(device) if cuda else 1.0
    results = {p: dict(path=p, ms_by_round=[], peak_gib=0.0) for p in paths}
    hf_cfg = dataclasses.asdict(cfg) | dict(embedding_size=None, attention_probs_dropout_prob=0.0)
    for round_ in range(args.bench_rounds):
        for path in paths if round_ % 2 == 0 else paths[::-1]:
            torch.cuda.empty_cache()  # (nothing without a GPU)
            times = [time.perf_counter()]
            r = results[path]
            torch.manual_seed(args.seed)
            if path.startswith("hf"):
                model = transformers.RoFormerForMaskedLM(transformers.RoFormerConfig(**hf_cfg))
                micro_batches = [dict(input_ids=ours["input_ids"], labels=ours["labels"])]
            else:
                model = RoFormerForMaskedLM(cfg, path.split("+")[0])
                micro_batches = [ours]
            stepped, optimizer = prepare(
                model, args, ddp, device, "+compile" in path, "+graphs" in path
            )
            for n in (3, args.bench_steps):  # built, compiled (round 1) and warmed up; then timed
                for _ in range(n):
                    train_step(stepped, optimizer, micro_batches, args, ddp)
                if cuda:
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter())
            r.setdefault("build_s", times[1] - times[0])
            r["ms_by_round"].append((times[2] - times[1]) / args.bench_steps * 1e3)
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
            r["peak_gib"] = max(r["peak_gib"], peak)
            r["ms"] = statistics.median(r["ms_by_round"])
            r["tokens_per_s"] = batch * seq * world / r["ms"] * 1e3
            r["of_matmul"] = flops / r["ms"] / 1e9 / rate
            del model, optimizer, stepped
            gc.collect()  # a graphed encoder refers to itself: only the collector frees its graphs
    base = next((results[p] for p in ("hf+compile", "hf") if p in results), None)
    for r in results.values() if rank == 0 else ():
        rounds = " / ".join(f"{m:.1f}" for m in r["ms_by_round"])
        gpu = ""
        if cuda:
            peak = f"  peak {r['peak_gib']:5.1f} GiB"
            gpu = f"{peak}  {r['of_matmul']:4.0%} of a {rate:.0f} TF/s matmul"
        ratio = f"  {r['tokens_per_s'] / base['tokens_per_s']:.2f}x {base['path']}" if base else ""
        print(
            f"{r['path']:>21}: {r['ms']:7.1f} ms/step (rounds {rounds}) "
            f"{r['tokens_per_s']:8.0f} tokens/s  "
            f"build + 3 steps {r['build_s']:3.0f} s{gpu}{ratio}"
        )
    return list(results.values())


def main(argv=None):
    args = parse_args(argv)
    ddp = "RANK" in os.environ  # torchrun sets RANK: NCCL on GPUs, gloo on CPUs
    rank = 0
    world = 1
    if ddp:
        torch.distributed.init_process_group("nccl" if ON_GPU else "gloo")
        rank = torch.distributed.get_rank()
        world = torch.distributed.get_world_size()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if ON_GPU else "cpu")
    if ON_GPU:
        torch.cuda.set_device(device)
    run = train
    if args.bench:
        run = bench
    try:
        result = run(args, ddp, rank, world, device)
    except torch.cuda.OutOfMemoryError:  # a clear message, not a trace from deep inside autograd
        raise SystemExit(
            f"out of GPU memory with --batch-size {args.batch_size} and --seq-len {args.seq_len}: "
            f"lower --batch-size and raise --grad-accum to keep the tokens per step"
        ) from None
    except KeyboardInterrupt:  # Ctrl-C: a note, not a traceback, and the shell's status for it
        ckpt = os.path.join(args.out, "ckpt.pt")
        saved = not args.bench and os.path.exists(ckpt)
        resume = f"; --resume goes on from {ckpt}" if saved else ""
        print(f"interrupted{resume}", file=sys.stderr)
        raise SystemExit(130) from None
    if ddp:  # leave together, once nothing holds the group (gloo's torn down mid-work can abort)
        torch.distributed.barrier()
        gc.collect()
        torch.distributed.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
