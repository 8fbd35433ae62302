"""Fixtures of the model tests: Gemma 3 270M's GGUF and its tokenizer (skipped when it is not
fetched, except in CI)."""

from __future__ import annotations

from pathlib import Path

import pytest
from spm_vocab import gemma3_gguf_path, skip_without_gemma3
from spm_vocab import gemma3_tokenizer as build_gemma3_tokenizer

from kvserve.model.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    path, reason = gemma3_gguf_path()
    if path is None:
        skip_without_gemma3(reason)
    assert path is not None
    return path


@pytest.fixture(scope="session")
def gemma3_tokenizer(gemma3_gguf: Path) -> Tokenizer:
    return build_gemma3_tokenizer(gemma3_gguf)
