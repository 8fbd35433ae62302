"""The families' direct loops (``run_layers`` of Llama and Gemma 3): a step whose every layer
group attends in one backend call runs as the products', RoPE's, the storage's and the backend's
bound calls, and gives the logits the per-layer methods give, bit for bit; every other step takes
the methods."""

from __future__ import annotations

import pytest
import torch
from model.test_gemma3 import tiny_gemma3
from tiny import random_tokens, tiny_model

from kvserve import LLM, SamplingParams
from kvserve.attention.backends import CpuBackend
from kvserve.model.decoder import Decoder
from kvserve.model.loader import LoadedModel


def run(monkeypatch: pytest.MonkeyPatch, direct: bool, prompts: list[list[int]], params: SamplingParams,
        loaded: LoadedModel | None = None, **opts: object) -> tuple[list[list[int]], list[torch.Tensor], int]:
    """Greedy tokens, every step's logits, and the attentions the direct loop bound (one a step and
    layer group; a speculative engine drafts every step it can: no timing decides it)."""
    with monkeypatch.context() as m:
        if not direct:
            m.setattr(Decoder, "bound_layers", lambda self: ())
        bound = CpuBackend.step_attend
        direct_steps = []
        m.setattr(CpuBackend, "step_attend", lambda self, *a: direct_steps.append(1) or bound(self, *a))
        llm = LLM(loaded=loaded or tiny_model(), **{"num_kv_blocks": 64, **opts})
        if llm.engine.speculator is not None:
            llm.engine.speculator.always_draft()
        model = llm.engine.model
        logits: list[torch.Tensor] = []
        compute = model.compute_logits
        model.compute_logits = lambda hidden: logits.append(compute(hidden).clone()) or logits[-1]  # type: ignore[method-assign]
        outs = llm.generate(prompts, params)
        llm.engine.check_integrity()
    return [o.token_ids for o in outs], logits, len(direct_steps)


PROMPTS = [random_tokens(40, seed=1), random_tokens(23, seed=2), random_tokens(57, seed=3)]


@pytest.mark.parametrize("kv_format", ["fp16", "native", "int8", "kivi2g8", "int4g8+out2", "0=fp16;1-=kivi2g8",
                                       "zip:hi=int8,lo=kivi2g8,salient=0.25"])
@pytest.mark.parametrize("weight_format", ["int8", "int4"])
def test_the_direct_loop_gives_the_methods_logits_bit_for_bit(monkeypatch, weight_format, kv_format) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    opts = {"weight_format": weight_format, "kv_format": kv_format, "attention_backend": "cpu"}
    tokens, logits, direct = run(monkeypatch, True, PROMPTS, params, **opts)
    ref_tokens, ref_logits, ref_direct = run(monkeypatch, False, PROMPTS, params, **opts)
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits) and all(torch.equal(a, b) for a, b in zip(logits, ref_logits))
    assert ref_direct == 0
    if kv_format.startswith("zip:"):    # the steps that score keys' saliency take the methods
        assert 0 < direct < len(logits)
    else:                               # every step, the three prompts' prefill included
        assert direct == len(logits) == 20


def test_verify_steps_go_direct_and_keep_plain_decodings_tokens(monkeypatch) -> None:
    prompt = random_tokens(16, seed=4) * 4        # repeats: prompt lookup drafts
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    opts = {"weight_format": "int8", "kv_format": "fp16", "attention_backend": "cpu"}
    plain, _, _ = run(monkeypatch, False, [prompt], params, **opts)
    spec, _, direct = run(monkeypatch, True, [prompt], params,
                          speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **opts)
    assert spec == plain and direct > 0


def test_steps_outside_one_kernel_call_take_the_methods(monkeypatch) -> None:
    """Float weights have no bound products, and the torch backend no in-place batch: no direct step."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for opts in ({"attention_backend": "cpu"}, {"weight_format": "int8", "attention_backend": "torch"}):
        tokens, _, direct = run(monkeypatch, True, PROMPTS[:1], params, **opts)
        assert direct == 0 and len(tokens[0]) == 6


@pytest.mark.parametrize("kv_format", ["native", "int8", "kivi2g8"])
def test_gemma3s_layer_groups_go_direct_past_the_window(monkeypatch, kv_format) -> None:
    """Tiny Gemma 3 (five sliding layers of window 8, then a full one; blocks of 4): six groups,
    each its own write plan and batch, contexts past the window; logits bit for bit."""
    loaded = tiny_gemma3(seed=7)[0]
    opts = {"weight_format": "int8", "kv_format": kv_format, "attention_backend": "cpu", "block_size": 4,
            "num_kv_blocks": 400}
    prompts = [random_tokens(11, seed=5, vocab_size=loaded.config.vocab_size),
               random_tokens(19, seed=6, vocab_size=loaded.config.vocab_size)]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    tokens, logits, direct = run(monkeypatch, True, prompts, params, loaded, **opts)
    ref_tokens, ref_logits, ref_direct = run(monkeypatch, False, prompts, params, loaded, **opts)
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits) and all(torch.equal(a, b) for a, b in zip(logits, ref_logits))
    assert ref_direct == 0 and direct == 6 * len(logits)      # a bound attention per group and step
