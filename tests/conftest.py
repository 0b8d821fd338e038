"""Shared test setup: the interpreter on CPU-only machines, and loading the numbered scripts.

The scripts' names start with digits, so they are loaded through importlib. With no GPU the
kernels run in Triton's interpreter (set before triton is imported) on small sizes; on a GPU the
same tests run on larger sizes.
"""

import contextlib
import importlib
import importlib.util
import itertools
import os
import pathlib
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = pathlib.Path(__file__).resolve().parents[1]
ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
_modules = {}


def load(filename):
    """Import ROOT/filename once and return the module (e.g. load('02_rope_fwd.py'))."""
    if filename not in _modules:
        name = "rope_" + filename[:-3].replace("-", "_")
        spec = importlib.util.spec_from_file_location(name, ROOT / filename)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _modules[filename] = module
    return _modules[filename]


def all_pairs(*values):
    """The cases of a feature matrix (one list of values per parameter): every combination on
    the GPU; on the CPU, where the interpreter runs a kernel thousands of times slower, a few that
    still put each value of every parameter together with each value of every other one
    (all-pairs testing, chosen greedily: about 15 cases where the product has hundreds)."""
    combos = list(itertools.product(*(range(len(v)) for v in values)))
    if not ON_GPU:

        def pairs(c):
            return {(i, c[i], j, c[j]) for i, j in itertools.combinations(range(len(c)), 2)}

        uncovered, chosen = set().union(*map(pairs, combos)), []
        while uncovered:
            best = max(combos, key=lambda c: len(pairs(c) & uncovered))
            chosen.append(best)
            uncovered -= pairs(best)
        combos = sorted(chosen)
    return [tuple(v[k] for v, k in zip(values, c)) for c in combos]


