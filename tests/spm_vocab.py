"""SentencePiece vocabularies for tests: two hand-made ones (Llama 2's shape and Gemma's), and
Gemma 3 270M's real one, found as ``gemma3_gguf_path`` says."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import gguf
import pytest

from kvserve.model.gguf_tokenizer import GGUFTokenizerFields, tokenizer_fields
from kvserve.model.loader import resolve_model_path
from kvserve.model.tokenizer import Tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = (int(t) for t in (
    gguf.TokenType.NORMAL, gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED,
    gguf.TokenType.BYTE))
BYTE_PIECES = [(f"<0x{b:02X}>", BYTE, 0.0) for b in range(256)]
CHARACTERS = [(c, NORMAL, -100.0 - i) for i, c in enumerate("▁Helowrdth!")]

# Llama 2's shape: <unk> <s> </s>, the 256 bytes (ids 3..258), then pieces whose scores are merge
# ranks. "▁▁" scores last (as in Llama 2); "He" comes late in the file but scores best.
LLAMA_PIECES = [("<unk>", UNKNOWN, 0.0), ("<s>", CONTROL, 0.0), ("</s>", CONTROL, 0.0), *BYTE_PIECES,
                ("▁▁", NORMAL, -1e9), ("ll", NORMAL, -1.0), ("▁w", NORMAL, -2.0), ("or", NORMAL, -3.0),
                ("▁wor", NORMAL, -4.0), ("ld", NORMAL, -5.0), ("▁world", NORMAL, -6.0), ("el", NORMAL, -7.0),
                ("lo", NORMAL, -8.0), ("▁t", NORMAL, -9.0), ("he", NORMAL, -10.0), ("▁the", NORMAL, -11.0),
                ("He", NORMAL, 5.0), ("[INST]", CONTROL, 0.0), ("<think>", USER_DEFINED, 0.0), *CHARACTERS]

# Gemma's shape: control tokens first, newlines and runs of spaces (stored as spaces) user-defined
# with score -1000, the bytes, then pieces whose scores follow their file order. No space prefix.
GEMMA_PIECES = [("<pad>", CONTROL, -1000.0), ("<eos>", CONTROL, -1000.0), ("<bos>", CONTROL, -1000.0),
                ("<unk>", CONTROL, -1000.0), ("<start_of_turn>", CONTROL, -1000.0),
                ("<end_of_turn>", CONTROL, -1000.0), ("\n", USER_DEFINED, -1000.0),
                ("\n\n", USER_DEFINED, -1000.0), ("  ", USER_DEFINED, -1000.0), ("   ", USER_DEFINED, -1000.0),
                *BYTE_PIECES,
                *((p, NORMAL, -float(i)) for i, p in enumerate(
                    ["▁t", "he", "▁the", "ll", "▁w", "or", "▁wor", "ld", "▁world", "el", "lo", "He"])),
                *CHARACTERS]


def llama_fields(with_bytes: bool = True) -> GGUFTokenizerFields:
    pieces = LLAMA_PIECES if with_bytes else [p for p in LLAMA_PIECES if p[1] != BYTE]
    return GGUFTokenizerFields(model="llama", tokens=[p for p, _, _ in pieces], token_types=[k for _, k, _ in pieces],
                               scores=[s for _, _, s in pieces], bos_token_id=1, eos_token_id=2, unk_token_id=0,
                               add_bos_token=True, add_space_prefix=True)


def gemma_fields() -> GGUFTokenizerFields:
    return GGUFTokenizerFields(model="llama", tokens=[p for p, _, _ in GEMMA_PIECES],
                               token_types=[k for _, k, _ in GEMMA_PIECES], scores=[s for _, _, s in GEMMA_PIECES],
                               bos_token_id=2, eos_token_id=1, unk_token_id=3, pad_token_id=0, add_bos_token=True,
                               add_space_prefix=False)


def write_tokenizer_gguf(path: Path, architecture: str, fields: GGUFTokenizerFields) -> None:
    """A GGUF file holding only ``fields`` (no tensors)."""
    w = gguf.GGUFWriter(path, architecture)
    w.add_tokenizer_model(fields.model)
    w.add_token_list(list(fields.tokens))
    w.add_token_types(list(fields.token_types))
    w.add_token_scores(list(fields.scores))
    for add, token_id in ((w.add_bos_token_id, fields.bos_token_id), (w.add_eos_token_id, fields.eos_token_id),
                          (w.add_unk_token_id, fields.unk_token_id), (w.add_pad_token_id, fields.pad_token_id)):
        if token_id is not None:
            add(token_id)
    w.add_add_bos_token(fields.add_bos_token)
    w.add_add_eos_token(fields.add_eos_token)
    w.add_add_space_prefix(fields.add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gemma3_gguf_path() -> tuple[Path | None, str]:
    """Gemma 3 270M's GGUF as `kvserve models fetch gemma-3-270m` left it (the test setup fetches
    it); None and the reason when it is not fetched."""
    try:
        return resolve_model_path("gemma-3-270m"), ""
    except ValueError as e:
        return None, str(e)


def skip_without_gemma3(reason: str) -> None:
    """Skip a test that needs the file: in CI (``$CI`` set) a failure, since the setup fetches it."""
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


@functools.cache
def gemma3_tokenizer(path: Path) -> Tokenizer:
    """Built once per test session (~10 s: reading 262k pieces, deriving 515k merges)."""
    return Tokenizer.from_gguf_fields(tokenizer_fields(gguf.GGUFReader(path)))
