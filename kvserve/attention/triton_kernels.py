"""CUDA attention over the paged KV cache in Triton, reading every KV format in place.

``paged_attention`` has the contract of ``reference.reference_attention`` (without the
codecs: the ``HalfLayout`` says what to read). Decode and prefill chunks over cached context
go through the same kernel (``triton_jit.attend``); long contexts are split across programs
(flash-decoding); the last program of a query tile's splits to finish merges them
(``LaunchConfig.merge_in_kernel``; else a second small kernel does), so a call is one launch.
Split partials and the merge's tickets live in a ``SplitScratch`` reused from call to call.

Dequantization is fused into the kernel for every layout ``HalfLayout.from_codec`` builds;
products run in q's dtype with float32 accumulation (float32 q: exact float32 dots).
Import with ``TRITON_INTERPRET=1`` in the environment to run the kernels on CPU tensors
(slowly) through Triton's interpreter.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvserve.kv.storage.layout import AttentionScores, CodecKind, HalfLayout, HalfStore, PagedBatch

try:
    from kvserve.attention import triton_jit
except ImportError:          # no triton: is_available() says so
    triton_jit = None        # type: ignore[assignment]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KINDS = frozenset(CodecKind)
MAX_HEAD_DIM = 256
MIN_TOKENS_PER_SPLIT = 256   # below this a split's loads do not pay for its merge
PROGRAMS_PER_SM = 2


def is_interpreted() -> bool:
    """Whether the kernels were decorated for Triton's interpreter (CPU tensors)."""
    return triton_jit is not None and type(triton_jit.attend).__name__ == "InterpretedFunction"


def is_available() -> bool:
    """Triton is importable and either a CUDA device is present or the interpreter is forced."""
    return triton_jit is not None and (is_interpreted() or torch.cuda.is_available())


@dataclass(frozen=True)
class LaunchConfig:
    """How one call is cut into programs. A program holds ``queries_per_tile`` queries x
    the group's query heads as ``rows`` rows and walks its split of ``tokens_per_split``
    keys in tiles of ``block_n`` tokens; ``tokens_per_split`` is a multiple of both
    ``block_n`` and the block size, so the open block lies in one split."""

    rows: int
    queries_per_tile: int
    block_n: int
    tokens_per_split: int
    num_splits: int
    num_warps: int = 4
    num_stages: int = 2
    merge_in_kernel: bool = True   # split partials merged by their tile's last program, not a second kernel


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _device_traits(device: torch.device) -> tuple[int, bool]:
    """A device's multiprocessors (1 off CUDA) and whether the kernels' dots run on float32
    operands there (the interpreter; GPUs before sm_80): asked of torch once per device, not at
    every call."""
    if device.type != "cuda":
        return 1, True
    return (torch.cuda.get_device_properties(device).multi_processor_count,
            is_interpreted() or torch.cuda.get_device_capability(device) < (8, 0))


