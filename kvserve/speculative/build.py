"""Speculative decoding's parts, built from the engine's config: the proposer by method (prompt
lookup; suffix decoding; the served model drafting over its own cache with some layers left out; a draft model
over a cache of its own) and the speculator that decides who drafts (engine/build.py calls
``make_speculator`` once)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from kvserve.attention.backends import make_attention_backend
from kvserve.attention.cpu_writes import CpuWrites
from kvserve.config import EngineConfig, SpeculativeConfig
from kvserve.kv.budget.budgets import Budgets
from kvserve.kv.codecs import parse_kv_format
from kvserve.kv.codecs.spec import AUTO
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.storage import KVStorage
from kvserve.kv.storage.factory import make_storage
from kvserve.model.decoder import Decoder
from kvserve.model.families import build_decoder
from kvserve.model.formats.build import make_products
from kvserve.model.formats.spec import WeightFormat
from kvserve.model.linear import make_linear
from kvserve.model.loader import LoadedModel, load_model
from kvserve.speculative.drafters import DraftModelProposer, ModelProposer, SelfProposer, TokenPass
from kvserve.speculative.proposers import NgramProposer, Proposer
from kvserve.speculative.speculator import PRIOR_STEP_BASE_S, PRIOR_STEP_ROW_S, Speculation, Speculator
from kvserve.speculative.suffix import SuffixProposer

log = logging.getLogger("kvserve")
LOOKUP_METHODS = ("ngram", "suffix")     # proposers that look drafts up, no model


@dataclass(frozen=True)
class Drafting:
    """What a model proposer is built from: the served model and its cache, a loaded draft model."""

    loaded: LoadedModel
    model: Decoder
    storage: KVStorage
    kv: KVCacheManager
    draft: LoadedModel | None
    weight_format: WeightFormat         # of a drafting model built here (WeightFormats.drafting)
    device: torch.device
    dtype: torch.dtype


def make_speculator(config: EngineConfig, budgets: Budgets, max_model_len: int,
                    drafting: Drafting) -> Speculation:
    """The engine's speculator: a null one without a speculative config, else the config's
    proposer under the speculator's cost model (``whole blocks``: where the KV format encodes them)."""
    spec = config.speculative
    if spec is None:
        return Speculation()
    proposer = make_proposer(spec) if spec.method in LOOKUP_METHODS else _model_proposer(config, spec, drafting)
    whole_blocks = drafting.storage.residual.num_rows > 0       # a format that encodes whole blocks
    return Speculator(spec, proposer, budgets, max_model_len, config.cache.block_size if whole_blocks else None)


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The lookup proposer ``config.method`` names (SpeculativeConfig checked its keys)."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        return SuffixProposer(config.suffix_max_depth, config.suffix_min_match, config.suffix_min_prob,
                              config.suffix_max_global_tokens)
    raise ValueError(f"no lookup proposer is named {config.method!r}")


def _model_proposer(config: EngineConfig, spec: SpeculativeConfig, d: Drafting) -> ModelProposer:
    """The ``self`` or ``draft`` proposer: its model (the served weights shared, or in the format
    ``spec.quantization`` names), the layers it runs, and for ``draft`` its own cache."""
    cc = config.cache
    if spec.method == "self":
        loaded, model = d.loaded, d.model
    else:
        loaded = d.draft if d.draft is not None else load_model(spec.model)
        _check_draft_model(d.loaded, loaded)
        model = None
    if model is None or spec.quantization is not None:
        products = make_products(d.weight_format, loaded, d.device, d.dtype,
                                 make_linear(config.linear_backend, d.device, d.dtype))
        model = build_decoder(loaded.config, loaded.weights, d.device, d.dtype, products)
    num_layers = loaded.config.num_layers
    skip = spec.skip_layers if spec.skip_layers is not None else (default_skip_layers(num_layers)
                                                                  if spec.method == "self" else ())
    bad = [i for i in skip if i >= num_layers]
    if bad or len(skip) >= num_layers:
        raise ValueError(f"speculative config: skip_layers {list(skip)} must name layers below {num_layers} and "
                         f"leave at least one")
    layers = [i for i in range(num_layers) if i not in set(skip)]
    # a drafting pass's prior cost: a step's, for the layers it runs (measured passes take over)
    share = len(layers) / d.loaded.config.num_layers
    prior = (PRIOR_STEP_BASE_S * share, PRIOR_STEP_ROW_S * share)
    backend = make_attention_backend(config.attention_backend, d.device)
    if spec.method == "self":
        log.info("self-drafting proposer: weights %s, %d of %d layers (%s left out)", model.products.name,
                 len(layers), num_layers, list(skip) or "none")
        return SelfProposer(TokenPass(model, d.storage, backend, layers), d.kv, *prior)
    # its own cache in the engine's default KV format (16-bit), whatever the served cache's
    storage = make_storage(loaded.config, parse_kv_format(AUTO, num_layers, d.dtype,
                                                          head_dim=loaded.config.head_dim),
                           replace(cc, num_blocks=d.storage.num_blocks), config.scheduler,
                           d.dtype, d.device, CpuWrites.for_storage)
    log.info("draft-model proposer: %s, weights %s, %d of %d layers, its own cache of %d blocks (%.1f MiB)",
             loaded.source, model.products.name, len(layers), num_layers, storage.num_blocks, storage.nbytes / 2**20)
    return DraftModelProposer(TokenPass(model, storage, backend, layers), storage.num_blocks, cc.block_size,
                              loaded.config.max_position_embeddings, *prior)


def default_skip_layers(num_layers: int) -> tuple[int, ...]:
    """The self draft's layers left out by default: every other one of the middle half."""
    return tuple(range(num_layers // 4, num_layers - num_layers // 4, 2))


def _check_draft_model(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft model must speak the target's vocabulary: the same size, the same tokenizer."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft model {draft.source} has a vocabulary of {draft.config.vocab_size} tokens; "
                         f"the served model's has {target.config.vocab_size}: they must be the same")
    if target.tokenizer is not None and draft.tokenizer is not None and \
            target.tokenizer.to_tokenizer_json() != draft.tokenizer.to_tokenizer_json():
        raise ValueError(f"the draft model {draft.source} has another tokenizer than the served model's: "
                         f"drafts would name other tokens")
