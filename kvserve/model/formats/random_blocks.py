"""Random GGUF block bytes, for tests and benchmarks of the kernels that read them in place.

Every code, fifth / high bit and sub-scale byte is random; the fp16 scale fields (where random
bytes would give huge, subnormal or non-finite scales) are overwritten with small random
halves. Any type ``gguf`` knows the block size of, including those no kernel reads (Q3_K).
"""

from __future__ import annotations

import gguf
import numpy as np

# byte offsets of each fp16 scale field in a block, per GGUF type
SCALE_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
                "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,)}


def random_gguf_bytes(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """The raw bytes (uint8, flat) of a [rows, cols] tensor of ``type_name``."""
    if type_name not in SCALE_FIELDS:
        raise ValueError(f"random blocks of {type_name} are not made here (types: {', '.join(SCALE_FIELDS)})")
    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    if cols % block:
        raise ValueError(f"{type_name} rows of {cols} elements are not whole blocks of {block}")
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // block, nbytes), dtype=np.uint8)
    for offset in SCALE_FIELDS[type_name]:
        halves = rng.uniform(-0.02, 0.02, size=(raw.shape[0],)).astype(np.float16)
        raw[:, offset:offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)
