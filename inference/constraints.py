"""Structured-output constraints: checked once, cached by their text, handed to vLLM.

A constraint (a JSON schema, a regex, a choice, a Lark grammar) is checked
before it reaches the engine: a JSON schema against the draft 2020-12
meta-schema (the error names the JSON pointer of the problem) and every kind by
compiling it with llguidance against the model's tokenizer. That work is on
the first-token path, so it runs on the tokenizer threads and its verdict is
kept in a bounded LRU by the constraint's text: a tool loop or a response
format sent on every turn compiles once (``agw.inference.constraint_cache``
counts hits and misses; the generation span and the result say which).

Why llguidance (vLLM's ``guidance`` backend) by default: with xgrammar, JSON
strings may hold raw control characters (measured: 4 of 30 outputs of the
smoke model held ``\\x00``, ``\\x06`` or ``\\x16``), which RFC 8259 forbids and
strict parsers reject; llguidance escapes them (0 of 30). Both run with
``disable_any_whitespace``: otherwise a weak model can fill its budget with
whitespace the JSON grammar allows.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass

from servicekit.errors import InvalidArgument
from servicekit.json_schema import check_schema

from inference.requests import Constraint

log = logging.getLogger(__name__)

#: vLLM's StructuredOutputsParams field for each kind.
_VLLM_FIELD = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}
MAX_SCHEMA_DEPTH = 32


@dataclass(frozen=True)
class CompiledConstraint:
    """A checked constraint: the keyword arguments of vLLM's StructuredOutputsParams."""

    kind: str
    params: tuple[tuple[str, object], ...]

    def structured_outputs(self):
        from vllm.sampling_params import StructuredOutputsParams

        # A new object per request: vLLM records its backend choice on it.
        return StructuredOutputsParams(**{key: (list(v) if isinstance(v, tuple) else v) for key, v in self.params})


class ConstraintCache:
    """Checks and caches constraints for one engine. ``compile`` is pure CPU work for a thread; the cache is
    touched only by ``lookup`` and ``remember``, both on the event loop, so no thread ever mutates it."""

    def __init__(self, backend: str, tokenizer, capacity: int = 256) -> None:
        self.backend = backend
        self._capacity = capacity
        self._compiled: OrderedDict[tuple[str, str], CompiledConstraint] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self._ll_tokenizer = None
        if backend == "guidance":
            import llguidance.hf

            self._ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)

    def lookup(self, constraint: Constraint) -> CompiledConstraint | None:
        """The compiled constraint if cached (a hit), else None (a miss: call :meth:`compile` off the loop)."""
        compiled = self._compiled.get((constraint.kind, constraint.spec))
        if compiled is None:
            self.misses += 1
            return None
        self._compiled.move_to_end((constraint.kind, constraint.spec))
        self.hits += 1
        return compiled

    def compile(self, constraint: Constraint) -> CompiledConstraint:
        """Check ``constraint`` (INVALID_ARGUMENT naming its field); off the loop. Caches nothing: see
        :meth:`remember`."""
        return CompiledConstraint(constraint.kind, self._check(constraint))

    def remember(self, constraint: Constraint, compiled: CompiledConstraint) -> None:
        """Cache a compiled constraint (on the loop), evicting the least recently used past capacity."""
        key = (constraint.kind, constraint.spec)
        self._compiled[key] = compiled
        self._compiled.move_to_end(key)
        while len(self._compiled) > self._capacity:
            self._compiled.popitem(last=False)

    def _check(self, constraint: Constraint) -> tuple[tuple[str, object], ...]:
        field, spec = constraint.field, constraint.spec
        if constraint.kind == "json":
            check_schema(field, spec, max_depth=MAX_SCHEMA_DEPTH)
            value: object = spec
        elif constraint.kind == "choice":
            choices = json.loads(spec)
            if not choices or any(not isinstance(c, str) or not c for c in choices):
                raise InvalidArgument(field, "needs at least one value, and no empty string")
            value = tuple(choices)
        elif constraint.kind in ("regex", "grammar"):
            if not spec:
                raise InvalidArgument(field, f"the {constraint.kind} is empty")
            value = spec
        else:
            raise InvalidArgument(field, f"unknown constraint kind {constraint.kind!r}")
        self._compile_with_llguidance(constraint, value)
        return ((_VLLM_FIELD[constraint.kind], value),)

    def _compile_with_llguidance(self, constraint: Constraint, value) -> None:
        """Compile as the engine will (guidance backend), so a grammar that cannot compile fails here, named."""
        if self._ll_tokenizer is None:
            return  # another backend: vLLM's own validation reports (as INVALID_ARGUMENT "request")
        import llguidance

        try:
            if constraint.kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(value, defaults={"whitespace_flexible": False})
            else:
                grammar = llguidance.grammar_from(constraint.kind, list(value) if constraint.kind == "choice" else value)
            error = llguidance.LLMatcher.validate_grammar(grammar, self._ll_tokenizer)
        except (ValueError, TypeError, KeyError) as exc:
            error = str(exc)
        if error:
            raise InvalidArgument(constraint.field, f"does not compile: {error[:300]}")
