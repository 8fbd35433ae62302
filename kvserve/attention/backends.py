"""Attention backends, chosen by the name users type (``--attention-backend``).

    torch    the portable reference path: gather each request's blocks, decode them through
             the codec into a full-precision copy, scaled_dot_product_attention (paged.py)
    cpu      a C++ kernel that reads every block where it lies, in its stored format (cpu.py)
    triton   the same in Triton, for CUDA GPUs (triton_kernels.py)
    auto     the fastest one available on the device: cpu on CPUs, triton on CUDA, else torch

A backend that reads in place gets one ``PagedBatch`` per step (every decode and every
prefill chunk over cached context, ragged) and each layer's ``HalfStore`` pair from the
storage. A chunk with no cached context in a storage that reads back what it was given
(native) is attended to its own new keys and values by scaled_dot_product_attention in
every backend, and a request whose KV budget has compacted its cache takes the torch path
(its slots are no longer its positions; docs/budgets.md).

Every backend also attends one sequence's dense keys and values at given query positions
(``attend_dense``: blending's passes over a prompt, outside the paged cache): the portable
path (dense.py) unless a backend has a kernel for it (cpu).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from types import MappingProxyType, ModuleType
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

import torch

from kvserve.attention import dense
from kvserve.kv.storage.layout import AttentionScores, HalfStore, PagedBatch

if TYPE_CHECKING:
    from kvserve.attention.triton_kernels import Halves, Launcher
    from kvserve.kv.storage import KVStorage

log = logging.getLogger(__name__)
T = TypeVar("T")


class AttentionBackend(ABC):
    """Attends a step's queries over the paged cache, and one sequence's queries over its dense
    keys and values (``attend_dense``: blending's passes). Contract of ``attend`` (backends that
    read in place): exactly ``kvserve.attention.reference.reference_attention``'s result, to
    float32 summation order, for q [T, Hq, D] on the storage's device."""

    name: ClassVar[str]
    #: False for the torch path, which reads through ``KVStorage.gather`` instead.
    reads_in_place: ClassVar[bool] = True
    #: ``attend`` takes ``scores`` (``AttentionScores``): it adds the attention weights keys get,
    #: for queries in these dtypes.
    scores_attention: ClassVar[bool] = False
    scored_dtypes: ClassVar[tuple[torch.dtype, ...]] = ()

    @classmethod
    @abstractmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        """Why this backend cannot run on ``device`` here, or None when it can."""

    def attend(self, q: torch.Tensor, key: HalfStore, value: HalfStore, batch: PagedBatch, scale: float,
               out: torch.Tensor | None = None, scores: AttentionScores | None = None) -> torch.Tensor:
        """``scores`` only where ``scores_attention``."""
        raise NotImplementedError(f"the {self.name} backend reads through the storage's gather")

    def step_attend(self, cache: KVStorage, batch: PagedBatch,
                    scale: float) -> Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]:
        """``attend`` over ``cache``'s layers with one step's batch bound, for a loop over the
        layers: (layer, q, out) -> the layer's output (``out`` where it could be written)."""
        return lambda layer, q, out: self.attend(q, *cache.half_stores(layer), batch, scale, out)

    def dense_rows(self, num_positions: int) -> int:
        """Rows to allocate for a dense KV of ``num_positions`` positions so that ``attend_dense``
        reads it without a copy (the rows past the positions are never read)."""
        return num_positions

    def attend_dense(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
                     scale: float) -> torch.Tensor:
        """One sequence's queries q [r, Hq, D] at ``positions`` ([r] int64, ascending, below n)
        over its keys and values [n, Hkv, D] at positions 0..n-1 (rows past the last query's
        position, padding, are never read), causally: each query attends to the keys up to its
        own position. [r, Hq, D] in q's dtype; nothing is written. Contract: one
        masked ``scaled_dot_product_attention`` call's result, to float32 summation order; every
        position a query (r == n) is the plain causal prefill, ``scaled_dot_product_attention``'s
        own in every backend. This portable path (dense.py) serves backends without a kernel."""
        return dense.attend_dense(q, key, value, positions, scale)


class HeldHalves(Generic[T]):
    """What a backend builds once per layer from its halves (the C++ kernel's registration, the
    Triton launch's checked arguments): storages hand out the same ``HalfStore`` objects every
    call, held here beside what was built from them (so their ids stay theirs), by their ids and
    ``shape`` (what else the build depended on)."""

    def __init__(self) -> None:
        self._held: dict[tuple[int, ...], tuple[HalfStore, HalfStore, T]] = {}

    def get(self, key: HalfStore, value: HalfStore, shape: tuple[int, ...], build: Callable[[], T]) -> T:
        at = (id(key), id(value), *shape)
        held = self._held.get(at)
        if held is None or held[0] is not key or held[1] is not value:
            if len(self._held) > 4096:      # a storage that builds its halves per call: stay bounded
                self._held.clear()
            held = (key, value, build())
            self._held[at] = held
        return held[2]

    def values(self) -> list[T]:
        return [built for _, _, built in self._held.values()]


class TorchBackend(AttentionBackend):
    name = "torch"
    reads_in_place = False

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        return None


