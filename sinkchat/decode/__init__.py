"""Single-token decode steps over the sink cache's buffers: `native_step` (one C call a token on sinkchat's kernels)
and `torch_step` (the same math in torch ops, optionally compiled by inductor); `select` picks one for a
`--decoder` mode. Both implement `sinkchat.core.step.DecodeStep`; the bootstrap injects the choice into the Engine."""

from __future__ import annotations

from typing import Any

from sinkchat.core.step import DecodeStep
from sinkchat.model.spec import ModelSpec


def select(model: Any, mode: str, spec: ModelSpec | None = None, build_cmd: list[str] | None = None,
           build_key: str = "") -> DecodeStep | None:
    """The single-token path for `--decoder mode`: "native" / "auto" take the native C step where the weights were
    packed for it, "auto" else the torch step compiled in the background; "native" without native weights falls
    back to the eager torch step; "compiled" / "eager" the torch step. None ("hf", or a model neither step can
    run): the Engine decodes through transformers' forward."""
    from sinkchat.decode.native_step import NativeStep
    from sinkchat.decode.torch_step import TorchStep

    if mode == "hf":
        return None
    spec = spec or ModelSpec.from_model(model)
    if mode in ("auto", "native"):
        step = NativeStep.for_model(model, spec)
        if step is not None:
            return step
        mode = "eager" if mode == "native" else mode
    return TorchStep.for_model(model, spec, mode, build_cmd, build_key)
