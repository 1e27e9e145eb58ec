"""A compact LLaMA-family forward (LLaMA, SmolLM2, Mistral, Qwen2): RMSNorm, RoPE, GQA, SwiGLU.

Tokens of all requests in a forward are packed into one `[T, hidden]` matrix, so the dense layers never
see padding; only attention is per request (see kernels/attention.py). q/k/v and gate/up are fused into
one matmul each. Linear layers are plain `nn.Linear` so that a drafter can swap in quantized ones.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn as nn

from spind.kernels.metadata import AttentionBackend, AttentionMetadata
from spind.models.kv_cache import KVCache
from spind.models.layers import Block, LlamaArgs, RMSNorm, rope_tables
from spind.models.loader import read_tensors, weight_files
from spind.models.quant import QUANTIZED_DTYPES, quantize_target
from spind.models.tensor_parallel import Shard

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        # uninitialised, as every weight is loaded: Embedding's own normal_ init has no C++ meta kernel, and the first
        # Python one imports torch's meta registrations (~150 MB resident for the process's life)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size,
                                         _weight=torch.empty(args.vocab_size, args.hidden_size))
        self.layers = nn.ModuleList(Block(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        cos, sin = rope_tables(args, args.max_position)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.fused_stack = None  # all layers in one kernel call (quantized targets: spind/models/fused.py)
        self.quantized: str | None = None  # the dtype of quantized weights (quant.quantize_target); None: float
        self.shard: Shard | None = None  # this rank's part of a tensor-parallel model (tensor_parallel.parallelize)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_kv_cache(self, num_blocks: int, block_size: int, max_model_len: int | None = None,
                     dtype: torch.dtype | None = None) -> KVCache:
        a = self.args
        return KVCache(len(self.layers), a.num_kv_heads, a.head_dim, num_blocks, block_size,
                       dtype or self.dtype, self.device, max_model_len or a.max_position)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCache,
                attend: AttentionBackend, logits_rows: torch.Tensor | None = None,
                feature_layers: tuple[int, ...] = ()) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions: [T]; KV of the new tokens is written at meta.slot_mapping. `attend` must have been
        planned for `meta` (outside, so that a captured CUDA graph of this forward never re-plans).

        Returns fp32 logits [len(logits_rows), vocab] (all T rows when logits_rows is None); with `feature_layers`,
        also every row's features (a draft head's input, spind/models/eagle.py): [T, len(feature_layers) * hidden],
        fp32, each part the hidden state entering that layer (as transformers' hidden_states[i]), or for i =
        num_layers the final normed one (what lm_head reads).
        """
        cos = self.rope_cos[positions].unsqueeze(1).to(self.dtype)  # [T, 1, D/2]
        sin = self.rope_sin[positions].unsqueeze(1).to(self.dtype)
        h = self.embed_tokens(tokens)
        slots = meta.slot_mapping
        plan = None if self.fused_stack is None else getattr(attend, "kernel_plan", lambda: None)()
        num_layers = len(self.layers)
        taps = sorted({i for i in feature_layers if i < num_layers})
        captured: dict[int, torch.Tensor] = {}
        if plan is not None:
            start = 0
            for stop in [*taps, num_layers]:  # segments between the recorded layers: the same kernels, in order
                if stop > start:
                    h = self.fused_stack(h, cos, sin, kv.k, kv.v, slots, plan, start, stop)
                captured[stop] = h
                start = stop
        else:
            for i, layer in enumerate(self.layers):
                captured[i] = h
                h = h + layer.self_attn(layer.input_layernorm(h), cos, sin, kv.k[i], kv.v[i], slots, attend)
                h = h + layer.mlp(layer.post_attention_layernorm(h))
        normed = None
        if num_layers in feature_layers:
            normed = captured[num_layers] = self.norm(h)
        features = torch.cat([captured[i] for i in feature_layers], -1).float() if feature_layers else None
        if logits_rows is not None:
            h = h.index_select(0, logits_rows)
            normed = None if normed is None else normed.index_select(0, logits_rows)
        if h.shape[0] == 0:
            logits = h.new_empty(0, self.args.vocab_size, dtype=torch.float32)
        else:
            logits = self.lm_head(self.norm(h) if normed is None else normed).float()
        return logits if features is None else (logits, features)