class CpuBackend(AttentionBackend):
    name = "cpu"
    scores_attention = True
    scored_dtypes = (torch.float32,)

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        if device.type != "cpu":
            return f"the cpu backend runs on CPU tensors, the engine is on {device}"
        from kvserve.attention import cpu
        return None if cpu.is_available() else "the C++ kernel could not be built or loaded (see the log)"

    def __init__(self) -> None:
        from kvserve.attention import cpu  # the kernel's module, once (not at every call)
        self._cpu: ModuleType = cpu
        self._layers: HeldHalves[object] = HeldHalves()     # each layer's halves registered with the kernel once

    def attend(self, q: torch.Tensor, key: HalfStore, value: HalfStore, batch: PagedBatch, scale: float,
               out: torch.Tensor | None = None, scores: AttentionScores | None = None) -> torch.Tensor:
        cpu = self._cpu
        ext = cpu.load_extension()
        if ext is None or q.dtype != torch.float32 or not q.is_contiguous() or q.device.type != "cpu":
            if scores is not None:
                raise ValueError("attention scores need contiguous float32 CPU queries and the C++ kernel")
            return cpu.paged_attention(q, key, value, batch, scale, out)    # checks and says what is wrong
        halves = self._layers.get(key, value, (q.shape[-1],), lambda: cpu.register_halves(ext, key, value, q.shape[-1]))
        return cpu.run_registered(ext, halves, q, batch, scale, out, scores)

    def step_attend(self, cache: KVStorage, batch: PagedBatch,
                    scale: float) -> Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]:
        """The kernel called at once on each layer's registered halves, for float32 queries and
        outputs (contiguous, on the CPU: the caller's promise; the kernel checks shapes)."""
        cpu = self._cpu
        ext = cpu.load_extension()
        if ext is None:
            return super().step_attend(cache, batch, scale)
        held, register, run = self._layers, cpu.register_halves, ext.run_halves
        args = (batch.block_tables, batch.context_lens, batch.query_starts, batch.open_rows, float(scale),
                cpu.query_positions(batch), batch.window or 0)

        def attend(layer: int, q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            key, value = cache.half_stores(layer)
            run(held.get(key, value, (q.shape[-1],), lambda: register(ext, key, value, q.shape[-1])), q, out, *args)
            return out
        return attend

    def dense_rows(self, num_positions: int) -> int:
        return self._cpu.dense_rows(num_positions)

    def attend_dense(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
                     scale: float) -> torch.Tensor:
        # the kernel reads float32 CPU keys and values; the causal prefill is SDPA's in every backend
        if (positions.numel() == key.shape[0] or key.device.type != "cpu"
                or not key.dtype == value.dtype == torch.float32 or not self._cpu.is_available()):
            return super().attend_dense(q, key, value, positions, scale)
        return self._cpu.dense_attention(q, key, value, positions, scale)


class TritonBackend(AttentionBackend):
    name = "triton"
    scores_attention = True
    scored_dtypes = (torch.float32, torch.float16, torch.bfloat16)

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        from kvserve.attention import triton_kernels
        if triton_kernels.triton_jit is None:
            return "triton is not installed"
        if device.type == "cuda" or (device.type == "cpu" and triton_kernels.is_interpreted()):
            return None
        return f"triton kernels run on CUDA (or on CPU under TRITON_INTERPRET=1), the engine is on {device}"

    def __init__(self) -> None:
        from kvserve.attention import triton_kernels  # the kernels' module, once (not at every call)
        self._kernels: ModuleType = triton_kernels
        # each layer's halves checked and their arguments built once (triton_kernels.prepare)
        self._layers: HeldHalves[Halves] = HeldHalves()
        # the split scratch and each step's plan, shared by the layers' calls (one stream)
        self.launcher: Launcher = triton_kernels.Launcher()

    def attend(self, q: torch.Tensor, key: HalfStore, value: HalfStore, batch: PagedBatch, scale: float,
               out: torch.Tensor | None = None, scores: AttentionScores | None = None) -> torch.Tensor:
        kernels = self._kernels
        halves = self._layers.get(key, value, (q.shape[-1], batch.block_size),
                                  lambda: kernels.prepare(key, value, q.shape[-1], batch.block_size))
        return kernels.paged_attention(q, key, value, batch, scale, out, scores=scores, halves=halves,
                                       launcher=self.launcher)

    # attend_dense: the portable path (SDPA). The paged kernel could read a dense KV as blocks, as
    # the cpu backend's does; not done: a blend's results on CUDA would move, untested without a GPU.


ATTENTION_BACKENDS: Mapping[str, type[AttentionBackend]] = MappingProxyType(
    {b.name: b for b in (TorchBackend, CpuBackend, TritonBackend)})
AUTO = "auto"


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend ``name`` on ``device``; ``auto`` falls back to torch (one log line says why)
    where the fast one cannot run. ValueError for an unknown name or an unavailable backend."""
    if name == AUTO:
        choice = ATTENTION_BACKENDS["triton" if device.type == "cuda" else "cpu"]
        reason = choice.unavailable_reason(device)
        if reason is None:
            return choice()
        log.warning("attention backend auto: %s; using the torch backend", reason)
        return TorchBackend()
    backend = ATTENTION_BACKENDS.get(name)
    if backend is None:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join([*ATTENTION_BACKENDS, AUTO])}")
    reason = backend.unavailable_reason(device)
    if reason is not None:
        raise ValueError(f"attention backend {name!r} is not available: {reason}")
    return backend()
