"""Plans as text tables and as JSON. Sizes are printed exactly in bytes and in binary units."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserve.plan.formats import BLOCK_SIZE, FORMATS, GROUP_SIZE
from kvserve.plan.models import BUILTIN_MODELS
from kvserve.plan.planner import TIER_BLOCK_HEADER_NBYTES, Capacity, KVLayout, Plan, Sharing
from kvserve.plan.weights import WeightCount

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def _trim(x: float) -> str:
    return f"{x:,.2f}".rstrip("0").rstrip(".")


def binary_size(nbytes: float) -> str:
    """``67108864000`` -> ``62.5 GiB`` (largest binary unit, at most two decimals)."""
    if nbytes < 1024:
        return f"{_trim(nbytes)} B"
    value, unit = float(nbytes), "B"
    for unit in _UNITS:
        value /= 1024
        if value < 1024:
            break
    return f"{_trim(value)} {unit}"


def fmt_bytes(nbytes: float) -> str:
    """``67,108,864,000 B (62.5 GiB)``: exact, then in binary units."""
    exact = f"{int(nbytes):,} B" if float(nbytes).is_integer() else f"{nbytes:,.2f} B"
    return exact if nbytes < 1024 else f"{exact} ({binary_size(nbytes)})"


def _rows(rows: list[tuple[str, str]], indent: str = "  ") -> list[str]:
    width = max(len(label) for label, _ in rows)
    return [f"{indent}{label:<{width}}  {value}" for label, value in rows]


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]], indent: str = "  ",
           left: tuple[int, ...] = (0,)) -> list[str]:
    """Columns right-aligned except those in ``left``."""
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    line = "  ".join(f"{{:{'<' if i in left else '>'}{w}}}" for i, w in enumerate(widths))
    return [indent + line.format(*r).rstrip() for r in (header, *rows)]


def _seqs(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _ratios(fp16: float, fp32: float) -> str:
    return f"{_trim(fp16)}x vs fp16, {_trim(fp32)}x vs fp32"


def _summary(plan: Plan) -> list[str]:
    layout, req, m = plan.layout, plan.request, plan.layout.model
    ctx, b = req.context_tokens, layout.block_size
    head = (f"KV memory plan: {m.name}: {m.num_layers} layers x {m.num_kv_heads} KV heads x head dim "
            f"{m.head_dim} ({m.num_heads} query heads, {m.attention})")
    rows = [("per token (all layers, K+V)", fmt_bytes(layout.bytes_per_token)),
            ("per block", fmt_bytes(layout.block_nbytes))]
    if layout.model.sliding_layers:
        kinds = layout.bytes_per_token_by_kind()
        num_sliding = len(layout.model.sliding_layers)
        rows += [(f"per token, full-attention layers ({layout.model.num_layers - num_sliding})",
                  fmt_bytes(kinds["full"])),
                 (f"per token, sliding-window layers ({num_sliding}: their window's blocks only)",
                  fmt_bytes(kinds["sliding"]))]
    if layout.residual_nbytes:
        rows.append((f"residual per sequence ({b} tokens, {layout.compute_format})", fmt_bytes(layout.residual_nbytes)))
    blocks = f"{ctx // b:,} full blocks + residual" if layout.residual_nbytes else f"{layout.num_blocks(ctx):,} blocks"
    if m.sliding_layers:
        whole = layout.num_blocks(ctx) * layout.block_nbytes
        blocks += f"; {plan.sequence_nbytes / whole:.2f}x of every layer whole"
    rows += [(f"per sequence of {ctx:,} tokens ({blocks})", fmt_bytes(plan.sequence_nbytes)),
             (f"batch of {req.batch_size:,} x {ctx:,} tokens", fmt_bytes(plan.batch_nbytes)),
             ("compression per token", _ratios(plan.compression(plan.fp16), plan.compression(plan.fp32)))]
    if layout.residual_nbytes:
        rows.append(("compression per sequence",
                     _ratios(plan.sequence_compression(plan.fp16), plan.sequence_compression(plan.fp32))))
    return [head, f"format {layout.format_name}, blocks of {b} tokens, GiB = 2^30 bytes", "",
            *_rows(rows, indent="")]


def _weights(plan: Plan, w: WeightCount) -> list[str]:
    header = ("tensor", "shape", "count", "format", "parameters", "bytes")
    rows = [(r.name, " x ".join(f"{n:,}" for n in r.shape) or "-", f"{r.num_tensors:,}", r.format, f"{r.num_params:,}",
             f"{r.nbytes:,}") for r in w.rows]
    out = ["", f"weights: {w.model_name} in {w.weight_format}", *_table(header, rows, left=(0, 3)),
           *_rows([("parameters", f"{w.num_params:,}"), ("bytes", fmt_bytes(w.nbytes)),
                   ("bits per parameter", _trim(w.bits_per_param))])]
    device = plan.request.device_bytes
    if device is not None and plan.kv_budget_nbytes is not None:
        out.append(f"device {fmt_bytes(device)} = weights {binary_size(w.nbytes)} + KV budget "
                   f"{binary_size(plan.kv_budget_nbytes)}")
    return out + [f"note: {note}" for note in w.notes]


def _device(plan: Plan, dev: Capacity) -> list[str]:
    req = plan.request
    fits = "fits" if plan.batch_fits else "does NOT fit"
    return ["", f"KV budget {fmt_bytes(dev.nbytes)}", *_rows([
        ("holds", f"{dev.num_blocks:,} blocks = {dev.num_tokens:,} tokens"),
        (f"sequences of {req.context_tokens:,} tokens", _seqs(dev.num_sequences)),
        (f"the batch of {req.batch_size:,}", f"{fits} ({plan.batch_nbytes / dev.nbytes:.1%} of the budget)")])]


def _sharing(s: Sharing) -> list[str]:
    head = (f"prefix sharing: {s.num_users:,} users x {s.context_tokens:,} tokens, the first {s.prefix_tokens:,} "
            f"shared ({s.shared_blocks:,} full blocks = {s.shared_tokens:,} tokens stored once; "
            "the partial block is per user)")
    saved = (f"{fmt_bytes(s.saved_nbytes)}, {s.saved_nbytes / s.without_sharing_nbytes:.1%} "
             f"= {s.num_users - 1:,} x {s.shared_tokens:,} tokens")
    return ["", head, *_rows([("without sharing", fmt_bytes(s.without_sharing_nbytes)),
                              ("with sharing", fmt_bytes(s.with_sharing_nbytes)), ("saved", saved)])]


def _tiers(plan: Plan) -> list[str]:
    header = ("tier", "capacity", "blocks", "tokens", f"sequences of {plan.request.context_tokens:,}")
    rows = [(name, binary_size(c.nbytes), f"{c.num_blocks:,}", f"{c.num_tokens:,}", _seqs(c.num_sequences))
            for name, c in plan.tiers]
    return ["", f"offload tiers (full blocks only, {TIER_BLOCK_HEADER_NBYTES}-byte header per block)",
            *_table(header, rows)]


def render_plan(plan: Plan) -> str:
    out = _summary(plan)
    if plan.weights is not None:
        out += _weights(plan, plan.weights)
    if plan.device is not None:
        out += _device(plan, plan.device)
    if plan.sharing is not None:
        out += _sharing(plan.sharing)
    if plan.tiers:
        out += _tiers(plan)
    if plan.layout.model.note:
        out.append(f"note: {plan.layout.model.note}")
    return "\n".join(out) + "\n"


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else round(x, 4)


def _capacity(c: Capacity) -> dict[str, Any]:
    return {"nbytes": c.nbytes, "gib": c.nbytes / (1 << 30), "num_blocks": c.num_blocks,
            "num_tokens": c.num_tokens, "num_sequences": c.num_sequences}


def _weights_dict(w: WeightCount) -> dict[str, Any]:
    return {"format": w.weight_format, "compute_dtype": w.compute_format, "num_params": w.num_params,
            "nbytes": w.nbytes, "gib": w.nbytes / (1 << 30), "bits_per_param": _number(w.bits_per_param),
            "tensors": [{**r._asdict(), "shape": list(r.shape)} for r in w.rows], "notes": list(w.notes)}


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The plan as JSON; ``weights`` and ``device_memory`` only when weights are counted and a
    device's memory is given."""
    layout, req, m = plan.layout, plan.request, plan.layout.model
    sharing = None
    if plan.sharing is not None:
        s = plan.sharing
        sharing = {**s._asdict(), "saved_nbytes": s.saved_nbytes, "saved_gib": s.saved_nbytes / (1 << 30)}
    out = {
        "model": {"name": m.name, "num_layers": m.num_layers, "num_heads": m.num_heads,
                  "num_kv_heads": m.num_kv_heads, "head_dim": m.head_dim, "hidden_size": m.hidden_size,
                  "max_context": m.max_context, "attention": m.attention},
        "kv_format": layout.format_name,
        "layer_formats": [[layer.key.name, layer.value.name] for layer in layout.kv_format.layers],
        "block_size": layout.block_size, "group_size": GROUP_SIZE, "compute_dtype": layout.compute_format,
        "bytes_per_token": _number(layout.bytes_per_token), "block_nbytes": layout.block_nbytes,
        "residual_nbytes_per_sequence": layout.residual_nbytes,
        "context_tokens": req.context_tokens, "blocks_per_sequence": layout.num_blocks(req.context_tokens),
        "sequence_nbytes": plan.sequence_nbytes,
        "batch_size": req.batch_size, "batch_nbytes": plan.batch_nbytes, "batch_gib": plan.batch_nbytes / (1 << 30),
        "compression": {"vs_fp16": _number(plan.compression(plan.fp16)),
                        "vs_fp32": _number(plan.compression(plan.fp32)),
                        "vs_fp16_per_sequence": _number(plan.sequence_compression(plan.fp16)),
                        "vs_fp32_per_sequence": _number(plan.sequence_compression(plan.fp32))},
        "device": None if plan.device is None else {**_capacity(plan.device), "batch_fits": plan.batch_fits},
        "prefix_sharing": sharing,
        "tier_block_header_nbytes": TIER_BLOCK_HEADER_NBYTES,
        "tiers": [{"name": name, **_capacity(c)} for name, c in plan.tiers],
    }
    if plan.weights is not None:
        out["weights"] = _weights_dict(plan.weights)
    if req.device_bytes is not None and plan.weights is not None and plan.kv_budget_nbytes is not None:
        out["device_memory"] = {"nbytes": req.device_bytes, "gib": req.device_bytes / (1 << 30),
                                "weights_nbytes": plan.weights.nbytes, "kv_budget_nbytes": plan.kv_budget_nbytes,
                                "kv_budget_gib": plan.kv_budget_nbytes / (1 << 30)}
    return out


