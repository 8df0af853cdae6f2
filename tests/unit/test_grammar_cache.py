"""The engine core's grammar cache (inference/grammar_cache.py), on vLLM's own classes and llguidance with the
smoke model's tokenizer: a cached grammar is a fresh matcher each time (a request's tokens never reach the
cached one), it is ready at once instead of through the compile pool, and vLLM finds the plugin."""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest

SCHEMA = json.dumps({"type": "object", "additionalProperties": False, "required": ["city"],
                     "properties": {"city": {"type": "string", "maxLength": 8}}})


@pytest.fixture(scope="module")
def engine_parts(tmp_path_factory):
    """vLLM's guidance backend and structured-output manager, patched, built without an engine."""
    import llguidance.hf
    from transformers import AutoTokenizer
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.structured_output.backend_guidance import GuidanceBackend

    from inference.grammar_cache import register
    from inference.smoke_model import build_smoke_model

    register()
    register()  # vLLM may load plugins more than once in a process
    model = tmp_path_factory.mktemp("smoke") / "smoke"
    build_smoke_model(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    backend = object.__new__(GuidanceBackend)  # its __post_init__ wants a whole vLLM config; these are what it sets
    backend.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
    backend.vocab_size = backend.ll_tokenizer.vocab_size
    backend.disable_any_whitespace, backend.disable_additional_properties = True, False
    manager = object.__new__(StructuredOutputManager)
    manager.backend, manager._use_async_grammar_compilation = backend, True
    manager.executor = ThreadPoolExecutor(1)
    yield SimpleNamespace(backend=backend, manager=manager, tokenizer=tokenizer)
    manager.executor.shutdown()


def _request(schema: str = SCHEMA):
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.structured_output.request import StructuredOutputRequest

    return SimpleNamespace(structured_output_request=StructuredOutputRequest(params=StructuredOutputsParams(json=schema)),
                           sampling_params=SimpleNamespace(all_stop_token_ids=set()), request_id="r")


def test_the_plugin_is_registered_for_vllm():
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("agw_grammar_cache") == "inference.grammar_cache:register"


def test_a_cached_grammar_is_a_fresh_matcher_that_a_requests_tokens_never_reach(engine_parts):
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions

    backend, tokenizer = engine_parts.backend, engine_parts.tokenizer
    first = backend.compile_grammar(StructuredOutputOptions.JSON, SCHEMA)
    tokens = tokenizer.encode('{"city"', add_special_tokens=False)
    assert first.accept_tokens("a", tokens)  # the first request moves on
    second = backend.compile_grammar(StructuredOutputOptions.JSON, SCHEMA)
    assert second.ll_matcher is not first.ll_matcher
    assert second.accept_tokens("b", tokens)  # the cached one starts from the beginning
    assert not backend.compile_grammar(StructuredOutputOptions.JSON, SCHEMA).accept_tokens(
        "c", tokenizer.encode('["x"]', add_special_tokens=False))  # and still constrains
    assert len(backend.agw_grammars) == 1


def test_an_uncached_grammar_goes_to_the_pool_and_a_cached_one_is_ready_at_once(engine_parts):
    manager = engine_parts.manager
    new_schema = SCHEMA.replace("city", "town")
    cold = _request(new_schema)
    manager.grammar_init(cold)
    assert isinstance(cold.structured_output_request._grammar, Future)  # vLLM's asynchronous path
    assert cold.structured_output_request.grammar is not None or cold.structured_output_request._grammar.result()
    warm = _request(new_schema)
    manager.grammar_init(warm)
    assert not isinstance(warm.structured_output_request._grammar, Future)
    assert warm.structured_output_request.is_grammar_ready  # schedulable in the step it arrived in


def test_validation_remembers_a_grammar_that_passed_and_refuses_a_bad_one_every_time(engine_parts):
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.structured_output import backend_guidance

    validate = backend_guidance.validate_guidance_grammar
    tokenizer = engine_parts.backend.ll_tokenizer
    good = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    validate(good, tokenizer=tokenizer)
    validate(good, tokenizer=tokenizer)
    assert len(validate.agw_passed) == 1
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(grammar="start: ( "))
    for _ in range(2):
        with pytest.raises(VLLMValidationError, match="Grammar error|Invalid grammar"):
            validate(bad, tokenizer=tokenizer)
    assert len(validate.agw_passed) == 1
