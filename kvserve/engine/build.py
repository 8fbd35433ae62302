"""The engine's wiring: every part built once, in dependency order, from the config.

    model ── products (weight format) ── attention backend
    KV storage ── pool ── tiering (mover, transports) ── budgets ── pins
                     └── KV manager (owns pool, tiering, budgets, pins)
    scheduler (KV manager, tiering) · runner (model, storage, KV manager, budgets)
    blender (model, storage, KV manager, tiering, attention backend) · sampler · grammars · model card

Each part gets the parts it calls, explicitly: nobody reaches a part through another's
attributes. Names are checked first, so a typo costs no model load and opens no tier.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch

from kvserve.attention.backends import AttentionBackend, make_attention_backend
from kvserve.attention.cpu_writes import CpuWrites
from kvserve.blend.admission import BlendAdmission
from kvserve.blend.blender import Blender
from kvserve.blend.calibrated import resolve_selection
from kvserve.config import EngineConfig, ModelConfig, SchedulerConfig
from kvserve.engine.checks import SLIDING_NO_BUDGETS, RequestChecks
from kvserve.engine.graphs import GRAPH_MAX_CONTEXT, DecodeGraphs, graph_batch_sizes, unfit_reason
from kvserve.engine.model_card import ModelCard
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.output_processor import OutputProcessor
from kvserve.kv.block_io import BlockMover
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.budget.budgets import Budgets, KVBudgets, NoBudgets
from kvserve.kv.budget.host_store import HostBlockStore
from kvserve.kv.budget.policies import check_budget, get_policy
from kvserve.kv.budget.precision import SaliencyPrecision
from kvserve.kv.codecs import KVFormat, parse_kv_format
from kvserve.kv.groups import LayerGroups
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.pins import Clock, Pins
from kvserve.kv.prefix import load_or_create_secret, make_extra_key
from kvserve.kv.storage import KVStorage
from kvserve.kv.storage.factory import make_storage
from kvserve.kv.storage.zip import ZipKVCache
from kvserve.kv.tiering import make_tiering
from kvserve.model.cpu_extension import load_extension as load_cpu_kernels
from kvserve.model.decoder import Decoder
from kvserve.model.families import build_decoder
from kvserve.model.formats.build import make_products
from kvserve.model.formats.spec import WeightFormat, parse_weight_format
from kvserve.model.linear import make_linear
from kvserve.model.loader import LoadedModel, default_cache_dir
from kvserve.offload.base import Transport
from kvserve.offload.tiered import open_transports
from kvserve.sampling.sampler import Sampler
from kvserve.sampling.structured import GrammarCompiler
from kvserve.scheduler.policies import policy_class
from kvserve.scheduler.scheduler import Scheduler
from kvserve.speculative.build import Drafting, make_speculator
from kvserve.speculative.speculator import Speculation

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


class WeightFormats(NamedTuple):
    """The weight formats of an engine's config, parsed once (``check_names``): the served
    model's, and the one a drafting model is built in (the speculative config's
    ``quantization``, else the served model's)."""

    served: WeightFormat
    drafting: WeightFormat


def check_names(config: EngineConfig, draft: LoadedModel | None = None) -> WeightFormats:
    """Raise ValueError for a name no registry knows (or a default budget its policy cannot
    run, or a draft method with no drafting model), before a model is loaded or a tier opened.
    The weight formats it parses are returned, for ``build_parts``."""
    policy_class(config.scheduler.policy)
    served = parse_weight_format(config.weight_format)
    spec = config.speculative
    drafting = served
    if spec is not None:
        if spec.quantization is not None:
            drafting = parse_weight_format(spec.quantization)
        if spec.method == "draft" and spec.model is None and draft is None:
            raise ValueError('speculative config: method "draft" needs the drafting model ("model": a path or name)')
        if draft is not None and (spec.method != "draft" or spec.model is not None):
            raise ValueError("a loaded draft model is for the draft method without a \"model\" in its config")
    cc = config.cache
    budget_policy = get_policy(cc.kv_policy)
    if cc.kv_budget is not None:
        check_budget(cc.kv_budget, budget_policy, cc.block_size)
    return WeightFormats(served, drafting)


