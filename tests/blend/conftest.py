"""Fixtures of the blending tests."""

from __future__ import annotations

import pytest
from tiny import tiny_model

from kvserve.model.loader import LoadedModel


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    """The tiny random-weight model (2 layers, vocabulary of 128)."""
    return tiny_model()
