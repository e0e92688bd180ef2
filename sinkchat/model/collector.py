"""Python's cyclic garbage collector during a command's start: off from the command line's entry (`pause`, called by
`cli.run`) to the end of the first model load (`resume`, called by `loader.load`), then the objects alive at that
point (the imported modules, torch's among them, and the model) are moved out of its reach for good (`gc.freeze`).

Why: importing torch and loading a model make a million long-lived objects, and the collector walked them again and
again while they were made: 415 collections, 0.67-0.82 s of a piped chat's later start on the busy 2-core box
(`gc.callbacks`), 0.003 s with the pause; `import torch` alone takes ~12% less with the collector off. Frozen, they
are never walked again, so later collections (during replies) stay short too. What is frozen unreachable is only the
start's own cyclic garbage: 7,075 small objects on that start (import-time tuples, cells, functions; `gc.collect`
freed 0 KiB of RSS), never collected. A command that loads no model (`logs`, `cache`) runs with the collector off; a
process's later loads (tests, `bench`) leave it alone; a caller of `cli.run` in-process gets it back (`resume` with
`freeze=False`) when the command returns.
"""

from __future__ import annotations

import gc

_PAUSED = {"by_us": False}


def pause() -> None:
    """Turn the collector off until `resume` (if it is on: a caller's own setting is left as it is)."""
    if gc.isenabled():
        gc.disable()
        _PAUSED["by_us"] = True


def resume(freeze: bool = True) -> None:
    """Turn the collector back on if `pause` turned it off, first freezing what is alive now (`freeze`). Else
    nothing: a load that no command line paused, or a later load of the same process."""
    if not _PAUSED["by_us"]:
        return
    _PAUSED["by_us"] = False
    if freeze:
        gc.freeze()
    gc.enable()


def paused() -> bool:
    return _PAUSED["by_us"]
