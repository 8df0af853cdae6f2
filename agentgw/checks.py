"""What a doctor check reports: its status, what it measured, and how to fix it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class Status(IntEnum):
    PASS = 0
    WARN = 1
    FAIL = 2


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    measured: str
    fix: str = ""

    def line(self) -> str:
        text = f"{self.status.name:<4}  {self.name:<34} {self.measured}"
        return text + (f"\n      fix: {self.fix}" if self.status is not Status.PASS and self.fix else "")
