"""What a front end needs to accept requests for an engine it does not hold.

The tokenizer (and its chat template), the vocabulary and context limits, and the block
keys' inputs (block size, extra key). The HTTP server reads it from its own engine; a
cluster's ingress gets it from an engine replica (it pickles with the tokenizer as JSON),
so both validate and tokenize exactly as the engine does and a router computes exactly
the engine's block keys (kv/prefix.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.blend.prompt import SegmentedPrompt
from kvserve.kv.prefix import extend_block_keys, salted_extra_key, segment_block_keys
from kvserve.model.tokenizer import Tokenizer
from kvserve.request import EncodedPrompt

Prompt = str | Sequence[int] | SegmentedPrompt | EncodedPrompt


@dataclass(frozen=True)
class ModelCard:
    tokenizer: Tokenizer | None
    vocab_size: int
    max_model_len: int
    block_size: int
    extra_key: bytes          # model fingerprint, KV format and dtype, salt (kv/prefix.make_extra_key)
    segment_preamble: tuple[int, ...] = ()    # the tokens segments are computed after (blend_preamble)

    def encode(self, prompt: Prompt) -> EncodedPrompt:
        """The one entry for a prompt in any form: text, token ids, a ``SegmentedPrompt`` (its
        parts tokenized, its segments' spans kept) or an ``EncodedPrompt`` (a front end's, not
        tokenized again: its ids are checked as any prompt's). ValueError as ``encode_prompt``."""
        if isinstance(prompt, EncodedPrompt):
            ids = self.encode_prompt(prompt.token_ids)
            spans = () if prompt.blend is None else prompt.blend.spans
            if spans and spans[-1][0] + spans[-1][1] > len(ids):
                start, length = spans[-1]
                raise ValueError(f"segment span {start}..{start + length} is outside the prompt's {len(ids)} tokens")
            return EncodedPrompt(ids, prompt.blend)
        if isinstance(prompt, SegmentedPrompt):
            ids, spec = prompt.encode(self.tokenizer)
            return EncodedPrompt(self.encode_prompt(ids), spec)
        return EncodedPrompt(self.encode_prompt(prompt))

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt, with a clear error (ValueError) for anything unusable."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass token ids")
            ids = self.tokenizer.encode_prompt(prompt)
        else:
            ids = list(prompt)
            if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
                raise ValueError("a token-id prompt must be a list of integers")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} is out of range for a vocabulary of {self.vocab_size}")
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the context window is {self.max_model_len} tokens "
                "and at least one must be left to generate")
        return ids

    def block_keys(self, token_ids: Sequence[int], salt: str = "", tenant: str = "") -> list[bytes]:
        """The content keys of the full blocks of ``token_ids`` in cache namespace (``tenant``,
        ``salt``), as the engine computes them."""
        keys: list[bytes] = []
        extend_block_keys(keys, token_ids, self.block_size, salted_extra_key(self.extra_key, salt, tenant))
        return keys

    def segment_keys(self, token_ids: Sequence[int], salt: str = "", tenant: str = "") -> list[bytes]:
        """The keys a segment's full blocks are stored under (kvserve/blend/store.py), as the
        engine computes them."""
        return segment_block_keys(token_ids, self.block_size, salted_extra_key(self.extra_key, salt, tenant),
                                  self.segment_preamble)

    def __reduce__(self) -> tuple[Any, ...]:
        # the tokenizer's compiled chat template does not pickle: send its JSON
        tok = None if self.tokenizer is None else self.tokenizer.to_json()
        return (_card_from_wire, (tok, self.vocab_size, self.max_model_len, self.block_size, self.extra_key,
                                  self.segment_preamble))


def _card_from_wire(tokenizer_json: str | None, vocab_size: int, max_model_len: int, block_size: int,
                    extra_key: bytes, segment_preamble: tuple[int, ...] = ()) -> ModelCard:
    tokenizer = None if tokenizer_json is None else Tokenizer.from_json(tokenizer_json)
    return ModelCard(tokenizer, vocab_size, max_model_len, block_size, extra_key, segment_preamble)
