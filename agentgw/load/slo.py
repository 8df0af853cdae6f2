"""Thresholds on a load run, as k6 has them: ``--slo first_token_p99=800ms --slo errors=0`` gates a deploy."""

from __future__ import annotations

import re
from dataclasses import dataclass

_SLO = re.compile(r"^(?P<metric>first_token|total)_(?P<stat>p50|p95|p99|max)=(?P<value>[\d.]+)(?P<unit>ms|s)?$"
                  r"|^(?P<count>errors|error_rate)=(?P<limit>[\d.]+)(?P<percent>%)?$")


@dataclass(frozen=True)
class Slo:
    """A threshold such as first_token_p99=800ms or errors=0."""

    text: str

    @staticmethod
    def parse(text: str) -> Slo:
        if not _SLO.match(text.strip()):
            raise ValueError(f"--slo {text!r}: use first_token_p99=800ms, total_p50=2s, errors=0 or error_rate=1%")
        return Slo(text.strip())

    def check(self, summary: dict) -> tuple[bool, str]:
        """(met, what was measured against what was allowed)."""
        match = _SLO.match(self.text)
        if match["metric"]:
            limit = float(match["value"]) * (1000 if match["unit"] == "s" else 1)
            measured = summary[f"{match['metric']}_ms"].get(match["stat"])
            if measured is None:
                return False, f"{self.text}: no successful turn to measure"
            return measured <= limit, f"{self.text}: measured {measured:.1f} ms"
        if match["count"] == "errors":
            return summary["errors"] <= float(match["limit"]), f"{self.text}: measured {summary['errors']}"
        rate = summary["errors"] / summary["turns"] if summary["turns"] else 0.0
        limit = float(match["limit"]) / (100 if match["percent"] else 1)
        return rate <= limit, f"{self.text}: measured {rate:.2%}"


