"""Options every sinkchat command shares, settings resolution (flags > env > .env > defaults), error mapping and
the one-call bootstrap `open_engine` that clients use. Torch is imported only when an engine is opened."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

import click

from sinkchat.config import (DECODERS, DEVICES, DTYPES, KV_DTYPES, MEMORY_MODES, PINS, POLICIES, QUANTS, ConfigError,
                             Settings, settings_from_env)
from sinkchat.errors import UserError

PROMPTS_PACKAGE = "sinkchat.prompts"  # the checkout's top-level prompts/ folder as a package (see pyproject.toml)

COMMON = [
    click.option("--model", "-m", default=None, help="HF id, local folder or .gguf file [env SINKCHAT_MODEL; default: the embedded SmolLM2-135M-Instruct, a small demo model]"),
    click.option("--quant", type=click.Choice(QUANTS), default=None, help="weight quantization: auto = q4 on CPU, nf4 on CUDA [env SINKCHAT_QUANT; default auto]"),
    click.option("--device", type=click.Choice(DEVICES), default=None, help="[env SINKCHAT_DEVICE; default auto]"),
    click.option("--dtype", type=click.Choice(DTYPES), default=None, help="compute dtype [env SINKCHAT_DTYPE; default auto]"),
    click.option("--kv-dtype", type=click.Choice(KV_DTYPES), default=None, help="what the KV cache stores: auto = bfloat16 with a fast decode step [env SINKCHAT_KV_DTYPE; default auto]"),
    click.option("--decoder", type=click.Choice(DECODERS), default=None, help="single-token decoding: auto = the native C step (AVX-512, AVX-VNNI, AVX2 or NEON kernels), else the torch step compiled in the background; native; compiled / eager = torch step and kernels; hf = the transformers forward [env SINKCHAT_DECODER; default auto]"),
    click.option("--threads", type=click.IntRange(0, 256), default=None, help="threads for the native kernels (a persistent pool, results identical at any count) and torch [env SINKCHAT_THREADS; default 0 = the physical cores]"),
    click.option("--policy", type=click.Choice(POLICIES), default=None, help="KV cache policy [env SINKCHAT_POLICY; default sink]"),
    click.option("--sinks", type=click.IntRange(0, 64), default=None, help="pinned sink tokens [env SINKCHAT_SINKS; default 4]"),
    click.option("--pin", type=click.Choice(PINS), default=None, help="what the sink policy also keeps forever: system = the system prompt (and the agent's tool definitions), shown as 'pinned N' in the status; none = only the sinks [env SINKCHAT_PIN; default system]"),
    click.option("--cache", "cache_size", type=click.IntRange(0, None), default=None, help="cache capacity in tokens incl. sinks [env SINKCHAT_CACHE; default (or 0) min(2048, model context)]"),
    click.option("--evict-chunk", type=click.IntRange(0, None), default=None, help="tokens evicted at once [env SINKCHAT_EVICT_CHUNK; default (cache - sinks)/16]"),
    click.option("--temperature", type=click.FloatRange(0, 10), default=None, help="[env SINKCHAT_TEMPERATURE; default 0.7; 0 = greedy]"),
    click.option("--max-tokens", type=click.IntRange(1, None), default=None, help="max tokens per reply [env SINKCHAT_MAX_TOKENS; default 512]"),
    click.option("--seed", type=int, default=None, help="random seed [env SINKCHAT_SEED]"),
    click.option("--memory", type=click.Choice(MEMORY_MODES), default=None, help="recall memory: on = tokens evicted from the window are kept in blocks on disk and the blocks a query needs are attended again (nothing forgotten without a 'forgotten' event) [env SINKCHAT_MEMORY; default off]"),
    click.option("--memory-budget", type=click.IntRange(1, None), default=None, help="disk budget of the session's recall memory in MiB; past it the oldest blocks are forgotten [env SINKCHAT_MEMORY_BUDGET; default 1024]"),
    click.option("--memory-block", type=click.IntRange(8, 1024), default=None, help="tokens per recall-memory block [env SINKCHAT_MEMORY_BLOCK; default 64]"),
    click.option("--memory-topk", type=click.IntRange(1, 64), default=None, help="recall-memory blocks each layer attends to [env SINKCHAT_MEMORY_TOPK; default 4]"),
    click.option("--memory-reread", type=click.IntRange(0, 9), default=None, help="recall-memory blocks read again as text before a message that names what one holds: the block it names and its neighbours, so a small model answers from it (passkey at 4k through cache 1,024: 19/20 against 9/20 attending alone) [env SINKCHAT_MEMORY_REREAD; default 3; 0 = none]"),
    click.option("--memory-bits", type=click.Choice(["8", "16"]), default=None, help="bits a stored key / value takes on disk: 16 = the cache's own (exact), 8 = int8 with a scale per token and head (half the disk) [env SINKCHAT_MEMORY_BITS; default 16]"),
    click.option("-v", "--verbose", count=True, help="log more (-vv for debug)"),
]
COMMON_KEYS = ("model", "quant", "device", "dtype", "kv_dtype", "decoder", "threads", "policy", "sinks", "pin", "cache_size", "evict_chunk",
               "temperature", "max_tokens", "seed", "memory", "memory_budget", "memory_block", "memory_topk", "memory_reread", "memory_bits", "verbose")
# what `build_settings` takes besides COMMON_KEYS (settings without a shared flag)
EXTRA_KEYS = ("top_p", "top_k", "repetition_penalty", "gauge_every", "memory_ram")


def common_options(f: Callable[..., Any] | None = None, *, exclude: tuple[str, ...] = ()) -> Any:
    """Decorator adding the shared options (minus `exclude`, e.g. a command that takes several --policy)."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for key, opt in reversed(list(zip(COMMON_KEYS, COMMON))):
            if key not in exclude:
                fn = opt(fn)
        return fn

    return deco(f) if f is not None else deco


