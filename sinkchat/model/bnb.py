"""bitsandbytes quantization of a loaded model's decoder linears (--quant nf4 / fp4 / int8, for CUDA)."""

from __future__ import annotations

import warnings
from typing import Any

from sinkchat.model.load_error import LoadError

# Kept in the compute dtype under 4-bit: K/V projections feed every cached key and value; their error is amplified
# through softmax over the whole window. They are 6% of the bundled model's linear weights (measured: NF4-32 with
# k/v in fp32 has 23.6 ppl vs 25.0 all-NF4 vs 19.8 fp32 on 2,048 tokens of alice29).
KEEP_FULL_PRECISION = ("k_proj", "v_proj")
BLOCKSIZE = 32


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
