"""Shared pieces of the benchmarks: text, tables, the transformers baseline."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from kvserve.model.linear import as_float
from kvserve.model.loader import LoadedModel, load_model

SHIPPED_TEXT = "data/botchan.txt"    # inside the kvserve package: the default evaluation text


def find_text(path: str | None = None) -> str:
    """Evaluation text: the file ``path``, else the botchan.txt shipped in the package."""
    if not path:
        return resources.files("kvserve").joinpath(SHIPPED_TEXT).read_text(encoding="utf-8")
    if not Path(path).is_file():
        raise ValueError(f"no text file {path}; pass --text PATH, or leave it out for the shipped botchan.txt")
    return Path(path).read_text(encoding="utf-8")


def stderr_log(name: str) -> Callable[[str], None]:
    """Progress lines ``[name HH:MM:SS] message`` on stderr, apart from the table on stdout."""
    def log(message: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
    return log


def load_text_model(model: str | None, text: str | None, threads: int | None,
                    bench: str) -> tuple[LoadedModel, list[int]]:
    """For benchmarks whose prompts are slices of a text: torch's threads (when given), the
    model, and the text's token ids; ValueError when the model has no tokenizer."""
    if threads:
        torch.set_num_threads(threads)
    loaded = load_model(model)
    if loaded.tokenizer is None:
        raise ValueError(f"bench {bench} needs a model with a tokenizer (the prompts are text)")
    return loaded, loaded.tokenizer.encode(find_text(text))


def write_plot(path: str | None, draw: Callable[[str], Path]) -> None:
    """``draw(path)`` (a function of kvserve/bench/plots.py) when ``--plot`` named a file."""
    if path:
        print(f"plot written to {draw(path)}")


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table, so the output pastes into the docs as is."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    fmt = lambda r: "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |"
    return "\n".join([fmt(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [fmt(r) for r in cells[1:]])


def median_times(fns: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """Median wall time of each function; one warm-up call each, then the
    functions take turns, so drift in machine load falls on all of them."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [statistics.median(ts) for ts in times]


def hf_model_from(loaded: LoadedModel, dtype: torch.dtype, device: torch.device):
    """transformers' LlamaForCausalLM holding exactly our weights (the baseline)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    c = loaded.config
    cfg_cls: Any
    model_cls: Any
    cfg_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if c.attention_bias else (LlamaConfig, LlamaForCausalLM)
    hcfg = cfg_cls(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                   num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                   num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
                   rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
                   tie_word_embeddings=c.tie_word_embeddings)
    model = model_cls(hcfg)
    model.load_state_dict({name: as_float(w) for name, w in loaded.weights.items()}, strict=False)
    return model.to(device=device, dtype=dtype).eval()
