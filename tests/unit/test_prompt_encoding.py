"""inference.prompt_encoding: a chat prefix tokenized ahead gives the very ids of a whole encode, or is not used."""

from __future__ import annotations

import copy
import random

import pytest
from transformers import AutoTokenizer

from inference.prompt_encoding import PromptEncoder
from inference.requests import Message, PromptInput

pytestmark = pytest.mark.unit

_WORDS = ["for", " while", "\n", "  ", "def f(x):", "<|end|>", "é", "\t", "tuple", "...", " ", "ok.", "\n\n", "'''"]


@pytest.fixture(scope="module")
def tokenizer(smoke_model):
    return AutoTokenizer.from_pretrained(smoke_model)


def _conversation(rng: random.Random, turns: int) -> tuple[Message, ...]:
    def text():
        return "".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 12)))

    messages = [Message("system", text())]
    for _ in range(turns):
        messages += [Message("user", text()), Message("assistant", text())]
    return tuple(messages)


def test_a_prefix_tokenized_ahead_gives_the_whole_encodes_ids(tokenizer):
    encoder = PromptEncoder(tokenizer)
    assert encoder.reuses_prefixes  # the smoke template ends each message with <|end|>\n; the next starts <|role|>
    rng = random.Random(7)
    for case in range(200):
        past = _conversation(rng, rng.randint(0, 6))
        prompt = PromptInput(messages=past + (Message("user", "Context:\n[1] x\n\nQuestion: " + str(case)),))
        whole, none_reused = encoder.encode(prompt)
        prefix = encoder.encode_prefix(past)
        ids, reused = encoder.encode(prompt, prefix)
        assert ids == whole, (case, past)
        assert none_reused == 0 and reused == len(prefix.token_ids) > 0


def test_a_prefix_that_is_not_the_prompts_start_is_not_used(tokenizer):
    encoder = PromptEncoder(tokenizer)
    past = (Message("system", "Be brief."), Message("user", "Hi."), Message("assistant", "Hello."))
    prompt = PromptInput(messages=(past[0], Message("user", "Hi!"), past[2], Message("user", "And?")))
    assert encoder.encode(prompt, encoder.encode_prefix(past)) == (encoder.encode(prompt)[0], 0)
    # Token ids and plain text prompts have no chat prefix to reuse.
    assert encoder.encode(PromptInput(token_ids=(5, 6)), encoder.encode_prefix(past)) == ([5, 6], 0)


def test_a_template_whose_messages_do_not_meet_at_an_added_token_reuses_nothing(tokenizer):
    joined = copy.deepcopy(tokenizer)
    # Messages run into one another as plain text: BPE may merge across the
    # boundary, so a prefix's ids are not the whole prompt's start.
    joined.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    encoder = PromptEncoder(joined)
    assert not encoder.reuses_prefixes
    past = (Message("system", "Be brief."), Message("user", "Hi."))
    prompt = PromptInput(messages=past + (Message("user", "And?"),))
    assert encoder.encode(prompt, encoder.encode_prefix(past)) == (encoder.encode(prompt)[0], 0)
