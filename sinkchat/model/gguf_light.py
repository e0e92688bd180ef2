"""A later start of a packed GGUF without transformers' model classes: `LightModel`, built from the packed cache
and a small sidecar written when the model was first loaded (its `ModelSpec`, a few config values, the names of
every weight), runs the native decode step and prefill as the transformers model does, and builds that model only
when something needs it (a transformers forward: the sink gauge's sampled steps, `sinkchat bench`'s baseline, an
attribute this class does not hold, a snapshot's config digest).

Why: importing a transformers model class (`modeling_llama`) pulls in `transformers.activations`, its hub kernels
and `torch.distributed.tensor` / `torch._dynamo` with them, and reading the config imports the config class, which
pulls the same chain: 1.7-2.9 s of a 4-6 s later start (busy 2-core machine, `python -X importtime`), for a model
whose every step runs in sinkchat's own kernels. The tokenizer goes through the `tokenizers` library and jinja2
directly where that is exact (`light_tokenizer`; else transformers' class the first start used, built directly:
`AutoTokenizer` scans every transformers model first, 0.3-0.4 s), and the KV cache defers its transformers base
(`core/kv_cache.TransformersBase`): such a start imports no transformers at all (1.1 s to import on a busy box).

Only for the shapes this class mirrors exactly: Llama / Mistral / Qwen2 / Phi-3 (no q/k norms, no Gemma embedding
scale or 1 + w norms), packed for the native kernels, fp32 on the CPU; everything else loads as before.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import warnings
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Sequence

from torch import nn

from sinkchat.model import light_tokenizer
from sinkchat.model.load_error import LoadError
from sinkchat.model.spec import LayerSpec, ModelSpec, NormSpec, RopeSpec

log = logging.getLogger(__name__)

VERSION = 3  # 2: the tokenizer class and absent config keys; 3: the light tokenizer's record
TYPES = ("llama", "mistral", "qwen2", "phi3")
# config values the light model answers itself (plain JSON values); any other attribute builds the real config
CONFIG_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings", "tie_word_embeddings",
               "eos_token_id", "bos_token_id", "pad_token_id", "architectures")


_ABSENT = object()


def sidecar_name(kernels: str) -> str:
    return f"light-v{VERSION}-{kernels}.json"


def eligible(spec: ModelSpec, kernels: str) -> bool:
    """Whether `LightModel` mirrors this model exactly and the native step runs it."""
    return (kernels == "native" and spec.model_type in TYPES and not spec.norm.qk_norm and not spec.norm.unit_offset
            and not spec.norm.sandwich and spec.embed_scale == 1.0 and spec.fast_step_refusal(native=True) is None)


def save_sidecar(model: nn.Module, tokenizer: Any, spec: ModelSpec, folder: Path, kernels: str) -> None:
    """Write what a later start needs besides the packed weights (best effort: without it, the start is as before).
    `tokenizer`: what `AutoTokenizer` made of the folder; a plain `TokenizersBackend` (most GGUFs' converted
    tokenizers) is then built directly, without `AutoTokenizer`'s scan of every transformers model (0.3-0.4 s)."""
    if not eligible(spec, kernels) or isinstance(model, LightModel):
        return
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cfg = model.config
    gen = getattr(model, "generation_config", None)
    data = {"version": VERSION, "kernels": kernels, "spec": asdict(spec),
            "config": {k: v for k in CONFIG_KEYS if (v := getattr(cfg, k, _ABSENT)) is not _ABSENT and _plain(v)},
            "absent": [k for k in CONFIG_KEYS if getattr(cfg, k, _ABSENT) is _ABSENT],  # Phi-3 has no head_dim
            "generation_eos": getattr(gen, "eos_token_id", None),
            "tokenizer": "TokenizersBackend" if type(tokenizer) is TokenizersBackend else None,
            "light_tokenizer": light_tokenizer.describe(tokenizer, folder),
            "names": sorted(n for n, _ in [*model.named_parameters(), *model.named_buffers()]
                            if "rotary_emb" not in n)}
    tmp = None
    try:  # a temp file of its own, renamed: two processes writing at once never leave half a file
        fd, tmp = tempfile.mkstemp(prefix=".light-", dir=folder)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, folder / sidecar_name(kernels))
    except OSError as e:
        log.info("could not write the light-start sidecar in %s: %s", folder, e)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _plain(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str)) or (
        isinstance(v, list) and all(isinstance(x, (int, str)) for x in v))


