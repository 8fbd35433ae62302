"""IncrementalDetokenizer on the default model's byte-level BPE tokenizer and on SentencePiece
ones (a hand-made vocabulary, Gemma 3's): the same text as a full decode, for O(new tokens) work
a step."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
from spm_vocab import gemma3_gguf_path, gemma3_tokenizer, llama_fields, skip_without_gemma3

from kvserve.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from kvserve.model.tokenizer import Tokenizer

NUM_OUTPUT_TOKENS = 4096
# Characters of 2, 3 and 4 UTF-8 bytes; byte-level BPE splits many of them over tokens.
MULTI_BYTE = "吾輩は猫である。名前はまだ無い。🎉👍🏽 naïve café 😀😀 “quotes” … 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🇯🇵 親譲りの無鉄砲"
# A step decodes ids[prefix:read] (the a tokens committed last) and ids[prefix:] (those and
# the b tokens since): 2a + b ids. A token holds >= 1 byte and a character <= 4, and no token
# of this vocabulary starts inside one character and ends inside another (checked below), so
# at most 3 tokens wait on a character: a, b <= 4 and a step decodes <= 12 ids, at any length.
MAX_HELD_TOKENS = 3
MAX_IDS_PER_STEP = 3 * (MAX_HELD_TOKENS + 1)


@pytest.fixture(scope="module")
def tokenizer(default_model) -> Tokenizer:
    assert default_model.tokenizer is not None
    return default_model.tokenizer


def botchan() -> str:
    return resources.files("kvserve").joinpath("data/botchan.txt").read_text(encoding="utf-8")


def output_ids(tokenizer: Tokenizer, num_tokens: int) -> list[int]:
    """Botchan's tokens with the multi-byte text every 40 tokens: ~10% of the ids."""
    text_ids, multi_ids = tokenizer.encode(botchan()), tokenizer.encode(MULTI_BYTE)
    ids: list[int] = []
    for start in range(0, len(text_ids), 40):
        ids += text_ids[start:start + 40] + multi_ids[:4 + start % 37]
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
    raise AssertionError("botchan.txt is shorter than expected")


def test_byte_level_splits_characters_over_tokens(tokenizer):
    """The premise: single tokens of the multi-byte text decode to U+FFFD."""
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode(MULTI_BYTE)]
    assert sum(REPLACEMENT_CHAR in p for p in pieces) >= 10
    assert "".join(pieces) != MULTI_BYTE


def gpt2_byte_of_char() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    shifted = [b for b in range(256) if b not in printable]     # these map to 256, 257, ...
    printable += shifted
    chars += [256 + k for k in range(len(shifted))]
    return {chr(c): b for b, c in zip(printable, chars)}


def ends_inside_a_character(data: bytes) -> bool:
    num_continuations = len(data) - len(data.rstrip(bytes(range(0x80, 0xC0))))
    lead = data[-1 - num_continuations] if num_continuations < len(data) else 0
    needed = 3 if lead >= 0xF0 else 2 if lead >= 0xE0 else 1 if lead >= 0xC0 else 0
    return num_continuations < needed


def test_no_token_spans_two_incomplete_characters(tokenizer):
    """What bounds the held tokens: a token that began inside one character and ended inside the
    next could chain, holding every token of a run of such characters."""
    byte_of_char = gpt2_byte_of_char()
    assert len(set(byte_of_char.values())) == 256
    for token_id in range(tokenizer.vocab_size):
        piece = tokenizer.id_to_token(token_id) or ""
        if token_id in tokenizer.special_token_ids or not all(c in byte_of_char for c in piece):
            continue
        data = bytes(byte_of_char[c] for c in piece)
        assert not (0x80 <= data[0] < 0xC0 and ends_inside_a_character(data)), (token_id, data)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_one_token_at_a_time_equals_full_decode_in_constant_work(tokenizer, skip_special_tokens):
    ids = output_ids(tokenizer, NUM_OUTPUT_TOKENS)
    ids[100:100] = sorted(tokenizer.special_token_ids)[:3]     # skipped or kept, as a full decode does
    ids = ids[:NUM_OUTPUT_TOKENS]
    final = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    growing: list[int] = []
    deltas, max_held, ids_per_step = [], 0, []
    for token_id in ids:
        growing.append(token_id)
        before = detok.num_decoded_tokens
        deltas.append(detok.step(growing))
        ids_per_step.append(detok.num_decoded_tokens - before)
        max_held = max(max_held, detok.num_pending_tokens)
        # committed text never ends in a character still arriving: it is a prefix of the final text
        assert final.startswith(detok.text)
    deltas.append(detok.finish(growing)[len("".join(deltas)):])
    assert "".join(deltas) == detok.text == final
    assert 1 <= max_held <= MAX_HELD_TOKENS     # characters did wait for their bytes
    assert max(ids_per_step) <= MAX_IDS_PER_STEP
    # O(n): English steps decode 3 ids (1 committed + 2); a full decode a step would be ~n^2/2
    assert detok.num_decoded_tokens <= 4 * NUM_OUTPUT_TOKENS
    assert detok.num_decode_calls <= 2 * NUM_OUTPUT_TOKENS + 2


