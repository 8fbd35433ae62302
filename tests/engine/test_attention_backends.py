"""Attention backends by name: the registry, auto, and clear errors."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model

from kvserve import LLM
from kvserve.attention.backends import ATTENTION_BACKENDS, CpuBackend, TorchBackend, make_attention_backend

CPU = torch.device("cpu")


def test_registry_names():
    assert list(ATTENTION_BACKENDS) == ["torch", "cpu", "triton"]
    assert isinstance(make_attention_backend("torch", CPU), TorchBackend)
    assert not TorchBackend.reads_in_place and CpuBackend.reads_in_place


def test_auto_picks_the_cpu_kernel_on_a_cpu():
    assert isinstance(make_attention_backend("auto", CPU), CpuBackend)


def test_unknown_or_unavailable_backends_are_clear_errors():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'; choose one of torch, cpu, triton, auto"):
        make_attention_backend("flash", CPU)
    with pytest.raises(ValueError, match="'cpu' is not available: the cpu backend runs on CPU tensors"):
        make_attention_backend("cpu", torch.device("cuda"))
    from kvserve.attention import triton_kernels
    if triton_kernels.is_interpreted():     # tests/attention/test_triton.py loaded the interpreter's kernels
        assert make_attention_backend("triton", CPU).name == "triton"
    else:
        with pytest.raises(ValueError, match="'triton' is not available: triton kernels run on CUDA"):
            make_attention_backend("triton", CPU)
    with pytest.raises(ValueError, match="unknown attention backend"):
        LLM(loaded=tiny_model(), attention_backend="flash")
