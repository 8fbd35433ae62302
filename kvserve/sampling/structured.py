"""Structured outputs: a request's ``StructuredOutputs`` compiled to a grammar, matched per token.

The grammar library is llguidance (chosen over xgrammar and outlines-core by measurement,
docs/server.md "Structured outputs"): it compiles lazily (about 2 ms for a schema, against
150-270 ms for xgrammar and outlines-core on this 2-core machine), its per-token mask costs
about 0.05 ms, it reads JSON schemas, regexes and Lark grammars, and it depends on nothing
but itself. Its tokenizer view is built once per engine (about 0.2 s), on the first
structured request.

    StructuredOutputs -> grammar text (cached) -> GrammarMatcher per request (a TokenConstraint)
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import torch

from kvserve.sampling_params import StructuredOutputs

# JSON as json.dumps writes it: ", " and ": ", no other whitespace, so a model cannot
# wander into endless newlines (a schema's "x-guidance" options can override this)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 64


class GrammarMatcher:
    """One request's position in its grammar (implements ``kvserve.request.TokenConstraint``)."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())
        self._raise_if_error()

    def accept(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            raise ValueError(f"the grammar rejected token {token_id}: {_without_state(self._matcher.get_error())}")

    @property
    def is_finished(self) -> bool:
        return self._matcher.is_stopped()

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, from the first, the grammar accepts from here."""
        return int(self._matcher.validate_tokens(list(tokens)))

    def masks_after(self, tokens: Sequence[int], words: int) -> list[torch.Tensor]:
        """The bitmask ([words] int32) of the tokens allowed after ``tokens[:1]``, ``tokens[:2]``, ...,
        as far as the grammar accepts them and has not stopped (drafted rows, kvserve/spec/);
        the state is left as it was."""
        masks: list[torch.Tensor] = []
        consumed = 0
        try:
            for token in tokens[:self.valid_prefix(tokens)]:
                if not self._matcher.consume_token(token):
                    break
                consumed += 1
                if self._matcher.is_stopped() or self._matcher.is_error():
                    break
                mask = torch.full((1, words), -1, dtype=torch.int32)
                try:
                    self.fill_bitmask(mask, 0)
                except ValueError:      # the grammar failed here: rows from here on are never accepted
                    break
                masks.append(mask[0])
        finally:
            self._matcher.rollback(consumed)
        return masks

    def _raise_if_error(self) -> None:
        if self._matcher.is_error():
            raise ValueError(f"the grammar failed: {_without_state(self._matcher.get_error())}")


class GrammarCompiler:
    """Turns ``StructuredOutputs`` into matchers for one tokenizer and vocabulary.

    ``tokenizer_json``: the ``tokenizers`` library's JSON of the model's tokenizer;
    ``vocab_size``: the width of the logits (may exceed the tokenizer's).
    """

    def __init__(self, tokenizer_json: str | None, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._grammars: OrderedDict[StructuredOutputs, str] = OrderedDict()

    def check(self, spec: StructuredOutputs) -> None:
        """ValueError naming the problem when ``spec`` does not compile, or allows no output at
        all (a regex matching nothing, a rule with no way out: its first mask is empty)."""
        matcher = self.matcher(spec)
        words = (self._vocab_size + 31) // 32
        mask = torch.zeros((1, words), dtype=torch.int32)
        try:
            matcher.fill_bitmask(mask, 0)
        except ValueError:
            raise ValueError(f"structured {spec.kind}: the constraint allows no output (it matches nothing, or "
                             "a rule refers to itself with no way out)") from None
        if not mask.any():
            raise ValueError(f"structured {spec.kind}: the constraint allows no token at all")

    def matcher(self, spec: StructuredOutputs) -> GrammarMatcher:
        m = llguidance.LLMatcher(self._llg_tokenizer(), self._grammar(spec), log_level=0)
        if m.is_error():
            raise ValueError(f"structured {spec.kind}: {_without_state(m.get_error())}")
        return GrammarMatcher(m)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            if self._tokenizer_json is None:
                raise ValueError("structured outputs need a model with a tokenizer")
            self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self._vocab_size,
                                                     eos_token=self._eos_token_ids or None)
        return self._tokenizer

    def _grammar(self, spec: StructuredOutputs) -> str:
        grammar = self._grammars.get(spec)
        if grammar is not None:
            self._grammars.move_to_end(spec)
            return grammar
        grammar = grammar_text(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._llg_tokenizer())
        if is_error:
            raise ValueError(f"structured {spec.kind}: {_without_state(messages[0]) if messages else 'invalid'}")
        self._grammars[spec] = grammar
        if len(self._grammars) > _CACHE_SIZE:
            self._grammars.popitem(last=False)
        return grammar


def grammar_text(spec: StructuredOutputs) -> str:
    """llguidance's grammar for ``spec`` (not yet checked); ValueError for unreadable JSON."""
    kind = spec.kind
    if kind == "json" or kind == "json_object":
        schema = spec.json if isinstance(spec.json, str) else json.dumps({"type": "object"})
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        except ValueError as e:
            raise ValueError(f"structured json: {e}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex or "")
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in spec.choice or ()))
    return llguidance.LLMatcher.grammar_from_lark(spec.grammar or "")


def _without_state(message: str) -> str:
    """llguidance's message without the parser state it appends (internal, and long)."""
    return message.split("<state>")[0].strip() or "invalid"
