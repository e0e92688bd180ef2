"""`python -m sinkchat.decode.build MODEL_CONFIG_JSON KV_DTYPE`: build the compiled decode step into inductor's
on-disk cache, in a process of its own, and exit 0 when the build works.

The chat process starts this in the background (see `fastdecode.TorchStep`) and then compiles the same step
itself, which finds everything in the cache. The model is loaded exactly as the chat loaded it (same settings,
same loader), so the graph, its input shapes and dtypes, and so the cache key, are the same.
"""

from __future__ import annotations

import json
import logging
import sys


def main(argv: list[str]) -> int:
    import os

    import torch

    from sinkchat.config import ModelConfig

    os.nice(10)  # the chat keeps the CPU
    _die_with_parent()
    from sinkchat.decode.torch_step import TorchStep
    from sinkchat.model.loader import load

    cfg = ModelConfig(**json.loads(argv[0]))
    kv = {"float32": torch.float32, "bfloat16": torch.bfloat16}[argv[1]]
    loaded = load(cfg)
    step = TorchStep.for_model(loaded.model, loaded.spec, "compiled")
    if step is None:
        print("this model has no fast decode step", file=sys.stderr)
        return 1
    step.prepare(kv)
    if step.status != "compiled":
        print(step.failed or "the build did not finish", file=sys.stderr)
        return 1
    return 0


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when the thread that started it goes (a killed chat leaves no build behind)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main(sys.argv[1:]))
