"""Text <-> token ids and chat-template rendering, on top of the ``tokenizers`` library."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from kvserve.model.gguf_tokenizer import GGUFTokenizerFields, gguf_backend

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback piece


def _gpt2_byte_of_char() -> Mapping[str, int]:
    """GPT-2's printable stand-in character for each byte (byte-level BPE pieces), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]     # these stand as chr(256), chr(257), ...
    return MappingProxyType({chr(c): b for b, c in zip([*printable, *shifted],
                                                       [*printable, *range(256, 256 + len(shifted))])})


_GPT2_BYTE_OF_CHAR = _gpt2_byte_of_char()


def _decoder_types(backend: BackendTokenizer) -> frozenset[str]:
    """The types of the backend's decoder and of those a ``Sequence`` decoder chains."""
    if backend.decoder is None:
        return frozenset()
    pending, types = [json.loads(backend.decoder.__getstate__())], set()
    while pending:
        decoder = pending.pop()
        types.add(decoder.get("type"))
        pending += decoder.get("decoders") or []
    return frozenset(types)


def _validate_messages(messages: object) -> None:
    """ValueError, not TypeError, for every defect: messages arrive from API clients, and the
    server maps ValueError to a 400 response."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of dicts, got {messages!r:.200}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(  # noqa: TRY004
                f"messages[{i}] must be a dict with 'role' and 'content', got {message!r:.200}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}]['role'] must be one of {sorted(CHAT_ROLES)}, got {role!r:.200}")
        if not isinstance(content, str):
            raise ValueError(  # noqa: TRY004
                f"messages[{i}]['content'] must be a string, got {content!r:.200}")


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile as transformers does, so prompts match the ones the model was trained on."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"The model's chat template does not compile: {e}") from e


def _template_reads(source: str | None, name: str) -> bool:
    """Whether the template reads the variable ``name`` (e.g. ``tools``)."""
    if not source:
        return False
    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    return name in jinja2.meta.find_undeclared_variables(env.parse(source))


class Tokenizer:
    """Wraps a ``tokenizers.Tokenizer`` with the model's special ids and chat template."""

    def __init__(self, backend: BackendTokenizer, bos_token_id: int | None,
                 eos_token_id: int | None, chat_template: str | None) -> None:
        self._backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
        self._template = _compile_chat_template(chat_template) if chat_template else None
        self.template_declares_tools = _template_reads(chat_template, "tools")
        decoder_types = _decoder_types(backend)
        self._is_byte_level = "ByteLevel" in decoder_types      # pieces spell bytes in GPT-2's alphabet
        self._has_byte_fallback = "ByteFallback" in decoder_types   # SentencePiece: ▁ and <0xNN> pieces

    @classmethod
    def from_gguf_fields(cls, fields: GGUFTokenizerFields) -> Tokenizer:
        """The tokenizer a GGUF file's metadata describes (kvserve/model/gguf_tokenizer.py)."""
        return cls(gguf_backend(fields), fields.bos_token_id, fields.eos_token_id, fields.chat_template)

    @classmethod
    def from_hf_dir(cls, path: Path, fallback_eos_token_id: int | None = None) -> Tokenizer:
        """Read ``tokenizer.json`` and, when present, ``tokenizer_config.json`` and
        ``chat_template.jinja``."""
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"{str(path)!r} has no tokenizer.json; only fast (tokenizers-library) "
                             "tokenizers are supported.")
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        template = _hf_chat_template(path, config)
        bos = _token_id(backend, config.get("bos_token"))
        eos = _token_id(backend, config.get("eos_token"))
        return cls(backend, bos, eos if eos is not None else fallback_eos_token_id, template)

    def to_tokenizer_json(self) -> str:
        """The ``tokenizers`` library's JSON, i.e. what a ``tokenizer.json`` file holds."""
        return self._backend.to_str()

    def to_json(self) -> str:
        """Everything ``from_json`` needs, for the weights cache."""
        return json.dumps({"backend": self._backend.to_str(), "bos_token_id": self.bos_token_id,
                           "eos_token_id": self.eos_token_id, "chat_template": self.chat_template})

    @classmethod
    def from_json(cls, data: str) -> Tokenizer:
        d = json.loads(data)
        return cls(BackendTokenizer.from_str(d["backend"]), d["bos_token_id"], d["eos_token_id"],
                   d["chat_template"])

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special tokens written in ``text`` (``<|im_start|>``) become their single id;
        ``add_special_tokens`` adds BOS where the model's tokenizer asks for it."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's ids as the model's tokenizer frames a sequence: with the BOS it asks for
        (``add_bos_token``: Gemma, Llama 2), once, where the text does not already begin with it (a
        chat template that writes ``<bos>`` itself); as plain ``encode`` for tokenizers that add none."""
        ids = self.encode(text, add_special_tokens=True)
        bos = self.bos_token_id
        if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos and not text.startswith(2 * (self.id_to_token(bos) or "\0")):
            return ids[1:]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for. A byte-level BPE token or a byte-fallback piece may
        hold part of a character, which no text shows; a SentencePiece piece's ``▁`` is a space,
        also where decoding the token alone strips it (the space prefix). Otherwise the UTF-8 of
        the token's decoded text."""
        piece = self.id_to_token(token_id) or ""
        if self._is_byte_level and piece and all(c in _GPT2_BYTE_OF_CHAR for c in piece):
            return bytes(_GPT2_BYTE_OF_CHAR[c] for c in piece)
        if self._has_byte_fallback:
            byte = _BYTE_PIECE.fullmatch(piece)
            return bytes([int(byte[1], 16)]) if byte else piece.replace("\u2581", " ").encode()
        return self.decode([token_id], skip_special_tokens=False).encode()

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """Render ``messages`` to the prompt text (not ids); ValueError on malformed messages,
        a model without a template, or a conversation the template rejects. ``tools`` (OpenAI
        tool definitions) reach templates that read them (``template_declares_tools``)."""
        if self._template is None:
            raise ValueError("This model has no chat template; send a plain prompt instead.")
        _validate_messages(messages)
        special = {"bos_token": self.bos_token_id, "eos_token": self.eos_token_id}
        strings = {k: (self.id_to_token(v) or "") if v is not None else "" for k, v in special.items()}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, **strings)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"The chat template rejected the messages: {e}") from e


def _hf_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    return template if isinstance(template, str) else None


def _token_id(backend: BackendTokenizer, token: object) -> int | None:
    """Id of a tokenizer_config special token, given as a string or {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None
