"""A service's Prometheus metrics, read as a scraper would."""

from __future__ import annotations

import asyncio
import urllib.request


async def scrape(port: int) -> dict[str, float]:
    """Prometheus samples as {'name{labels}': value} (off the event loop: urllib blocks)."""
    def fetch() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return response.read().decode()

    samples = {}
    for line in (await asyncio.to_thread(fetch)).splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


def total(samples: dict[str, float], name: str, *labels: str) -> float:
    """Sum of the samples of ``name`` whose labels contain every one of ``labels``."""
    return sum(v for k, v in samples.items() if k.split("{")[0] == name and all(label in k for label in labels))