def pop_common(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Remove the shared options from a command's kwargs, merged with the ones given before the subcommand."""
    ctx = click.get_current_context(silent=True)
    parent = (ctx.find_root().obj or {}) if ctx else {}
    out = {}
    for k in COMMON_KEYS:
        v = kwargs.pop(k, None)
        if v is None or (k == "verbose" and v == 0):
            v = parent.get(k, v)
        out[k] = v
    return out


# the type each `build_settings` key takes (every other key is text); a string that reads as one is accepted, as
# the CLI and the environment give them
INT_KEYS = ("threads", "sinks", "cache_size", "evict_chunk", "max_tokens", "seed", "memory_budget", "memory_block",
            "memory_topk", "memory_reread", "memory_bits", "memory_ram", "top_k", "gauge_every", "verbose")
FLOAT_KEYS = ("temperature", "top_p", "repetition_penalty")


def build_settings(opts: dict[str, Any], names: dict[str, str] | None = None) -> Settings:
    """Flags (non-None values in `opts`) over environment / .env over defaults. A key that names no setting, or a
    value of the wrong type, is a ConfigError naming it (a misspelled `{"memroy": "on"}` must not be silently
    ignored). `names`: other names callers know settings by (the Python API's `cache`), used in those errors."""
    names = names or {}
    _check_keys(opts, names)
    opts = {k: _typed(k, v, names) for k, v in opts.items()}
    base = settings_from_env()
    m = base.model
    m = replace(m, **{k: opts[k] for k in ("model", "quant", "device", "dtype", "kv_dtype", "decoder", "threads") if opts.get(k) is not None})
    c = base.cache
    cache_changes = {"policy": opts.get("policy"), "n_sink": opts.get("sinks"), "capacity": opts.get("cache_size"),
                     "evict_chunk": opts.get("evict_chunk"), "pin": opts.get("pin")}
    c = replace(c, **{k: v for k, v in cache_changes.items() if v is not None})
    s = base.sampling
    samp = {k: opts.get(k) for k in ("temperature", "max_tokens", "seed", "top_p", "top_k", "repetition_penalty")}
    s = replace(s, **{k: v for k, v in samp.items() if v is not None})
    mem = {"mode": opts.get("memory"), "budget_mb": opts.get("memory_budget"), "block": opts.get("memory_block"),
           "topk": opts.get("memory_topk"), "ram_mb": opts.get("memory_ram"), "bits": opts.get("memory_bits"),
           "reread": opts.get("memory_reread")}
    mc = replace(base.memory, **{k: v for k, v in mem.items() if v is not None})
    gauge = opts.get("gauge_every")
    if mc.on and c.policy != "sink":  # refused before the model loads (it was after)
        raise ConfigError("--memory on keeps what the sink policy evicts: use --policy sink")
    return replace(base, model=m, cache=c, sampling=s, memory=mc,
                   gauge_every=base.gauge_every if gauge is None else gauge)


def _check_keys(opts: dict[str, Any], names: dict[str, str]) -> None:
    """ConfigError for keys that name no setting, with the closest name (a name of `names` where it has one)."""
    import difflib

    unknown = sorted(set(opts) - set(COMMON_KEYS) - set(EXTRA_KEYS))
    if not unknown:
        return
    shown = {key: alias for alias, key in names.items()}
    known = sorted({shown.get(k, k) for k in COMMON_KEYS + EXTRA_KEYS} - {"verbose"})
    hints = [f"{k!r}" + (f" (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(k, known, 1)) else "")
             for k in unknown]
    raise ConfigError(f"unknown setting {', '.join(hints)}; settings: {', '.join(known)}")


def _typed(key: str, value: Any, names: dict[str, str]) -> Any:
    """`value` as the type `key` takes (None stays None: not given); a ConfigError naming the key otherwise."""
    if value is None:
        return None
    shown = next((alias for alias, k in names.items() if k == key), key)
    if key in INT_KEYS:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            return int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{shown} must be a whole number, not {value!r}")
    if key in FLOAT_KEYS:
        try:
            if not isinstance(value, bool) and isinstance(value, (int, float, str)):
                return float(value)
        except ValueError:
            pass
        raise ConfigError(f"{shown} must be a number, not {value!r}")
    if key == "model" and isinstance(value, os.PathLike):
        return os.fspath(value)
    if not isinstance(value, str):
        raise ConfigError(f"{shown} must be a string, not {value!r}")
    return value


def setup_logging(verbose: int) -> None:
    """Library warnings as the apps' own lines (`warning: the snapshot's recall memory ... is not loaded`); with -v
    / -vv every record with its level and logger, for debugging."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_UserFormatter() if verbose == 0 else logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
    for noisy in ("bitsandbytes", "transformers", "accelerate", "urllib3", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(max(level, logging.ERROR))


class _UserFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = f"{record.levelname.lower()}: {record.getMessage()}"
        if record.exc_info:  # log.exception: a bug's traceback is kept (serve's "generation failed")
            text += "\n" + self.formatException(record.exc_info)
        return text


def read_prompt(name: str) -> str:
    """A prompt file from prompts/ (name without extension), read as package data, so an installed wheel has it."""
    from importlib import resources

    try:
        p: Any = resources.files(PROMPTS_PACKAGE) / f"{name}.txt"
    except ModuleNotFoundError:  # sinkchat imported from a checkout that is not installed (PYTHONPATH=.)
        p = Path(__file__).resolve().parent.parent / "prompts" / f"{name}.txt"
    try:
        return p.read_text(encoding="utf-8").strip()
    except OSError as e:
        raise ConfigError(f"cannot read prompt file {p}: {e.strerror}") from None


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn user mistakes (`sinkchat.errors.UserError` and its subclasses: ConfigError, LoadError,
    UnsupportedModel, ContextFull, SnapshotError, LogError) into one-line errors with the error's exit status (2 for
    bad settings, 1 for the rest). Anything else is a bug and keeps its traceback."""
    try:
        yield
    except UserError as e:
        if e.exit_code == 2:
            raise click.UsageError(str(e)) from None
        err = click.ClickException(str(e))
        err.exit_code = e.exit_code
        raise err from None


def open_engine(settings: Settings, system: str | None, progress: Callable[[str], None] | None = None) -> Any:
    """Load the model and build the Engine (the one bootstrap every client shares)."""
    import os

    from sinkchat.config import cache_dir

    # before transformers is imported (importing it fixes inductor's cache dir): compiled decode steps are kept
    # with sinkchat's other caches, not in /tmp where they would be rebuilt after every reboot
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    from sinkchat.model.loader import load

    # load() checks the file before it imports torch (a truncated GGUF: one line in well under a second), so torch
    # comes in with the decode step, after it
    loaded = load(settings.model, progress, check_context=settings.cache.resolved)
    from sinkchat import decode
    from sinkchat.core.engine import Engine
    from sinkchat.core.sampling import Sampler

    m = settings.model
    build = [sys.executable, "-m", "sinkchat.decode.build", json.dumps(dataclasses.asdict(m))]
    step = decode.select(loaded.model, m.decoder, loaded.spec, build, loaded.fingerprint)
    return Engine(loaded.model, loaded.tokenizer, settings.cache, spec=loaded.spec, step=step,
                  sampler=Sampler(settings.sampling), loaded=loaded, system=system,
                  gauge_every=settings.gauge_every, kv_dtype=m.kv_dtype, memory=open_memory(settings, loaded.spec))


def block_bytes(cfg: Any, spec: Any, width: int = 2) -> int:
    """Bytes of one stored block's keys and values at least (its record on disk is this plus a header and its token
    ids): the cache's own `width` bytes a value at 16 bits (a float32 cache stores 4), or int8 with an fp32 scale
    per token, layer, KV head and K / V."""
    rows = cfg.block * len(spec.global_layers) * spec.n_kv * 2  # per token, layer and KV head: a key and a value
    return rows * spec.head_dim * width if cfg.bits == 16 else rows * (spec.head_dim + 4)


def check_budget(cfg: Any, spec: Any, kv_dtype: str = "auto") -> None:
    """ConfigError when --memory-budget cannot hold one block of this model (every block was then reported
    forgotten, each with `[Errno 27] one block (1475740 bytes) exceeds the memory budget`). `auto` is taken as
    bfloat16 (what the native step stores); a float32 cache that `auto` gives elsewhere is still reported per block."""
    from sinkchat.core.metrics import human_bytes

    need = block_bytes(cfg, spec, 4 if kv_dtype == "float32" else 2)
    if need > cfg.budget_mb << 20:
        raise ConfigError(f"--memory-budget {cfg.budget_mb} MiB holds no block: a block of {cfg.block} tokens takes "
                          f"at least {human_bytes(need)} on this model (a larger --memory-budget, or a smaller "
                          "--memory-block or --memory-bits 8)")


def open_memory(settings: Settings, spec: Any) -> Any:
    """The recall memory the settings ask for (None: off): its store in a folder of its own under the data dir,
    readable by the user alone and removed when the process ends (the session's memory goes with it)."""
    if not settings.memory.on:
        return None
    import atexit
    import os
    import time

    from sinkchat.config import data_dir
    from sinkchat.memory.recall import RecallMemory

    if settings.cache.policy != "sink":
        raise ConfigError("--memory on keeps what the sink policy evicts: use --policy sink")
    check_budget(settings.memory, spec, settings.model.kv_dtype)
    root = data_dir() / "memory" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    try:
        memory = RecallMemory.for_spec(settings.memory, spec, root)
    except OSError as e:
        raise ConfigError(f"cannot create the memory store under {root.parent}: {e.strerror}") from None
    atexit.register(memory.close)
    from sinkchat.memory.sweep import sweep_dead_stores

    sweep_dead_stores(root.parent, keep=root)  # a killed process's store stays behind (up to its budget each)
    return memory
