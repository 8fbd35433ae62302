"""PNG plots of the benchmarks' results (``kvserve bench ... --plot FILE``).

Each function takes the results a benchmark already returns (the rows of its table) and
writes one PNG; ``PLOTS`` says which one each ``kvserve bench`` command draws. Figures are drawn with matplotlib's object API on an Agg canvas: no pyplot,
no global backend switch, no display needed.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

DPI = 120


def _figure(ncols: int, title: str) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(6.0 * ncols, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(1, ncols, squeeze=False)[0])
    fig.suptitle(title)
    return fig, axes


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    fig.savefig(path, dpi=DPI, format="png")
    return path


def _bars(ax: Axes, labels: Sequence[str], series: Mapping[str, Sequence[float]], ylabel: str) -> None:
    """Grouped bars: one group per label, one bar per series, each bar marked with its value."""
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.2)                  # room above the bars for their values and the legend
    if len(series) > 1:
        ax.legend(loc="upper left")


def plot_chat(results: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """``bench chat``: time to first token per turn with the prefix cache on and off."""
    fig, (ttft, speedup) = _figure(2, "Multi-turn chat: time to first token, prefix cache on vs off")
    tokens = [r["prompt_tokens"] for r in results]
    ttft.plot(tokens, [r["ttft_off_s"] * 1e3 for r in results], "o-", label="cache off (recompute)")
    ttft.plot(tokens, [r["ttft_on_s"] * 1e3 for r in results], "o-", label="cache on")
    ttft.set_xlabel("prompt tokens (history)")
    ttft.set_ylabel("TTFT (ms)")
    ttft.grid(alpha=0.3)
    ttft.legend()
    _bars(speedup, [str(r["turn"]) for r in results], {"speedup": [r["speedup"] for r in results]},
          "TTFT off / on (x)")
    speedup.set_xlabel("turn")
    return _save(fig, path)


def plot_tiers(results: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """``bench tiers``: TTFT per turn (mean over the conversations) for each configuration."""
    fig, (per_turn, mean) = _figure(2, "Conversations beyond the device pool: offload tiers vs recompute")
    for r in results:
        by_turn: dict[int, list[float]] = {}
        for t in r["turns"]:
            by_turn.setdefault(t["turn"], []).append(t["ttft_s"] * 1e3)
        turns = sorted(by_turn)
        per_turn.plot([t + 1 for t in turns], [statistics.fmean(by_turn[t]) for t in turns], "o-", label=r["config"])
    per_turn.xaxis.set_major_locator(MaxNLocator(integer=True))
    per_turn.set_xlabel("turn")
    per_turn.set_ylabel("TTFT, mean over conversations (ms)")
    per_turn.grid(alpha=0.3)
    per_turn.legend()
    _bars(mean, [r["config"] for r in results], {"mean TTFT": [r["ttft_mean_s"] * 1e3 for r in results]},
          "mean TTFT (ms)")
    return _save(fig, path)


def plot_capacity(results: Iterable[Any], path: str | Path) -> Path:
    """``bench capacity``: requests held at once and decode throughput per KV format
    (``CapacityResult``s)."""
    rows = list(results)
    fig, (held, speed) = _figure(2, "KV capacity per format (same pool in bytes)")
    labels = [f"{r.kv_format}{'' if r.layout == 'window' else ' (whole)'}\n{r.held_bytes_per_token or r.bytes_per_token:,.0f} "
              "B/token" for r in rows]
    _bars(held, labels, {"fit (by blocks)": [r.fit for r in rows],
                         "peak concurrent": [r.peak_concurrent for r in rows]}, "requests at once")
    _bars(speed, labels, {"decode tok/s": [r.decode_tok_s for r in rows]}, "decode tokens / s at the peak batch")
    return _save(fig, path)


def plot_decode(rows: Sequence[Mapping[str, float]], path: str | Path) -> Path:
    """``bench decode``: tokens / s per batch size, kvserve vs transformers ``generate``."""
    fig, (ax,) = _figure(1, "Decode throughput vs transformers generate")
    _bars(ax, [str(int(r["batch"])) for r in rows],
          {"kvserve": [r["kvserve_tok_s"] for r in rows], "transformers": [r["transformers_tok_s"] for r in rows]},
          "tokens / s")
    ax.set_xlabel("batch size")
    return _save(fig, path)


def plot_step_parts(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """``bench kv-decode``: tokens / s per KV format and backend, and each decode step taken
    apart (stacked: products, attention, the rest)."""
    fig, (speed, parts) = _figure(2, "Decode per KV format")
    labels = [f"{r['kv_format']}\n{r['backend']}{' graphs' if r.get('graphs') else ''}" for r in rows]
    _bars(speed, labels, {"tok/s": [statistics.median(r["tok_s"]) for r in rows]}, "decode tokens / s (median)")
    bottom = [0.0] * len(rows)
    for key, name in (("products_ms", "products"), ("attention_ms", "attention"), ("rest_ms", "rest")):
        values = [r[key] or 0.0 for r in rows]
        parts.bar(range(len(rows)), values, 0.6, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    parts.set_xticks(range(len(rows)), labels)
    parts.set_ylabel("ms per decode step (median)")
    parts.grid(axis="y", alpha=0.3)
    parts.legend(loc="upper right")
    return _save(fig, path)


def plot_serve(ttft_s: Sequence[float], e2e_s: Sequence[float], path: str | Path, title: str = "") -> Path:
    """``bench serve``: the distribution (CDF) of time to first token and end-to-end latency."""
    fig, (ax,) = _figure(1, title or "HTTP server under load: latency distribution")
    for name, values in (("time to first token", ttft_s), ("end to end", e2e_s)):
        ordered = sorted(values)
        if ordered:
            ax.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post", label=name)
    ax.set_xlabel("seconds")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_structured(rows: Sequence[Mapping[str, float]], path: str | Path) -> Path:
    """``bench structured``: sampling ms per generated token, unconstrained vs JSON-schema
    constrained, per batch size (the part of a step the constraint changes)."""
    fig, (ax,) = _figure(1, "JSON-schema constraint: sampling cost per generated token")
    _bars(ax, [f"batch {int(r['batch'])}" for r in rows],
          {"unconstrained": [r["baseline_sampling_ms"] for r in rows],
           "JSON schema": [r["constrained_sampling_ms"] for r in rows]},
          "ms per generated token")
    return _save(fig, path)


def plot_rag(results: Iterable[Any], path: str | Path) -> Path:
    """``bench rag``: median time to first token (bar: p10–p90 over queries) against the share of
    answers correct, one point per method (``RagResult``s)."""
    rows = list(results)
    fig, (ax,) = _figure(1, "Answers from k documents: time to first token vs accuracy")
    for r in rows:
        median = r.median_ttft_s * 1e3
        lo, hi = (t * 1e3 for t in r.ttft_p10_p90_s)
        accuracy = 100 * r.num_correct / r.num_answers
        ax.errorbar([median], [accuracy], xerr=[[median - lo], [hi - median]], fmt="o", capsize=4, label=r.method)
    ax.set_xlim(left=0)
    ax.set_xlabel("time to first token, median (ms; bar: p10–p90)")
    ax.set_ylabel("answers correct (%)")
    ax.set_ylim(-2, 105)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return _save(fig, path)


def plot_peer(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """``bench peer``: tokens / s per row for kvserve and llama.cpp (log scale; the rows differ by
    orders of magnitude), and kvserve / llama.cpp per row where llama.cpp ran."""
    compared = [r for r in rows if r["llama_tok_s"] is not None]
    fig, axes = _figure(2 if compared else 1, "kvserve vs llama.cpp, same GGUF and threads")
    series = {"kvserve": [r["kvserve_tok_s"] for r in rows]}
    if compared:
        series["llama.cpp"] = [r["llama_tok_s"] or 0.0 for r in rows]
    _bars(axes[0], [r["label"].replace(", ", "\n") for r in rows], series, "tokens / s")
    axes[0].set_yscale("log")
    axes[0].tick_params(axis="x", labelsize=7)
    if compared:
        _bars(axes[1], [r["label"].replace(", ", "\n") for r in compared],
              {"kvserve / llama.cpp": [r["ratio"] for r in compared]}, "kvserve / llama.cpp (x)")
        axes[1].axhline(1.0, color="grey", linewidth=0.8)
        axes[1].tick_params(axis="x", labelsize=7)
    return _save(fig, path)


def plot_spec(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """``bench spec``: tokens / s of plain and speculative decoding per workload and batch, with
    the bound (plain x mean accepted length); and the acceptance rate."""
    fig, (speed, acceptance) = _figure(2, "Speculative decoding vs plain decoding (greedy, same tokens)")
    labels = [f"{r['workload']}\nbatch {r['batch']}\n{r.get('method', '')}" for r in rows]
    _bars(speed, labels, {"plain": [r["plain_tok_s"] for r in rows], "speculative": [r["spec_tok_s"] for r in rows],
                          "bound": [r["bound_tok_s"] for r in rows]}, "tokens / s")
    _bars(acceptance, labels, {"acceptance (%)": [100 * r["acceptance"] for r in rows]}, "drafted tokens accepted (%)")
    return _save(fig, path)


def plot_cluster(runs: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """``bench cluster``: time to first token (mean, p50, p95) and the share of prompt tokens
    served from a cache, per configuration (``Run.summary()``s); a label says the share of
    requests routed to the replica holding their prefix, where the router reports it."""
    fig, (ttft, hits) = _figure(2, "Engine replicas: KV-aware vs default routing, write-through")
    labels = [r["name"] if r["routed_to_holder"] is None or "pow2" in r["name"]
              else f"{r['name']}\n{r['routed_to_holder']:.0%} to holder" for r in runs]
    _bars(ttft, labels, {q: [r[f"ttft_{q}_s"] * 1e3 for r in runs] for q in ("mean", "p50", "p95")}, "TTFT (ms)")
    _bars(hits, labels, {"prefix hits": [100 * r["hit_rate"] for r in runs]}, "prompt tokens from a cache (%)")
    hits.set_ylim(0, 105)
    return _save(fig, path)


def plot_cluster_rag(runs: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """``bench cluster-rag``: time to first token (mean, p50, p95) and the segment tokens the
    replicas computed and stored (a document missing where a query landed), per configuration
    (``RagRun.summary()``s)."""
    fig, (ttft, computed) = _figure(2, "RAG on engine replicas: routing by stored segments")
    labels = [r["name"] for r in runs]
    _bars(ttft, labels, {q: [r[f"ttft_{q}_s"] * 1e3 for r in runs] for q in ("mean", "p50", "p95")}, "TTFT (ms)")
    _bars(computed, labels, {"computed": [r["stored_tokens"] for r in runs],
                             "reused": [r["reused_tokens"] for r in runs]}, "segment tokens")
    return _save(fig, path)


# What ``kvserve bench <name> --plot FILE`` draws: a bench offers --plot only with an entry
# here (tests/bench/test_plots.py walks the parser, and draws each from made-up results).
PLOTS: dict[str, Callable[..., Path]] = {
    "chat": plot_chat,
    "decode": plot_decode,
    "serve": plot_serve,
    "capacity": plot_capacity,
    "tiers": plot_tiers,
    "kv-decode": plot_step_parts,
    "cluster": plot_cluster,
    "cluster-rag": plot_cluster_rag,
    "structured": plot_structured,
    "rag": plot_rag,
    "peer": plot_peer,
    "spec": plot_spec,
}
