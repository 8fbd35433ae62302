"""A prompt's own ``blend_selection``, ``blend_sink_tokens`` and ``blend_last_segments``: it blends
as an engine given those options would, beside prompts that take the engine's."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from test_engine import DOCS, GREEDY, rag

from kvserve import LLM, SegmentedPrompt
from kvserve.blend.prompt import Segment
from kvserve.config import BlendOptionError

HOW = [("query-segments", 4, 1), ("narrowing", 0, 0), ("query", 2, 0), ("deviation", 0, 1), ("auto", 0, 0)]


def own(prompt: SegmentedPrompt, selection: str, sinks: int, last: int) -> SegmentedPrompt:
    return dataclasses.replace(prompt, blend_selection=selection, blend_sink_tokens=sinks, blend_last_segments=last)


@pytest.mark.parametrize(("selection", "sinks", "last"), HOW)
def test_a_prompts_own_selection_blends_as_the_engine_option_would(loaded, selection, sinks, last):
    """The same prompt through an engine on the default options, naming its own selection, and
    through an engine given them as options: the same rows recomputed, the same tokens; and a
    prompt naming nothing, in the first engine, blends by the engine's (deviation, no sinks)."""
    base = rag([2, 0, 1], 0.15)
    outs = []
    for options, prompt in (({}, own(base, selection, sinks, last)),
                            ({"blend_selection": selection, "blend_sink_tokens": sinks, "blend_last_segments": last},
                             base)):
        llm = LLM(loaded=loaded, num_kv_blocks=64, blend_cost_model=False, blend_query_layer=1,
                  enable_prefix_caching=False, **options)
        outs.append(llm.generate([prompt], GREEDY)[0])
        llm.engine.check_integrity()
    mine, engines = outs
    assert mine.num_reused_tokens == engines.num_reused_tokens == sum(len(d) for d in DOCS[:3])   # 121
    assert (mine.num_recomputed_tokens, mine.token_ids) == (engines.num_recomputed_tokens, engines.token_ids)


def test_prompts_with_and_without_their_own_selection_share_an_engine(loaded):
    """One engine, three prompts in one batch: each recomputes what it would alone. (The
    segments are stored first: a segment computed for the prompt that first holds it is reused
    whole, tail and all, where a stored one gives its full blocks only.)"""
    llm = LLM(loaded=loaded, num_kv_blocks=96, blend_cost_model=False, blend_query_layer=1,
              enable_prefix_caching=False)
    llm.cache_segments(DOCS[:3])
    prompts = [own(rag([2, 0, 1], 0.15), "query-segments", 4, 1), rag([1, 2, 0], 0.15),
               own(rag([0, 1, 2], 0.3), "query", 0, 0)]
    alone = [llm.generate([p], GREEDY)[0] for p in prompts]
    together = llm.generate(prompts, GREEDY)
    assert [(o.num_recomputed_tokens, o.token_ids) for o in together] == \
        [(o.num_recomputed_tokens, o.token_ids) for o in alone]
    # the default prompt took deviation; a prompt naming deviation recomputes the same rows
    named = llm.generate([own(rag([1, 2, 0], 0.15), "deviation", 0, 0)], GREEDY)[0]
    assert (named.num_recomputed_tokens, named.token_ids) == (alone[1].num_recomputed_tokens, alone[1].token_ids)
    llm.engine.check_integrity()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"blend_selection": "best"}, "unknown blend selection 'best'; choose one of auto, deviation"),
    ({"blend_sink_tokens": -1}, "blend_sink_tokens must be an integer >= 0, got -1"),
    ({"blend_last_segments": 1.5}, "blend_last_segments must be an integer >= 0, got 1.5"),
])
def test_bad_per_prompt_options_are_refused_when_the_prompt_is_made(kwargs, message):
    """The error names the option (the server's 400 ``param``), also after a trip through pickle
    (a Ray replica's error reaches the driver that way)."""
    with pytest.raises(ValueError, match=message):
        SegmentedPrompt(["a", Segment("b")], **kwargs)
    with pytest.raises(BlendOptionError, match=message) as raised:
        SegmentedPrompt.from_text("a b", ["b"], **kwargs)
    again = pickle.loads(pickle.dumps(raised.value))
    assert (type(again), again.option, str(again)) == (BlendOptionError, next(iter(kwargs)), str(raised.value))
