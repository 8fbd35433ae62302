"""The storage for a KV format: the native layout when every layer keeps the compute dtype
as it is, a base and a side pool under precision by saliency (``zip:``), otherwise blocks
through their codecs (with full-precision open blocks)."""

from __future__ import annotations

from dataclasses import replace

import torch

from kvserve.config import CacheConfig, ModelConfig, SchedulerConfig
from kvserve.kv.codecs import KVFormat
from kvserve.kv.groups import LayerGroups
from kvserve.kv.storage.base import KVStorage
from kvserve.kv.storage.grouped import GroupedStorage, slot_format
from kvserve.kv.storage.layout import MakeRowWriter
from kvserve.kv.storage.paged import PagedKVCache
from kvserve.kv.storage.quantized import QuantizedKVCache
from kvserve.kv.storage.zip import ZipKVCache


def make_storage(model: ModelConfig, fmt: KVFormat, cache: CacheConfig, scheduler: SchedulerConfig,
                 dtype: torch.dtype, device: torch.device, make_writer: MakeRowWriter | None = None,
                 groups: LayerGroups | None = None) -> KVStorage:
    """``groups``: the model's layer groups; where a block holds fewer layers than the model has
    (sliding-window layers), a storage of ``groups.num_slots`` layers the groups share."""
    if groups is not None and groups.num_slots != model.num_layers:
        slots = slot_format(fmt, groups)
        inner = make_storage(replace(model, num_layers=groups.num_slots, layers=()), slots, cache, scheduler, dtype,
                             device, make_writer)
        return GroupedStorage(inner, groups)
    cls: type[KVStorage] = PagedKVCache if fmt.is_lossless else ZipKVCache if fmt.refine else QuantizedKVCache
    return cls.build(model, fmt, cache, scheduler, dtype, device, make_writer)