def test_finish_flushes_an_incomplete_character_as_a_full_decode_does(tokenizer):
    ids = tokenizer.encode("ok 🎉")
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith(REPLACEMENT_CHAR))
    detok = IncrementalDetokenizer(tokenizer)
    for n in range(1, cut + 1):
        detok.step(ids[:n])
    held = tokenizer.decode(ids[:cut])
    assert detok.text == "ok" and detok.num_pending_tokens >= 1 and held.endswith(REPLACEMENT_CHAR)
    assert detok.finish(ids[:cut]) == held
    calls = detok.num_decode_calls
    assert detok.finish(ids[:cut]) == detok.text and detok.num_decode_calls == calls    # idempotent


def test_a_step_without_new_tokens_decodes_nothing(tokenizer):
    ids = tokenizer.encode("Botchan")
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.step(ids) == "Botchan"
    calls = detok.num_decode_calls
    assert detok.step(ids) == "" and detok.num_decode_calls == calls


def test_no_tokenizer_gives_no_text():
    detok = IncrementalDetokenizer(None)
    assert detok.step([1, 2, 3]) == "" and detok.finish([1, 2, 3, 4]) == "" and detok.text == ""
    assert detok.num_decode_calls == 0


# --- SentencePiece: the ▁ space marker, byte-fallback pieces (tests/spm_vocab.py) ---------------

def stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool) -> tuple[IncrementalDetokenizer, list[int]]:
    """Feed ``ids`` one at a time, checking each step's text against the full decode; returns
    the detokenizer and the ids each step decoded."""
    final = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    growing: list[int] = []
    deltas, ids_per_step = [], []
    for token_id in ids:
        growing.append(token_id)
        before = detok.num_decoded_tokens
        deltas.append(detok.step(growing))
        ids_per_step.append(detok.num_decoded_tokens - before)
        assert final.startswith(detok.text)
    deltas.append(detok.finish(growing)[len("".join(deltas)):])
    assert "".join(deltas) == detok.text == final
    return detok, ids_per_step


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_sentencepiece_space_prefix_is_stripped_once(skip_special_tokens):
    """The hand-made Llama-2-shaped vocabulary: its decoder strips the space the prefix added,
    from the first piece of whatever it decodes, so a step's two decodes must start alike."""
    tok = Tokenizer.from_gguf_fields(llama_fields())
    texts = ["Hello world", "  the world", "héllo wörld 🎉 the", "[INST] Hello<think>world", " ", "Hello  the  world "]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=True) + tok.encode(text) + [2]
        stream(tok, ids, skip_special_tokens)


@pytest.fixture(scope="module")
def gemma3() -> Tokenizer:
    path, reason = gemma3_gguf_path()
    if path is None:
        skip_without_gemma3(reason)
    assert path is not None
    return gemma3_tokenizer(path)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_sentencepiece_one_token_at_a_time_equals_full_decode_in_constant_work(gemma3, skip_special_tokens):
    """Gemma 3 over tests/data/tokenizer_sample.txt twice, each with its BOS: "▁" pieces,
    characters spelled with up to four <0xNN> pieces, special tokens, runs of spaces."""
    sample = (Path(__file__).parent.parent / "data" / "tokenizer_sample.txt").read_bytes().decode("utf-8")
    ids = gemma3.encode(sample, add_special_tokens=True) * 2
    pieces = [gemma3.id_to_token(i) or "" for i in ids]
    assert sum(p.startswith("▁") for p in pieces) > 100 and sum(p.startswith("<0x") for p in pieces) > 50
    detok, ids_per_step = stream(gemma3, ids, skip_special_tokens)
    assert max(ids_per_step) <= MAX_IDS_PER_STEP    # a character takes at most 4 byte pieces, as above
    assert detok.num_decoded_tokens <= 4 * len(ids) and detok.num_decode_calls <= 2 * len(ids) + 2


def test_sentencepiece_leading_space_after_bos(gemma3):
    ids = gemma3.encode(" Hello", add_special_tokens=True)
    assert ids[0] == gemma3.bos_token_id and gemma3.id_to_token(ids[1]) == "▁Hello"
    detok = IncrementalDetokenizer(gemma3)
    assert detok.step(ids[:1]) == "" and detok.step(ids) == " Hello" and detok.finish(ids) == " Hello"


def test_sentencepiece_character_over_byte_pieces_waits(gemma3):
    ids = gemma3.encode("ok 𠮷!")       # 𠮷 is not a piece: its four bytes are
    assert [gemma3.id_to_token(i) for i in ids] == ["ok", "▁", "<0xF0>", "<0xA0>", "<0xAE>", "<0xB7>", "!"]
    detok = IncrementalDetokenizer(gemma3)
    assert [detok.step(ids[:n]) for n in range(1, len(ids) + 1)] == ["ok", " ", "", "", "", "𠮷", "!"]
    assert detok.finish(ids) == "ok 𠮷!"


def test_skipped_special_tokens_are_never_a_step_window_by_themselves():
    """The hand-made vocabulary strips the space its prefix adds from the first piece it decodes:
    a window of only skipped specials before " Hello" would lose that space."""
    tok = Tokenizer.from_gguf_fields(llama_fields())
    ids = tok.encode("world[INST] Hello[INST][INST] world")
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.step(ids[:n]) for n in range(1, len(ids) + 1)]
    assert "".join(deltas) == detok.finish(ids) == tok.decode(ids) == "world Hello world"
    assert deltas[1] == "" and detok.num_decoded_tokens < 3 * len(ids)    # [INST] alone decodes nothing
