"""Whole blocks as bytes: the payload a block carries between tiers.

A cache lists its per-block tensors (each ``[num_blocks, ...]``) in a fixed order;
a block's payload is the concatenation of its row of each tensor, as raw bytes.
The order and dtypes depend only on the model shape and the KV format, which are
part of every block key, so a payload read back under the same key fits exactly.

``BlockMover`` is what the tiering (kv/tiering.py) holds: whole blocks of the live
cache to payload bytes and back; the offload tiers below it see only the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def block_nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t[0].numel() * t.element_size() for t in tensors)


def read_blocks(tensors: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """Payloads of ``block_ids`` as a CPU uint8 tensor [len(block_ids), block_nbytes]."""
    if not tensors:
        raise ValueError("a cache with no tensors has no payload")
    device = tensors[0].device
    ids = torch.tensor(block_ids, dtype=torch.long, device=device)
    rows = [t.index_select(0, ids).reshape(len(block_ids), -1).view(torch.uint8) for t in tensors]
    gathered = torch.cat(rows, dim=1)
    if device.type != "cuda":
        return gathered.cpu()
    # through page-locked memory: a DMA copy, about twice the bandwidth of pageable memory
    host = torch.empty(gathered.shape, dtype=torch.uint8, pin_memory=True)
    host.copy_(gathered, non_blocking=True)
    torch.cuda.current_stream(device).synchronize()
    return host


def write_blocks(tensors: list[torch.Tensor], block_ids: list[int], payloads: torch.Tensor) -> None:
    """Store payloads ([n, block_nbytes] uint8, any device) into ``block_ids``."""
    expected = block_nbytes(tensors)
    if payloads.dim() != 2 or payloads.shape[1] != expected or payloads.dtype != torch.uint8:
        raise ValueError(f"payloads must be uint8 [n, {expected}], got {payloads.dtype} {tuple(payloads.shape)}")
    if payloads.shape[0] != len(block_ids):
        raise ValueError(f"{payloads.shape[0]} payloads for {len(block_ids)} blocks")
    ids = torch.tensor(block_ids, dtype=torch.long, device=tensors[0].device)
    # one copy of the whole batch; from pinned memory it is queued on the stream that reads it
    payloads = payloads.to(tensors[0].device, non_blocking=True)
    offset = 0
    for t in tensors:
        n = t[0].numel() * t.element_size()
        chunk = payloads[:, offset:offset + n]   # index_copy_ takes the strided slice as it is
        t.index_copy_(0, ids, chunk.view(t.dtype).view(len(block_ids), *t.shape[1:]))
        offset += n


class BlockMover:
    """Copies whole blocks of the device cache to bytes and back.

    Holds the cache's per-block tensors (views of the live storage), not the cache.
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.nbytes_per_block = block_nbytes(tensors)

    def read(self, block_ids: list[int]) -> list[bytes]:
        rows = read_blocks(self.tensors, block_ids).numpy()
        return [row.tobytes() for row in rows]

    def write(self, block_ids: list[int], payloads: Sequence[bytes]) -> None:
        shape = (len(payloads), self.nbytes_per_block)
        on_cuda = self.tensors[0].device.type == "cuda"
        # page-locked staging on CUDA, so the host-to-device copies are DMA and asynchronous
        staged = torch.empty(shape, dtype=torch.uint8, pin_memory=on_cuda)
        rows = staged.numpy()
        for i, payload in enumerate(payloads):
            rows[i] = np.frombuffer(payload, dtype=np.uint8)
        write_blocks(self.tensors, block_ids, staged)