def read_sidecar(folder: Path, kernels: str) -> dict[str, Any] | None:
    """The sidecar for `kernels`, checked whole (its spec rebuilt once here), or None."""
    path = folder / sidecar_name(kernels)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("version") != VERSION or data.get("kernels") != kernels:
            return None
        spec_of(data["spec"])
        data["config"]["model_type"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.info("no light start from %s: %s", folder, e)
        return None
    return data


def spec_of(d: dict[str, Any]) -> ModelSpec:
    """The `ModelSpec` written by `save_sidecar` (`asdict`), rebuilt with its tuples."""
    layers = tuple(LayerSpec(attention=x["attention"], window=x["window"], scaling=x["scaling"],
                             rope=RopeSpec(**{**x["rope"], "inv_freq": tuple(x["rope"]["inv_freq"])}))
                   for x in d["layers"])
    return ModelSpec(**{**d, "layers": layers, "norm": NormSpec(**d["norm"]), "linears": tuple(d["linears"])})


class LightConfig:
    """`model.config` of a `LightModel`: the sidecar's values; any other attribute from the real transformers
    config (`LightModel.transformers_model().config`, built on that first use)."""

    def __init__(self, values: dict[str, Any], absent: Sequence[str], owner: "LightModel") -> None:
        self.__dict__.update(_values=dict(values), _absent=frozenset(absent), _owner=owner)

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__["_values"]
        if name in values:
            v = values[name]
            return list(v) if isinstance(v, list) else v
        if name.startswith("__") or name in self.__dict__["_absent"]:
            raise AttributeError(name)
        return getattr(self.real(), name)

    def real(self) -> Any:
        """The transformers model's own config (`gguf_load.skeleton` takes this for a LightConfig)."""
        return self.__dict__["_owner"].transformers_model().config


class _Part(nn.Module):
    """A container or a leaf (a norm's weight, a bias) of the light module tree, named as transformers names it."""


class LightModel(nn.Module):
    """transformers' `*ForCausalLM` module tree as the native step and prefill read it (`model.layers[i]` with
    `self_attn.*` / `mlp.*` linears and norm weights, `model.norm`, the embeddings and head), holding the packed
    modules themselves. `forward` and unknown attributes go to the transformers model, built once on first need
    around the same module objects (hooks and weights shared)."""

    def __init__(self, folder: Path, spec: ModelSpec, config: dict[str, Any], generation_eos: Any,
                 absent: Sequence[str] = ()) -> None:
        super().__init__()
        self.model = _Part()
        self.model.layers = nn.ModuleList(_Part() for _ in range(spec.n_layers))
        for layer in self.model.layers:
            layer.self_attn, layer.mlp = _Part(), _Part()
        self.model.embed_tokens = _Part()
        self.__dict__["_folder"], self.__dict__["_hf"], self.__dict__["_building"] = folder, None, False
        self.__dict__["config"] = LightConfig(config, list(absent), self)
        self.__dict__["generation_config"] = SimpleNamespace(eos_token_id=generation_eos)

    # the accessors transformers' models have (gguf_packed wires the embeddings and head through them)
    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, module: nn.Module) -> None:
        self.model.embed_tokens = module

    def get_output_embeddings(self) -> nn.Module | None:
        return self._modules.get("lm_head")

    def set_output_embeddings(self, module: nn.Module) -> None:
        self.lm_head = module

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """While filled from the packed cache, `get_submodule` makes the leaves it is asked for (norms)."""
        self.__dict__["_building"] = True
        try:
            yield
        finally:
            self.__dict__["_building"] = False

    def get_submodule(self, target: str) -> nn.Module:
        if not self.__dict__["_building"] or not target:
            return super().get_submodule(target)
        mod: nn.Module = self
        for part in target.split("."):
            if part not in mod._modules:
                mod.add_module(part, _Part())
            mod = mod._modules[part]
        return mod

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.transformers_model()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_") or self.__dict__.get("_building", True):
                raise
            return getattr(self.transformers_model(), name)

    def transformers_model(self) -> nn.Module:
        """The transformers model over the same modules and weights (built once: ~2 s of imports)."""
        if self.__dict__["_hf"] is None:
            self.__dict__["_hf"] = _materialize(self)
        return self.__dict__["_hf"]


