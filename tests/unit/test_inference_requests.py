"""Request checks: each bad value is INVALID_ARGUMENT naming its field."""

from __future__ import annotations

import pytest

from inference.requests import (
    Limits,
    Message,
    PromptInput,
    Sampling,
    SamplingInput,
    check_fits_context,
    check_prompt_input,
    check_token_ids,
    resolve_sampling,
)
from servicekit.errors import InvalidArgument

pytestmark = pytest.mark.unit

LIMITS = Limits(max_context_tokens=100, vocab_size=50, default_max_tokens=16)


def test_defaults_fill_unset_fields():
    assert resolve_sampling(SamplingInput(), LIMITS) == Sampling(max_tokens=16)


@pytest.mark.parametrize(
    ("given", "field"),
    [
        (SamplingInput(max_tokens=0), "sampling.max_tokens"),
        (SamplingInput(max_tokens=100), "sampling.max_tokens"),
        (SamplingInput(temperature=-1), "sampling.temperature"),
        (SamplingInput(temperature=float("nan")), "sampling.temperature"),
        (SamplingInput(top_p=0), "sampling.top_p"),
        (SamplingInput(top_p=1.01), "sampling.top_p"),
        (SamplingInput(top_k=-2), "sampling.top_k"),
        (SamplingInput(stop=("",)), "sampling.stop"),
    ],
)
def test_out_of_range_sampling(given, field):
    with pytest.raises(InvalidArgument) as caught:
        resolve_sampling(given, LIMITS)
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        (PromptInput(), "input"),
        (PromptInput(text=""), "input.prompt"),
        (PromptInput(messages=()), "input.chat.messages"),
        (PromptInput(messages=(Message("", "x"),)), "input.chat.messages[0].role"),
        (PromptInput(token_ids=()), "input.token_ids"),
    ],
)
def test_missing_or_empty_prompt(prompt, field):
    with pytest.raises(InvalidArgument) as caught:
        check_prompt_input(prompt)
    assert caught.value.field == field


def test_unknown_token_id_names_its_position():
    with pytest.raises(InvalidArgument, match=r"token_ids\[2\]: id 50 is not in the vocabulary"):
        check_token_ids([1, 2, 50], LIMITS)


def test_the_first_unknown_token_id_is_named_and_valid_ids_pass():
    with pytest.raises(InvalidArgument, match=r"token_ids\[1\]: id 70 "):
        check_token_ids((3, 70, 4, 90), LIMITS)
    check_token_ids((), LIMITS)
    check_token_ids((0, LIMITS.vocab_size - 1), LIMITS)
    with pytest.raises(InvalidArgument, match=r"token_ids\[0\]"):
        check_token_ids([LIMITS.vocab_size], LIMITS)


def test_context_overflow_says_limit_and_length():
    with pytest.raises(InvalidArgument, match="prompt is 90 tokens but the context is 100 tokens and max_tokens=20"):
        check_fits_context(90, Sampling(max_tokens=20), LIMITS)
    check_fits_context(80, Sampling(max_tokens=20), LIMITS)
