"""The dense-product backends (kvserve/model/linear.py): oneDNN's packed product against
F.linear, a row's result independent of its batch, the choice by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_model

from kvserve.config import EngineConfig
from kvserve.llm import LLM
from kvserve.model.linear import OneDnnLinear, TorchLinear, make_linear, onednn_unavailable_reason
from kvserve.sampling_params import SamplingParams

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(onednn_unavailable_reason(CPU, torch.float32) is not None,
                                  reason=f"oneDNN: {onednn_unavailable_reason(CPU, torch.float32)}")
# SmolLM2-135M's products (fused qkv, o, gate_up, down) and an odd one
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (37, 23)]


@needs_onednn
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_onednn_matches_f_linear_and_a_rows_result_never_depends_on_its_batch(out_features, in_features):
    g = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, in_features, generator=g) * in_features ** -0.5
    bias = torch.randn(out_features, generator=g)
    x = torch.randn(300, in_features, generator=g)
    linear = OneDnnLinear()
    packed = linear.prepare(w)
    full = linear(x, packed, bias)
    # float32 summation order only: |error| of a few ulp of values of size ~1
    torch.testing.assert_close(full, F.linear(x, w, bias), atol=2e-5, rtol=1e-5)
    for rows in (1, 2, 3, 4, 16, 17, 128):            # a prefix of the batch, alone
        assert torch.equal(linear(x[:rows], packed, bias), full[:rows]), rows
    for row in (0, 5, 299):                             # one row alone (the matrix-vector case)
        assert torch.equal(linear(x[row:row + 1], packed, bias), full[row:row + 1]), row
    assert torch.equal(linear(x[::2], packed, bias), full[::2])     # a strided batch


def test_make_linear_by_name():
    assert isinstance(make_linear("torch", CPU, torch.float32), TorchLinear)
    assert isinstance(make_linear("auto", CPU, torch.float16), TorchLinear)      # float32 only
    with pytest.raises(ValueError, match="linear_backend must be one of auto, torch, onednn, got 'mkl'"):
        make_linear("mkl", CPU, torch.float32)
    with pytest.raises(ValueError, match="onednn cannot run here: onednn multiplies CPU tensors, the engine is on cuda"):
        make_linear("onednn", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="linear_backend must be one of auto, torch, onednn, got 'x'"):
        EngineConfig(linear_backend="x")
    if onednn_unavailable_reason(CPU, torch.float32) is None:
        assert isinstance(make_linear("auto", CPU, torch.float32), OneDnnLinear)


@needs_onednn
def test_the_engine_on_onednn_gives_f_linears_logprobs():
    loaded = tiny_model()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    prompts = [[1, 5, 9, 13, 2, 7, 7, 3, 30, 31, 32], [4, 4, 4, 90]]
    outs = {}
    for name in ("torch", "onednn"):
        llm = LLM(loaded=loaded, linear_backend=name, num_kv_blocks=32, block_size=4)
        assert llm.engine.model.lm_head.linear.name == name
        outs[name] = llm.generate(prompts, params)
    for ref, got in zip(outs["torch"], outs["onednn"]):
        assert got.token_ids == ref.token_ids
        for a, b in zip(ref.logprobs, got.logprobs):
            assert abs(a.top[0][1] - b.top[0][1]) < 1e-4
