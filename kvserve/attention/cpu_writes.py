"""Quantize-on-write on the CPU: one C++ call per layer writes the step's new keys and values
into both halves, in every KV format (the encoders of kvserve/attention/csrc/encode.h, built
into the attention extension).

The call takes each layer's halves as the attention kernel reads them (registered once with
``cpu.register_halves``) and does what the storage's torch path does, in one pass:

    per-token halves           token --encode--> its slot                     (``slots``)
    halves of whole blocks     token --copy--> its residual row               (``residual_slots``)
                               filled rows --encode--> their blocks            (``encode_rows``, ``encode_block_ids``)
    a zip storage's halves     every half as a half of whole blocks, and the filled rows that have a
                               side slot --encode--> the finer format there   (``refine_rows``, ``refine_slots``)

The bytes are the torch codecs' own (same float32 operations in the same order), so the
torch path stays the reference and the fallback: a storage takes this writer only on CPU
tensors and where the extension builds (``for_storage`` returns None otherwise). The engine's
wiring hands ``CpuWrites.for_storage`` to the storage (``make_storage(make_writer=...)``), so
kv/ never imports the attention package.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType

import torch

from kvserve.attention.cpu import register_halves
from kvserve.attention.cpu_extension import load_extension
from kvserve.kv.storage.layout import HalfStore

_NO_INDICES = torch.empty(0, dtype=torch.long)


class CpuWrites:
    """Writes into the given halves (per layer, keys then values); the views are derived once:
    storages hand out the same part tensors for their whole life."""

    def __init__(self, ext: ModuleType, halves: Sequence[tuple[HalfStore, HalfStore]], head_dim: int) -> None:
        self._ext = ext
        self._layers = [register_halves(ext, k, v, head_dim) for k, v in halves]

    @classmethod
    def for_storage(cls, device: torch.device, halves: Sequence[tuple[HalfStore, HalfStore]],
                    head_dim: int) -> CpuWrites | None:
        """The writer for a storage on ``device``, or None where the torch path must write (not a
        CPU storage, or the extension cannot be built: its log line says why)."""
        if device.type != "cpu":
            return None
        ext = load_extension()
        return None if ext is None else cls(ext, halves, head_dim)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
              residual_slots: torch.Tensor | None = None, encode_rows: torch.Tensor | None = None,
              encode_block_ids: torch.Tensor | None = None, refine_rows: torch.Tensor | None = None,
              refine_slots: torch.Tensor | None = None) -> None:
        """``key``/``value`` [num_tokens, heads, dim] of ``layer``: see the module docstring for
        the index tensors (int64; the residual ones only where a half keeps rows). Halves with a
        finer format (a zip storage's) also encode ``refine_rows`` into side slots ``refine_slots``."""
        args = (self._layers[layer], _channels_contiguous(key), _channels_contiguous(value), slots,
                _NO_INDICES if residual_slots is None else residual_slots,
                _NO_INDICES if encode_rows is None else encode_rows,
                _NO_INDICES if encode_block_ids is None else encode_block_ids)
        if refine_rows is None:
            self._ext.write_halves(*args)
        else:
            assert refine_slots is not None
            self._ext.write_halves_refined(*args, refine_rows, refine_slots)


    def bind(self, slots: torch.Tensor, residual_slots: torch.Tensor | None = None,
             encode_rows: torch.Tensor | None = None,
             encode_block_ids: torch.Tensor | None = None) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
        """``write`` with one step's index tensors bound (no refined halves): (layer, key, value)."""
        ext, layers = self._ext, self._layers
        tail = (slots, _NO_INDICES if residual_slots is None else residual_slots,
                _NO_INDICES if encode_rows is None else encode_rows,
                _NO_INDICES if encode_block_ids is None else encode_block_ids)

        def write(layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
            ext.write_halves(layers[layer], _channels_contiguous(key), _channels_contiguous(value), *tail)
        return write


def _channels_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
