"""The KV memory planner (``kvserve plan``): how much KV memory a model needs, and what fits
beside its weights."""

from kvserve.plan.formats import BLOCK_SIZE, FORMATS, GROUP_SIZE, HalfSize, NamedFormat, get_format
from kvserve.plan.models import BUILTIN_MODELS, ModelShape, load_gguf, load_model_shape, lookup_model, resolve_model
from kvserve.plan.planner import (
    GIB,
    TIER_BLOCK_HEADER_NBYTES,
    Capacity,
    KVLayout,
    Plan,
    PlanRequest,
    Sharing,
    make_plan,
)
from kvserve.plan.weights import WeightCount, WeightRow, count_weights

__all__ = [
    "BLOCK_SIZE",
    "BUILTIN_MODELS",
    "FORMATS",
    "GIB",
    "GROUP_SIZE",
    "TIER_BLOCK_HEADER_NBYTES",
    "Capacity",
    "HalfSize",
    "KVLayout",
    "ModelShape",
    "NamedFormat",
    "Plan",
    "PlanRequest",
    "Sharing",
    "WeightCount",
    "WeightRow",
    "count_weights",
    "get_format",
    "load_gguf",
    "load_model_shape",
    "lookup_model",
    "make_plan",
    "resolve_model",
]
