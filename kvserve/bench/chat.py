"""Multi-turn chat: time to first token per turn with the prefix cache on and off.

One conversation whose history grows past ``target_tokens``: each user turn asks
about a passage of the evaluation text; the assistant answers greedily. The run
with the cache on records the conversation; the run with it off replays exactly
the same messages, so both prefill the same prompts turn by turn.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

from kvserve.bench.common import table
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams

SYSTEM = "You are a careful reader. Answer questions about the passages the user shares, briefly."


def passages(text: str, words: int) -> list[str]:
    tokens = re.sub(r"\s+", " ", text).split(" ")
    return [" ".join(tokens[i:i + words]) for i in range(0, len(tokens) - words, words)]


def user_turns(text: str, count: int, words: int) -> list[str]:
    return [f"Here is passage {i + 1}:\n{p}\nWho is speaking in this passage, and what happens?"
            for i, p in enumerate(passages(text, words)[:count])]


@dataclass(frozen=True)
class Turn:
    prompt_tokens: int
    cached_tokens: int
    ttft: float
    reply: str


def converse(llm: LLM, turns: list[str], max_tokens: int, replies: list[str] | None = None,
             stop_at_tokens: int | None = None) -> list[Turn]:
    """Play the conversation turn by turn; with ``replies`` given, the history holds
    them instead of the model's answers. Stops after the first turn whose prompt
    reaches ``stop_at_tokens``."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    history = [{"role": "system", "content": SYSTEM}]
    log: list[Turn] = []
    for i, turn in enumerate(turns):
        history.append({"role": "user", "content": turn})
        out = llm.chat(history, params)[0]
        reply = replies[i] if replies is not None else out.text
        history.append({"role": "assistant", "content": reply})
        log.append(Turn(out.num_prompt_tokens, out.num_cached_tokens, out.ttft or 0.0, reply))
        if stop_at_tokens is not None and out.num_prompt_tokens >= stop_at_tokens:
            break
    return log


def run(on: LLM, off: LLM, text: str, target_tokens: int, words_per_turn: int,
        max_tokens: int, repeats: int = 1) -> tuple[list[dict], str]:
    """Each turn's TTFT is the median over ``repeats`` plays of the whole
    conversation (the prefix cache is emptied before each play)."""
    turns = user_turns(text, 200, words_per_turn)
    with_cache = converse(on, turns, max_tokens, stop_at_tokens=target_tokens)
    replies = [t.reply for t in with_cache]
    used = turns[:len(with_cache)]
    plays_on = [with_cache]
    plays_off = []
    for r in range(repeats):
        if r > 0:
            on.reset_prefix_cache()
            plays_on.append(converse(on, used, max_tokens, replies=replies))
        plays_off.append(converse(off, used, max_tokens, replies=replies))
    rows = []
    results = []
    for i, a in enumerate(with_cache):
        if any(p[i].prompt_tokens != a.prompt_tokens for p in plays_on + plays_off):
            raise RuntimeError(f"turn {i + 1}: the runs prefilled different prompts")
        ttft_on = statistics.median(p[i].ttft for p in plays_on)
        ttft_off = statistics.median(p[i].ttft for p in plays_off)
        speedup = ttft_off / ttft_on
        results.append({"turn": i + 1, "prompt_tokens": a.prompt_tokens, "cached_tokens": a.cached_tokens,
                        "ttft_on_s": ttft_on, "ttft_off_s": ttft_off, "speedup": speedup})
        rows.append([i + 1, a.prompt_tokens, a.cached_tokens, f"{ttft_on * 1000:.0f}",
                     f"{ttft_off * 1000:.0f}", f"{speedup:.1f}x"])
    text_table = table(["turn", "prompt tokens", "from cache", "TTFT cache on (ms)", "TTFT cache off (ms)",
                        "speedup"], rows)
    return results, text_table
