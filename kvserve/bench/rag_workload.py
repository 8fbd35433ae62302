"""The workload of ``kvserve bench rag``: documents with a planted fact each, queries over k of
them, the prompt's wording, and how an answer is scored (kvserve/bench/rag.py says why so).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.blend.prompt import SegmentedPrompt
from kvserve.kv.prefix import common_prefix_len
from kvserve.model.tokenizer import Tokenizer

FIRST_NAMES = ("Marta", "Tobias", "Ines", "Oskar", "Lena", "Viktor", "Greta", "Anselm", "Nadia", "Cyril",
               "Petra", "Emil", "Sabine", "Hugo", "Delia", "Rolf", "Wanda", "Linus", "Odile", "Bruno")
SURNAMES = ("Quill", "Brenwick", "Tallow", "Ostrander", "Marchetti", "Vane", "Kestrel", "Lindqvist", "Dunmore",
            "Pellham", "Okafor", "Rask", "Haverford", "Zoller", "Fenwick", "Aldous", "Morrow", "Sable",
            "Thorne", "Ingram")
# What each document's number is: distinct per document, so a question names two things the
# model can match (the 135M default confuses documents when only the name differs).
ATTRIBUTES = ("locker number", "room number", "bicycle code", "ticket number", "badge number", "phone extension",
              "mailbox number", "seat number", "account number", "house number", "parcel number",
              "license number", "passport number", "membership number", "parking space", "library card number",
              "gate code", "order number", "cabin number", "employee number")
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"'])) +")


@dataclass(frozen=True)
class Document:
    """A slice of the text with one planted fact: ``name``'s ``attribute`` is ``number``."""

    text: str
    name: str
    attribute: str
    number: str
    num_tokens: int

    @property
    def fact(self) -> str:
        return fact_sentence(self.name, self.attribute, self.number)


@dataclass(frozen=True)
class Query:
    """Documents (indices into the pool, in prompt order) and the one whose fact is asked."""

    doc_ids: tuple[int, ...]
    target: int


def fact_sentence(name: str, attribute: str, number: str) -> str:
    return f"{name}'s {attribute} is {number}."


def sentences(text: str) -> list[str]:
    """The text's sentences, whitespace collapsed (line breaks are the file's, not the prose's)."""
    return [s for s in _SENTENCE_END.split(" ".join(text.split())) if s]


def make_documents(text: str, tokenizer: Tokenizer, num_docs: int, doc_tokens: int, seed: int) -> list[Document]:
    """``num_docs`` runs of whole sentences of about ``doc_tokens`` tokens (fact included), one
    from each of ``num_docs`` equal stretches of the text (so no two overlap), each with its
    fact sentence at a random boundary between two sentences; names and numbers distinct."""
    most = min(len(FIRST_NAMES), len(SURNAMES), len(ATTRIBUTES))
    if not 1 <= num_docs <= most:
        raise ValueError(f"num_docs must be in 1..{most}, got {num_docs}")
    rng = random.Random(seed)
    names = [f"{f} {s}" for f, s in zip(rng.sample(FIRST_NAMES, num_docs), rng.sample(SURNAMES, num_docs))]
    attributes = rng.sample(ATTRIBUTES, num_docs)
    numbers: list[str] = []
    while len(numbers) < num_docs:
        n = str(rng.randrange(1000, 10000))
        if n not in numbers and n not in text:
            numbers.append(n)
    pieces = sentences(text)
    lengths = [len(tokenizer.encode(" " + s)) for s in pieces]
    docs = []
    for i, (name, attribute, number) in enumerate(zip(names, attributes, numbers)):
        lo, hi = i * len(pieces) // num_docs, (i + 1) * len(pieces) // num_docs
        fact = fact_sentence(name, attribute, number)
        fact_tokens = len(tokenizer.encode(" " + fact))
        body = _sentence_run(lengths, lo, hi, doc_tokens - fact_tokens, rng)
        if body is None:
            raise ValueError(f"the text ({len(pieces)} sentences) is too short for {num_docs} documents of "
                             f"{doc_tokens} tokens; pass fewer --num-docs or --doc-tokens")
        chosen = pieces[body[0]:body[1]]
        at = rng.randint(1, len(chosen) - 1) if len(chosen) > 1 else 1     # between two sentences
        doc_text = " ".join([*chosen[:at], fact, *chosen[at:]])
        docs.append(Document(doc_text, name, attribute, number, len(tokenizer.encode(doc_text))))
    return docs


