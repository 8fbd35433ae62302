"""The engine's wiring: every part built once, in dependency order, from the config.

    model ── products (weight format) ── attention backend
    KV storage ── pool ── tiering (mover, transports) ── budgets ── pins
                     └── KV manager (owns pool, tiering, budgets, pins)
    scheduler (KV manager, tiering) · runner (model, storage, KV manager, budgets)
    blender (model, storage, KV manager, tiering) · sampler · grammars · model card

Each part gets the parts it calls, explicitly: nobody reaches a part through another's
attributes. Names are checked first, so a typo costs no model load and opens no tier.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.attention.backends import AttentionBackend, make_attention_backend
from kvserve.attention.cpu_writes import CpuWrites
from kvserve.blend.admission import BlendAdmission
from kvserve.blend.blender import Blender
from kvserve.config import EngineConfig, ModelConfig
from kvserve.engine.checks import RequestChecks
from kvserve.engine.model_card import ModelCard
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.output_processor import OutputProcessor
from kvserve.kv.block_io import BlockMover
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.budget.budgets import Budgets, KVBudgets, NoBudgets
from kvserve.kv.budget.host_store import HostBlockStore
from kvserve.kv.budget.policies import check_budget, get_policy
from kvserve.kv.codecs import KVFormat, parse_kv_format
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.pins import Clock, Pins
from kvserve.kv.prefix import load_or_create_secret, make_extra_key
from kvserve.kv.storage import KVStorage
from kvserve.kv.storage.factory import make_storage
from kvserve.kv.storage.quantized import QuantizedKVCache
from kvserve.kv.tiering import make_tiering
from kvserve.model.formats.build import make_products
from kvserve.model.formats.spec import parse_weight_format
from kvserve.model.linear import make_linear
from kvserve.model.llama import LlamaModel
from kvserve.model.loader import LoadedModel, default_cache_dir
from kvserve.offload.base import Transport
from kvserve.offload.tiered import open_transports
from kvserve.sampling.sampler import Sampler
from kvserve.sampling.structured import GrammarCompiler
from kvserve.scheduler.policies import policy_class
from kvserve.scheduler.scheduler import Scheduler
from kvserve.spec.proposers import make_proposer
from kvserve.spec.speculator import Speculator

log = logging.getLogger("kvserve")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA device")
    return device


def resolve_dtype(name: str, device: torch.device, model_dtype: str) -> torch.dtype:
    if name == "auto":
        # fp32 on CPU: measured ~4.7x faster than bf16 there; the model's dtype on GPUs
        name = "float32" if device.type == "cpu" else model_dtype
        if name == "float32" and device.type == "cuda":
            name = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return getattr(torch, name)


def check_names(config: EngineConfig) -> None:
    """Raise ValueError for a name no registry knows (or a default budget its policy cannot
    run), before a model is loaded or a tier opened."""
    policy_class(config.scheduler.policy)
    parse_weight_format(config.weight_format)
    cc = config.cache
    budget_policy = get_policy(cc.kv_policy)
    if cc.kv_budget is not None:
        check_budget(cc.kv_budget, budget_policy, cc.block_size)


@dataclass(frozen=True)
class EngineParts:
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    model: LlamaModel
    weight_format: str
    fingerprint: str              # the model's identity, weights' format included
    kv_format: KVFormat
    model_card: ModelCard
    kv: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    sampler: Sampler
    grammars: GrammarCompiler
    attention: AttentionBackend
    speculator: Speculator | None       # None: no speculative decoding
    checks: RequestChecks
    blending: BlendAdmission            # segmented requests' queue and first admission
    outputs: OutputProcessor


def build_parts(config: EngineConfig, loaded: LoadedModel, tiers: Sequence[Transport] | None,
                clock: Clock) -> EngineParts:
    """Every part of an engine for ``loaded``; ``tiers`` replace the transports ``config.tiers``
    would open (LLMEngine's docstring)."""
    mc, cc = loaded.config, config.cache
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device, mc.torch_dtype)
    max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    products = make_products(config.weight_format, loaded, device, dtype,
                             make_linear(config.linear_backend, device, dtype))
    model = LlamaModel(mc, loaded.weights, device, dtype, products)
    # the weights' format is part of the model's identity: KV computed with other weights never matches
    fingerprint = f"{loaded.fingerprint}:weights={products.name}"
    attention = make_attention_backend(config.attention_backend, device)

    kv_format = parse_kv_format(cc.kv_format, mc.num_layers, dtype, head_dim=mc.head_dim)
    # new rows through the C++ writer where it runs (attention/cpu_writes.py), else the torch path
    storage = make_storage(mc, kv_format, cc, config.scheduler, dtype, device, CpuWrites.for_storage)
    pool = BlockPool(storage.num_blocks, cc.block_size)
    secret_path = Path(cc.key_secret_file) if cc.key_secret_file else default_cache_dir() / "block-key-secret"
    extra_key = make_extra_key(fingerprint, f"{kv_format.spec}:{dtype}", cc.cache_salt,
                               load_or_create_secret(secret_path))
    # what a front end needs to parse requests for this engine (a cluster's ingress gets it over the wire)
    model_card = ModelCard(loaded.tokenizer, mc.vocab_size, max_model_len, cc.block_size, extra_key)
    # the tiering copies blocks through the mover; Redis keys are namespaced by the extra key
    # (model, format, dtype, salt), as blocks are tagged by it
    mover = BlockMover(storage.block_tensors())
    transports = list(tiers) if tiers is not None else open_transports(config.tiers, extra_key.hex()[:32])
    tiering = make_tiering(transports, mover, extra_key, cc.block_size, config.write_through)
    budgets = _make_budgets(config, storage, kv_format, mc)
    pins = Pins(pool, int(cc.max_pinned_fraction * storage.num_blocks), cc.max_pin_ttl_s, clock)
    kv = KVCacheManager(pool, extra_key, cc.enable_prefix_caching, storage.residual, tiering, budgets, pins)
    eos = sorted(mc.eos_token_ids)
    tokenizer_json = loaded.tokenizer.to_tokenizer_json() if loaded.tokenizer is not None else None
    scheduler = Scheduler(config.scheduler, kv, tiering)
    blender = Blender(model, storage, kv, tiering, cc.blend_select_layer, cc.blend_cost_model)
    grammars = GrammarCompiler(tokenizer_json, mc.vocab_size, eos)
    parts = EngineParts(
        model_config=mc, device=device, dtype=dtype, max_model_len=max_model_len, model=model,
        weight_format=products.name, fingerprint=fingerprint, kv_format=kv_format, model_card=model_card, kv=kv,
        scheduler=scheduler, runner=ModelRunner(model, storage, kv, budgets, attention),
        sampler=Sampler(config.seed, eos), grammars=grammars, attention=attention,
        speculator=_make_speculator(config, kv_format, budgets, max_model_len),
        checks=RequestChecks(budgets, grammars, mc.vocab_size), blending=BlendAdmission(blender, kv, scheduler),
        outputs=OutputProcessor(loaded.tokenizer, frozenset(mc.eos_token_ids), max_model_len))
    log.info("engine ready: %s on %s/%s, weights %s (%.1f MiB), KV format %s, %d blocks of %d tokens (%.1f MiB), "
             "attention %s, offload tiers: %s", loaded.source, device, dtype, products.name,
             model.weight_nbytes / 2**20, kv_format.spec, storage.num_blocks, cc.block_size,
             storage.nbytes / 2**20, attention.name, ", ".join(tiering.tier_names) or "none")
    return parts


def _make_speculator(config: EngineConfig, kv_format: KVFormat, budgets: Budgets,
                     max_model_len: int) -> Speculator | None:
    spec = config.speculative
    if spec is None:
        return None
    if QuantizedKVCache.keeps_residual(kv_format):
        raise ValueError(f"speculative decoding does not run yet with KV formats that encode whole blocks "
                         f"(--kv-format {kv_format.spec}: a block would be encoded before its drafted tokens "
                         f"are checked); use a format whose halves encode token by token (e.g. native, int8)")
    return Speculator(spec, make_proposer(spec), budgets, max_model_len)


def _make_budgets(config: EngineConfig, storage: KVStorage, kv_format: KVFormat, mc: ModelConfig) -> Budgets:
    cc = config.cache
    if not storage.supports_budgets:
        if cc.kv_budget is not None:
            raise ValueError(f"a KV budget needs the native KV format (compaction rewrites full-precision "
                             f"entries); got --kv-format {kv_format.spec}")
        return NoBudgets(f"KV format {kv_format.spec} is quantized; budgets need the native format")
    return KVBudgets(storage, mc.num_kv_heads, cc.kv_budget, cc.kv_policy, HostBlockStore(cc.budget_host_bytes))
