"""The model's C++ CPU kernels (kvserve/model/csrc/: products with quantized weights read in
place, RoPE) as an extension built on first use (kvserve/extensions.py): AVX-512 with VNNI's
integer dot products where this CPU has them, else AVX2 + FMA + F16C (maddubs), else a
portable scalar build."""

from __future__ import annotations

import functools
import os
from types import MappingProxyType, ModuleType

from kvserve.extensions import CppExtension, load
from kvserve.extensions import supported_isas as isas_of

_AVX2 = ("-mavx2", "-mfma", "-mf16c")
QLINEAR = CppExtension(
    prefix="kvserve_cpu_layers",
    sources=tuple(f"model/csrc/{name}" for name in ("layers.cpp", "qkernel.h", "qvec.h", "amx.h", "rate.h", "rope.h", "norms.h", "rowmax.h")),
    isas=MappingProxyType({
        "avx512vnni": (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
                       "-mamx-tile", "-mamx-int8"),   # AMX runs only where amx.h finds it
        "avx2": _AVX2,
        "scalar": (),
    }),
    cpu_flags=MappingProxyType({
        "avx512vnni": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}),
        "avx2": frozenset({"avx2", "fma", "f16c"}),
    }),
    title="the C++ model kernels (quantized weights, RoPE, norms)",
    fallback="quantized weight formats are unavailable on this CPU (native float weights work, RoPE in torch)",
)


def supported_isas() -> list[str]:
    """The kernel's instruction sets this CPU runs, widest first (``scalar`` last)."""
    return isas_of(QLINEAR)


@functools.cache
def load_extension(isa: str | None = None) -> ModuleType | None:
    """The compiled module (``isa``: None for the widest this CPU runs), or None after one log
    line saying why it cannot be built. ``KVSERVE_AMX=0`` keeps the products off AMX's tiles
    (csrc/amx.h) where the CPU has them; ``1`` (the default) lets them take long batches."""
    amx = os.environ.get("KVSERVE_AMX", "1").strip()
    if amx not in ("0", "1"):
        raise ValueError(f"KVSERVE_AMX={amx!r}: set it to 0 (no AMX tiles) or 1 (the default)")
    ext = load(QLINEAR, isa)
    if ext is not None:
        ext.set_amx(amx == "1")
    return ext
