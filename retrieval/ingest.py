"""Turning text into passages to index: files on disk, or the bundled sample corpus.

The sample corpus is Python's own help topics (``pydoc_data.topics``), present
on every Python install, so a fresh machine has something real to search.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst")
_SLUG = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class Passage:
    """One document to upsert: a stable id, its text and payload fields."""

    id: str
    text: str
    payload: dict = field(default_factory=dict)


def paragraphs(text: str) -> Iterator[str]:
    for block in re.split(r"\n\s*\n", text):
        block = " ".join(block.split())
        if block:
            yield block


def chunk(text: str, *, min_chars: int = 200, max_chars: int = 1200) -> list[str]:
    """Paragraphs merged up to ``min_chars``; anything past ``max_chars`` split at a space."""
    chunks, current = [], ""
    for paragraph in paragraphs(text):
        current = f"{current} {paragraph}".strip()
        while len(current) > max_chars:
            cut = current.rfind(" ", 0, max_chars)
            cut = cut if cut > min_chars else max_chars
            chunks.append(current[:cut].strip())
            current = current[cut:].strip()
        if len(current) >= min_chars:
            chunks.append(current)
            current = ""
    if current:
        chunks.append(current)
    return chunks


def sample_corpus(max_per_topic: int | None = None) -> list[Passage]:
    """Python's help topics as passages, with ``topic`` and ``index`` in the payload."""
    from pydoc_data.topics import topics

    passages = []
    for topic in sorted(topics):
        for index, text in enumerate(chunk(topics[topic])):
            if max_per_topic is not None and index >= max_per_topic:
                break
            passages.append(Passage(f"{topic}-{index}", text, {"topic": topic, "index": index, "source": f"pydoc:{topic}"}))
    return passages


def files_to_passages(paths: Iterable[Path]) -> list[Passage]:
    """Every text or Markdown file under ``paths`` as passages; ids derive from path and position."""
    passages = []
    for path in _text_files(paths):
        slug = _SLUG.sub("_", str(path)).strip("_")[-100:]
        for index, text in enumerate(chunk(path.read_text(errors="replace"))):
            passages.append(Passage(f"{slug}-{index}", text, {"source": str(path), "index": index}))
    return passages


def _text_files(paths: Iterable[Path]) -> Iterator[Path]:
    for path in paths:
        if path.is_dir():
            yield from sorted(p for p in path.rglob("*") if p.suffix.lower() in TEXT_SUFFIXES and p.is_file())
        elif path.is_file():
            yield path
        else:
            raise FileNotFoundError(f"no such file or folder: {path}")
