"""``kvserve bench spec``: speculative decoding against plain decoding, in the same run.

Two workloads of chat prompts, greedy, ``max_tokens`` each (eos ends an answer early, the
same in both runs since their tokens are the same):

    grounded   answer by editing a given passage (a different one per request):
               the output quotes the input, so prompt lookup drafts well
    open       open-ended requests (a story, an explanation): little to look up

For each workload and batch size, plain and speculative engines (same model, same options)
take turns, the prefix cache reset before each run, median of ``repeats`` after a warm-up;
tok/s = generated tokens / wall time (prefill included). The bench checks that both give
the same token ids for every request, and says so in every row. The limit speculation is
measured against: at most ``mean accepted length`` tokens per step where plain decoding gives
one, reached only if a step of k + 1 tokens per request cost what a step of one does
(``bound`` column: plain tok/s x mean accepted length).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from kvserve.bench.common import find_text, table
from kvserve.llm import LLM
from kvserve.options import CommandDefault, add_engine_args, engine_options
from kvserve.sampling_params import SamplingParams

# edits of a given passage this small model carries out (it declines "repeat word for word")
GROUNDED_ASKS = ['Rewrite this text with every "I" replaced by "we"', "Translate this text into simple English",
                 "Correct any spelling mistakes in this text and return it", "Rewrite this text in the present tense"]
TOPICS = ["a lighthouse keeper", "a lost umbrella", "the first snow", "a chess match", "an old bridge",
          "a quiet library", "a runaway kite", "a night train", "a village baker", "a broken clock",
          "a summer storm", "a market day", "a paper boat", "a mountain road", "a sleepy cat", "a street musician"]


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


def _timed(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, list[list[int]], Any]:
    llm.reset_prefix_cache()
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
    return seconds, [o.token_ids for o in outs], (drafted, accepted, drafts)


def run(plain: LLM, spec: LLM, text: str, batch_sizes: list[int], max_tokens: int,
        repeats: int) -> list[dict[str, Any]]:
    tok = plain.tokenizer
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    rows = []
    for workload, make in (("grounded", lambda n: grounded_prompts(text, n)), ("open", open_prompts)):
        for bs in batch_sizes:
            prompts = [tok.apply_chat_template(m, add_generation_prompt=True) for m in make(bs)]
            _timed(plain, prompts, params)     # warm-up
            _timed(spec, prompts, params)
            t_plain, t_spec, same = [], [], True
            counts = (0, 0, 0)
            for _ in range(repeats):
                s_plain, ids_plain, _ = _timed(plain, prompts, params)
                s_spec, ids_spec, counts = _timed(spec, prompts, params)
                t_plain.append(s_plain)
                t_spec.append(s_spec)
                same = same and ids_plain == ids_spec
            num_tokens = sum(len(t) for t in ids_plain)
            drafted, accepted, drafts = counts
            plain_tps = num_tokens / statistics.median(t_plain)
            spec_tps = num_tokens / statistics.median(t_spec)
            mean_len = 1.0 + accepted / drafts if drafts else 1.0
            rows.append({"workload": workload, "batch": bs, "tokens": num_tokens,
                         "plain_tok_s": plain_tps, "spec_tok_s": spec_tps, "ratio": spec_tps / plain_tps,
                         "spec_tok_s_all": [num_tokens / t for t in t_spec],
                         "plain_tok_s_all": [num_tokens / t for t in t_plain],
                         "acceptance": accepted / drafted if drafted else 0.0, "mean_accepted_length": mean_len,
                         "bound_tok_s": plain_tps * mean_len, "identical": same})
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    return table(["workload", "batch", "plain tok/s", "spec tok/s", "spec / plain", "spread (spec)",
                  "acceptance", "mean accepted", "bound tok/s", "identical"],
                 [[r["workload"], r["batch"], f"{r['plain_tok_s']:.1f}", f"{r['spec_tok_s']:.1f}",
                   f"{r['ratio']:.2f}x", f"{min(r['spec_tok_s_all']):.0f}-{max(r['spec_tok_s_all']):.0f}",
                   f"{r['acceptance']:.0%}", f"{r['mean_accepted_length']:.2f}", f"{r['bound_tok_s']:.0f}",
                   "yes" if r["identical"] else "NO"] for r in rows])


def run_spec(args: argparse.Namespace) -> int:
    from kvserve.bench import plots
    from kvserve.bench.common import write_plot
    from kvserve.model.loader import load_model

    loaded = load_model(args.model)
    options = engine_options(args)
    spec_config = options.pop("speculative_config")       # the speculative engine's alone
    plain = LLM(loaded=loaded, **options)
    spec = LLM(loaded=loaded, speculative_config=spec_config, **options)
    if args.always_draft:
        spec.engine.speculator.always_draft()
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    rows = run(plain, spec, find_text(args.text), sizes, args.max_tokens, args.repeats)
    print(f"speculative decoding {spec_config} vs plain, {loaded.source}, device {plain.engine.device}, "
          f"weights {plain.engine.weight_format}, greedy, max_tokens {args.max_tokens}, median of {args.repeats}"
          f"{', always drafting (cost model off)' if args.always_draft else ''}")
    print(render(rows))
    write_plot(args.plot, lambda path: plots.plot_spec(rows, path))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "spec", "speculative_config": spec_config, "rows": rows}, f, indent=2)
    if not all(r["identical"] for r in rows):
        print("speculative decoding changed greedy output: a bug", flush=True)
        return 1
    return 0


def add_spec_parser(bsub: Any, common: Any) -> None:
    s = bsub.add_parser("spec", parents=[common], help="speculative decoding vs plain decoding (grounded and open)")
    add_engine_args(s, ("speculative_config",), defaults={"speculative_config": CommandDefault(
        '{"method": "ngram", "num_speculative_tokens": 4}', "the speculative engine's; the plain one runs without")})
    s.add_argument("--always-draft", action="store_true",
                   help="draft num_speculative_tokens every step, the cost model off: what the proposer gives "
                        "when it never backs off")
    s.add_argument("--text", default=None, help="passages for the grounded prompts (default: the shipped botchan.txt)")
    s.add_argument("--batch-sizes", default="1,4,16")
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--repeats", type=int, default=3)
    s.set_defaults(run=run_spec)