def _materialize(light: LightModel) -> nn.Module:
    from transformers import AutoConfig

    from sinkchat.model import gguf_convert, gguf_load

    log.info("building the transformers model around the packed modules")
    folder = light.__dict__["_folder"]
    hf = gguf_load.skeleton(AutoConfig.from_pretrained(str(folder)))
    hf.set_input_embeddings(light.get_input_embeddings())
    head = light.get_output_embeddings()
    if head is not None:
        hf.set_output_embeddings(head)
    for name, mod in light.named_modules():
        if name.startswith("model.layers.") and name.count(".") == 4 and not isinstance(mod, _Part):
            parent, _, child = name.rpartition(".")
            setattr(hf.get_submodule(parent), child, mod)  # a packed linear
    for name, p in light.named_parameters():
        owner, _, attr = name.rpartition(".")
        if isinstance(light.get_submodule(owner), _Part):  # a norm weight (packed modules came whole)
            # into `_parameters` itself: under accelerate's init_empty_weights (a caller's skeleton asking this
            # config for a value) `setattr` would move the weight to the meta device
            hf.get_submodule(owner)._parameters[attr] = p
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"the light model lacks {left[:3]}")
    return gguf_convert.finish(hf, folder)


def load(folder: Path, kernels: str, spec: ModelSpec, side: dict[str, Any]) -> LightModel | None:
    """The light model from `folder`'s packed cache and its sidecar `side` (of `spec`), or None (a weight missing or
    extra: the caller loads through transformers)."""
    from sinkchat.model import gguf_packed

    model = LightModel(folder, spec, side.get("config") or {}, side.get("generation_eos"), side.get("absent", []))
    with model.building():
        if gguf_packed.load(None, folder, kernels, into=model) is None:
            return None
    names = sorted(n for n, _ in [*model.named_parameters(), *model.named_buffers()])
    if names != side.get("names"):
        log.info("light-start weights in %s differ from the sidecar's; loading through transformers", folder)
        return None
    model.requires_grad_(False)
    model.eval()
    return model


def load_for(source: str, src: str, progress: Callable[[str], None], check_context: Callable[[int], Any] | None,
             phases: Any) -> tuple[LightModel, Any, ModelSpec] | None:
    """`loader.load`'s (model, tokenizer, spec) of a packed GGUF on the native kernels without transformers' config
    and model classes, where the folder's sidecar says `LightModel` mirrors it; None: load as usual. The same
    checks and messages, in the same order (the caller checked the settings: q4, CPU, fp32, native kernels)."""
    side = read_sidecar(Path(src), "native")
    if side is None:
        return None
    spec = spec_of(side["spec"])
    if check_context is not None:
        check_context(spec.max_positions)
    phases.end("config")
    progress(f"loading {Path(source).name} (q4, cpu)")
    try:  # the messages `loader.load` gives for the same failures
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokenizer = _tokenizer(src, side)
            phases.end("tokenizer")
            model = load(Path(src), "native", spec, side)
    except OSError as e:
        raise LoadError(f"cannot load '{source}': {str(e).splitlines()[0][:200]}") from None
    except ValueError as e:
        raise LoadError(f"'{source}' is not a supported causal LM: {str(e).splitlines()[0][:200]}") from None
    if model is None:
        return None
    progress("loaded the packed model from the cache")
    phases.end("weights")
    return model, tokenizer, spec


def _tokenizer(src: str, side: dict[str, Any]) -> Any:
    """The folder's tokenizer as `AutoTokenizer` makes it: through the `tokenizers` library directly where the
    sidecar says that is exact (`light_tokenizer`), else the class it made when the sidecar was written, directly
    (no scan of transformers' models), else `AutoTokenizer` given the model type (so it reads no config class, whose
    import pulls torch._dynamo: ~1 s)."""
    light = light_tokenizer.LightTokenizer.load(Path(src), side.get("light_tokenizer"))
    if light is not None:
        return light
    if side.get("tokenizer") == "TokenizersBackend":
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(src)
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(src, config=SimpleNamespace(model_type=side["config"]["model_type"],
                                                                     _name_or_path=src))