def load_llama(model_dir: Path, dtype: str = "float32", device: str = "cpu",
               layers: tuple[int, ...] | None = None, shard: Shard | None = None) -> LlamaModel:
    """Build our module from an HF-style directory (config.json + safetensors or torch .bin weights, sharded or not).

    The module is created on the meta device and materialised in `dtype` on `device`; weights then stream in one
    tensor at a time, converted as they are copied into place. Loading peaks at the model's size in `dtype` plus one
    checkpoint tensor, never a whole state dict or an fp32 copy. Quantized dtypes build an fp32 master first
    (quant.quantize_target swaps its linears). `layers` keeps only those decoder layers (a layer-subset self-draft).
    """
    if dtype not in DTYPES and dtype not in QUANTIZED_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join([*DTYPES, *QUANTIZED_DTYPES])}")
    cfg = json.loads((model_dir / "config.json").read_text())
    args = LlamaArgs.from_hf(cfg)
    if args.sliding_window is not None:
        log.warning("%s: attention window of %d tokens (max_position_embeddings %d); spind's attention has no window, "
                    "so it serves sequences of at most %d tokens, where the window never binds", model_dir,
                    args.sliding_window, cfg.get("max_position_embeddings", 2048), args.max_position)
    keep = list(range(args.num_layers)) if layers is None else list(layers)
    if any(not 0 <= i < args.num_layers for i in keep):
        raise ValueError(f"layer subset {keep} out of range 0..{args.num_layers - 1}")
    args = dataclasses.replace(args, num_layers=len(keep))
    if shard is not None:
        args = shard.local_args(args)
    files = weight_files(model_dir)
    if not files:
        raise ValueError(f"{model_dir} has no safetensors or pytorch_model*.bin weights")

    with torch.device("meta"):
        model = LlamaModel(args)
    model.requires_grad_(False).to(DTYPES.get(dtype, torch.float32))  # quantized: fp32 activations, norms and KV
    tied = args.tie_word_embeddings
    if tied:  # before materialising, so the head is never allocated apart
        model.lm_head.weight = model.embed_tokens.weight
    _materialise(model, device)
    cos, sin = rope_tables(args, args.max_position)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)  # tables stay fp32

    todo = _destinations(model, keep, tied)
    with torch.no_grad():
        slices = {} if shard is None else {n: shard.slice_of(n) for n in todo}
        for name, w in read_tensors(files, todo.keys(), device, slices):
            for dst in todo.pop(name):
                if w.shape != dst.shape:
                    raise ValueError(f"{model_dir}: {name} has shape {tuple(w.shape)}, config.json implies "
                                     f"{tuple(dst.shape)}")
                dst.copy_(w)  # converts to the model's dtype (and device) on the fly
            del w  # before the next read maps its tensor: one source tensor resident at a time
    if todo.pop("lm_head.weight", None) is not None:  # untied in config.json, but the checkpoint has no head
        model.lm_head.weight = model.embed_tokens.weight
    if todo:
        raise ValueError(f"{model_dir}: weight {next(iter(todo))} missing ({len(todo)} in all)")
    if dtype in QUANTIZED_DTYPES:
        quantize_target(model, model_dir, dtype, keep, shard)
    return model.eval().requires_grad_(False)


def layer_subset(model: LlamaModel, layers: list[int] | tuple[int, ...]) -> LlamaModel:
    """A layer-subset self-draft that shares `model`'s weights: its embedding, final norm, head and kept blocks are
    the target's own modules, so the draft costs no second copy of them (only its own KV cache). Float models only:
    a quantized target runs its layers as one fused stack (spind/models/fused.py) that a subset cannot reuse."""
    if model.quantized is not None:
        raise ValueError(f"a {model.quantized} target's layers run as one fused stack; load the subset apart")
    keep = list(layers)
    if not keep or any(not 0 <= i < len(model.layers) for i in keep):
        raise ValueError(f"layer subset {keep} out of range 0..{len(model.layers) - 1}")
    with torch.device("meta"):  # a frame only: every module and buffer is replaced by the target's
        sub = LlamaModel(dataclasses.replace(model.args, num_layers=len(keep)))
    sub.embed_tokens, sub.norm, sub.lm_head = model.embed_tokens, model.norm, model.lm_head
    sub.layers = nn.ModuleList(model.layers[i] for i in keep)
    sub.rope_cos, sub.rope_sin = model.rope_cos, model.rope_sin
    return sub.eval()


def _materialise(model: nn.Module, device: str) -> None:
    """Module.to_empty, with shared parameters kept shared; and by shape, since torch.empty_like of a meta tensor
    imports sympy and torch's symbolic shapes (~35 MB resident for the process's life)."""
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) not in done:
                done[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=False)
            setattr(module, name, done[id(p)])


def _destinations(model: LlamaModel, keep: list[int], tied: bool) -> dict[str, list[torch.Tensor]]:
    """Checkpoint name -> the parameters (or rows of a fused one) it is copied into: one each, unless `keep` (the
    checkpoint layer each model layer holds) names a layer twice."""
    out: dict[str, list[torch.Tensor]] = defaultdict(list)

    def put(names: list[str], params: list[torch.Tensor]) -> None:
        for name, param in zip(names, params, strict=True):
            out[name].append(param)

    put(["model.embed_tokens.weight", "model.norm.weight"], [model.embed_tokens.weight, model.norm.weight])
    if not tied:
        put(["lm_head.weight"], [model.lm_head.weight])
    for layer, old in zip(model.layers, keep):
        p, attn, mlp = f"model.layers.{old}.", layer.self_attn, layer.mlp
        qkv_rows = [attn.q_size, attn.kv_size, attn.kv_size]
        put([p + f"self_attn.{n}_proj.weight" for n in "qkv"], attn.qkv_proj.weight.split(qkv_rows))
        if attn.qkv_proj.bias is not None:
            put([p + f"self_attn.{n}_proj.bias" for n in "qkv"], attn.qkv_proj.bias.split(qkv_rows))
        put([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], mlp.gate_up_proj.weight.split(mlp.inter))
        put([p + "self_attn.o_proj.weight", p + "mlp.down_proj.weight", p + "input_layernorm.weight",
             p + "post_attention_layernorm.weight"],
            [attn.o_proj.weight, mlp.down_proj.weight, layer.input_layernorm.weight,
             layer.post_attention_layernorm.weight])
    return out