def launch_config(q: torch.Tensor, batch: PagedBatch, num_kv_heads: int,
                  tokens_per_split: int | None = None) -> LaunchConfig:
    """The default cut: enough (sequence, head, split) programs to fill the device twice
    over, splits of at least MIN_TOKENS_PER_SPLIT keys. ``tokens_per_split`` forces the
    split length (rounded up to the tile unit)."""
    group = q.shape[1] // num_kv_heads
    head_dim = q.shape[2]
    if batch.max_query_len <= 1:
        rows = max(16, _next_pow2(group))
    else:
        rows = max(64 if head_dim <= 128 else 32, _next_pow2(group))
    queries = max(1, rows // group)
    block_n = 64 if head_dim <= 128 else 32
    unit = math.lcm(block_n, batch.block_size)
    max_len = max(1, batch.max_context_len)
    if tokens_per_split is None:
        programs = batch.num_seqs * num_kv_heads * -(-batch.max_query_len // queries)
        sms = _device_traits(q.device)[0]
        want = -(-PROGRAMS_PER_SM * sms // max(1, programs))
        splits = max(1, min(want, max_len // MIN_TOKENS_PER_SPLIT))
        tokens_per_split = -(-max_len // splits)
    tokens_per_split = -(-max(1, tokens_per_split) // unit) * unit
    # 8 warps once a tile holds 8K elements: 4 would need over 200 registers a thread to
    # dequantize a 64 x 128 tile (ptxas, sm_90)
    warps = 8 if max(block_n, rows) * head_dim >= 8192 else 4
    return LaunchConfig(rows, queries, block_n, tokens_per_split, -(-max_len // tokens_per_split), num_warps=warps)


class SplitScratch:
    """Where split programs leave their partials (acc, max, sum) and take their tickets (one int32
    counter per query tile and KV head: the in-kernel merge's), per device, grown as calls need and
    reused by every call after: calls on one stream run one after another, so a call's partials
    are merged before the next call writes them. Between launches every ticket is zero (a launch's
    merging program sets its tile's back), so they are zeroed once, when allocated."""

    def __init__(self) -> None:
        self._partials: dict[torch.device, torch.Tensor] = {}
        self._tickets: dict[torch.device, torch.Tensor] = {}

    def partials(self, num_splits: int, num_rows: int, d_pad: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views [num_splits, num_rows, d_pad], [num_splits, num_rows] x 2 (float32) of one buffer."""
        n = num_splits * num_rows
        buf = self._partials.get(device)
        if buf is None or buf.numel() < n * (d_pad + 2):
            buf = torch.empty(n * (d_pad + 2), dtype=torch.float32, device=device)
            self._partials[device] = buf
        return (buf[:n * d_pad].view(num_splits, num_rows, d_pad), buf[n * d_pad:n * (d_pad + 1)].view(num_splits, num_rows),
                buf[n * (d_pad + 1):n * (d_pad + 2)].view(num_splits, num_rows))

    def tickets(self, count: int, device: torch.device) -> torch.Tensor:
        """``count`` int32 counters, all zero."""
        held = self._tickets.get(device)
        if held is None or held.numel() < count:
            held = torch.zeros(max(count, 2 * (0 if held is None else held.numel())), dtype=torch.int32, device=device)
            self._tickets[device] = held
        return held[:count]

    def check_integrity(self) -> None:
        """Every ticket back at zero (reads them from the device: tests and idle checks)."""
        for device, held in self._tickets.items():
            if int(torch.count_nonzero(held)):
                raise AssertionError(f"{int(torch.count_nonzero(held))} split tickets on {device} were left non-zero")


@dataclass(frozen=True)
class Halves:
    """A layer's keys and values checked once and their kernel arguments built (``prepare``): a
    storage hands out the same halves every step, so a backend prepares each layer's once."""

    key: HalfStore
    value: HalfStore
    num_kv_heads: int
    head_dim: int
    block_size: int
    args: tuple[Any, ...]               # attend's: both halves' parts and rows, the side map, finer parts
    constants: Mapping[str, Any]
    key_args: tuple[Any, ...]           # score's: the keys'
    key_constants: Mapping[str, Any]


def prepare(key: HalfStore, value: HalfStore, head_dim: int, block_size: int) -> Halves:
    """``key`` and ``value`` checked against their layouts (ValueError for what the kernels
    cannot read) and their arguments built."""
    num_kv_heads = _check_half("key", key, block_size, head_dim)
    if _check_half("value", value, block_size, head_dim) != num_kv_heads:
        raise ValueError("keys and values are stored with different numbers of heads")
    _check_refined(key, value, block_size, head_dim, num_kv_heads)
    # without finer copies the keys' main part stands in for the side map (never read then)
    side = key.refined.side_map if key.refined is not None else _part_tensors(key.layout, key.parts)[0]
    refined = {"REFINED": key.refined is not None}
    key_constants = {**_half_constants("K", key), **_finer_constants("KF", key), **refined}
    return Halves(key, value, num_kv_heads, head_dim, block_size,
                  (*_half_args(key), *_half_args(value), side, *_finer_args(key), *_finer_args(value)),
                  {**key_constants, **_half_constants("V", value), **_finer_constants("VF", value)},
                  (*_half_args(key), side, *_finer_args(key)), key_constants)


def paged_attention(q: torch.Tensor, key: HalfStore, value: HalfStore, batch: PagedBatch, scale: float,
                    out: torch.Tensor | None = None, *, config: LaunchConfig | None = None,
                    scores: AttentionScores | None = None, halves: Halves | None = None,
                    launcher: Launcher | None = None) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D] in q's dtype (written into ``out`` when given); the
    semantics of ``reference_attention``, except that ``open_rows`` of a sequence whose last
    block is full is ignored. ValueError for inputs the kernel cannot read. The batch's
    ``max_query_len`` and ``max_context_len`` size the grid and must bound every sequence's
    (not checked: that would cost a device sync). ``config`` overrides the default cut.
    ``scores``: the attention weights keys get are added to it (``AttentionScores``; a second
    kernel, ``score``, after the attention has each row's final max and sum). ``halves``:
    ``key`` and ``value`` as ``prepare`` made them earlier (checked then, not again).
    ``launcher``: what the calls of one stream share (``Launcher``: the split scratch, the step's
    batch checked and cut once for all its layers); a fresh one per call without."""
    if triton_jit is None:
        raise RuntimeError("the Triton attention backend needs the triton package (pip install triton)")
    _check_query(q, out)
    if halves is None:
        halves = prepare(key, value, q.shape[2], batch.block_size)
    elif halves.key is not key or halves.value is not value or halves.head_dim != q.shape[2] or \
            halves.block_size != batch.block_size:
        raise ValueError("these halves were prepared for other keys and values, head_dim or block size")
    num_kv_heads = halves.num_kv_heads
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {num_kv_heads} KV heads")
    launcher = launcher if launcher is not None else Launcher()
    plan = launcher.plan(q, batch, num_kv_heads, config)
    if scores is not None:
        if batch.window is not None:
            raise ValueError("attention scores are not kept under a sliding window")
        _check_scores(scores, batch, num_kv_heads, q.device)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    if q.shape[0] == 0 or batch.num_seqs == 0:
        return out
    stats = None if scores is None else torch.empty(2, q.shape[0] * q.shape[1], dtype=torch.float32, device=q.device)
    ran = _launch(q, halves, plan, scale, out, stats)
    if scores is not None and stats is not None:
        _score(q, halves, ran, scale, scores, stats)
    return out


class Launcher:
    """What the calls on one stream share: the split scratch (``SplitScratch``), and the plan of
    the step's batches (``StepPlan``: checked, cut and its kernel arguments built by the first
    layer's call, reused by every later layer's while the same batch, query shape and config come
    back; the KEPT_PLANS latest are kept).

    Plans of several batches share the scratch: their calls run one after another on the stream,
    each merging its splits before the next writes them."""

    KEPT_PLANS = 4      # a step's batches: the whole one, a sliding window's, a budget's per-layer ones

    def __init__(self) -> None:
        self.scratch = SplitScratch()
        self._plans: list[StepPlan] = []      # most recent first

    def plan(self, q: torch.Tensor, batch: PagedBatch, num_kv_heads: int, config: LaunchConfig | None = None,
             f32_dots: bool | None = None) -> StepPlan:
        """The plan for ``batch`` under queries like ``q`` (ValueError for a batch the kernels
        cannot read, or a config that does not tile its blocks); ``f32_dots``: the device's (asked
        of it) unless given (compiling for another device)."""
        query = (q.shape, q.dtype, q.device)
        for held in self._plans:
            if held.batch is batch and held.query == query and held.num_kv_heads == num_kv_heads \
                    and held.asked is config and (f32_dots is None or f32_dots == held.f32_dots):
                return held
        _check_batch(batch, q.device)
        cfg = config or launch_config(q, batch, num_kv_heads)
        if cfg.tokens_per_split % math.lcm(cfg.block_n, batch.block_size):
            raise ValueError(f"tokens_per_split {cfg.tokens_per_split} is not a multiple of block_n {cfg.block_n} "
                             f"and the block size {batch.block_size}")
        f32 = _device_traits(q.device)[1] if f32_dots is None else f32_dots
        num_q_tiles = -(-batch.max_query_len // cfg.queries_per_tile)
        num_rows, d_pad = q.shape[0] * q.shape[1], max(16, _next_pow2(q.shape[2]))
        partials: tuple[torch.Tensor, ...] | None = None      # one split: the output stands in (never read)
        tickets = None
        if cfg.num_splits > 1:
            partials = self.scratch.partials(cfg.num_splits, num_rows, d_pad, q.device)
            if cfg.merge_in_kernel:
                tickets = self.scratch.tickets(batch.num_seqs * num_q_tiles * num_kv_heads, q.device)
        plan = StepPlan(batch, query, num_kv_heads, config, cfg, f32, num_q_tiles, _batch_args(batch),
                        _tile_constants(q.shape, q.dtype, num_kv_heads, batch, cfg, f32), partials, tickets)
        self._plans = [plan, *self._plans[:self.KEPT_PLANS - 1]]
        return plan


@dataclass
class StepPlan:
    """A batch's launch for queries of one shape: its cut, its kernel arguments and tile
    constants, its split partials and tickets (``Launcher.plan``); each layer's merged constants
    are kept by its halves' id (``constants``)."""

    batch: PagedBatch
    query: tuple[Any, ...]              # q's shape, dtype, device
    num_kv_heads: int
    asked: LaunchConfig | None          # the config the caller gave (None: the default cut)
    cfg: LaunchConfig
    f32_dots: bool
    num_q_tiles: int
    batch_args: list[Any]
    tile_constants: dict[str, Any]
    partials: tuple[torch.Tensor, ...] | None
    tickets: torch.Tensor | None
    # by the halves' id, held beside them (so the id stays theirs)
    _constants: dict[tuple[int, bool], tuple[Halves, dict[str, Any]]] = field(default_factory=dict)

    def constants(self, halves: Halves, stats: bool) -> dict[str, Any]:
        """``attend``'s compile-time constants for ``halves`` (a layer's), with or without scoring."""
        key = (id(halves), stats)
        held = self._constants.get(key)
        if held is None or held[0] is not halves:
            held = (halves, {**halves.constants, **self.tile_constants, "SPLIT": self.cfg.num_splits > 1,
                             "STATS": stats, "MERGE_HERE": self.tickets is not None})
            self._constants[key] = held
        return held[1]

    def with_config(self, cfg: LaunchConfig) -> StepPlan:
        """The same plan in another tile (a launch that did not fit: ``smaller_configs``)."""
        q_shape, q_dtype, _ = self.query
        tiles = _tile_constants(q_shape, q_dtype, self.num_kv_heads, self.batch, cfg, self.f32_dots)
        return replace(self, cfg=cfg, tile_constants=tiles, _constants={})


@dataclass(frozen=True)
class AttendLaunch:
    """The ``attend`` kernel's grid, positional arguments and compile-time constants."""

    grid: tuple[int, int, int]
    args: list[Any]
    constants: dict[str, Any]


def attend_launch(q: torch.Tensor, halves: Halves, plan: StepPlan, scale: float, out: torch.Tensor,
                  stats: torch.Tensor | None = None) -> AttendLaunch:
    """What ``paged_attention`` launches for one layer (``stats``: [2, rows] where each row's
    final max and sum go, for scoring). Also used to compile the kernel without a GPU."""
    cfg, batch = plan.cfg, plan.batch
    partials = plan.partials if plan.partials is not None else (out, out, out)
    args = [q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1), *partials, q.shape[0] * q.shape[1],
            *plan.batch_args, batch.window or 0, halves.num_kv_heads, plan.num_q_tiles, cfg.tokens_per_split,
            scale * math.log2(math.e), *halves.args, *((out, out) if stats is None else (stats[0], stats[1])),
            out if plan.tickets is None else plan.tickets]
    return AttendLaunch((batch.num_seqs * plan.num_q_tiles, halves.num_kv_heads, cfg.num_splits), args,
                        plan.constants(halves, stats is not None))


def _batch_args(batch: PagedBatch) -> list[Any]:
    """The batch as both kernels take it: block table (its rows contiguous) and its row stride,
    context lengths, query starts, open rows, query positions (the context lengths stand in
    without: not read)."""
    tables = batch.block_tables if batch.block_tables.stride(1) == 1 else batch.block_tables.contiguous()
    return [tables, tables.stride(0), batch.context_lens, batch.query_starts, batch.open_rows,
            batch.context_lens if batch.query_positions is None else batch.query_positions]


def _tile_constants(q_shape: torch.Size, q_dtype: torch.dtype, num_kv_heads: int, batch: PagedBatch,
                    cfg: LaunchConfig, f32_dots: bool) -> dict[str, Any]:
    """The compile-time shape of both kernels' tiles (queries [T, Hq, D] in ``q_dtype``): rows,
    keys, head and block sizes, dot dtype."""
    head_dim = q_shape[2]
    return {"GROUP": q_shape[1] // num_kv_heads, "QUERIES": cfg.queries_per_tile, "ROWS": cfg.rows,
            "D": head_dim, "D_PAD": max(16, _next_pow2(head_dim)), "BLOCK_SIZE": batch.block_size,
            "BLOCK_N": cfg.block_n, "PAGES": _pages_per_tile(cfg.block_n, batch.block_size),
            "DOT": _dot_dtype(q_dtype), "F32_DOTS": f32_dots, "HAS_POSITIONS": batch.query_positions is not None}


def smaller_configs(cfg: LaunchConfig) -> Iterator[LaunchConfig]:
    """What a launch whose kernel needs more shared memory than the device has tries next, in
    order: one pipeline stage instead of two (the same sums), then tiles of half as many keys
    down to 16 (each key's logit the same, the softmax's running sums taken in smaller tiles).
    ``tokens_per_split`` stays a multiple of the smaller tile."""
    if cfg.num_stages > 1:
        cfg = replace(cfg, num_stages=1)
        yield cfg
    while cfg.block_n > 16:
        cfg = replace(cfg, block_n=cfg.block_n // 2)
        yield cfg


# (device, the kernel's specialization, the asked config's tile and stages) -> the config that fits
_FITTED: dict[tuple[Any, ...], LaunchConfig] = {}


def _launch(q: torch.Tensor, halves: Halves, plan: StepPlan, scale: float, out: torch.Tensor,
            stats: torch.Tensor | None) -> StepPlan:
    """Runs ``attend`` (and ``merge`` where the splits are not merged in the kernel); returns the
    plan that ran (``plan``, or it in the config that fit)."""
    assert triton_jit is not None
    cfg = plan.cfg
    launch = attend_launch(q, halves, plan, scale, out, stats)

    def memo() -> tuple[Any, ...]:
        return q.device, tuple(sorted((k, str(v)) for k, v in launch.constants.items())), cfg.num_warps, cfg.num_stages

    asked = memo() if _FITTED else None          # (nothing to look up until a launch has not fit)
    fitted = _FITTED.get(asked) if asked is not None else None
    if fitted is not None:
        cfg = replace(fitted, tokens_per_split=cfg.tokens_per_split, num_splits=cfg.num_splits,
                      merge_in_kernel=cfg.merge_in_kernel)
        plan = plan.with_config(cfg)
        launch = attend_launch(q, halves, plan, scale, out, stats)
    tries = smaller_configs(cfg)
    while True:
        try:
            triton_jit.attend[launch.grid](*launch.args, **launch.constants, num_warps=cfg.num_warps,
                                           num_stages=cfg.num_stages)
            break
        except triton_jit.OutOfResources as e:
            asked = asked if asked is not None else memo()
            smaller = next(tries, None)
            if smaller is None:
                raise ValueError(f"the Triton attention kernel does not fit this device's shared memory for "
                                 f"{_describe(halves.key.layout)} keys and {_describe(halves.value.layout)} values "
                                 f"at head_dim {q.shape[2]} in {q.dtype}, even in {cfg.block_n}-key tiles ({e}); use "
                                 "a 16-bit compute dtype or the torch attention backend") from e
            cfg = smaller
            plan = plan.with_config(cfg)
            launch = attend_launch(q, halves, plan, scale, out, stats)
            _FITTED[asked] = cfg
    if plan.partials is not None and plan.tickets is None:     # splits merged by the second kernel
        rows, num_rows, d_pad = 16, q.shape[0] * q.shape[1], max(16, _next_pow2(q.shape[2]))
        row_stats = (out, out) if stats is None else (stats[0], stats[1])
        triton_jit.merge[(-(-num_rows // rows),)](*plan.partials, out, out.stride(0), out.stride(1), num_rows, q.shape[1],
                                                  cfg.num_splits, *row_stats, ROWS=rows, D=q.shape[2], D_PAD=d_pad,
                                                  STATS=stats is not None, num_warps=4)
    return plan


def _score(q: torch.Tensor, halves: Halves, plan: StepPlan, scale: float, scores: AttentionScores,
           stats: torch.Tensor) -> None:
    """``score`` over the keys, one program per (sequence, KV head), in the tiles ``attend`` ran."""
    assert triton_jit is not None
    grid, args, constants = score_launch(q, halves, plan, scale, scores, stats)
    triton_jit.score[grid](*args, **constants, num_warps=plan.cfg.num_warps, num_stages=1)


def score_launch(q: torch.Tensor, halves: Halves, plan: StepPlan, scale: float, scores: AttentionScores,
                 stats: torch.Tensor) -> tuple[tuple[int, int], list[Any], dict[str, Any]]:
    """``score``'s grid, positional arguments and constants in the tiles of the ``attend`` that ran
    (its plan's batch arguments and tile constants: no per-call work but the list; also used to
    compile it without a GPU)."""
    w = scores.weights
    args = [q, q.stride(0), q.stride(1), stats[0], stats[1], w, w.stride(0), w.stride(1), w.shape[2],
            scores.score_from, *plan.batch_args, halves.num_kv_heads, scale * math.log2(math.e), *halves.key_args]
    return (plan.batch.num_seqs, halves.num_kv_heads), args, {**halves.key_constants, **plan.tile_constants}


def _describe(layout: HalfLayout) -> str:
    """A layout in a few words, e.g. ``int8+had`` or ``asym_channel 2-bit+out4``."""
    kind = layout.kind.name.lower() if layout.kind != CodecKind.PLAIN else str(layout.plain_dtype).split(".")[-1]
    bits = f" {layout.bits}-bit" if layout.kind in (CodecKind.ASYM_TOKEN, CodecKind.ASYM_CHANNEL) else ""
    return kind + bits + ("+had" if layout.hadamard else "") + (f"+out{layout.num_outliers}" if layout.num_outliers else "")


def _pages_per_tile(block_n: int, block_size: int) -> int:
    """Blocks a tile covers: block_n / B when B divides it, 1 when the tile lies inside a
    block, 0 when tiles straddle blocks (every token looked up)."""
    if block_n % block_size == 0:
        return block_n // block_size
    return 1 if block_size % block_n == 0 else 0


def _dot_dtype(dtype: torch.dtype) -> Any:
    tl = triton_jit.tl
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


PART_NAMES = ("scale", "zero", "outlier_values", "outlier_channels")


def _part_tensors(layout: HalfLayout, parts: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """Main part, scale, zero, outlier values, outlier channels (the main part stands in for
    those the layout lacks)."""
    main = parts["codes" if layout.kind != CodecKind.PLAIN else "data"]
    return [main, *(parts.get(name, main) for name in PART_NAMES)]


def _half_args(store: HalfStore) -> list[Any]:
    """Six pointers (the parts, then the residual rows; the main part stands in for what the
    half lacks) and their six block strides."""
    tensors = _part_tensors(store.layout, store.parts)
    tensors.append(tensors[0] if store.residual is None else store.residual)
    return [*tensors, *(t.stride(0) for t in tensors)]


def _finer_args(store: HalfStore) -> list[Any]:
    """Five pointers to the parts of the half's finer copies and their five side-slot strides
    (the half's own parts stand in without refinement: never read then)."""
    refined = store.refined
    tensors = _part_tensors(store.layout, store.parts) if refined is None else _part_tensors(refined.layout,
                                                                                              refined.parts)
    return [*tensors, *(t.stride(0) for t in tensors)]


def _layout_constants(prefix: str, layout: HalfLayout) -> dict[str, Any]:
    return {f"{prefix}_KIND": int(layout.kind), f"{prefix}_BITS": layout.bits,
            f"{prefix}_GROUP_SIZE": max(1, layout.group_size), f"{prefix}_HAD": layout.hadamard,
            f"{prefix}_NOUT": layout.num_outliers}


def _half_constants(prefix: str, store: HalfStore) -> dict[str, Any]:
    return {**_layout_constants(prefix, store.layout), f"{prefix}_HAS_RESIDUAL": store.residual is not None}


def _finer_constants(prefix: str, store: HalfStore) -> dict[str, Any]:
    return _layout_constants(prefix, store.layout if store.refined is None else store.refined.layout)


# ---- input checks: a layout or tensor the kernel cannot read raises, never reads wrong bytes


def _check_query(q: torch.Tensor, out: torch.Tensor | None) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, query heads, head_dim], got shape {tuple(q.shape)}")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    if not 1 <= q.shape[2] <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {q.shape[2]} is outside 1..{MAX_HEAD_DIM}")
    if not is_interpreted() and not q.is_cuda:
        raise ValueError("the Triton kernels run on CUDA tensors (or on CPU with TRITON_INTERPRET=1 set before "
                         "kvserve.attention.triton_kernels is imported)")
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(f"out must match q ({tuple(q.shape)}, {q.dtype}, {q.device}), got "
                             f"{tuple(out.shape)}, {out.dtype}, {out.device}")
        if out.stride(2) != 1:
            raise ValueError("out must be contiguous along head_dim")


def _expect(name: str, t: torch.Tensor | None, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...],
            device: torch.device) -> torch.Tensor:
    """``t`` is [n, *shape] in one of ``dtypes``, contiguous but for its first dim."""
    if t is None:
        raise ValueError(f"missing part {name!r}")
    if tuple(t.shape[1:]) != shape or t.dim() != len(shape) + 1:
        raise ValueError(f"{name}: expected shape [n, {', '.join(map(str, shape))}], got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the main part on {device}")
    expected = 1
    for size, stride in zip(reversed(shape), reversed(t.stride()[1:])):
        if size > 1 and stride != expected:
            raise ValueError(f"{name}: only the block dim may be strided (got strides {t.stride()})")
        expected *= size
    return t


def _check_layout(half: str, layout: HalfLayout, head_dim: int) -> None:
    if layout.kind not in KINDS:
        raise ValueError(f"{half}: unknown codec kind {layout.kind!r}")
    if layout.kind in (CodecKind.ASYM_TOKEN, CodecKind.ASYM_CHANNEL):
        if layout.bits not in (2, 4):
            raise ValueError(f"{half}: packed codes of {layout.bits} bits are not supported (2 or 4)")
        if layout.kind == CodecKind.ASYM_TOKEN and (layout.group_size < 1 or head_dim % layout.group_size):
            raise ValueError(f"{half}: group size {layout.group_size} does not divide head_dim {head_dim}")
    if layout.hadamard and (head_dim & (head_dim - 1) or head_dim < 16):
        raise ValueError(f"{half}: +had needs a power-of-two head_dim of at least 16, got {head_dim}")
    if not 0 <= layout.num_outliers < head_dim:
        raise ValueError(f"{half}: {layout.num_outliers} outlier channels for head_dim {head_dim}")


def _check_half(half: str, store: HalfStore, block_size: int, head_dim: int) -> int:
    """Validate one half against its layout; returns its number of heads."""
    heads = _check_parts(half, store.layout, store.parts, block_size, head_dim)
    if store.residual is not None:
        _expect(f"{half}.residual", store.residual, (block_size, heads, head_dim), FLOAT_DTYPES,
                _part_tensors(store.layout, store.parts)[0].device)
    return heads


def _check_refined(key: HalfStore, value: HalfStore, block_size: int, head_dim: int, num_kv_heads: int) -> None:
    """The finer copies of a zip storage (``HalfStore.refined``): both halves or neither, one
    side map (int64, an entry per block), the finer parts valid for their layouts, in the base's
    Hadamard domain (the loop works in one basis)."""
    if key.refined is None and value.refined is None:
        return
    if key.refined is None or value.refined is None or key.refined.side_map is not value.refined.side_map:
        raise ValueError("keys and values are refined together, by one side map")
    side_map = key.refined.side_map
    num_blocks = next(iter(key.parts.values())).shape[0]
    device = next(iter(key.parts.values())).device
    if side_map.dtype != torch.int64 or side_map.dim() != 1 or side_map.shape[0] < num_blocks or \
            side_map.device != device:
        raise ValueError(f"the side map must be a 1-d int64 tensor of at least {num_blocks} entries on {device}")
    for half, store in (("key", key), ("value", value)):
        refined = store.refined
        assert refined is not None
        if refined.layout.reads_rotated != store.layout.reads_rotated:
            raise ValueError(f"{half}: the Triton kernels read a finer copy in its base's Hadamard domain only: give "
                             "both formats +had (without +outN) or neither (the cpu backend reads mixed domains)")
        if _check_parts(f"{half} (finer)", refined.layout, refined.parts, block_size, head_dim) != num_kv_heads:
            raise ValueError(f"{half}: the finer copies have another number of heads than the blocks")
        if _part_tensors(refined.layout, refined.parts)[0].device != device:
            raise ValueError(f"{half}: the finer copies are on another device than the blocks")


def _check_parts(half: str, layout: HalfLayout, parts: Mapping[str, torch.Tensor], block_size: int,
                 head_dim: int) -> int:
    """Validate a half's parts against its layout; returns its number of heads."""
    _check_layout(half, layout, head_dim)
    main_name = "data" if layout.kind == CodecKind.PLAIN else "codes"
    main = parts.get(main_name)
    if main is None or main.dim() != 4:
        raise ValueError(f"{half}: expected a part {main_name!r} [blocks, block_size, heads, ...]")
    heads, device = main.shape[2], main.device
    if layout.kind == CodecKind.PLAIN:
        if layout.plain_dtype not in FLOAT_DTYPES:
            raise ValueError(f"{half}: plain storage in {layout.plain_dtype} is not supported")
        _expect(f"{half}.data", main, (block_size, heads, head_dim), (layout.plain_dtype,), device)
    elif layout.kind in (CodecKind.INT8, CodecKind.FP8):
        code_dtype = torch.int8 if layout.kind == CodecKind.INT8 else torch.uint8
        _expect(f"{half}.codes", main, (block_size, heads, head_dim), (code_dtype,), device)
        _expect(f"{half}.scale", parts.get("scale"), (block_size, heads), (torch.float16,), device)
    else:
        _expect(f"{half}.codes", main, (block_size, heads, head_dim * layout.bits // 8), (torch.uint8,), device)
        param: tuple[int, ...] = (heads, head_dim) if layout.kind == CodecKind.ASYM_CHANNEL \
            else (block_size, heads, head_dim // layout.group_size)
        for name in ("scale", "zero"):
            _expect(f"{half}.{name}", parts.get(name), param, (torch.float16,), device)
    if layout.num_outliers:
        n = layout.num_outliers
        _expect(f"{half}.outlier_values", parts.get("outlier_values"), (block_size, heads, n), (torch.float16,),
                device)
        _expect(f"{half}.outlier_channels", parts.get("outlier_channels"), (heads, n), (torch.uint8,), device)
    return heads


def _check_scores(scores: AttentionScores, batch: PagedBatch, num_kv_heads: int, device: torch.device) -> None:
    w, first = scores.weights, scores.score_from
    if w.dtype != torch.float32 or w.dim() != 3 or tuple(w.shape[:2]) != (batch.num_seqs, num_kv_heads) or \
            w.stride(2) != 1 or w.device != device:
        raise ValueError(f"scores.weights must be float32 [{batch.num_seqs}, {num_kv_heads}, width] on {device}, "
                         f"its last dim contiguous; got {w.dtype} {tuple(w.shape)} on {w.device}")
    if first.dtype != torch.int32 or tuple(first.shape) != (batch.num_seqs,) or first.device != device:
        raise ValueError(f"scores.score_from must be int32 [{batch.num_seqs}] on {device}")


def _check_batch(batch: PagedBatch, device: torch.device) -> None:
    s = batch.num_seqs
    expected = {"block_tables": (batch.block_tables, 2), "context_lens": (batch.context_lens, 1),
                "query_starts": (batch.query_starts, 1), "open_rows": (batch.open_rows, 1)}
    for name, (t, dims) in expected.items():
        if t.dtype != torch.int32 or t.dim() != dims or t.device != device:
            raise ValueError(f"batch.{name} must be a {dims}-d int32 tensor on {device}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    if batch.block_tables.shape[0] != s or batch.open_rows.shape[0] != s or batch.query_starts.shape[0] != s + 1:
        raise ValueError(f"batch tensors disagree on the number of sequences ({s})")
    positions = batch.query_positions
    if positions is not None and (positions.dtype != torch.int32 or positions.dim() != 1 or positions.device != device):
        raise ValueError(f"batch.query_positions must be a 1-d int32 tensor on {device}")
    if batch.block_size < 1 or batch.max_query_len < 0 or batch.max_context_len < 0:
        raise ValueError("batch.block_size must be positive and the maxima non-negative")