@contextlib.contextmanager
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) inside the block (warn_only: cuBLAS would otherwise
    ask for CUBLAS_WORKSPACE_CONFIG), restored after it."""
    before, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def make_view(shape, dtype, view, generator=None):
    """A random tensor of logical `shape` laid out in memory as `view` says.

    contiguous | packed (a slice of a larger [..., 3, h, d] tensor, like q of a fused qkv) |
    permuted (the first two dims swapped in memory) | strided_d (the last dim has stride 2).
    """
    kw = dict(dtype=dtype, device=DEVICE)
    if view == "contiguous":
        return torch.randn(shape, **kw)
    if view == "packed":
        return torch.randn(*shape[:-2], 3, *shape[-2:], **kw)[..., 1, :, :]
    if view == "permuted":
        return torch.randn(shape[1], shape[0], *shape[2:], **kw).transpose(0, 1)
    if view == "strided_d":
        return torch.randn(*shape[:-1], 2 * shape[-1], **kw)[..., ::2]
    raise ValueError(view)


def logical_shape(fmt, b, s, h, d):
    """The shape of b sequences of s tokens, h heads of dim d, in layout fmt."""
    return {"sbhd": (s, b, h, d), "bshd": (b, s, h, d), "thd": (b * s, h, d)}[fmt]


def random_cu_seqlens(b, total, with_empty=False):
    """b sequences of random lengths summing to total (one of them empty if asked)."""
    cuts = torch.sort(torch.randint(0, total + 1, (b - 1,))).values
    if with_empty:
        cuts[0] = cuts[1] if b > 2 else 0
    return torch.cat([torch.tensor([0]), cuts, torch.tensor([total])]).to(torch.int32).to(DEVICE)


LONGER = 1000 if ON_GPU else 100  # the interpreter runs each program in turn, slowly
THD_PACKINGS = {  # thd sequence lengths: the edges of cu_seqlens (02's and 03's tests)
    "empty first, last and in a row": [0, 3, 0, 0, 5, 0],
    "one token each": [1] * 9,
    "short ones and one far longer": [1, 1, 1, LONGER, 1, 1],
    "one sequence": [17],
}


# Hugging Face's entry points (02's hf_rope_fwd, 03's hf_apply_rotary_pos_emb): transformers'
# function as the reference, inputs as models make them, tiny random models. The interpreter's
# bf16 arithmetic is wrong: bf16 runs on a GPU only.
HF_DTYPES = [torch.float32, torch.float16] + [torch.bfloat16] * ON_GPU


def hf_reference(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb on the first d2 channels, the rest passed through."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    d2 = cos.shape[-1]
    q_embed, k_embed = llama.apply_rotary_pos_emb(q[..., :d2], k[..., :d2], cos, sin, unsqueeze_dim)
    return torch.cat((q_embed, q[..., d2:]), -1), torch.cat((k_embed, k[..., d2:]), -1)


def hf_inputs(b, s, h, h_k, d, d2, dtype, unsqueeze_dim, table_batch, scale=1.0):
    """q and k as a model makes them (transposed views of [b, s, h, d] memory when unsqueeze_dim
    is 1), and cos/sin tables [table_batch, s, d2] of random angles scaled by an attention
    factor."""
    q = torch.randn(b, s, h, d, device=DEVICE, dtype=dtype)
    k = torch.randn(b, s, h_k, d, device=DEVICE, dtype=dtype)
    if unsqueeze_dim == 1:
        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
    angles = torch.randn(table_batch, s, d2 // 2, device=DEVICE).repeat(1, 1, 2)
    cos = (angles.cos() * scale).to(dtype)
    sin = (angles.sin() * scale).to(dtype)
    return q, k, cos, sin


def _llama_config(rope_type):
    rope_parameters = {
        "default": None,
        "llama3": dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
        "yarn": dict(rope_type="yarn", factor=4.0, attention_factor=1.3),
        "longrope": dict(
            rope_type="longrope",
            short_factor=[1.0, 1.5, 2.0, 2.5],
            long_factor=[2.0, 3.0, 4.0, 5.0],
            original_max_position_embeddings=8,
        ),
    }[rope_type]
    kwargs = {}
    if rope_parameters is not None:
        kwargs["rope_parameters"] = dict(rope_theta=10000.0, **rope_parameters)
    return kwargs


# (modeling module, config class, model class, config kwargs): tiny random models
HF_MODELS = {
    **{
        f"llama {rope_type}": ("llama", "LlamaConfig", "LlamaForCausalLM", _llama_config(rope_type))
        for rope_type in ("default", "llama3", "yarn", "longrope")
    },
    "qwen2": ("qwen2", "Qwen2Config", "Qwen2ForCausalLM", {}),
    "phi (partial rotary)": ("phi", "PhiConfig", "PhiForCausalLM", {}),
    "gpt-neox (partial rotary)": (
        "gpt_neox",
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(rope_parameters=dict(rope_theta=10000.0, partial_rotary_factor=0.5)),
    ),
    "qwen2-vl text (m-rope)": (
        "qwen2_vl",
        "Qwen2VLTextConfig",
        "Qwen2VLTextModel",
        dict(
            rope_parameters=dict(rope_theta=10000.0, rope_type="default", mrope_section=[1, 1, 2])
        ),
    ),
}


def tiny_hf_model(name):
    """HF_MODELS[name] with 2 layers, 4 heads (2 k heads) of 8 channels, float32 and in eval mode,
    random weights (seed 0): (its modeling module, config, model, a batch of 2 x 12 tokens)."""
    transformers = pytest.importorskip("transformers")
    module_name, config_name, model_name, extra = HF_MODELS[name]
    modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    config = getattr(transformers, config_name)(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **extra,
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(DEVICE).float().eval()
    tokens = torch.randint(0, 64, (2, 12), device=DEVICE)
    return modeling, config, model, tokens


def hf_bad_inputs():
    """Bad inputs of a Hugging Face entry point, each with the error's message: {case: (args,
    kwargs, message)}."""

    def t(*shape):
        return torch.randn(*shape, device=DEVICE)

    q, k = t(2, 4, 5, 16), t(2, 2, 5, 16)
    cos = t(1, 5, 16)
    ids = torch.zeros(2, 5, dtype=torch.long, device=DEVICE)
    return {
        "table of the wrong length": ((q, k, t(1, 6, 16), t(1, 6, 16)), {}, "must have shape"),
        "table of another batch": ((q, k, t(3, 5, 16), t(3, 5, 16)), {}, "must have shape"),
        "odd d2": ((q, k, t(1, 5, 7), t(1, 5, 7)), {}, "must be even"),
        "d2 over the head dim": ((q, k, t(1, 5, 18), t(1, 5, 18)), {}, "must be even"),
        "head dim over 256": (
            (t(1, 1, 5, 264), t(1, 1, 5, 264), t(1, 5, 264), t(1, 5, 264)),
            {},
            "q's head dim 264 is over the supported 256",
        ),
        "cos and sin differ": ((q, k, cos, t(1, 5, 8)), {}, "one shape"),
        "table on another device": ((q, k, cos.to("meta"), cos), {}, "is on meta"),
        "integer table": ((q, k, cos.long(), cos), {}, "cos must be a float32"),
        "float8 table": ((q, k, cos, cos.to(torch.float8_e4m3fn)), {}, "sin must be a float32"),
        "0-d tables": ((q, k, cos[0, 0, 0], cos[0, 0, 0]), {}, "must have shape"),
        "k of another length": ((q, t(2, 2, 6, 16), cos, cos), {}, "every dim but heads"),
        "q and k of two dtypes": ((q, k.half(), cos, cos), {}, "of one dtype"),
        "unsqueeze_dim 3": ((q, k, cos, cos, 3), {}, "unsqueeze_dim must be 1"),
        "unsqueeze_dim 1.0": ((q, k, cos, cos, 1.0), {}, "unsqueeze_dim must be 1"),
        "position_ids passed as unsqueeze_dim": ((q, k, cos, cos, ids), {}, "keyword-only"),
        "position_ids with a 3-D table": ((q, k, cos, cos), {"position_ids": ids}, "a cache"),
        "position_ids past the cache": (
            (q, k, cos[0], cos[0]),
            {"position_ids": torch.full((2, 5), 5, device=DEVICE)},
            r"in \[0, 5\)",
        ),
        "position_ids of another length": (
            (q, k, cos[0], cos[0]),
            {"position_ids": ids[:, :4]},
            r"position_ids must have shape \[2 or 1, 5\]",
        ),
        "float position_ids": (
            (q, k, cos[0], cos[0]),
            {"position_ids": torch.zeros(2, 5, device=DEVICE)},
            "int32 or int64",
        ),
    }
