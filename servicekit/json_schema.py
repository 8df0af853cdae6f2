"""Checks of a caller's JSON Schema (a tool's parameters, a response format), naming what is wrong.

A schema arrives as JSON text. It must parse, stay within a nesting depth, and
be a valid draft 2020-12 schema; a violation is ``INVALID_ARGUMENT`` naming the
request field and, for a schema that parses but is not valid, the JSON pointer
(RFC 6901) of the offending part, so a caller can find it in a large schema.

These checks are pure CPU: services run them on a thread, and cache the
verdict by the schema's text (:class:`SchemaVerdicts`).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict

from servicekit.errors import InvalidArgument


def json_pointer(path) -> str:
    """The RFC 6901 pointer of a path of keys and indexes ('' is the whole document)."""
    return "".join("/" + str(part).replace("~", "~0").replace("/", "~1") for part in path)


def depth_of(value, limit: int) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), counting no further than ``limit + 1``."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict | list) and level <= limit:
            children = node.values() if isinstance(node, dict) else node
            for child in children:
                stack.append((child, level + 1))
            deepest = max(deepest, level + 1)
    return deepest


def parse_schema(field: str, text: str, *, max_depth: int) -> dict | bool:
    """The schema parsed, or ``INVALID_ARGUMENT`` naming ``field``: not JSON, not an object, or too deep."""
    try:
        schema = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidArgument(field, f"is not JSON ({exc}); send a JSON Schema as JSON text") from None
    if not isinstance(schema, dict | bool):
        raise InvalidArgument(field, f"is a JSON {type(schema).__name__}, not a schema (an object)")
    depth = depth_of(schema, max_depth)
    if depth > max_depth:
        raise InvalidArgument(field, f"nests deeper than {max_depth} levels; flatten it")
    return schema


def check_schema(field: str, text: str, *, max_depth: int) -> dict | bool:
    """Parse and validate against the draft 2020-12 meta-schema; the error names the JSON pointer."""
    from jsonschema import Draft202012Validator, exceptions

    schema = parse_schema(field, text, max_depth=max_depth)
    try:
        Draft202012Validator.check_schema(schema)
    except exceptions.SchemaError as exc:
        where = json_pointer(exc.path) or "/"
        raise InvalidArgument(field, f"is not a valid JSON Schema at {where}: {exc.message[:300]}") from None
    return schema


class SchemaVerdicts:
    """A bounded memory of schemas already checked, by a hash of their text: a tool loop's schemas are
    checked once, not on every step. Stores only that a text passed; a failure is checked again."""

    def __init__(self, capacity: int = 1024) -> None:
        self._capacity = capacity
        self._passed: OrderedDict[bytes, None] = OrderedDict()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(*parts: str) -> bytes:
        digest = hashlib.sha256()
        for part in parts:
            encoded = part.encode()
            digest.update(len(encoded).to_bytes(8, "big"))
            digest.update(encoded)
        return digest.digest()

    def seen(self, key: bytes) -> bool:
        """Whether ``key`` passed before (and count the hit or miss)."""
        if key in self._passed:
            self._passed.move_to_end(key)
            self.hits += 1
            return True
        self.misses += 1
        return False

    def remember(self, key: bytes) -> None:
        self._passed[key] = None
        self._passed.move_to_end(key)
        while len(self._passed) > self._capacity:
            self._passed.popitem(last=False)
