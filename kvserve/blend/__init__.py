"""Segments: KV of documents cached by content, independent of position (selective
reconstruction, CacheBlend-style).

A segment is computed standalone (positions from 0, no context before it) and stored under
keys of its own (kv/prefix.py: ``segment_block_keys``). Reused at another position, its keys
are re-rotated there (``rope.py``); its values do not depend on the position.
"""
