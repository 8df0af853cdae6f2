"""A vLLM plugin: the engine core keeps compiled llguidance grammars, and a cached one costs no scheduler round.

vLLM 0.32 compiles a fresh llguidance matcher for every constrained request,
in a thread pool whose future the scheduler polls: the request waits for the
next engine step even when the same schema was compiled a moment ago. That
extra step was most of a cached grammar's first-token cost (1.4x
unconstrained on the smoke model, docs/benchmarks.md), against a goal of
1.1x. Our own constraint cache (``inference.constraints``) cannot help: it
lives in the service's process, and the compile happens in the engine core's.

This plugin, loaded by vLLM in each of its processes (the
``vllm.general_plugins`` entry point in pyproject.toml), changes two things in
the engine core, for the guidance backend only:

- ``GuidanceBackend.compile_grammar`` keeps a pristine matcher per
  (request type, grammar) in a bounded LRU on the backend instance, and hands
  each request a ``deep_copy`` of it (about 2 µs against 0.5 ms to compile,
  measured with llguidance on the smoke model's tokenizer);
- ``StructuredOutputManager.grammar_init`` compiles a cached grammar in
  place instead of submitting it to the pool, so the request is schedulable
  in the step it arrives in. Uncached grammars keep vLLM's asynchronous path.

And one in the service's own process, where vLLM checks each request's
grammar before queueing it: ``validate_guidance_grammar`` remembers the
grammars that passed (0.16 ms each, on the event loop); one that fails is
checked, and refused, every time.

It patches vLLM's classes, so it checks the version it was written against
and does nothing on another (logging why): a vLLM upgrade then costs only
the speed-up, never correctness.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

log = logging.getLogger(__name__)

#: The vLLM release whose internals this plugin was written against and tested with.
SUPPORTED_VLLM = "0.32."
#: Compiled grammars kept per engine; a schema's matcher is small (its lexer and parser tables).
MAX_GRAMMARS = 256


def _patch_backend(guidance_backend, guidance_grammar) -> None:
    compile_uncached = guidance_backend.compile_grammar

    def compile_grammar(self, request_type, grammar_spec, stop_token_ids=None):
        # vLLM compiles in its pool's threads and, for cached grammars now, in the scheduler's: one lock.
        lock = self.__dict__.setdefault("agw_grammars_lock", threading.Lock())
        cache = self.__dict__.setdefault("agw_grammars", OrderedDict())
        key = (request_type, grammar_spec)
        with lock:
            pristine = cache.get(key)
            if pristine is not None:
                cache.move_to_end(key)
        if pristine is None:
            grammar = compile_uncached(self, request_type, grammar_spec, stop_token_ids)
            with lock:
                cache[key] = grammar.ll_matcher.deep_copy()  # before the request consumes a token
                if len(cache) > MAX_GRAMMARS:
                    cache.popitem(last=False)
            return grammar
        return guidance_grammar(ll_matcher=pristine.deep_copy(), ll_tokenizer=self.ll_tokenizer,
                                vocab_size=self.vocab_size)

    compile_grammar.agw_cached = True
    guidance_backend.compile_grammar = compile_grammar


def _patch_manager(manager_class, guidance_backend) -> None:
    init_async = manager_class.grammar_init

    def grammar_init(self, request) -> None:
        structured = request.structured_output_request
        if (structured is not None and isinstance(self.backend, guidance_backend)
                and structured.structured_output_key in self.backend.__dict__.get("agw_grammars", {})):
            # Cached: a deep copy, done here, so the request is ready in this step (no pool round trip).
            structured.grammar = self._create_grammar(request)
            return
        init_async(self, request)

    manager_class.grammar_init = grammar_init


def _patch_validation(backend_module) -> None:
    validate = backend_module.validate_guidance_grammar
    # Held by the patched function, as the backend instance holds the matchers: there is no other owner here.
    passed: OrderedDict = OrderedDict()

    def validate_guidance_grammar(sampling_params, tokenizer=None) -> None:
        params = sampling_params.structured_outputs
        if params is None:
            return
        key = (id(tokenizer), backend_module.get_structured_output_key(params))
        if key in passed:
            passed.move_to_end(key)
            return
        validate(sampling_params, tokenizer=tokenizer)  # raises VLLMValidationError for a bad grammar
        passed[key] = True
        if len(passed) > MAX_GRAMMARS:
            passed.popitem(last=False)

    validate_guidance_grammar.agw_passed = passed
    backend_module.validate_guidance_grammar = validate_guidance_grammar


def register() -> None:
    """vLLM's plugin hook; safe to call more than once per process (vLLM may)."""
    import vllm

    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        log.warning("agent-gateway grammar cache: written for vLLM %sx, found %s; not installed (cached grammars "
                    "cost vLLM's usual compile and scheduler round)", SUPPORTED_VLLM, vllm.__version__)
        return
    from vllm.v1.structured_output import StructuredOutputManager, backend_guidance

    if getattr(backend_guidance.GuidanceBackend.compile_grammar, "agw_cached", False):
        return
    _patch_backend(backend_guidance.GuidanceBackend, backend_guidance.GuidanceGrammar)
    _patch_manager(StructuredOutputManager, backend_guidance.GuidanceBackend)
    _patch_validation(backend_guidance)
    log.info("agent-gateway grammar cache installed (guidance backend, %d grammars)", MAX_GRAMMARS)
