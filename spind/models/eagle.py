"""Feature-level draft heads (EAGLE): one decoder layer that reads the target's own hidden states.

A head drafts the token after position p from the target's features at p - 1 (what the target computed when it
read token p - 1) and the embedding of token p; its next steps feed its own output hidden state back in place of
the target's features. Two published layouts load from a directory (config.json + safetensors or a torch .bin):

- **EAGLE-1/2** (`layers.0.*`, `fc.weight` + `fc.bias` of [h, 2h]): the feature is the target's final *normed*
  hidden state; x = fc([embed(token), hidden]) enters a decoder layer without an input norm; its output goes
  through the target's own lm_head (no norm), over the whole vocabulary.
- **EAGLE-3** (`midlayer.*`, `fc.weight` [h, n h], `d2t`): the feature is the concatenation of the hidden states
  entering n target layers (by default 2, L/2 and L - 3, or config `eagle_aux_hidden_state_layer_ids`), reduced
  by fc; the layer's attention reads [input_layernorm(embed(token)), hidden_norm(hidden)] (2h wide) and adds to
  the hidden state; its own norm and lm_head score a *draft vocabulary* whose id i is target id i + d2t[i].

The token embedding is always the target's. `EagleHead.draft_step` is the serving path (a per-request KV cache
with rollback, `HeadKV`); training (spind/train/) composes the same pieces with its own attention.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from spind.models.layers import LlamaArgs, RMSNorm, apply_rope, rope_tables
from spind.models.loader import weight_files

LAYOUTS = ("eagle1", "eagle3")


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's (and vLLM's) default: the hidden states entering layers 2, L // 2 and L - 3 (within 0..L - 1
    for a model of fewer than 6 layers)."""
    last = num_target_layers - 1
    return (min(2, last), num_target_layers // 2, max(num_target_layers - 3, 0))


@dataclass(frozen=True)
class EagleConfig:
    layout: str  # "eagle1" | "eagle3"
    args: LlamaArgs  # the head's own layer: hidden size, heads, RoPE (num_layers is 1)
    draft_vocab_size: int  # eagle1: the target's vocabulary
    feature_layers: tuple[int, ...]  # LlamaModel.forward's feature_layers (eagle1: the final normed state)
    fc_bias: bool = False

    @property
    def num_features(self) -> int:
        return len(self.feature_layers)

    def to_json(self, target_vocab: int) -> dict:
        """A config.json in the published layout (what `load_eagle_head` reads back)."""
        a = self.args
        out = {"architectures": ["LlamaForCausalLMEagle3" if self.layout == "eagle3" else "LlamaForCausalLM"],
               "model_type": "llama", "hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size,
               "num_hidden_layers": 1, "num_attention_heads": a.num_heads, "num_key_value_heads": a.num_kv_heads,
               "head_dim": a.head_dim, "rms_norm_eps": a.rms_norm_eps, "rope_theta": a.rope_theta,
               "max_position_embeddings": a.max_position, "vocab_size": target_vocab, "hidden_act": "silu",
               "tie_word_embeddings": False, "attention_bias": a.attention_bias}
        if self.layout == "eagle3":
            out["draft_vocab_size"] = self.draft_vocab_size
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.feature_layers)}
        return out