def _sentence_run(lengths: Sequence[int], lo: int, hi: int, num_tokens: int,
                  rng: random.Random) -> tuple[int, int] | None:
    """Sentences [start, end) within [lo, hi) whose tokens come nearest ``num_tokens``, from a
    random start among those that leave enough room before ``hi``; None when none does."""
    starts = [s for s in range(lo, hi) if sum(lengths[s:hi]) >= num_tokens]
    if not starts:
        return None
    start = rng.choice(starts)
    end, total = start, 0
    while total < num_tokens:
        total += lengths[end]
        end += 1
    if end - start > 1 and total - num_tokens > num_tokens - (total - lengths[end - 1]):
        end -= 1          # one sentence fewer comes nearer
    return start, end


def make_queries(num_docs: int, num_queries: int, k: int, seed: int) -> list[Query]:
    """``num_queries`` draws of ``k`` distinct documents in random order, each asking for one of them."""
    if not 1 <= k <= num_docs:
        raise ValueError(f"k must be in 1..{num_docs} (the number of documents), got {k}")
    rng = random.Random(seed)
    queries = []
    for _ in range(num_queries):
        doc_ids = tuple(rng.sample(range(num_docs), k))
        queries.append(Query(doc_ids, rng.choice(doc_ids)))
    return queries


def is_correct(answer: str, number: str) -> bool:
    """Whether the answer holds ``number`` as a whole number (not inside a longer one)."""
    return re.search(rf"(?<!\d){re.escape(number)}(?!\d)", answer) is not None


def agreement(token_ids: Sequence[int], reference: Sequence[int]) -> float:
    """The share of the reference's tokens matched position by position up to the first difference."""
    if not reference:
        return 1.0 if not token_ids else 0.0
    return common_prefix_len(token_ids, reference) / len(reference)


QUESTION_PLACES = ("both", "end")


def prompt_text(tokenizer: Tokenizer, documents: Sequence[Document], query: Query, question: str = "both") -> str:
    """The query's prompt: the chat template around the question (``both``: before the labelled
    documents and after them; ``end``: after them only), then the start of the answer (the
    module docstring shows it)."""
    if question not in QUESTION_PLACES:
        raise ValueError(f"question must be one of {', '.join(QUESTION_PLACES)}, got {question!r}")
    target = documents[query.target]
    asked = f"{target.name}'s {target.attribute}"
    body = "\n\n".join(f"Document {n}:\n{documents[i].text}" for n, i in enumerate(query.doc_ids, 1))
    head = f"Find {asked} in the documents below.\n\n" if question == "both" else "Documents:\n\n"
    user = f"{head}{body}\n\nQuestion: What is {asked}?"
    return tokenizer.apply_chat_template([{"role": "user", "content": user}]) + f"{asked} is"


def template_head(tokenizer: Tokenizer) -> str:
    """The chat template's text before a user message's content (the system turn and the user
    turn's start): the head of every query's prompt, what ``--preamble-head`` stores the
    documents after."""
    mark = "\x00documents\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}])
    return text[:text.index(mark)]


def segmented_prompt(text: str, documents: Sequence[Document], query: Query,
                     blend_fraction: float) -> SegmentedPrompt:
    """``text`` (from ``prompt_text``) cut at the query's documents, each a segment."""
    return SegmentedPrompt.from_text(text, [documents[i].text for i in query.doc_ids], blend_fraction)
