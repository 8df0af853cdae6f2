"""Order of the end-to-end modules.

The inference tests that count engine capacity (queue bounds, in-flight ids)
run first, on an engine nothing else has used yet: after the Chat module's
4,000-token turns they have been seen to fail intermittently (an open
investigation, noted on issue 6). Everything else keeps pytest's order.
"""

from __future__ import annotations

FIRST = ("test_inference.py",)


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: 0 if item.path.name in FIRST else 1)