def render_models() -> str:
    rows = []
    for shape in BUILTIN_MODELS.values():
        fp16 = KVLayout.build(shape, "fp16")
        rows.append((shape.name, str(shape.num_layers), str(shape.num_heads), str(shape.num_kv_heads),
                     str(shape.head_dim), str(shape.hidden_size), shape.attention,
                     f"{shape.max_context:,}" if shape.max_context else "-", f"{int(fp16.bytes_per_token):,}"))
    header = ("model", "layers", "heads", "KV heads", "head dim", "hidden", "attention", "max context",
              "fp16 B/token")
    return "\n".join(_table(header, rows, indent="")) + (
        "\nnames are case-insensitive; an org prefix and -Instruct/-chat/-hf/-v0.x suffixes are ignored\n")


def render_formats(head_dim: int) -> str:
    rows = []
    for fmt in FORMATS.values():
        k = fmt.key.block_nbytes(head_dim, BLOCK_SIZE) / BLOCK_SIZE
        v = fmt.value.block_nbytes(head_dim, BLOCK_SIZE) / BLOCK_SIZE
        rows.append((fmt.name, _trim(k), _trim(v), _trim(k + v), f"{_trim(4 * head_dim / (k + v))}x",
                     fmt.description))
    header = ("format", "K", "V", "K+V", "vs fp16", "layout")
    return (f"bytes per token, per layer and KV head, at head dim {head_dim} (block {BLOCK_SIZE}, "
            f"group {GROUP_SIZE})\n" + "\n".join(_table(header, rows, indent="", left=(0, 5))) + "\n")
