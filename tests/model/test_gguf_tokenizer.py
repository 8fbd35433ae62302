"""SentencePiece vocabularies from GGUF metadata (kvserve/model/gguf_tokenizer.py): a hand-made
vocabulary with exact ids; tiny GGUF files against transformers' reading of the same files; Gemma 3
270M's 262k pieces against transformers' ids, checked in by scripts/tokenizer_reference.py
(tests/data/gemma3_tokenizer_reference.json: loading transformers' tokenizer of that file takes
~25 s)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import gguf
import pytest
from spm_vocab import GEMMA_PIECES, gemma_fields, llama_fields, write_tokenizer_gguf

from kvserve.model.gguf_loader import file_sha256
from kvserve.model.gguf_tokenizer import GGUFTokenizerFields, tokenizer_fields
from kvserve.model.tokenizer import Tokenizer
from scripts.tokenizer_reference import BOOK, ids_sha256, sample_texts

REFERENCE = Path(__file__).parent.parent / "data" / "gemma3_tokenizer_reference.json"
ROUND_TRIP = ["Hello world", "Hello  the world!", "héllo wörld", "the\n\nworld", "Hello<think>world", "x€y🎉",
              "Hello world ", ""]


# --- a hand-made vocabulary (tests/spm_vocab.py: Llama 2's shape) -----------------------------

@pytest.fixture(scope="module")
def llama() -> Tokenizer:
    return Tokenizer.from_gguf_fields(llama_fields())


def pieces(tok: Tokenizer, ids: list[int]) -> list[str | None]:
    return [tok.id_to_token(i) for i in ids]


def test_merges_follow_scores(llama: Tokenizer) -> None:
    # "He" (score 5) joins before "ll" (-1) and "el" (-7), though the file lists it after them
    assert llama.encode("Hello world") == [274, 271, 260, 278, 265]
    assert pieces(llama, [274, 271, 260, 278, 265]) == ["▁", "He", "ll", "o", "▁world"]
    assert llama.encode("the") == [270]                 # ▁ t h e -> ▁t he -> ▁the
    # "▁▁" scores last: a run of two spaces before a word is "▁" "▁the", not "▁▁" "the"
    assert llama.encode("Hello  the") == [274, 271, 260, 278, 274, 270]
    assert llama.encode("  ") == [259]


def test_space_prefix_only_at_the_start_of_the_text(llama: Tokenizer) -> None:
    assert llama.encode("world") == [265]               # ▁world
    assert llama.encode(" world") == [265]              # already starts with a space: none added
    # special ([INST]) and user-defined (<think>) tokens are matched whole; no prefix after them
    assert llama.encode("[INST] Hello<think>world") == [272, 274, 271, 260, 278, 273, 279, 262, 264]
    assert pieces(llama, [279, 262, 264]) == ["w", "or", "ld"]


def test_byte_fallback(llama: Tokenizer) -> None:
    # é is not a piece: its UTF-8 bytes C3 A9 are, as <0xC3> (3 + 0xC3) and <0xA9> (3 + 0xA9)
    assert llama.encode("héllo") == [274, 283, 3 + 0xC3, 3 + 0xA9, 260, 278]
    assert pieces(llama, [3 + 0xC3, 3 + 0xA9]) == ["<0xC3>", "<0xA9>"]
    assert llama.decode([3 + 0xF0, 3 + 0x9F, 3 + 0x8E, 3 + 0x89]) == "🎉"
    assert llama.decode([3 + 0xF0, 3 + 0x9F]) == "\ufffd\ufffd"   # an incomplete character: one U+FFFD a byte


def test_unknown_piece_without_byte_fallback() -> None:
    tok = Tokenizer.from_gguf_fields(llama_fields(with_bytes=False))
    assert tok.encode("hé€llo") == [tok.token_to_id(p) for p in ["▁", "h", "<unk>", "ll", "o"]]  # unknowns fuse


def test_special_tokens(llama: Tokenizer) -> None:
    assert llama.encode("Hello world", add_special_tokens=True) == [1, 274, 271, 260, 278, 265]
    assert llama.special_token_ids == frozenset({0, 1, 2, 272})          # control and unknown, not <think>
    ids = llama.encode("[INST] Hello<think>world[INST]", add_special_tokens=True)
    assert llama.decode(ids, skip_special_tokens=False) == "<s>[INST] Hello<think>world[INST]"
    assert llama.decode(ids) == "Hello<think>world"     # the prefix space is stripped once
    assert (llama.bos_token_id, llama.eos_token_id, llama.vocab_size) == (1, 2, 285)


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(llama: Tokenizer, text: str) -> None:
    assert llama.decode(llama.encode(text)) == text
    assert llama.decode(llama.encode(text, add_special_tokens=True)) == text


def test_add_eos() -> None:
    tok = Tokenizer.from_gguf_fields(dataclasses.replace(llama_fields(), add_bos_token=False, add_eos_token=True))
    assert tok.encode("world", add_special_tokens=True) == [265, 2]


def test_json_round_trip(llama: Tokenizer) -> None:
    copy = Tokenizer.from_json(llama.to_json())
    for text in [*ROUND_TRIP, "[INST] Hello<think>world[INST]"]:
        for add in (False, True):
            ids = llama.encode(text, add_special_tokens=add)
            assert copy.encode(text, add_special_tokens=add) == ids
            assert copy.decode(ids) == llama.decode(ids)
            assert copy.decode(ids, skip_special_tokens=False) == llama.decode(ids, skip_special_tokens=False)
    assert copy.special_token_ids == llama.special_token_ids


def test_token_bytes(llama: Tokenizer, default_model) -> None:
    """What logprobs report: a piece's ▁ is a space, a byte piece its byte."""
    ids = llama.encode("héllo wörld 🎉", add_special_tokens=True)
    assert [llama.token_bytes(i) for i in ids[:5]] == [b"<s>", b" ", b"h", b"\xc3", b"\xa9"]
    assert b"".join(llama.token_bytes(i) for i in ids) == "<s> héllo wörld 🎉".encode()  # with the prefix space
    text = "emoji 🤖🚀 naïve, 日本語"     # byte-level BPE: a token may hold part of a character
    ids = default_model.tokenizer.encode(text)
    assert b"".join(default_model.tokenizer.token_bytes(i) for i in ids) == text.encode()


