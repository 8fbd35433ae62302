"""``kvserve eval``: perplexity, greedy agreement and passkey retrieval per KV format,
with transformers' quantized KV cache as the baseline, in one table."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvserve.eval.perplexity import describe_layout
from kvserve.options import CommandDefault, add_engine_args, engine_options

DEFAULT_FORMATS = ("native", "fp16", "bf16", "fp8", "int8", "int4", "kivi4", "kivi2", "kivi2+had",
                   "kivi4+out4", "0-1=fp16;2-=kivi2", "k=kivi4,v=kivi2")
DEFAULT_WEIGHT_FORMATS = ("native", "gguf", "int8", "int8-ch", "int4", "int4+out8", "int4-g64",
                          "int4-g64+out8", "int8+out8")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def ppl_stride(args: argparse.Namespace) -> int:
    """``--stride`` (512 unless given) for sliding windows; the halves layout takes none."""
    if args.ppl_layout == "halves" and args.stride is not None:
        raise SystemExit("--stride applies to --ppl-layout sliding: halves windows follow each other, no stride")
    return 512 if args.stride is None else args.stride


def settings_from(args: argparse.Namespace) -> Any:
    from kvserve.eval.harness import EvalSettings
    return EvalSettings(
        ppl_tokens=args.ppl_tokens, window=args.window, stride=ppl_stride(args), ppl_layout=args.ppl_layout,
        chunk=args.chunk,
        num_prompts=args.num_prompts, agree_tokens=args.agree_tokens,
        passkey_lengths=_ints(args.passkey_lengths), passkey_depths=_floats(args.passkey_depths),
        passkey_trials=args.passkey_trials, passkey_filler=args.passkey_filler,
        passkey_reuse=not args.no_passkey_reuse,
        answer_tokens=args.answer_tokens, context_tokens=args.context_tokens, seed=args.workload_seed,
        tasks=tuple(t for t in args.tasks.split(",") if t))


def run_eval(args: argparse.Namespace) -> int:
    from kvserve.bench.common import find_text
    from kvserve.engine.build import resolve_device, resolve_dtype
    from kvserve.eval.report import goal_lines, render_table, to_json
    from kvserve.eval.runner import RunContext, run_all, units_for
    from kvserve.model.loader import load_model

    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = settings_from(args)
    ctx = RunContext(model=args.model, text=find_text(args.text), settings=settings,
                     engine_options={**engine_options(args), "max_num_seqs": 4},
                     threads=args.threads, dense_passkey=args.hf_dense_passkey)
    units = units_for(args.format or list(DEFAULT_FORMATS), _ints(args.hf_bits), args.hf_dense)
    results = run_all(ctx, units, args.jobs)
    wall = time.perf_counter() - t_start

    loaded = load_model(args.model)
    mc = loaded.config
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device, mc.torch_dtype)
    print(f"kvserve eval: {loaded.source}, device {device}, compute dtype {dtype}, prompts fed in chunks "
          f"of {settings.chunk} tokens")
    windows = describe_layout(settings.ppl_layout, settings.window, settings.stride)
    print(f"perplexity: first {settings.ppl_tokens} tokens of the text, {windows}; agreement: "
          f"{settings.num_prompts} chat prompts x {settings.agree_tokens} greedy tokens vs the same engine's uncompressed cache; passkey: {settings.passkey_filler} filler, "
          f"depths {', '.join(f'{d:g}' for d in settings.passkey_depths)}, {settings.passkey_trials} key(s) "
          f"each, answer in {settings.answer_tokens} greedy tokens")
    print(render_table(results, mc.kv_bytes_per_token(4), mc.kv_bytes_per_token(2), settings.passkey_lengths))
    for line in goal_lines(results):
        print(f"goal: {line}")
    print(f"wall time {wall:.0f} s ({wall / 60:.1f} min), {args.jobs} job(s), "
          f"{args.threads or torch.get_num_threads()} thread(s) each")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": settings.__dict__, "wall_s": wall,
                                               "results": to_json(results)}, indent=2, default=str))
    return 0


def add_quality_args(e: argparse.ArgumentParser, chunk_help: str) -> None:
    """The perplexity and greedy-agreement flags ``eval`` and ``eval-weights`` share."""
    e.add_argument("--text", default=None, help="perplexity text (default: the shipped botchan.txt)")
    e.add_argument("--ppl-tokens", type=int, default=2048, help="score the first N tokens of the text")
    e.add_argument("--window", type=int, default=1024)
    e.add_argument("--stride", type=int, default=None, help="tokens between sliding windows (default 512)")
    e.add_argument("--ppl-layout", choices=("sliding", "halves"), default="sliding",
                   help="sliding: windows every --stride tokens, every token scored once; halves: llama.cpp's "
                        "llama-perplexity (windows back to back, each scored on its second half; no stride)")
    e.add_argument("--chunk", type=int, default=64, help=chunk_help)
    e.add_argument("--num-prompts", type=int, default=8, help="chat prompts for greedy agreement")
    e.add_argument("--agree-tokens", type=int, default=32, help="greedy tokens per chat prompt")


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("eval", help="KV format quality: perplexity, greedy agreement, passkey retrieval")
    e.add_argument("--model", default=None)
    add_engine_args(e, ("device", "dtype", "kv_cache_memory_gb", "weight_format"))   # the KV pool of each engine
    e.add_argument("--format", action="append", default=None,
                   help=f"a KV format spec to evaluate (repeatable; default: {' | '.join(DEFAULT_FORMATS)})")
    e.add_argument("--hf-bits", default="4,2", help="transformers QuantizedCache (quanto) bit widths; '' for none")
    e.add_argument("--hf-dense", action="store_true",
                   help="transformers' uncompressed cache on the same weights (dequantized, as --weight-format "
                        "native computes), also without --hf-bits: the cross-check of the two implementations")
    e.add_argument("--hf-dense-passkey", action="store_true",
                   help="also run passkey on transformers' uncompressed cache (same weights as native)")
    e.add_argument("--tasks", default="ppl,agree,passkey", help="comma-separated subset of ppl,agree,passkey")
    add_quality_args(e, "prompt tokens per forward (both engines)")
    e.add_argument("--passkey-lengths", default="1024,2048,4096", help="filler tokens")
    e.add_argument("--passkey-depths", default="0,0.25,0.5,0.75,1")
    e.add_argument("--passkey-trials", type=int, default=1, help="keys per length and depth")
    e.add_argument("--passkey-filler", default="repeat", choices=["repeat", "text"])
    e.add_argument("--no-passkey-reuse", action="store_true",
                   help="compute every passkey prompt cold (default: shared prefixes come from the prefix "
                        "cache; needles sit on chunk boundaries, so the result is the same)")
    e.add_argument("--answer-tokens", type=int, default=12)
    e.add_argument("--context-tokens", type=int, default=1024, help="sequence length for bytes/token @context")
    e.add_argument("--seed", type=int, default=0, dest="workload_seed", metavar="SEED")   # the engine's: --engine-seed
    e.add_argument("--jobs", type=int, default=1,
                   help="worker processes, one configuration each at a time (use with --threads 1)")
    e.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 is far faster on a busy shared machine)")
    e.add_argument("--json", default=None, help="also write the results to this JSON file")
    e.set_defaults(run=run_eval)


def run_eval_budget(args: argparse.Namespace) -> int:
    from kvserve.bench.common import find_text
    from kvserve.engine.build import resolve_device, resolve_dtype
    from kvserve.eval.budget import BudgetEvalSettings, evaluate, goal_lines, render, speed_lines
    from kvserve.kv.codecs import parse_kv_format
    from kvserve.model.loader import load_model

    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = BudgetEvalSettings(
        contexts=_ints(args.contexts), fractions=_floats(args.fractions),
        policies=tuple(p for p in args.policies.split(",") if p), depths=_floats(args.depths),
        filler=args.filler, answer_tokens=args.answer_tokens, ppl_tokens=args.ppl_tokens, chunk=args.chunk,
        seed=args.workload_seed, kv_format=args.kv_format)
    loaded = load_model(args.model)
    text = find_text(args.text)
    rows = evaluate(loaded, text, settings, args.kv_cache_memory_gb,
                    log=lambda m: print(f"[eval-budget {time.strftime('%H:%M:%S')}] {m}", file=sys.stderr, flush=True))
    device = resolve_device("auto")
    dtype = resolve_dtype("auto", device, loaded.config.torch_dtype)
    mc = loaded.config
    block_nbytes = parse_kv_format(settings.kv_format, mc.num_layers, dtype, head_dim=mc.head_dim).nbytes_per_block(
        16, mc.num_kv_heads, mc.head_dim)
    wall = time.perf_counter() - t_start
    print(f"kvserve eval-budget: {loaded.source}, {device}/{dtype}, prefill chunks of {settings.chunk}; passkey: "
          f"{settings.filler} filler, depths {', '.join(f'{d:g}' for d in settings.depths)}, answer in "
          f"{settings.answer_tokens} greedy tokens; perplexity: {settings.ppl_tokens} tokens after the first "
          f"<context> tokens of the text, fed one per decode step; budgets {', '.join(f'{f:g}' for f in settings.fractions)}"
          f" x context; KV format {settings.kv_format}")
    print(render(rows, block_nbytes, 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim, settings.ppl_tokens))
    for line in goal_lines(rows, settings):
        print(f"goal: {line}")
    for line in speed_lines(rows):
        print(f"speed: {line}")
    print(f"wall time {wall:.0f} s, {args.threads or torch.get_num_threads()} thread(s)")
    return 0


def add_eval_budget_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("eval-budget", help="KV budget policies vs the full cache: passkey, perplexity, memory, speed",
                       description="--kv-format is the format of every row, the full cache's too (under zip: the "
                                   "only policy is saliency-blocks)")
    e.add_argument("--model", default=None)
    e.add_argument("--text", default=None, help="evaluation text (default: the shipped botchan.txt)")
    e.add_argument("--contexts", default="2048,4096", help="context lengths in tokens")
    e.add_argument("--fractions", default="0.125,0.25", help="budgets as fractions of the context")
    e.add_argument("--policies", default="streaming,h2o,snapkv,pyramid,merge,arkvale,arkvale-bound")
    e.add_argument("--depths", default="0.1,0.5,0.9", help="passkey depths")
    e.add_argument("--filler", default="text", choices=["text", "repeat"], help="passkey haystack")
    e.add_argument("--answer-tokens", type=int, default=8)
    e.add_argument("--ppl-tokens", type=int, default=64, help="tokens scored by forced decoding")
    e.add_argument("--chunk", type=int, default=512, help="prefill tokens per step")
    add_engine_args(e, ("kv_format", "kv_cache_memory_gb"), defaults={
        "kv_cache_memory_gb": CommandDefault(
        0.5, "one engine running one request at a time: the full cache of the default --contexts fits")})
    e.add_argument("--seed", type=int, default=0, dest="workload_seed", metavar="SEED")   # the engine's: --engine-seed
    e.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 on a shared machine)")
    e.set_defaults(run=run_eval_budget)


def run_eval_weights(args: argparse.Namespace) -> int:
    from kvserve.bench.common import find_text
    from kvserve.eval import weights

    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = weights.weight_settings(args.ppl_tokens, args.window, ppl_stride(args), args.chunk, args.num_prompts,
                                       args.agree_tokens, args.ppl_layout)
    report, results = weights.run(args.model, find_text(args.text), args.text or "the shipped botchan.txt", settings,
                                  args.format or DEFAULT_WEIGHT_FORMATS, {**engine_options(args), "max_num_seqs": 4})
    wall = time.perf_counter() - t_start
    print(report)
    print(f"wall time {wall:.0f} s ({wall / 60:.1f} min), {torch.get_num_threads()} thread(s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": weights.settings_json(settings), "wall_s": wall,
                                               "results": weights.to_json(results)}, indent=2))
    return 0


def add_eval_weights_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("eval-weights", help="weight format quality vs native weights: perplexity, greedy agreement, "
                                            "resident bytes")
    e.add_argument("--model", default=None)
    add_engine_args(e, ("device", "dtype", "kv_cache_memory_gb"))
    e.add_argument("--format", action="append", default=None,
                   help=f"a weight format to evaluate (repeatable; native always runs, as the reference; default: "
                        f"{' | '.join(DEFAULT_WEIGHT_FORMATS)})")
    add_quality_args(e, "prompt tokens per forward")
    e.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    e.add_argument("--json", default=None, help="also write the results to this JSON file")
    e.set_defaults(run=run_eval_weights)
