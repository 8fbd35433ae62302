"""Token ids -> text, decoding only the tokens that arrived since the last step.

A token may end inside a multi-byte UTF-8 character: a byte-level BPE token holds any bytes, and
a SentencePiece vocabulary spells a character it lacks with byte-fallback tokens (``<0xF0>``, one
byte each), so an emoji's four bytes can take four tokens; decoding them alone gives U+FFFD. So
text is committed only up to a token that ends on a character boundary, and the tokens after it
wait for the rest of their bytes:

    ids:  [ committed ... | prefix .. read | read .. len ]
                             decoded last,    new, or held: their
                             ends on a        text ended in U+FFFD
                             character

Each step decodes ``ids[prefix:read]`` and ``ids[prefix:]`` (the prefix gives the decoder the
context before the new tokens: a SentencePiece decoder turns a leading ``▁`` into a space and,
where the vocabulary prepends one to the text, strips the first space of what it decodes, the
same in both) and commits the second's extra text when it does not end in U+FFFD; then
``prefix, read = read, len(ids)``.

The ids are those whose text counts: with ``skip_special_tokens`` the special ones are left out
as they arrive. A full decode leaves them out before its decoder runs, so this is the same
text, and ``ids[prefix:read]`` always holds a token the decoder sees (were it only skipped
tokens, the first space of the new tokens would be stripped as if it began the text).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.model.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"    # what a decode gives for bytes that are not (yet) a whole character


class IncrementalDetokenizer:
    """The text of one growing list of output token ids.

    ``text`` (the committed text) only grows, never ends in a character whose bytes are still
    arriving, and after ``finish`` equals ``tokenizer.decode(ids, skip_special_tokens)`` for
    byte-level BPE tokenizers (their decode is the tokens' bytes, concatenated, read as UTF-8
    with U+FFFD for invalid bytes) and for SentencePiece ones whose runs of byte-fallback tokens
    are valid UTF-8. (A full SentencePiece decode turns a run that is not, e.g. a stray
    continuation byte after a character, wholly into U+FFFD, one a byte, the valid characters
    too; the stream committed those characters before the stray byte came, and keeps them.)
    The work of a step is the tokens since the last committed ones: ``num_decoded_tokens`` and
    ``num_decode_calls`` count it. With no tokenizer the text stays "". Owned by one request;
    ``ids`` must be the same list each call, only appended to.
    """

    def __init__(self, tokenizer: Tokenizer | None, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._skipped_ids = tokenizer.special_token_ids if tokenizer and skip_special_tokens else frozenset()
        self.text = ""
        self._ids: list[int] = []   # the ids whose text counts (specials left out when skipped)
        self._prefix = 0        # _ids[prefix:read] were decoded last and end on a character boundary
        self._read = 0          # _ids[read:] have not been committed
        self._num_seen = 0      # len(ids) at the last step: a step with nothing new decodes nothing
        self.num_decode_calls = 0
        self.num_decoded_tokens = 0

    @property
    def num_pending_tokens(self) -> int:
        """Tokens seen but not committed: they end inside a character."""
        return len(self._ids) - self._read

    def step(self, ids: Sequence[int]) -> str:
        """Commit what ``ids`` (the whole list so far) adds to the text; returns that delta ("" while a
        character is incomplete)."""
        if self._tokenizer is None or len(ids) == self._num_seen:
            return ""
        num_kept = len(self._ids)
        self._ids += [i for i in ids[self._num_seen:] if i not in self._skipped_ids]
        self._num_seen = len(ids)
        if len(self._ids) == num_kept:
            return ""    # only skipped tokens arrived
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if new_text.endswith(REPLACEMENT_CHAR):
            return ""    # wait for the character's remaining bytes (finish() flushes them)
        return self._commit(new_text[len(prefix_text):])

    def finish(self, ids: Sequence[int]) -> str:
        """Commit everything, an incomplete character as the U+FFFD a full decode gives; returns
        the final text. It ends the stream: calling it again returns the same text, but ``ids``
        must not grow after it (the next token could complete a character flushed as U+FFFD)."""
        self.step(ids)
        if self._tokenizer is not None and self._read < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix:self._read])
            self._commit(self._decode(self._ids[self._prefix:])[len(prefix_text):])
        return self.text

    def _commit(self, delta: str) -> str:
        self.text += delta
        self._prefix, self._read = self._read, len(self._ids)
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        assert self._tokenizer is not None
        if not ids:
            return ""
        self.num_decode_calls += 1
        self.num_decoded_tokens += len(ids)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