class EagleHead(nn.Module):
    def __init__(self, cfg: EagleConfig, target_vocab: int) -> None:
        super().__init__()
        self.cfg = cfg
        a = cfg.args
        h = a.hidden_size
        self.eagle3 = cfg.layout == "eagle3"
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_size, self.kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        self.scale = a.head_dim ** -0.5
        self.fc = nn.Linear((cfg.num_features if self.eagle3 else 2) * h, h, bias=cfg.fc_bias)
        self.input_layernorm = RMSNorm(h, a.rms_norm_eps) if self.eagle3 else None
        self.hidden_norm = RMSNorm(h, a.rms_norm_eps) if self.eagle3 else None
        self.qkv_proj = nn.Linear(2 * h if self.eagle3 else h, self.q_size + 2 * self.kv_size, bias=a.attention_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, a.rms_norm_eps)
        self.gate_up_proj = nn.Linear(h, 2 * a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, h, bias=False)
        self.norm = RMSNorm(h, a.rms_norm_eps) if self.eagle3 else None
        # eagle1 scores with the target's lm_head (bound by `bind_target`)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False) if self.eagle3 else None
        # draft id -> target id (absolute); the identity for eagle1
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size), persistent=False)
        self.target_vocab = target_vocab
        self.embed: nn.Embedding | None = None  # the target's (bind_target); kept out of the head's parameters
        self.target_lm_head: nn.Module | None = None
        cos, sin = rope_tables(a, a.max_position)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def bind_target(self, embed: nn.Embedding, lm_head: nn.Module | None = None, max_position: int = 0) -> None:
        """Share the target's embedding (and, eagle1, its lm_head); RoPE tables cover max_position positions."""
        object.__setattr__(self, "embed", embed)  # not registered: the head's state dict holds only its own
        object.__setattr__(self, "target_lm_head", lm_head)
        if not self.eagle3 and lm_head is None:
            raise ValueError("an EAGLE-1 head scores with the target's lm_head")
        if max_position > self.rope_cos.shape[0]:
            cos, sin = rope_tables(self.cfg.args, max_position)
            self.rope_cos, self.rope_sin = cos.to(self.rope_cos.device), sin.to(self.rope_sin.device)

    # ---- the layer, in pieces (training composes them with its own attention) ----------------------
    def hidden_in(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [n, width] as the head's input hidden state [n, h] (eagle3: fc; eagle1: as is)."""
        return self.fc(features) if self.eagle3 else features

    def qkv(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """q [n, H, D], k and v [n, KV, D] (RoPE applied) and the residual, for tokens [n] over hidden [n, h]."""
        emb = self.embed(tokens).to(hidden.dtype)
        if self.eagle3:
            x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], -1)
            residual = hidden
        else:
            x = residual = self.fc(torch.cat([emb, hidden], -1))
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], -1)
        cos = self.rope_cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.rope_sin[positions].unsqueeze(1).to(x.dtype)
        q = apply_rope(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        return q, k, v.view(n, self.num_kv_heads, self.head_dim), residual

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn [n, H, D] -> the layer's output hidden state [n, h] (fed back as the next step's hidden)."""
        h = residual + self.o_proj(attn.reshape(attn.shape[0], self.q_size))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(h)).chunk(2, -1)
        return h + self.down_proj(F.silu(gate) * up)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Scores over the draft vocabulary [n, draft_vocab_size], fp32."""
        if self.eagle3:
            return self.lm_head(self.norm(hidden)).float()
        return self.target_lm_head(hidden).float()

    # ---- serving ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft_step(self, kv: "HeadKV", seqs: list[tuple[str, torch.Tensor, torch.Tensor]]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step over several requests: seqs holds (req_id, tokens [n_i], hidden [n_i, h]) appended at positions
        kv.length(req_id) ...; returns (each request's last output hidden [B, h], its draft-vocab logits [B, V_d])."""
        tokens = torch.cat([t for _, t, _ in seqs])
        hidden = torch.cat([h for _, _, h in seqs])
        # entry p (RoPE position p, as trained) lives at KV index p - 1: entry 0 would need features before token 0
        positions = torch.cat([torch.arange(kv.length(r), kv.length(r) + len(t), device=tokens.device)
                               for r, t, _ in seqs]) + 1
        q, k, v, residual = self.qkv(tokens, hidden, positions)
        outs, start = [], 0
        for rid, t, _ in seqs:
            n = len(t)
            keys, values = kv.append(rid, k[start:start + n], v[start:start + n])
            outs.append(_attend(q[start:start + n], keys, values, self.scale))
            start += n
        out = self.finish(torch.cat(outs), residual)
        if out.shape[0] > len(seqs):
            out = out.index_select(0, torch.tensor([len(t) for _, t, _ in seqs], device=out.device).cumsum(0) - 1)
        return out, self.logits(out)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.d2t[draft_ids]

    def quantize_linears(self, activations: str = "q16") -> "EagleHead":
        """Serve the head's linears as Q8_0 blocks through spind's CPU kernels (1.06 bytes a weight against fp32's
        4: a drafting step at batch 1 reads every weight). For quantized CPU targets; the draft's numerics never
        touch exactness (the target verifies), only its acceptance, a little."""
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        from spind.models.gguf_linear import GGUFLinear
        from spind.models.loader import GGUFBlocks

        for name in ("fc", "qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"):
            linear = getattr(self, name)
            if not isinstance(linear, nn.Linear):
                continue
            data = quantize(linear.weight.detach().float().cpu().numpy(), GGMLQuantizationType.Q8_0)
            setattr(self, name, GGUFLinear.from_blocks(GGUFBlocks("Q8_0", torch.from_numpy(data)), linear.bias,
                                                       activations))
        return self


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, D] at the last n of keys/values [L, KV, D] (causal); GQA by repeating the KV heads."""
    n, heads = q.shape[0], q.shape[1]
    rep = heads // keys.shape[1]
    k = keys.repeat_interleave(rep, 1).transpose(0, 1)  # [H, L, D]
    v = values.repeat_interleave(rep, 1).transpose(0, 1)
    big = keys.shape[0]
    mask = torch.ones(n, big, dtype=torch.bool, device=q.device).tril(big - n)
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale).transpose(0, 1)


class HeadKV:
    """A draft head's KV cache: per request, contiguous K and V [capacity, KV, D] grown by doubling, and a length
    that rollback truncates (the entries beyond are overwritten by the next append)."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.shape, self.dtype, self.device = (num_kv_heads, head_dim), dtype, device
        self.k: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.lengths: dict[str, int] = {}

    def add(self, req_id: str) -> None:
        self.k[req_id] = torch.empty(64, *self.shape, dtype=self.dtype, device=self.device)
        self.v[req_id] = torch.empty(64, *self.shape, dtype=self.dtype, device=self.device)
        self.lengths[req_id] = 0

    def free(self, req_id: str) -> None:
        for d in (self.k, self.v, self.lengths):
            d.pop(req_id, None)

    def has(self, req_id: str) -> bool:
        return req_id in self.lengths

    def length(self, req_id: str) -> int:
        return self.lengths[req_id]

    def truncate(self, req_id: str, length: int) -> None:
        self.lengths[req_id] = min(length, self.lengths[req_id])

    def append(self, req_id: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [n, KV, D] after the request's entries; returns all its keys and values [L + n, KV, D]."""
        start = self.lengths[req_id]
        end = start + k.shape[0]
        if end > self.k[req_id].shape[0]:
            cap = max(end, 2 * self.k[req_id].shape[0])
            for d in (self.k, self.v):
                grown = torch.empty(cap, *self.shape, dtype=self.dtype, device=self.device)
                grown[:start] = d[req_id][:start]
                d[req_id] = grown
        self.k[req_id][start:end] = k
        self.v[req_id][start:end] = v
        self.lengths[req_id] = end
        return self.k[req_id][:end], self.v[req_id][:end]


# ---- loading and saving ------------------------------------------------------------------------
_EAGLE3_NAMES = {  # checkpoint name -> our parameter (q/k/v and gate/up are fused on load)
    "fc.weight": "fc.weight", "midlayer.hidden_norm.weight": "hidden_norm.weight",
    "midlayer.input_layernorm.weight": "input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "midlayer.self_attn.o_proj.weight": "o_proj.weight", "midlayer.mlp.down_proj.weight": "down_proj.weight",
    "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight",
}
_EAGLE1_NAMES = {"fc.weight": "fc.weight", "fc.bias": "fc.bias",
                 "layers.0.post_attention_layernorm.weight": "post_attention_layernorm.weight",
                 "layers.0.self_attn.o_proj.weight": "o_proj.weight", "layers.0.mlp.down_proj.weight": "down_proj.weight"}


def _layout(names: set[str]) -> str:
    if "fc.weight" not in names:
        raise ValueError("not an EAGLE head: no fc.weight (the layer that reads the target's features)")
    if any(n.startswith("midlayer.") for n in names):
        return "eagle3"
    if any(n.startswith("layers.0.") for n in names):
        return "eagle1"
    raise ValueError("not an EAGLE head: no midlayer.* (EAGLE-3) or layers.0.* (EAGLE-1) weights")


def read_head_config(head_dir: Path, names: set[str], target: LlamaArgs) -> EagleConfig:
    cfg = json.loads((head_dir / "config.json").read_text())
    layout = _layout(names)
    args = LlamaArgs.from_hf({**cfg, "num_hidden_layers": 1, "model_type": "llama"})
    args = dataclasses.replace(args, max_position=max(args.max_position, target.max_position))
    if args.hidden_size != target.hidden_size:
        raise ValueError(f"{head_dir}: the head's hidden size {args.hidden_size} is not the target's "
                         f"{target.hidden_size}; it was trained for another model")
    if cfg.get("vocab_size", target.vocab_size) != target.vocab_size:
        raise ValueError(f"{head_dir}: the head's vocabulary ({cfg['vocab_size']}) is not the target's "
                         f"({target.vocab_size}); it was trained for another model")
    if layout == "eagle1":
        return EagleConfig("eagle1", args, target.vocab_size, (target.num_layers,), fc_bias="fc.bias" in names)
    aux = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = tuple(aux) if aux else default_aux_layers(target.num_layers)
    if any(not 0 <= i <= target.num_layers for i in layers):  # num_layers: the final normed state
        raise ValueError(f"{head_dir}: feature layers {layers} out of the target's 0..{target.num_layers}")
    draft_vocab = cfg.get("draft_vocab_size") or target.vocab_size
    return EagleConfig("eagle3", args, draft_vocab, layers, fc_bias="fc.bias" in names)


def load_eagle_head(head_dir: Path, target: LlamaArgs) -> EagleHead:
    """An EAGLE-1 or EAGLE-3 head for a target of shape `target`, in fp32 on the CPU; ValueError where its shapes
    do not fit the target (hidden size, vocabulary, feature layers) or a weight is missing."""
    head_dir = Path(head_dir)
    if not (head_dir / "config.json").is_file():
        raise ValueError(f"{head_dir}: no config.json (an EAGLE head is a directory: config.json + weights)")
    files = weight_files(head_dir)
    if not files:
        raise ValueError(f"{head_dir} has no safetensors or pytorch_model*.bin weights")
    tensors = {k.removeprefix("model."): v for k, v in _read_all(files).items()}
    cfg = read_head_config(head_dir, set(tensors), target)
    head = EagleHead(cfg, target.vocab_size)
    state = _to_state(tensors, cfg, head)
    missing = [n for n, p in head.state_dict().items() if n not in state]
    if missing:
        raise ValueError(f"{head_dir}: weight(s) {', '.join(missing)} missing for an {cfg.layout} head")
    for name, param in head.state_dict().items():
        if state[name].shape != param.shape:
            raise ValueError(f"{head_dir}: {name} has shape {tuple(state[name].shape)}, config.json implies "
                             f"{tuple(param.shape)}")
    head.load_state_dict(state)
    if "d2t" in tensors:
        d2t = tensors["d2t"].long()
        if d2t.shape != (cfg.draft_vocab_size,):
            raise ValueError(f"{head_dir}: d2t has shape {tuple(d2t.shape)}, draft_vocab_size is "
                             f"{cfg.draft_vocab_size}")
        ids = torch.arange(cfg.draft_vocab_size) + d2t
        if int(ids.min()) < 0 or int(ids.max()) >= target.vocab_size:
            raise ValueError(f"{head_dir}: d2t maps draft ids outside the target's vocabulary")
        head.d2t = ids
    elif cfg.layout == "eagle3" and cfg.draft_vocab_size != target.vocab_size:
        raise ValueError(f"{head_dir}: a draft vocabulary of {cfg.draft_vocab_size} needs its d2t map")
    return head.eval().requires_grad_(False)


def _read_all(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of a head's files (a head is small: tens of MB at most for a 70B target's); an int8 weight
    with a per-row `<name>_scale` (how spind ships its own heads) comes back dequantized."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)) if f.suffix == ".safetensors" else
                   torch.load(f, map_location="cpu", weights_only=True))
    for name in [n for n in out if n.endswith(SCALE_SUFFIX)]:
        base = name[: -len(SCALE_SUFFIX)]
        if base in out and out[base].dtype == torch.int8:
            out[base] = out[base].float() * out.pop(name).float()[:, None]
    return out


