"""Tiny-model tests run single-threaded: on a shared 2-core machine, two OpenMP threads
per tiny matmul spend most of their time waiting on each other (measured 70x slower)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