def check_model(config: EngineConfig, mc: ModelConfig) -> None:
    """ValueError for an engine option this model cannot run, saying why."""
    if not mc.has_sliding_layers:
        return
    if config.cache.kv_budget is not None:
        raise ValueError(SLIDING_NO_BUDGETS)
    spec = config.speculative
    if spec is not None and spec.method != "ngram":
        raise ValueError(f"speculative method {spec.method!r} drafts with a model over the served cache's tables, "
                         "which on a model with sliding-window layers are one per layer group (not built yet); "
                         "use \"ngram\"")


def _rows_for_groups(scheduler: SchedulerConfig, groups: LayerGroups) -> SchedulerConfig:
    """What a storage sizes its open blocks' residual rows by: with several layer groups a request
    holds an open block in each, so as many sequences and step tokens times the groups."""
    n = len(groups.groups)
    if n == 1:
        return scheduler
    return replace(scheduler, max_num_seqs=n * scheduler.max_num_seqs + n,
                   max_num_batched_tokens=n * scheduler.max_num_batched_tokens)


@dataclass(frozen=True)
class EngineParts:
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    model: Decoder
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
    speculator: Speculation             # a null object without speculative decoding
    checks: RequestChecks
    blending: BlendAdmission            # segmented requests' queue and first admission
    outputs: OutputProcessor


