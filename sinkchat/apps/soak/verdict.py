"""One row of a soak's verdict table (criteria.py, criteria_memory.py)."""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024 * 1024


@dataclass(frozen=True)
class Verdict:
    name: str
    value: str
    threshold: str
    status: str  # PASS | FAIL | SHORT (too short to judge) | INCOMPLETE (stopped early) | n/a

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"