def test_gemma_runs_of_spaces_are_spelled_with_the_space_marker() -> None:
    tok = Tokenizer.from_gguf_fields(gemma_fields())
    two, three = (next(i for i, (p, _, _) in enumerate(GEMMA_PIECES) if p == run) for run in ("  ", "   "))
    assert pieces(tok, [two, three]) == ["▁▁", "▁▁▁"]
    # a run of spaces is whole before its word; "\n\n" is one user-defined token; no prefix
    ids = tok.encode("Hello   the\n\nworld")
    assert pieces(tok, ids) == ["He", "ll", "o", "▁▁▁", "t", "he", "\n\n", "w", "or", "ld"]
    assert tok.decode(ids) == "Hello   the\n\nworld"


@pytest.mark.parametrize("bad", [{"token_types": [1]}, {"scores": [0.0]}, {"bos_token_id": 10_000}])
def test_fields_are_checked(bad) -> None:
    with pytest.raises(ValueError, match="GGUF tokenizer"):
        dataclasses.replace(llama_fields(), **bad)


def test_unsupported_model_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="'t5' is not supported"):
        Tokenizer.from_gguf_fields(dataclasses.replace(llama_fields(), model="t5"))


# --- tiny GGUF files against transformers' tokenizer of the same file --------------------------

TINY_TEXTS = ["Hello world", "Hello world!", " Hello  the world", "    the     world  ", "the", "héllo wörld 🎉",
              "[INST] Hello<think>world[INST]", "<start_of_turn>user\nHello<end_of_turn>\n", "Hello   the\n\nworld\n", "a<unk>b<s>",
              "", " ", "  ", "\n", "xyz"]


@pytest.mark.parametrize(("architecture", "make_fields"), [("llama", llama_fields), ("gemma3", gemma_fields)])
def test_tiny_gguf_matches_transformers(tmp_path: Path, architecture: str, make_fields) -> None:
    transformers = pytest.importorskip("transformers")
    fields: GGUFTokenizerFields = make_fields()
    write_tokenizer_gguf(tmp_path / "tok.gguf", architecture, fields)
    assert tokenizer_fields(gguf.GGUFReader(tmp_path / "tok.gguf")) == fields
    ours = Tokenizer.from_gguf_fields(fields)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tok.gguf")
    for text in TINY_TEXTS:
        for add in (False, True):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == reference.encode(text, add_special_tokens=add), (text, add)
            for skip in (False, True):
                assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


