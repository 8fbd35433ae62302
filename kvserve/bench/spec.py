"""``kvserve bench spec``: speculative decoding against plain decoding, in the same run.

Workloads of chat prompts, greedy, ``max_tokens`` each (eos ends an answer early, the same in
both runs since their tokens are the same):

    grounded   answer by editing a given passage (a different one per request):
               the output quotes the input, so prompt lookup drafts well
    open       open-ended requests (a story, an explanation): little to look up
    code-edit  rename a class (or another one per request) in a given 122-line Python file
               and return the whole file: the output copies the input but for the new name

For each workload and batch size, the plain engine and each speculative one (same model, same
options; ``--speculative-config`` and every ``--compare-config``) take turns, the prefix cache
reset and what proposers learnt from finished requests dropped before each run (``--keep-history``
keeps it: a request then may meet its own earlier answer), median of ``repeats`` after a
warm-up; tok/s = generated tokens / wall time (prefill included), decode tok/s = tokens after
each request's first / the time after the last first token. The bench checks that all give the
same token ids for every request, and says so in every row. The limit speculation is measured
against: at most ``mean accepted length`` tokens per step where plain decoding gives one,
reached only if a step of k + 1 tokens per request cost what a step of one does (``bound``
column: plain tok/s x mean accepted length).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from importlib import resources
from typing import Any, NamedTuple

from kvserve.bench.common import find_text, table
from kvserve.config import SpeculativeConfig
from kvserve.llm import LLM
from kvserve.options import CommandDefault, add_engine_args, engine_options
from kvserve.sampling_params import SamplingParams

WORKLOADS = ("grounded", "open", "code-edit")
# edits of a given passage this small model carries out (it declines "repeat word for word")
GROUNDED_ASKS = ['Rewrite this text with every "I" replaced by "we"', "Translate this text into simple English",
                 "Correct any spelling mistakes in this text and return it", "Rewrite this text in the present tense"]
TOPICS = ["a lighthouse keeper", "a lost umbrella", "the first snow", "a chess match", "an old bridge",
          "a quiet library", "a runaway kite", "a night train", "a village baker", "a broken clock",
          "a summer storm", "a market day", "a paper boat", "a mountain road", "a sleepy cat", "a street musician"]
CODE_FILE = "data/ledger.py.txt"      # inside the kvserve package: the file code-edit asks to change
RENAMES = [("InventoryLedger", "StockBook"), ("StockItem", "Product"), ("Movement", "StockMove"),
           ("InventoryLedger", "Depot")]


def grounded_prompts(text: str, n: int) -> list[list[dict[str, str]]]:
    words = text.split()
    out = []
    for i in range(n):
        passage = " ".join(words[3000 + 150 * i:3000 + 150 * i + 110])
        ask = GROUNDED_ASKS[i % len(GROUNDED_ASKS)]
        out.append([{"role": "user", "content": f"{ask}:\n\n{passage}"}])
    return out


def open_prompts(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]}."}] for i in range(n)]


def code_edit_prompts(n: int) -> list[list[dict[str, str]]]:
    code = resources.files("kvserve").joinpath(CODE_FILE).read_text(encoding="utf-8")
    out = []
    for i in range(n):
        old, new = RENAMES[i % len(RENAMES)]
        ask = f"Rename the class {old} to {new} everywhere in this file. Reply with the whole updated file only."
        out.append([{"role": "user", "content": f"{ask}\n\n```python\n{code}```"}])
    return out


class Timed(NamedTuple):
    seconds: float
    decode_seconds: float            # after the last request's first token
    token_ids: list[list[int]]
    drafted: int                     # speculative counters over the run
    accepted: int
    drafts: int


def _timed(llm: LLM, prompts: list[str], params: SamplingParams, keep_history: bool) -> Timed:
    llm.reset_prefix_cache()
    if not keep_history:
        llm.engine.speculator.clear_history()
    before = llm.engine.stats().spec
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    after = llm.engine.stats().spec
    drafted = accepted = drafts = 0
    if before is not None and after is not None:
        drafted = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        drafts = after.num_drafts - before.num_drafts
    first = max(o.ttft or 0.0 for o in outs)
    return Timed(seconds, seconds - first, [o.token_ids for o in outs], drafted, accepted, drafts)


def run(plain: LLM, specs: list[tuple[str, LLM]], text: str, batch_sizes: list[int], max_tokens: int,
        repeats: int, workloads: tuple[str, ...] = ("grounded", "open"),
        keep_history: bool = False) -> list[dict[str, Any]]:
    """A row per workload, batch size and speculative engine (``(name, llm)``), against the
    same plain runs."""
    tok = plain.tokenizer
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    makers: dict[str, Callable[[int], list[list[dict[str, str]]]]] = {
        "grounded": lambda n: grounded_prompts(text, n), "open": open_prompts, "code-edit": code_edit_prompts}
    rows: list[dict[str, Any]] = []
    for workload in workloads:
        for bs in batch_sizes:
            prompts = [tok.apply_chat_template(m, add_generation_prompt=True) for m in makers[workload](bs)]
            for llm in (plain, *(s for _, s in specs)):       # warm-up
                _timed(llm, prompts, params, keep_history)
            plain_runs: list[Timed] = []
            spec_runs: list[list[Timed]] = [[] for _ in specs]
            for _ in range(repeats):
                plain_runs.append(_timed(plain, prompts, params, keep_history))
                for runs, (_, llm) in zip(spec_runs, specs):
                    runs.append(_timed(llm, prompts, params, keep_history))
            rows.extend(_row(workload, bs, name, plain_runs, runs) for (name, _), runs in zip(specs, spec_runs))
    return rows


def _row(workload: str, batch: int, name: str, plain: list[Timed], spec: list[Timed]) -> dict[str, Any]:
    ids = plain[-1].token_ids
    num_tokens = sum(len(t) for t in ids)
    num_decoded = sum(max(0, len(t) - 1) for t in ids)
    last = spec[-1]
    plain_tps = num_tokens / statistics.median(r.seconds for r in plain)
    spec_tps = num_tokens / statistics.median(r.seconds for r in spec)
    plain_decode = num_decoded / statistics.median(r.decode_seconds for r in plain)
    spec_decode = num_decoded / statistics.median(r.decode_seconds for r in spec)
    mean_len = 1.0 + last.accepted / last.drafts if last.drafts else 1.0
    return {"workload": workload, "batch": batch, "method": name, "tokens": num_tokens,
            "plain_tok_s": plain_tps, "spec_tok_s": spec_tps, "ratio": spec_tps / plain_tps,
            "spec_tok_s_all": [num_tokens / r.seconds for r in spec],
            "plain_tok_s_all": [num_tokens / r.seconds for r in plain],
            "plain_decode_tok_s": plain_decode, "spec_decode_tok_s": spec_decode,
            "decode_ratio": spec_decode / plain_decode,
            "spec_decode_tok_s_all": [num_decoded / r.decode_seconds for r in spec],
            "plain_decode_tok_s_all": [num_decoded / r.decode_seconds for r in plain],
            "acceptance": last.accepted / last.drafted if last.drafted else 0.0, "mean_accepted_length": mean_len,
            "bound_tok_s": plain_tps * mean_len,
            "identical": all(r.token_ids == ids for r in plain + spec)}


def render(rows: list[dict[str, Any]]) -> str:
    return table(["workload", "batch", "method", "plain tok/s", "spread (plain)", "spec tok/s", "spread (spec)",
                  "spec / plain", "decode spec / plain", "acceptance", "mean accepted", "bound tok/s", "identical"],
                 [[r["workload"], r["batch"], r["method"], f"{r['plain_tok_s']:.1f}",
                   f"{min(r['plain_tok_s_all']):.1f}-{max(r['plain_tok_s_all']):.1f}", f"{r['spec_tok_s']:.1f}",
                   f"{min(r['spec_tok_s_all']):.1f}-{max(r['spec_tok_s_all']):.1f}", f"{r['ratio']:.2f}x",
                   f"{r['decode_ratio']:.2f}x", f"{r['acceptance']:.0%}", f"{r['mean_accepted_length']:.2f}",
                   f"{r['bound_tok_s']:.0f}", "yes" if r["identical"] else "NO"] for r in rows])


def config_name(text: str) -> str:
    """A speculative config as a row names it: its method and k, and any other key it sets."""
    config = SpeculativeConfig.from_json(text)
    rest = {k: v for k, v in json.loads(text).items() if k not in ("method", "num_speculative_tokens")}
    extra = "".join(f" {k}={v}" for k, v in rest.items())
    return f"{config.method} k={config.num_speculative_tokens}{extra}"


def run_spec(args: argparse.Namespace) -> int:
    from kvserve.bench import plots
    from kvserve.bench.common import write_plot
    from kvserve.model.loader import load_model

    loaded = load_model(args.model)
    options = engine_options(args)
    configs = [options.pop("speculative_config"), *args.compare_config]     # the speculative engines' alone
    workloads = tuple(w for w in args.workloads.split(",") if w)
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown or not workloads:
        raise ValueError(f"--workloads: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(WORKLOADS)}")
    plain = LLM(loaded=loaded, **options)
    specs = [(config_name(c), LLM(loaded=loaded, speculative_config=c, **options)) for c in configs]
    if args.always_draft:
        for _, spec in specs:
            spec.engine.speculator.always_draft()
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    rows = run(plain, specs, find_text(args.text), sizes, args.max_tokens, args.repeats, workloads,
               args.keep_history)
    print(f"speculative decoding {', '.join(configs)} vs plain, {loaded.source}, device {plain.engine.device}, "
          f"weights {plain.engine.weight_format}, greedy, max_tokens {args.max_tokens}, median of {args.repeats}"
          f"{', always drafting (cost model off)' if args.always_draft else ''}"
          f"{', history kept across runs' if args.keep_history else ''}")
    print(render(rows))
    write_plot(args.plot, lambda path: plots.plot_spec(rows, path))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "spec", "speculative_configs": configs, "rows": rows}, f, indent=2)
    if not all(r["identical"] for r in rows):
        print("speculative decoding changed greedy output: a bug", flush=True)
        return 1
    return 0


def add_spec_parser(bsub: Any, common: Any) -> None:
    s = bsub.add_parser("spec", parents=[common], help="speculative decoding vs plain decoding (grounded and open)")
    add_engine_args(s, ("speculative_config",), defaults={"speculative_config": CommandDefault(
        '{"method": "ngram", "num_speculative_tokens": 4}', "the speculative engine's; the plain one runs without")})
    s.add_argument("--compare-config", action="append", default=[], metavar="JSON",
                   help="another speculative config measured in the same run against the same plain runs "
                        "(repeatable)")
    s.add_argument("--workloads", default="grounded,open", help=f"comma-separated, of {', '.join(WORKLOADS)}")
    s.add_argument("--keep-history", action="store_true",
                   help="keep what proposers learnt from finished requests across runs (suffix decoding's "
                        "outputs index): a repeated request then meets its own earlier answer")
    s.add_argument("--always-draft", action="store_true",
                   help="draft num_speculative_tokens every step, the cost model off: what the proposer gives "
                        "when it never backs off")
    s.add_argument("--text", default=None, help="passages for the grounded prompts (default: the shipped botchan.txt)")
    s.add_argument("--batch-sizes", default="1,4,16")
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--repeats", type=int, default=3)
    s.set_defaults(run=run_spec)
