"""Fixtures of the model tests: Gemma 3 270M's GGUF and its tokenizer (skipped when absent)."""

from __future__ import annotations

from pathlib import Path

import pytest
from spm_vocab import gemma3_gguf_path
from spm_vocab import gemma3_tokenizer as build_gemma3_tokenizer

from kvserve.model.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    path, reason = gemma3_gguf_path()
    if path is None:
        pytest.skip(reason)
    return path


@pytest.fixture(scope="session")
def gemma3_tokenizer(gemma3_gguf: Path) -> Tokenizer:
    return build_gemma3_tokenizer(gemma3_gguf)
