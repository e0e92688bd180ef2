"""Settings as frozen dataclasses, resolved from flags > environment (SINKCHAT_*) > .env > defaults.

No torch import here: the CLI reads settings (and `--help` runs) without paying for torch.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from sinkchat.errors import UsageError

POLICIES = ("sink", "window", "dense")
MAX_SINKS = 64  # the paper uses 4; more only shrinks the window
QUANTS = ("auto", "q4", "nf4", "fp4", "int8", "none")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_DTYPES = ("auto", "float32", "bfloat16")
PINS = ("system", "none")
DECODERS = ("auto", "native", "compiled", "eager", "hf")

# Every SINKCHAT_* setting: name -> (default, meaning). `.env.example` is generated from / checked against this.
ENV_SETTINGS: dict[str, tuple[str, str]] = {
    "SINKCHAT_MODEL": ("", "model: HF id, local folder or .gguf file (empty = bundled SmolLM2-135M-Instruct)"),
    "SINKCHAT_QUANT": ("auto", "weight quantization: auto (q4 on CPU, nf4 on CUDA), q4 (asymmetric int4, group 32, "
                       "sinkchat's kernels or torch's), nf4, fp4, int8 (bitsandbytes) or none"),
    "SINKCHAT_KERNELS": ("auto", "q4 kernels: auto (sinkchat's native kernels for the best instruction set the CPU "
                         "has, avx512 / avxvnni / avx2 / neon, where a C compiler is found; else torch's), one of "
                         "those forced, torch, or ref (sinkchat's kernels through their scalar C reference: any CPU, "
                         "slow; for checks)"),
    "SINKCHAT_DEVICE": ("auto", "auto, cpu or cuda"),
    "SINKCHAT_DTYPE": ("auto", "compute dtype: auto, float32, bfloat16, float16"),
    "SINKCHAT_KV_DTYPE": ("auto", "what the KV cache stores: auto (bfloat16 with a fast decode step, else the "
                          "compute dtype), float32 or bfloat16"),
    "SINKCHAT_DECODER": ("auto", "single-token decoding: auto (the native C step with the native kernels, else the "
                        "torch step compiled in the background), native, compiled (torch step and kernels, wait "
                        "for the compile), eager (torch step and kernels, never compiled) or hf (the transformers "
                        "forward, the reference)"),
    "SINKCHAT_PREFILL": ("auto", "chunk prefill: auto (the native C prefill wherever the native step runs a model it "
                         "computes, else the transformers forward) or hf (always the transformers forward: the "
                         "reference, for measurements)"),
    "SINKCHAT_THREADS": ("0", "threads for sinkchat's kernels and torch (0 = one per physical core this process may "
                         "run on)"),
    "SINKCHAT_POLICY": ("sink", "cache policy: sink, window (naive, for comparison) or dense"),
    "SINKCHAT_SINKS": ("4", "number of pinned attention-sink tokens"),
    "SINKCHAT_PIN": ("system", "what else the sink policy keeps forever after the sinks: system (the system prompt, "
                     "with the agent's tool definitions) or none"),
    "SINKCHAT_CACHE": ("0", "cache capacity in tokens, sinks included (0 = min(2048, model context))"),
    "SINKCHAT_EVICT_CHUNK": ("0", "tokens evicted per eviction event (0 = (capacity - sinks)/16)"),
    "SINKCHAT_TEMPERATURE": ("0.7", "sampling temperature (0 = greedy)"),
    "SINKCHAT_TOP_P": ("0.9", "nucleus sampling threshold"),
    "SINKCHAT_TOP_K": ("40", "top-k sampling (0 = off)"),
    "SINKCHAT_REPETITION_PENALTY": ("1.1", "repetition penalty (1 = off)"),
    "SINKCHAT_MAX_TOKENS": ("512", "maximum tokens per reply"),
    "SINKCHAT_SEED": ("", "random seed (empty = random)"),
    "SINKCHAT_HOME": ("", "data dir for history, logs, snapshots (empty = XDG user data dir)"),
    "SINKCHAT_CACHE_DIR": ("", "dir for converted models (empty = XDG user cache dir)"),
    "SINKCHAT_GAUGE_EVERY": ("4", "compute the sink-attention gauge every N decode steps (0 = off)"),
    "SINKCHAT_MEMORY": ("off", "recall memory: on (tokens evicted from the window go to an on-disk block store and "
                        "the blocks a query needs join attention again) or off (evicted tokens are dropped)"),
    "SINKCHAT_MEMORY_BUDGET": ("1024", "disk budget of a session's recall memory in MiB (past it the oldest blocks "
                               "are forgotten, and that is reported)"),
    "SINKCHAT_MEMORY_BLOCK": ("64", "tokens per recall-memory block"),
    "SINKCHAT_MEMORY_TOPK": ("4", "recall-memory blocks each layer attends to at a time"),
    "SINKCHAT_MEMORY_REREAD": ("3", "recall-memory blocks read again as text before a message that names what they hold "
                               "(the block it names and its neighbours; 0 = none)"),
    "SINKCHAT_MEMORY_RAM": ("64", "MiB of recalled blocks kept in RAM (least recently used go first)"),
    "SINKCHAT_MEMORY_BITS": ("16", "bits a stored key / value takes in the recall memory: 16 (the cache's own, exact) "
                                   "or 8 (int8 with a scale per token and head: half the disk)"),
}
MEMORY_MODES = ("on", "off")


class ConfigError(UsageError, ValueError):
    """A user-facing configuration mistake; the CLI prints it as one line (exit 2)."""


_dotenv_loaded = False
_from_dotenv: set[str] = set()  # the SINKCHAT_* names `.env` set (errors say where a bad value came from)


def load_dotenv_once(path: str | os.PathLike[str] = ".env") -> None:
    """Read `.env` from the working directory without overriding real environment variables."""
    global _dotenv_loaded
    if _dotenv_loaded:
        return
    _dotenv_loaded = True
    p = Path(path)
    if not p.is_file():
        return
    try:
        lines = p.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        key = key.strip().removeprefix("export ").strip()
        value = value.strip().strip('"').strip("'")
        if key.startswith("SINKCHAT_") and key not in os.environ:
            os.environ[key] = value
            _from_dotenv.add(key)


def _set_as(name: str) -> str:
    """`SINKCHAT_X='v'` as the user set it, and where: the environment or `.env` (a user who set it in .env finds
    nothing with `env | grep`)."""
    return f"{name}={os.environ.get(name, ENV_SETTINGS[name][0])!r}" + (" (set in .env)" if name in _from_dotenv else "")


def env(name: str, cast: Callable[[str], Any] = str) -> Any:
    """Value of a SINKCHAT_* setting (environment, then .env, then the documented default)."""
    load_dotenv_once()
    raw = os.environ.get(name, ENV_SETTINGS[name][0])
    try:
        return cast(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{_set_as(name)} is not a valid value ({ENV_SETTINGS[name][1]})") from None


def physical_cores() -> int:
    """The physical cores this process may run on: the CPUs of its affinity mask, counted once per (package, core)
    pair, so SMT siblings, which share a core's load ports and caches, count once (the decode step is bound by memory
    traffic; a second thread on the same core adds wake-ups, not bandwidth). From sysfs, else /proc/cpuinfo; where
    neither says, every CPU in the mask (os.cpu_count() without one)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    for ids in (_sysfs_cores, _cpuinfo_cores):
        try:
            cores = ids()
        except (OSError, ValueError):
            continue
        mine = {cores[c] for c in cpus if c in cores}
        if mine and all(c in cores for c in cpus):
            return len(mine)
    return max(1, len(cpus))