# --- Gemma 3 270M (tests/model/conftest.py finds the file) --------------------------------------

@pytest.fixture(scope="module")
def reference(gemma3_gguf: Path) -> dict:
    data = json.loads(REFERENCE.read_text(encoding="utf-8"))
    assert file_sha256(gemma3_gguf) == data["gguf_sha256"], (
        f"{gemma3_gguf} is not the file the reference ids were written from; run scripts/tokenizer_reference.py")
    return data


def test_gemma3_ids_and_decodes_equal_transformers(gemma3_tokenizer: Tokenizer, reference: dict) -> None:
    texts = reference["texts"]
    assert [t["text"] for t in texts] == sample_texts()
    for t in texts:
        text, decoded = t["text"], t["decode"]
        ids, with_special = gemma3_tokenizer.encode(text), gemma3_tokenizer.encode(text, add_special_tokens=True)
        assert ids == t["ids"], text
        assert with_special == t["ids_with_special_tokens"] == [2, *ids]
        assert gemma3_tokenizer.decode(ids, skip_special_tokens=False) == decoded["ids"]
        assert gemma3_tokenizer.decode(ids) == decoded["ids_skip_special"]
        assert gemma3_tokenizer.decode(with_special, skip_special_tokens=False) == decoded["ids_with_special_tokens"]
        assert gemma3_tokenizer.decode(with_special) == decoded["ids_with_special_tokens_skip_special"]
    assert len(texts[0]["ids"]) == 615 and sum(len(t["ids"]) for t in texts) == 615 + 570
    # the sample exercises what it is for: byte fallback, runs of spaces, special tokens
    used = {gemma3_tokenizer.id_to_token(i) for t in texts for i in t["ids"]}
    assert {"<0xF0>", "▁▁", "▁" * 24, "<start_of_turn>", "\n\n\n", "\t" * 31} <= used


def test_gemma3_book_equals_transformers(gemma3_tokenizer: Tokenizer, reference: dict) -> None:
    text = BOOK.read_bytes().decode("utf-8")
    ids = gemma3_tokenizer.encode(text)
    assert (len(ids), ids_sha256(ids)) == (reference["book"]["num_ids"], reference["book"]["ids_sha256"])
    assert gemma3_tokenizer.decode(ids) == text
    assert hashlib.sha256(text.encode()).hexdigest() == reference["book"]["decode_sha256"]


def test_gemma3_vocabulary(gemma3_tokenizer: Tokenizer) -> None:
    tok = gemma3_tokenizer
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id) == (262144, 2, 1)
    assert {tok.token_to_id(t) for t in ("<start_of_turn>", "<end_of_turn>", "<pad>")} == {105, 106, 0}
    assert {0, 1, 2, 3, 105, 106} <= tok.special_token_ids and 107 not in tok.special_token_ids   # "\n" is text
    assert len(tok.special_token_ids) == 6249
    assert tok.encode("<start_of_turn>user\n") == [105, 2364, 107]


def test_gemma3_token_bytes(gemma3_tokenizer: Tokenizer) -> None:
    ids = gemma3_tokenizer.encode(sample_texts()[0], add_special_tokens=True)
    full = gemma3_tokenizer.decode(ids, skip_special_tokens=False)
    assert b"".join(gemma3_tokenizer.token_bytes(i) for i in ids) == full.encode()


def test_gemma3_json_round_trip(gemma3_tokenizer: Tokenizer) -> None:
    """The GGUF loader's cache keeps the tokenizer as this JSON."""
    copy = Tokenizer.from_json(gemma3_tokenizer.to_json())
    for text in sample_texts():
        ids = gemma3_tokenizer.encode(text, add_special_tokens=True)
        assert copy.encode(text, add_special_tokens=True) == ids
        assert copy.decode(ids) == gemma3_tokenizer.decode(ids)
        assert copy.decode(ids, skip_special_tokens=False) == gemma3_tokenizer.decode(ids, skip_special_tokens=False)
    assert (copy.special_token_ids, copy.vocab_size, copy.bos_token_id) == (
        gemma3_tokenizer.special_token_ids, gemma3_tokenizer.vocab_size, gemma3_tokenizer.bos_token_id)
