"""Built-in chat templates (kvserve/model/chat_templates.py): Gemma 3's exact prompts, the
conversations it refuses, and one BOS in the ids the engine makes of a rendered prompt."""

from __future__ import annotations

import dataclasses
import json

import pytest
from spm_vocab import gemma_fields

from kvserve.engine.model_card import ModelCard
from kvserve.model.chat_templates import builtin_chat_template
from kvserve.model.tokenizer import Tokenizer

SYSTEM, USER, ASSISTANT = "system", "user", "assistant"


def chat(*turns: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in turns]


def with_gemma3_template(tokenizer: Tokenizer) -> Tokenizer:
    """A copy that carries the template (the GGUF has none)."""
    return Tokenizer.from_json(json.dumps(json.loads(tokenizer.to_json()) | {"chat_template": builtin_chat_template(
        "gemma3")}))


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    """The hand-made Gemma-shaped vocabulary (tests/spm_vocab.py): <bos> is id 2."""
    fields = dataclasses.replace(gemma_fields(), chat_template=builtin_chat_template("gemma3"))
    return Tokenizer.from_gguf_fields(fields)


def test_families_with_their_own_templates_get_none() -> None:
    assert builtin_chat_template("gemma3") is not None
    assert builtin_chat_template("llama") is None and builtin_chat_template("qwen2") is None


@pytest.mark.parametrize(("messages", "add_generation_prompt", "expected"), [
    (chat((USER, "Hi")), True,
     "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"),
    (chat((USER, "Hi")), False,
     "<bos><start_of_turn>user\nHi<end_of_turn>\n"),
    # the system message opens the first user turn, then a blank line; contents are stripped
    (chat((SYSTEM, "Be brief."), (USER, "  What is 2+2?\n")), True,
     "<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"),
    (chat((SYSTEM, "Be brief."), (USER, "2+2?"), (ASSISTANT, " 4 "), (USER, "And 3+3?")), True,
     ("<bos><start_of_turn>user\nBe brief.\n\n2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n"
      "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n<start_of_turn>model\n")),
    (chat((USER, "Two\nlines"), (ASSISTANT, "{{ not jinja }}")), False,
     "<bos><start_of_turn>user\nTwo\nlines<end_of_turn>\n<start_of_turn>model\n{{ not jinja }}<end_of_turn>\n"),
])
def test_gemma3_prompts(gemma: Tokenizer, messages, add_generation_prompt: bool, expected: str) -> None:
    assert gemma.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize(("messages", "match"), [
    (chat((USER, "a"), (USER, "b")), "message 1 is 'user' where 'assistant' must be"),
    (chat((ASSISTANT, "a")), "message 0 is 'assistant' where 'user' must be"),
    (chat((SYSTEM, "s"), (ASSISTANT, "a")), "message 1 is 'assistant' where 'user' must be"),
    (chat((SYSTEM, "a"), (SYSTEM, "b"), (USER, "c")), "message 1 is 'system'"),
    (chat((USER, "a"), (ASSISTANT, "b"), (SYSTEM, "c")), "message 2 is 'system'"),
    (chat((USER, "a"), ("tool", "{}")), "message 1 is 'tool'"),
    (chat((SYSTEM, "s")), "add a user message after it"),
])
def test_gemma3_refuses_what_its_format_cannot_hold(gemma: Tokenizer, messages, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        gemma.apply_chat_template(messages)


def engine_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The ids the server and LLM.chat give the engine for a rendered chat prompt."""
    card = ModelCard(tokenizer=tokenizer, vocab_size=tokenizer.vocab_size, max_model_len=4096, block_size=16,
                     extra_key=b"")
    return card.encode_prompt(prompt)


def test_a_rendered_prompt_has_one_bos(gemma: Tokenizer) -> None:
    """The template writes <bos> and the file asks for BOS: the engine encodes a rendered prompt
    without adding special tokens, so it starts with the template's BOS and has no other."""
    ids = engine_ids(gemma, gemma.apply_chat_template(chat((SYSTEM, "s"), (USER, "Hello world"))))
    assert ids[0] == gemma.bos_token_id == 2 and ids.count(2) == 1
    assert gemma.decode(ids, skip_special_tokens=False).startswith("<bos><start_of_turn>user\ns\n\nHello")


def test_gemma3_file_prompt_ids(gemma3_tokenizer: Tokenizer) -> None:
    tok = with_gemma3_template(gemma3_tokenizer)
    ids = engine_ids(tok, tok.apply_chat_template(chat((USER, "Hi"))))
    assert ids[:4] == [2, 105, 2364, 107] and ids[-3:] == [105, 4368, 107]   # <bos><start_of_turn>user\n, model\n
    assert ids.count(2) == 1 and ids.count(105) == 2 and ids.count(106) == 1
    assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(chat((USER, "Hi")))
