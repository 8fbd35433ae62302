"""Paged KV storage: the protocol (``base``) and the factory that picks an implementation
for a KV format (``factory``). The implementations are ``paged`` (the native layout)
and ``quantized`` (blocks through a codec)."""

from kvserve.kv.storage.base import KVStorage, Overlay, StepWrites, WritePlanner

__all__ = ["KVStorage", "Overlay", "StepWrites", "WritePlanner"]
