"""A prompt given as parts, some of them segments: what a caller passes to blend.

    SegmentedPrompt(["Answer from these notes.\\n", Segment(doc_a), "\\n", Segment(doc_b), "\\nQ: ..."])

Each part is tokenized on its own (no special tokens) and the prompt's ids are the parts'
ids in order, so a segment's ids are the same whatever surrounds it: that is what lets its
standalone KV be found again under its content key. ``from_text`` cuts a rendered prompt
(a chat template's output, say) at the segments' texts; the server does that for its
``segments`` extension field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.config import BLEND_SELECTION_CHOICES, check_blend_selection
from kvserve.model.tokenizer import Tokenizer
from kvserve.request import DEFAULT_BLEND_FRACTION, BlendSpec, check_blend_fraction

__all__ = ["DEFAULT_BLEND_FRACTION", "Segment", "SegmentedPrompt"]


@dataclass(frozen=True)
class Segment:
    """A part of a prompt whose KV is cached by content and reused at any position."""

    content: str | tuple[int, ...]

    def __init__(self, content: str | Sequence[int]) -> None:
        object.__setattr__(self, "content", content if isinstance(content, str) else tuple(content))


@dataclass(frozen=True)
class SegmentedPrompt:
    """Parts (text, token ids, or ``Segment``) and the share of segment tokens to recompute.
    Opting in is lossy: a reused segment never saw the text before it, and blending restores
    only ``blend_fraction`` of that attention (docs/blend.md). ``blend_selection``,
    ``blend_sink_tokens`` and ``blend_last_segments`` choose this prompt's recomputed tokens as
    the engine options of those names do (None: the engine's), so one engine serves prompts
    that ask before the documents and prompts that ask after them, each its best way."""

    parts: tuple[str | tuple[int, ...] | Segment, ...]
    blend_fraction: float = DEFAULT_BLEND_FRACTION
    blend_selection: str | None = None
    blend_sink_tokens: int | None = None
    blend_last_segments: int | None = None

    def __init__(self, parts: Sequence[str | Sequence[int] | Segment],
                 blend_fraction: float = DEFAULT_BLEND_FRACTION, blend_selection: str | None = None,
                 blend_sink_tokens: int | None = None, blend_last_segments: int | None = None) -> None:
        frozen = tuple(p if isinstance(p, (str, Segment)) else tuple(p) for p in parts)
        object.__setattr__(self, "parts", frozen)
        object.__setattr__(self, "blend_fraction", check_blend_fraction(blend_fraction))
        check_blend_selection("auto" if blend_selection is None else blend_selection,
                              0 if blend_sink_tokens is None else blend_sink_tokens,
                              0 if blend_last_segments is None else blend_last_segments, BLEND_SELECTION_CHOICES)
        object.__setattr__(self, "blend_selection", blend_selection)
        object.__setattr__(self, "blend_sink_tokens", blend_sink_tokens)
        object.__setattr__(self, "blend_last_segments", blend_last_segments)
        if not any(isinstance(p, Segment) for p in frozen):
            raise ValueError("a segmented prompt needs at least one Segment")

    @classmethod
    def from_text(cls, text: str, segments: Sequence[str], blend_fraction: float = DEFAULT_BLEND_FRACTION,
                  blend_selection: str | None = None, blend_sink_tokens: int | None = None,
                  blend_last_segments: int | None = None) -> SegmentedPrompt:
        """``text`` cut at each of ``segments`` in turn (the first occurrence after the previous
        one); ValueError naming the segment that does not occur."""
        parts: list[str | Segment] = []
        at = 0
        for i, segment in enumerate(segments):
            if not isinstance(segment, str) or not segment:
                raise ValueError(f"segment {i} must be a non-empty string")
            found = text.find(segment, at)
            if found < 0:
                raise ValueError(f"segment {i} ({segment[:40]!r}...) does not occur in the prompt "
                                 f"after the previous segment")
            if found > at:
                parts.append(text[at:found])
            parts.append(Segment(segment))
            at = found + len(segment)
        if at < len(text):
            parts.append(text[at:])
        return cls(parts, blend_fraction, blend_selection, blend_sink_tokens, blend_last_segments)

    def encode(self, tokenizer: Tokenizer | None) -> tuple[list[int], BlendSpec]:
        """The prompt's token ids and its segments' spans (``ModelCard.encode`` checks the ids
        as any prompt's: vocabulary, context window)."""
        ids: list[int] = []
        spans: list[tuple[int, int]] = []
        for part in self.parts:
            content = part.content if isinstance(part, Segment) else part
            if isinstance(content, str):
                if tokenizer is None:
                    raise ValueError("this engine has no tokenizer; give the parts as token ids")
                piece = tokenizer.encode(content)
            else:
                piece = list(content)
            if isinstance(part, Segment):
                if not piece:
                    raise ValueError("a segment has no tokens")
                spans.append((len(ids), len(piece)))
            ids.extend(piece)
        return ids, BlendSpec(tuple(spans), self.blend_fraction, self.blend_selection, self.blend_sink_tokens,
                              self.blend_last_segments)
