"""Runs the evaluation units (one KV configuration each), in this process or in workers.

A unit is self-contained: it loads the model (from the converted-weights cache),
rebuilds the workload and evaluates one backend, so units can run in separate
single-threaded processes (``--jobs``): on a small shared CPU machine two
processes of one thread each run ~2x faster than one process with two threads,
and far faster when other work competes for the cores (OpenMP threads then
spend their time waiting on each other).

The greedy references (the uncompressed cache of each engine) are computed first,
in this process, and handed to every unit.
"""

from __future__ import annotations

import gc
import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.engine.build import resolve_device, resolve_dtype
from kvserve.eval.backends import EvalBackend, KVServeBackend
from kvserve.eval.harness import EvalSettings, FormatResult, Workload, evaluate, greedy_all, stderr_log
from kvserve.model.loader import LoadedModel, load_model

DENSE = "hf-dynamic"   # transformers with its uncompressed DynamicCache


@dataclass(frozen=True)
class Unit:
    engine: str              # "kvserve" or "transformers"
    name: str                # a KV format spec, "hf-quantoN" or DENSE
    nbits: int | None = None  # transformers' quantized cache


@dataclass(frozen=True)
class RunContext:
    """Everything a unit needs, picklable (sent to worker processes)."""

    model: str | None
    text: str
    settings: EvalSettings
    engine_options: dict[str, Any] = field(default_factory=dict)
    threads: int | None = None
    dense_passkey: bool = False


def units_for(formats: Sequence[str], hf_bits: Sequence[int], hf_dense: bool = False) -> list[Unit]:
    units = [Unit("kvserve", f) for f in formats]
    if hf_bits or hf_dense:
        units.append(Unit("transformers", DENSE))
        units += [Unit("transformers", f"hf-quanto{b}", b) for b in hf_bits]
    return units


def _load(ctx: RunContext) -> tuple[LoadedModel, Workload]:
    if ctx.threads:
        torch.set_num_threads(ctx.threads)
    loaded = load_model(ctx.model)
    if loaded.tokenizer is None:
        raise ValueError("kvserve eval needs a model with a tokenizer")
    return loaded, Workload.build(loaded.tokenizer, ctx.text, ctx.settings)


def _backend(unit: Unit, loaded: LoadedModel, ctx: RunContext) -> EvalBackend:
    chunk = ctx.settings.chunk
    if unit.engine == "kvserve":
        return KVServeBackend(loaded, unit.name, chunk, **ctx.engine_options)
    from kvserve.bench.common import hf_model_from
    from kvserve.eval import hf_baseline as hfb

    device = resolve_device(ctx.engine_options.get("device", "auto"))
    dtype = resolve_dtype(ctx.engine_options.get("dtype", "auto"), device, loaded.config.torch_dtype)
    hf = hf_model_from(loaded, dtype, device)   # exactly the engine's weights, dtype and device
    make = (hfb.dynamic_cache_factory(hf.config) if unit.nbits is None
            else hfb.quanto_cache_factory(hf.config, unit.nbits))
    return hfb.HFBackend(hf, make, unit.name, chunk, loaded.tokenizer)


def references(ctx: RunContext, need_hf: bool) -> dict[str, list[list[int]]]:
    """Greedy chat outputs of each engine's uncompressed cache: {"kvserve": ..., "transformers": ...}."""
    if "agree" not in ctx.settings.tasks:
        return {}
    loaded, work = _load(ctx)
    refs = {}
    for unit in [Unit("kvserve", "native")] + ([Unit("transformers", DENSE)] if need_hf else []):
        stderr_log(f"reference greedy outputs: {unit.engine} {unit.name}")
        refs[unit.engine] = greedy_all(_backend(unit, loaded, ctx), work.chat_prompts, ctx.settings.agree_tokens)
        gc.collect()
    return refs


def run_unit(ctx: RunContext, unit: Unit, refs: dict[str, list[list[int]]]) -> FormatResult:
    """Evaluate one unit. Agreement is against the same engine's uncompressed cache,
    except for transformers' own uncompressed cache, which is compared with kvserve's
    native cache (a cross-check of the two implementations)."""
    loaded, work = _load(ctx)
    backend = _backend(unit, loaded, ctx)
    if isinstance(backend, KVServeBackend):
        stderr_log(f"{unit.name}: KV format {backend.spec}")
    tasks = ctx.settings.tasks
    if unit.name == DENSE:
        ref = refs.get("kvserve")
        if not ctx.dense_passkey:
            tasks = tuple(t for t in tasks if t != "passkey")
    else:
        ref = refs.get(unit.engine)
    result, _ = evaluate(backend, unit.engine, work, ctx.settings, ref, tasks)
    return result


def run_all(ctx: RunContext, units: Sequence[Unit], jobs: int = 1) -> list[FormatResult]:
    refs = references(ctx, any(u.engine == "transformers" for u in units))
    gc.collect()
    if jobs <= 1:
        return [run_unit(ctx, u, refs) for u in units]
    # longest first (transformers' quantized caches take no prefix reuse), so the
    # workers finish together; results come back in the order of ``units``
    def rank(u: Unit) -> int:
        return 0 if u.nbits is not None else 2 if u.name == DENSE else 1

    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {u: pool.submit(run_unit, ctx, u, refs) for u in sorted(units, key=rank)}
        return [futures[u].result() for u in units]