SCALE_SUFFIX = "_scale"


def _int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (codes, fp16 scales); w ~= codes * scale[:, None]."""
    scale = (w.abs().amax(1) / 127).clamp(min=1e-8).half()
    return (w / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def _to_state(tensors: dict[str, torch.Tensor], cfg: EagleConfig, head: EagleHead) -> dict[str, torch.Tensor]:
    names = _EAGLE3_NAMES if cfg.layout == "eagle3" else _EAGLE1_NAMES
    layer = "midlayer." if cfg.layout == "eagle3" else "layers.0."
    state = {ours: tensors[theirs].float() for theirs, ours in names.items() if theirs in tensors}
    qkv = [tensors.get(f"{layer}self_attn.{n}_proj.weight") for n in "qkv"]
    if all(t is not None for t in qkv):
        state["qkv_proj.weight"] = torch.cat(qkv).float()
    if head.qkv_proj.bias is not None:
        bias = [tensors.get(f"{layer}self_attn.{n}_proj.bias") for n in "qkv"]
        if all(t is not None for t in bias):
            state["qkv_proj.bias"] = torch.cat(bias).float()
    gate_up = [tensors.get(f"{layer}mlp.{n}_proj.weight") for n in ("gate", "up")]
    if all(t is not None for t in gate_up):
        state["gate_up_proj.weight"] = torch.cat(gate_up).float()
    return state


def save_eagle_head(head: EagleHead, out_dir: Path, dtype: torch.dtype = torch.float16) -> None:
    """Write `head` in the published EAGLE-3 layout (config.json + model.safetensors with d2t / t2d), which
    `load_eagle_head` (and, in a float dtype, other EAGLE-3 loaders) read. torch.int8: each matrix as per-row int8
    codes with an fp16 `<name>_scale` (norms in fp16): 1 byte a weight, how spind ships its own head."""
    from safetensors.torch import save_file

    if not head.eagle3:
        raise ValueError("spind writes EAGLE-3 heads only")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach() for k, v in head.state_dict().items()}
    out = {theirs: sd[ours].to(dtype) for theirs, ours in _EAGLE3_NAMES.items()}
    a = head.cfg.args
    q, k, v = sd["qkv_proj.weight"].split([head.q_size, head.kv_size, head.kv_size])
    out.update({"midlayer.self_attn.q_proj.weight": q.to(dtype), "midlayer.self_attn.k_proj.weight": k.to(dtype),
                "midlayer.self_attn.v_proj.weight": v.to(dtype)})
    gate, up = sd["gate_up_proj.weight"].split(a.intermediate_size)
    out.update({"midlayer.mlp.gate_proj.weight": gate.to(dtype), "midlayer.mlp.up_proj.weight": up.to(dtype)})
    if dtype == torch.int8:
        out = {theirs: sd[ours].half() for theirs, ours in _EAGLE3_NAMES.items()}
        out.update({"midlayer.self_attn.q_proj.weight": q, "midlayer.self_attn.k_proj.weight": k,
                    "midlayer.self_attn.v_proj.weight": v, "midlayer.mlp.gate_proj.weight": gate,
                    "midlayer.mlp.up_proj.weight": up})
        for name in [n for n, w in out.items() if w.dim() == 2]:
            out[name], out[name + SCALE_SUFFIX] = _int8_rows(out[name].float())
    offsets = head.d2t - torch.arange(head.cfg.draft_vocab_size)  # published as offsets
    out["d2t"] = offsets.to(torch.int32) if dtype == torch.int8 else offsets
    t2d = torch.zeros(head.target_vocab, dtype=torch.bool)
    t2d[head.d2t] = True
    out["t2d"] = t2d
    save_file({k: v.contiguous() for k, v in out.items()}, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(head.cfg.to_json(head.target_vocab), indent=2) + "\n")
