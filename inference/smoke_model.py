"""The offline smoke model: a tiny Llama with random weights and a real tokenizer.

Nothing can be downloaded from a model hub on the machines this project is
built and tested on, so the inference service ships this builder. The result is
a real Hugging Face model folder that vLLM loads like any other: a byte-level
BPE tokenizer trained on Python's bundled ``pydoc_data`` topics, a chat
template, and a two-layer Llama whose weights are random. It exercises the
whole engine (tokenizer, scheduler, prefix cache, sampling) and produces
**meaningless text**. Point ``AGW_MODEL`` at a real model for real answers.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: Bumped whenever the builder's output changes, so stale builds are redone.
BUILD_VERSION = 2
MARKER = "agentgw-smoke-model.json"

#: Tools are rendered right after the system message (before it when there is none), so a session's
#: system prompt stays a prefix shared with its tool-less sessions and its tools stay in its own cached
#: prefix. Calls follow the Hermes convention (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``),
#: which vLLM's ``hermes`` tool parser reads.
_TOOLS_BLOCK = (
    "{% if tools %}<|system|>\n# Tools\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|end|>\n{% endif %}"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if not messages or messages[0]['role'] != 'system' %}" + _TOOLS_BLOCK + "{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "<tool_call>{\"name\": {{ call['function']['name'] | tojson }}, \"arguments\": "
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}}</tool_call>"
    "{% endfor %}<|end|>\n"
    "{% if loop.first and message['role'] == 'system' %}" + _TOOLS_BLOCK + "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"]
#: Added but not special: a special token is dropped from decoded text, and the tool parser must see these.
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]


@dataclass(frozen=True)
class SmokeModelSpec:
    """Shape of the smoke model. Head size 64 suits vLLM's CPU attention kernels."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096
    seed: int = 0


def _corpus() -> list[str]:
    """Local English text to train the tokenizer on: Python's help topics."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def _train_tokenizer(spec: SmokeModelSpec):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in TOOL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
        model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _random_model(spec: SmokeModelSpec, tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec.seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    return LlamaForCausalLM(config).eval()


def is_built(folder: Path, spec: SmokeModelSpec = SmokeModelSpec()) -> bool:
    """Whether ``folder`` holds a smoke model built by this version with ``spec``."""
    marker = folder / MARKER
    if not marker.exists():
        return False
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return recorded.get("build_version") == BUILD_VERSION and recorded.get("spec") == asdict(spec)


def build_smoke_model(folder: Path, spec: SmokeModelSpec = SmokeModelSpec(), *, force: bool = False) -> Path:
    """Build the smoke model into ``folder`` unless an identical build is there.

    The build goes to a temporary sibling folder and is renamed into place, so
    a crash or a concurrent builder never leaves a half-written model. When a
    concurrent builder (another replica on the same ``AGW_HOME``) finishes
    first, its build stays and ours is dropped: that replica may already be
    loading from the folder.
    """
    folder = folder.resolve()
    if not force and is_built(folder, spec):
        log.info("smoke model already built at %s", folder)
        return folder
    started = time.perf_counter()
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        tokenizer = _train_tokenizer(spec)
        model = _random_model(spec, tokenizer)
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / MARKER).write_text(
            json.dumps({"build_version": BUILD_VERSION, "spec": asdict(spec), "note": __doc__.splitlines()[0]}, indent=2)
        )
        if not force and is_built(folder, spec):  # another builder finished first: keep theirs
            shutil.rmtree(staging, ignore_errors=True)
            log.info("smoke model built meanwhile at %s by another process; using it", folder)
            return folder
        _move_into_place(staging, folder, spec)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("built smoke model at %s in %.1f s", folder, time.perf_counter() - started)
    return folder


def _move_into_place(staging: Path, folder: Path, spec: SmokeModelSpec) -> None:
    """Rename ``staging`` to ``folder``, retiring a stale build there first (renames: never half a folder)."""
    if folder.exists():
        retired = Path(tempfile.mkdtemp(prefix=f".{folder.name}-retired-", dir=folder.parent))
        os.replace(folder, retired / folder.name)
        shutil.rmtree(retired, ignore_errors=True)
    try:
        os.replace(staging, folder)
    except OSError:  # a concurrent builder's rename won the race: theirs is as good as ours
        if not is_built(folder, spec):
            raise
        shutil.rmtree(staging, ignore_errors=True)
