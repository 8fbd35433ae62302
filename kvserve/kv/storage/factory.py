"""The storage for a KV format: the native layout when every layer keeps the compute dtype
as it is, otherwise blocks through their codecs (with full-precision open blocks)."""

from __future__ import annotations

import torch

from kvserve.config import CacheConfig, ModelConfig, SchedulerConfig
from kvserve.kv.codecs import KVFormat
from kvserve.kv.paged_cache import PagedKVCache
from kvserve.kv.quantized_cache import QuantizedKVCache
from kvserve.kv.storage.base import KVStorage


def make_storage(model: ModelConfig, fmt: KVFormat, cache: CacheConfig, scheduler: SchedulerConfig,
                 dtype: torch.dtype, device: torch.device) -> KVStorage:
    cls: type[KVStorage] = PagedKVCache if fmt.is_lossless else QuantizedKVCache
    return cls.build(model, fmt, cache, scheduler, dtype, device)