def build_parts(config: EngineConfig, weights: WeightFormats, loaded: LoadedModel, tiers: Sequence[Transport] | None,
                clock: Clock, draft: LoadedModel | None = None, timer: Clock = time.perf_counter) -> EngineParts:
    """Every part of an engine for ``loaded``, its weights in ``weights`` (``check_names``'s);
    ``tiers`` replace the transports ``config.tiers`` would open, ``draft`` the draft method's
    model (LLMEngine's docstring)."""
    mc, cc = loaded.config, config.cache
    check_model(config, mc)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device, mc.torch_dtype)
    max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    products = make_products(weights.served, loaded, device, dtype, make_linear(config.linear_backend, device, dtype))
    model = build_decoder(mc, loaded.weights, device, dtype, products)
    # the weights' format is part of the model's identity: KV computed with other weights never matches
    fingerprint = f"{loaded.fingerprint}:weights={products.name}"
    kv_format = parse_kv_format(cc.kv_format, mc.num_layers, dtype, head_dim=mc.head_dim)
    # new rows through the C++ writer where it runs (attention/cpu_writes.py), else the torch path
    groups = LayerGroups.of(mc.sliding_windows if cc.window_kv else (None,) * mc.num_layers)
    storage = make_storage(mc, kv_format, cc, _rows_for_groups(config.scheduler, groups), dtype, device,
                           CpuWrites.for_storage, groups)
    mixes_domains = isinstance(storage, ZipKVCache) and storage.mixes_rotation_domains
    attention = _attention_backend(config.attention_backend, device, kv_format, mixes_domains)
    if mixes_domains and attention.reads_in_place:
        log.warning("KV format %s: the finer and base formats of a half differ in +had; the kernel rotates the "
                    "finer blocks' rows as it reads them (measured 2.7x slower decode): give both +had or neither",
                    kv_format.spec)
    pool = BlockPool(storage.num_blocks, cc.block_size)
    secret_path = Path(cc.key_secret_file) if cc.key_secret_file else default_cache_dir() / "block-key-secret"
    extra_key = make_extra_key(fingerprint, f"{kv_format.spec}:{dtype}", cc.cache_salt,
                               load_or_create_secret(secret_path))
    preamble = _blend_preamble(cc.blend_preamble, loaded)
    # the tiering copies blocks through the mover; Redis keys are namespaced by the extra key
    # (model, format, dtype, salt), as blocks are tagged by it
    mover = BlockMover(storage.block_tensors())
    transports = list(tiers) if tiers is not None else open_transports(config.tiers, extra_key.hex()[:32])
    tiering = make_tiering(transports, mover, extra_key, cc.block_size, config.write_through, timer)
    budgets = _make_budgets(config, storage, kv_format, mc)
    pins = Pins(pool, int(cc.max_pinned_fraction * storage.num_blocks), cc.max_pin_ttl_s, clock)
    kv = KVCacheManager(pool, extra_key, cc.enable_prefix_caching, storage.residual, tiering, budgets, pins, groups,
                        config.scheduler.max_num_batched_tokens)
    # a captured decode step's padded rows write one block of their own (engine/graphs.py)
    reserved = _reserve_graph_block(config, device, attention, storage, kv)
    max_model_len = fit_max_model_len(config.max_model_len_fit, kv, max_model_len, storage.nbytes / storage.num_blocks)
    graphs = None if reserved is None else DecodeGraphs(
        model, storage, attention, reserved, kv.num_blocks_needed(min(max_model_len, GRAPH_MAX_CONTEXT)),
        graph_batch_sizes(config.scheduler.max_num_seqs), capture=True,
        group_of_layer=() if groups.is_single else groups.group_of_layer)
    # what a front end needs to parse requests for this engine (a cluster's ingress gets it over the wire)
    model_card = ModelCard(loaded.tokenizer, mc.vocab_size, max_model_len, cc.block_size, extra_key, preamble)
    eos = sorted(mc.eos_token_ids)
    tokenizer_json = loaded.tokenizer.to_tokenizer_json() if loaded.tokenizer is not None else None
    scheduler = Scheduler(config.scheduler, kv, tiering, whole_blocks=storage.residual.num_rows > 0)
    # a prompt's own selection resolves as the option does (the closure holds the fingerprint,
    # not the loaded model's weights)
    resolve = functools.partial(resolve_selection, query_layer=cc.blend_query_layer, fingerprint=loaded.fingerprint)
    selection, query_layer = resolve(cc.blend_selection)
    blender = Blender(model, storage, kv, pool, tiering, attention, cc.blend_select_layer, cc.blend_cost_model, selection,
                      cc.blend_sink_tokens, query_layer, preamble, cc.blend_in_batch, cc.blend_last_segments,
                      resolve)
    grammars = GrammarCompiler(tokenizer_json, mc.vocab_size, eos)
    parts = EngineParts(
        model_config=mc, device=device, dtype=dtype, max_model_len=max_model_len, model=model,
        weight_format=products.name, fingerprint=fingerprint, kv_format=kv_format, model_card=model_card, kv=kv,
        scheduler=scheduler, runner=ModelRunner(model, storage, kv, budgets, attention, graphs),
        sampler=Sampler(config.seed, eos, _sampling_kernels(device)), grammars=grammars, attention=attention,
        speculator=make_speculator(config, budgets, max_model_len,
                                   Drafting(loaded, model, storage, kv, draft, weights.drafting, device, dtype)),
        checks=RequestChecks(budgets, grammars, mc.vocab_size, mc.has_sliding_layers),
        blending=BlendAdmission(blender, kv, scheduler, _blend_step_tokens(config)),
        outputs=OutputProcessor(loaded.tokenizer, frozenset(mc.eos_token_ids), max_model_len))
    log.info("engine ready: %s on %s/%s, weights %s (%.1f MiB), KV format %s, %d blocks of %d tokens (%.1f MiB), "
             "attention %s, offload tiers: %s", loaded.source, device, dtype, products.name,
             model.weight_nbytes / 2**20, kv_format.spec, storage.num_blocks, cc.block_size,
             storage.nbytes / 2**20, attention.name, ", ".join(tiering.tier_names) or "none")
    return parts


