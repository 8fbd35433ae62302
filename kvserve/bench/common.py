"""Shared pieces of the benchmarks: text, tables, the transformers baseline."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path

import torch

from kvserve.model.families import family_of
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
    """transformers' model of the loaded model's family holding exactly our weights (the baseline)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = family_of(loaded.config).hf_config_dict(loaded.config)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf))
    missing, unexpected = model.load_state_dict({name: as_float(w) for name, w in loaded.weights.items()},
                                                strict=False)
    if unexpected or any("lm_head" not in m and "rotary" not in m for m in missing):
        raise ValueError(f"transformers' {type(model).__name__} does not hold these weights: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return model.to(device=device, dtype=dtype).eval()
