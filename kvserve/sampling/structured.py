"""Structured outputs: a request's ``StructuredOutputs`` compiled to a grammar, matched per token.

The grammar library is llguidance (chosen over xgrammar and outlines-core by measurement,
docs/server.md "Structured outputs"): it compiles lazily (about 2 ms for a schema, against
150-270 ms for xgrammar and outlines-core on this 2-core machine), its per-token mask costs
about 0.05 ms, it reads JSON schemas, regexes and Lark grammars, and it depends on nothing
but itself. Its tokenizer view is built once per engine (about 0.2 s), on the first
structured request.

    StructuredOutputs -> grammar text (cached) -> GrammarMatcher per request (a TokenConstraint)

llguidance works within limits (``GRAMMAR_LIMITS``, its defaults written out): past one, a
matcher stops with an error, which may come only when a token reaches the part of the grammar
that needs it (``{"regex": "a{1000000}"}`` builds, then fails on its first token). So ``check``
also walks the constraint a little way (``probe``) before a request is queued; a constraint
that fails later, mid-answer, fails its request alone (ConstraintError: the client's, not the
engine's).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import numpy as np
import torch

from kvserve.request import ConstraintError
from kvserve.sampling_params import StructuredOutputs

# JSON as json.dumps writes it: ", " and ": ", no other whitespace, so a model cannot
# wander into endless newlines (a schema's "x-guidance" options can override this)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 64

# llguidance's limits (its defaults, named here so that a refusal can say which one was hit);
# verbose_errors off: an error never carries the parser's state (it can hold the grammar)
GRAMMAR_LIMIT_VALUES = {"initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000, "max_lexer_states": 250_000,
                        "max_grammar_size": 500_000, "step_max_items": 50_000, "max_items_in_row": 2_000}
GRAMMAR_LIMITS = llguidance.LLParserLimits(
    initial_lexer_fuel=GRAMMAR_LIMIT_VALUES["initial_lexer_fuel"], step_lexer_fuel=GRAMMAR_LIMIT_VALUES["step_lexer_fuel"],
    max_lexer_states=GRAMMAR_LIMIT_VALUES["max_lexer_states"], max_grammar_size=GRAMMAR_LIMIT_VALUES["max_grammar_size"],
    step_max_items=GRAMMAR_LIMIT_VALUES["step_max_items"], max_items_in_row=GRAMMAR_LIMIT_VALUES["max_items_in_row"],
    verbose_errors=False)
PROBE_TOKENS = 32       # how far ``check`` walks a constraint (the longest allowed token at each step)
# an llguidance message -> the limits it means (an error on a token the grammar itself allowed
# is a limit too, of one of them)
_LIMIT_HINTS = (("too many expressions", ("initial_lexer_fuel", "step_lexer_fuel")),
                ("too many states", ("max_lexer_states",)), ("max_lexer_states", ("max_lexer_states",)),
                ("grammar size", ("max_grammar_size",)), ("items", ("step_max_items", "max_items_in_row")))


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
            raise ConstraintError(f"the output constraint failed on token {token_id}: "
                                  f"{limit_message(self._matcher.get_error())}")

    @property
    def is_finished(self) -> bool:
        return self._matcher.is_stopped()

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, from the first, the grammar accepts from here."""
        return int(self._matcher.validate_tokens(list(tokens)))

    def masks_after(self, tokens: Sequence[int], words: int) -> list[torch.Tensor]:
        """The bitmask ([words] int32) of the tokens allowed after ``tokens[:1]``, ``tokens[:2]``, ...,
        as far as the grammar accepts them and has not stopped (drafted rows, kvserve/speculative/);
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

    def probe(self, token_nbytes: np.ndarray) -> None:
        """Walk the constraint from here as an answer would: ``PROBE_TOKENS`` steps, each taking
        the longest token the mask allows (``token_nbytes``: bytes per token id, 0 for special
        tokens), each with its mask. ConstraintError when it fails on the way: every token taken
        was one it allowed, so that is a limit of the grammar engine. The state is left where
        the walk ended."""
        mask = torch.zeros((1, (len(token_nbytes) + 31) // 32), dtype=torch.int32)
        for _ in range(PROBE_TOKENS):
            self.fill_bitmask(mask, 0)
            allowed = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")[:len(token_nbytes)]
            sizes = np.where(allowed.astype(bool), token_nbytes, -1)
            token = int(sizes.argmax())
            if sizes[token] <= 0:       # nothing allowed but the end (or nothing at all)
                return
            self.accept(token)
            if self._matcher.is_stopped():
                return

    def _raise_if_error(self) -> None:
        if self._matcher.is_error():
            raise ConstraintError(f"the output constraint failed: {limit_message(self._matcher.get_error())}")


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
        self._nbytes: np.ndarray | None = None
        self._grammars: OrderedDict[StructuredOutputs, str] = OrderedDict()

    def check(self, spec: StructuredOutputs) -> None:
        """ValueError naming the problem when ``spec`` does not compile, allows no output at
        all (a regex matching nothing, a rule with no way out: its first mask is empty), or fails
        within its first tokens (``GrammarMatcher.probe``: a limit of the grammar engine, named)."""
        matcher = self.matcher(spec)
        words = (self._vocab_size + 31) // 32
        mask = torch.zeros((1, words), dtype=torch.int32)
        try:
            matcher.fill_bitmask(mask, 0)
        except ValueError as e:
            if _limits_of(str(e)):
                raise ValueError(f"structured {spec.kind}: {e}") from None
            raise ValueError(f"structured {spec.kind}: the constraint allows no output (it matches nothing, or "
                             "a rule refers to itself with no way out)") from None
        if not mask.any():
            raise ValueError(f"structured {spec.kind}: the constraint allows no token at all")
        try:
            matcher.probe(self._token_nbytes())
        except ConstraintError as e:
            message = str(e) if _limits_of(str(e)) else limit_message(str(e), probed=True)
            raise ValueError(f"structured {spec.kind}: the constraint fails within the first {PROBE_TOKENS} tokens "
                             f"it allows, past a limit of the grammar engine: {message}") from None

    def matcher(self, spec: StructuredOutputs) -> GrammarMatcher:
        m = llguidance.LLMatcher(self._llg_tokenizer(), self._grammar(spec), log_level=0, limits=GRAMMAR_LIMITS)
        if m.is_error():
            raise ValueError(f"structured {spec.kind}: {limit_message(m.get_error())}")
        return GrammarMatcher(m)

    def _token_nbytes(self) -> np.ndarray:
        """Bytes of each token id (0 for special tokens and ids past the tokenizer's): what the
        probe's walk takes the longest of."""
        if self._nbytes is None:
            tok = self._llg_tokenizer()
            self._nbytes = np.array([0 if i >= tok.vocab_size or tok.is_special_token(i) else len(tok.decode_bytes([i]))
                                     for i in range(self._vocab_size)], dtype=np.int64)
        return self._nbytes

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
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._llg_tokenizer(),
                                                                                 limits=GRAMMAR_LIMITS)
        if is_error:
            raise ValueError(f"structured {spec.kind}: {limit_message(messages[0]) if messages else 'invalid'}")
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
    return message.split("<state>")[0].split("<non-verbose/>")[0].strip() or "invalid"


def _limits_of(message: str) -> tuple[str, ...]:
    return next((limits for hint, limits in _LIMIT_HINTS if hint in message), ())


def limit_message(message: str, probed: bool = False) -> str:
    """llguidance's ``message`` without its parser state, naming the limit it hit when it is one
    (every limit when ``probed``: an error on tokens the grammar allowed is one of them)."""
    text = _without_state(message)
    limits = _limits_of(text) or (tuple(GRAMMAR_LIMIT_VALUES) if probed else ())
    if not limits:
        return text
    named = ", ".join(f"{name} {GRAMMAR_LIMIT_VALUES[name]:,}" for name in limits)
    return f"{text} (llguidance's limit: {named})" if len(limits) < len(GRAMMAR_LIMIT_VALUES) else \
        f"{text} (llguidance's limits: {named})"