def fit_max_model_len(fit: str | None, kv: KVCacheManager, max_model_len: int, block_nbytes: float) -> int:
    """``max_model_len``, checked against the pool as ``fit`` says: a pool that holds one request
    of that many tokens (``KVCacheManager.max_blocks_held``: on sliding-window layers their
    windows' blocks) keeps it; else "refuse" raises ValueError naming both numbers and the
    flags that fix it, and "lower" gives the most tokens the pool holds for one request (so that
    a request's default max_tokens, the rest of the window, always fits). None: no check."""
    fits = kv.max_request_tokens(max_model_len)
    if fit is None or fits == max_model_len:
        return max_model_len
    needed = kv.max_blocks_held(max_model_len)
    if fit == "lower" and fits >= 2:
        log.warning("max_model_len lowered from %d to %d tokens: the KV cache's %d blocks hold no more of one request "
                    "(%d tokens needs %d blocks; --max-model-len-fit lower)", max_model_len, fits,
                    kv.num_blocks, max_model_len, needed)
        return fits
    gib = math.ceil(needed * block_nbytes / 2**30 * 100) / 100
    raise ValueError(
        f"the KV cache has {kv.num_blocks} blocks of {kv.block_size} tokens, but one request of max_model_len "
        f"{max_model_len} tokens needs up to {needed} blocks: the cache holds at most {fits} tokens of one request, "
        f"so a request without max_tokens could never run. Give --max-model-len {fits} (or less), a KV cache of "
        f"{needed} blocks or more (--kv-cache-gb {gib:.2f}, or --num-kv-blocks {needed}), or --max-model-len-fit "
        f"lower to start with max_model_len {fits}")


def _sampling_kernels(device: torch.device) -> ModuleType | None:
    """The model's C++ extension for the sampler's greedy argmax (kvserve/sampling/sampler.py
    ``row_max``) on a CPU engine, which loads it for its products anyway (None where it cannot be
    built, and on CUDA: the logits come to the host, but building it there would stall a
    first request)."""
    return load_cpu_kernels() if device.type == "cpu" else None


def _reserve_graph_block(config: EngineConfig, device: torch.device, attention: AttentionBackend,
                         storage: KVStorage, kv: KVCacheManager) -> int | None:
    """With ``cuda_graphs``: the block the graphs' padded rows use, or ValueError saying why no
    decode step of this engine could be captured; None without."""
    if not config.cuda_graphs:
        return None
    reason = unfit_reason(device, attention, storage)
    if reason is not None:
        raise ValueError(f"cuda_graphs: {reason}")
    return kv.reserve_block()


def _attention_backend(name: str, device: torch.device, kv_format: KVFormat, mixes_domains: bool) -> AttentionBackend:
    """The backend ``name``; under a ``zip:`` format whose finer copies are in another Hadamard
    domain than their base (``mixes_domains``: ``hi=int8,lo=kivi2+had``), which the Triton kernels
    do not read, ``auto`` on CUDA is the torch path and ``triton`` an error saying so."""
    if not mixes_domains or not (name == "triton" or (name == "auto" and device.type == "cuda")):
        return make_attention_backend(name, device)
    reason = ("the Triton kernels read a finer copy in its base's Hadamard domain only (give both formats +had, "
              "without +outN, or neither)")
    if name == "triton":
        raise ValueError(f"the triton attention backend cannot read {kv_format.spec}: {reason}; use "
                         "--attention-backend torch (or cpu on a CPU)")
    log.info("KV format %s: attention through the torch path (%s)", kv_format.spec, reason)
    return make_attention_backend("torch", device)


def _make_budgets(config: EngineConfig, storage: KVStorage, kv_format: KVFormat, mc: ModelConfig) -> Budgets:
    cc = config.cache
    if mc.has_sliding_layers:
        return NoBudgets(SLIDING_NO_BUDGETS)
    if isinstance(storage, ZipKVCache):
        return SaliencyPrecision(storage, mc.num_kv_heads, cc.budget_host_bytes, cc.kv_budget, cc.kv_policy)
    return KVBudgets(storage, mc.num_kv_heads, cc.kv_budget, cc.kv_policy, HostBlockStore(cc.budget_host_bytes))


def _blend_preamble(text: str | None, loaded: LoadedModel) -> tuple[int, ...]:
    """The blend preamble's token ids (none without one); ValueError where there is no tokenizer."""
    if text is None:
        return ()
    if loaded.tokenizer is None:
        raise ValueError("blend_preamble is text, and this model has no tokenizer")
    return tuple(loaded.tokenizer.encode(text))


def _blend_step_tokens(config: EngineConfig) -> int | None:
    """The blend work between two steps: the step's token budget when blends run in steps
    (and prompts prefill in chunks), else None (each blend whole)."""
    sc = config.scheduler
    return sc.max_num_batched_tokens if config.cache.blend_in_steps and sc.enable_chunked_prefill else None