def _sysfs_cores() -> dict[int, tuple[str, str]]:
    """CPU number -> (package, core) from /sys/devices/system/cpu/cpuN/topology."""
    out = {}
    for d in Path("/sys/devices/system/cpu").glob("cpu[0-9]*"):
        topo = d / "topology"
        out[int(d.name[3:])] = ((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip())
    return out


def _cpuinfo_cores() -> dict[int, tuple[str, str]]:
    """CPU number -> (physical id, core id) from /proc/cpuinfo (x86 lists both per processor)."""
    out, cur = {}, {}
    for line in Path("/proc/cpuinfo").read_text().splitlines() + [""]:
        key, _, val = line.partition(":")
        if key.strip():
            cur[key.strip()] = val.strip()
        elif cur:
            if {"processor", "physical id", "core id"} <= cur.keys():
                out[int(cur["processor"])] = (cur["physical id"], cur["core id"])
            cur = {}
    return out


def opt_int(raw: str) -> int | None:
    return int(raw) if str(raw).strip() else None


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # None = bundled default
    quant: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    threads: int = 0  # 0: physical_cores()
    kv_dtype: str = "auto"
    decoder: str = "auto"

    def __post_init__(self) -> None:
        if self.quant not in QUANTS:
            raise ConfigError(f"--quant must be one of {', '.join(QUANTS)}, not {self.quant!r}")
        if self.device not in DEVICES:
            raise ConfigError(f"--device must be one of {', '.join(DEVICES)}, not {self.device!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, not {self.kv_dtype!r}")
        if self.decoder not in DECODERS:
            raise ConfigError(f"--decoder must be one of {', '.join(DECODERS)}, not {self.decoder!r}")
        if self.threads < 0:
            raise ConfigError("--threads must be >= 0")

    @property
    def resolved_threads(self) -> int:
        """--threads, or for 0 (the default) the physical cores."""
        return self.threads or physical_cores()


@dataclass(frozen=True)
class CacheConfig:
    """What the KV cache keeps. `capacity` counts the sinks; 0 means 'pick from the model's context'."""

    policy: str = "sink"
    n_sink: int = 4
    capacity: int = 0
    evict_chunk: int = 0
    pin: str = "system"  # "system": the sink policy also keeps the system prompt forever (see Engine.add_message)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"--policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        if self.pin not in PINS:
            raise ConfigError(f"--pin must be one of {', '.join(PINS)}, not {self.pin!r}")
        if not 0 <= self.n_sink <= MAX_SINKS:
            raise ConfigError(f"--sinks must be between 0 and {MAX_SINKS}")
        if self.capacity < 0 or self.evict_chunk < 0:
            raise ConfigError("--cache and --evict-chunk must be >= 0")
        if self.capacity and self.capacity < self.n_sink + 8:
            raise ConfigError(f"--cache {self.capacity} is too small: need at least sinks + 8 = {self.n_sink + 8}")

    def resolved(self, max_positions: int) -> "CacheConfig":
        """Fill the automatic sizes for a model whose trained context is `max_positions`."""
        cap = self.capacity or min(2048, max_positions)
        if cap > max_positions:
            raise ConfigError(f"--cache {cap} exceeds the model's trained context ({max_positions} tokens)")
        if self.evict_chunk and self.evict_chunk > cap - self.n_sink - 1:
            raise ConfigError(f"--evict-chunk {self.evict_chunk} must be smaller than the window "
                              f"({cap - self.n_sink} = cache {cap} - {self.n_sink} sinks)")
        chunk = self.evict_chunk or max(1, (cap - self.n_sink) // 16)
        chunk = min(chunk, cap - self.n_sink - 1)
        return replace(self, capacity=cap, evict_chunk=max(1, chunk))

    @property
    def window(self) -> int:
        return self.capacity - self.n_sink


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 40
    repetition_penalty: float = 1.1
    max_tokens: int = 512
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (0.0 <= self.temperature <= 10.0):
            raise ConfigError("temperature must be between 0 and 10")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError("top_k must be >= 0")
        if not (0.0 < self.repetition_penalty <= 10.0):
            raise ConfigError("repetition_penalty must be in (0, 10]")
        if self.max_tokens < 1:
            raise ConfigError("max_tokens must be >= 1")


@dataclass(frozen=True)
class MemoryConfig:
    """The recall memory (`sinkchat.memory`): evicted tokens kept in blocks on disk, the top-k blocks per layer
    attended again. `budget_mb`: the store's disk budget; `ram_mb`: recalled blocks cached in RAM."""

    mode: str = "off"
    budget_mb: int = 1024
    block: int = 64
    topk: int = 4
    ram_mb: int = 64
    bits: int = 16
    reread: int = 3

    def __post_init__(self) -> None:
        if self.mode not in MEMORY_MODES:
            raise ConfigError(f"--memory must be on or off, not {self.mode!r}")
        if self.budget_mb < 1:
            raise ConfigError("--memory-budget must be at least 1 (MiB)")
        if not 8 <= self.block <= 1024:
            raise ConfigError("--memory-block must be between 8 and 1024 tokens")
        if not 1 <= self.topk <= 64:
            raise ConfigError("--memory-topk must be between 1 and 64")
        if self.ram_mb < 1:
            raise ConfigError("--memory-ram must be at least 1 (MiB)")
        if self.bits not in (8, 16):
            raise ConfigError(f"--memory-bits must be 8 or 16, not {self.bits!r}")
        if not 0 <= self.reread <= 9:
            raise ConfigError("--memory-reread must be between 0 and 9 (blocks)")

    @property
    def on(self) -> bool:
        return self.mode == "on"


@dataclass(frozen=True)
class Settings:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    gauge_every: int = 4
    memory: MemoryConfig = field(default_factory=MemoryConfig)


def prefill_mode() -> str:
    """SINKCHAT_PREFILL, checked: "auto" (the native C prefill where it runs) or "hf" (transformers' forward)."""
    mode = env("SINKCHAT_PREFILL")
    if mode not in ("auto", "hf"):
        raise ConfigError(f"SINKCHAT_PREFILL must be auto or hf, not {mode!r}")
    return mode


def settings_from_env() -> Settings:
    """Settings from the environment and `.env` alone; CLI flags are applied on top with `dataclasses.replace`. A
    value the settings' checks refuse is named as the user set it (`SINKCHAT_MEMORY='maybe' (set in .env): must be
    on or off`), not as the flag the checks are written for (`--memory must be ...`: a flag never passed)."""
    prefill_mode()  # read where it is used (the native step); checked here, before any model loads
    try:
        return _env_settings()
    except ConfigError as e:
        raise _as_env_error(e) from None


FLAG = re.compile(r"--([a-z][a-z-]*)")
LEADING_FLAGS = re.compile(r"^--[a-z-]+(?: and --[a-z-]+)?")


def _as_env_error(e: ConfigError) -> ConfigError:
    """`e` (a check's message naming flags) about the SINKCHAT_* variables those flags are set by, where one of
    them is set; else `e`."""
    msg = str(e)
    names = [n for f in dict.fromkeys(FLAG.findall(msg))
             if (n := "SINKCHAT_" + f.upper().replace("-", "_")) in os.environ]
    if not names:
        return e
    rest = LEADING_FLAGS.sub("", msg, count=1).strip()
    return ConfigError(f"{', '.join(_set_as(n) for n in names)}: {rest}")


def _env_settings() -> Settings:
    return Settings(
        model=ModelConfig(
            model=env("SINKCHAT_MODEL") or None,
            quant=env("SINKCHAT_QUANT"),
            device=env("SINKCHAT_DEVICE"),
            dtype=env("SINKCHAT_DTYPE"),
            threads=env("SINKCHAT_THREADS", int),
            kv_dtype=env("SINKCHAT_KV_DTYPE"),
            decoder=env("SINKCHAT_DECODER"),
        ),
        cache=CacheConfig(
            policy=env("SINKCHAT_POLICY"),
            n_sink=env("SINKCHAT_SINKS", int),
            capacity=env("SINKCHAT_CACHE", int),
            evict_chunk=env("SINKCHAT_EVICT_CHUNK", int),
            pin=env("SINKCHAT_PIN"),
        ),
        sampling=SamplingConfig(
            temperature=env("SINKCHAT_TEMPERATURE", float),
            top_p=env("SINKCHAT_TOP_P", float),
            top_k=env("SINKCHAT_TOP_K", int),
            repetition_penalty=env("SINKCHAT_REPETITION_PENALTY", float),
            max_tokens=env("SINKCHAT_MAX_TOKENS", int),
            seed=env("SINKCHAT_SEED", opt_int),
        ),
        gauge_every=env("SINKCHAT_GAUGE_EVERY", int),
        memory=MemoryConfig(
            mode=env("SINKCHAT_MEMORY"),
            budget_mb=env("SINKCHAT_MEMORY_BUDGET", int),
            block=env("SINKCHAT_MEMORY_BLOCK", int),
            topk=env("SINKCHAT_MEMORY_TOPK", int),
            ram_mb=env("SINKCHAT_MEMORY_RAM", int),
            bits=env("SINKCHAT_MEMORY_BITS", int),
            reread=env("SINKCHAT_MEMORY_REREAD", int),
        ),
    )


def data_dir() -> Path:
    """Where history, logs and snapshots live (SINKCHAT_HOME or the XDG user data dir)."""
    home = env("SINKCHAT_HOME")
    if home:
        return Path(home).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "sinkchat"


def cache_dir() -> Path:
    """Where converted models live (SINKCHAT_CACHE_DIR or the XDG user cache dir)."""
    d = env("SINKCHAT_CACHE_DIR")
    if d:
        return Path(d).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sinkchat"
