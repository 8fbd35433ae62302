"""Weight formats by name (``--weight-format``): how the model's matrices are held and multiplied.

    auto        gguf where the file has quantized blocks a kernel reads on this device, else native
    native      every matrix dequantized to the compute dtype (float products, oneDNN on CPU)
    gguf        the file's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) read in place;
                other types and float tensors are dequantized (said in the log)
    int8[-gG]   symmetric int8, one float16 scale per G columns (default 32, as Q8_0), quantized at load;
                int8-ch: one scale per output channel
    int4[-gG]   asymmetric int4 in groups of G columns (default 32), quantized at load; the LM head
                (and tied embedding) in int8-g32
    ...+outN    int8 / int4 with outlier protection: the N input channels of each matrix with the
                largest mean activation magnitude (measured at load on a shipped calibration text)
                multiplied in float32, apart (LLM.int8()'s decomposition)

G is a multiple of 32 that divides every matrix's input width (576 and 1536 for SmolLM2: 32, 64
or 192). The format is part of the model's fingerprint, so KV blocks computed with different
weights never share a key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

BASES = ("auto", "native", "gguf", "int8", "int4")
DEFAULT_INT4_GROUP = 32
DEFAULT_INT8_GROUP = 32
_SPEC = re.compile(r"^(?P<base>[a-z0-9]+)(?:-g(?P<group>\d+)|(?P<channel>-ch))?(?:\+out(?P<out>\d+))?$")


@dataclass(frozen=True)
class WeightFormat:
    """A parsed ``--weight-format``. ``group``: columns per scale (None: one per output channel,
    ``int8-ch``); ``outliers``: input channels kept in float32 (int8 / int4 only)."""

    base: str
    group: int | None = None
    outliers: int = 0

    def __post_init__(self) -> None:
        if self.base not in BASES:
            raise ValueError(f"weight format {self.base!r} is not one of {', '.join(BASES)}")
        quantized_here = self.base in ("int8", "int4")
        if self.group is not None and (not quantized_here or self.group < 32 or self.group % 32):
            raise ValueError(f"-g{self.group}: a group is a positive multiple of 32 columns, for int8 / int4 only")
        if self.group is None and self.base == "int4":
            raise ValueError("int4 takes groups (-gG), not one scale per output channel")
        if self.outliers and (not quantized_here or self.outliers > 64):
            raise ValueError(f"+out{self.outliers}: outlier protection keeps 1-64 channels, for int8 / int4 only")

    @property
    def name(self) -> str:
        defaults = {"int4": DEFAULT_INT4_GROUP, "int8": DEFAULT_INT8_GROUP}
        if not self.is_quantized_here or self.group == defaults[self.base]:
            group = ""
        else:
            group = "-ch" if self.group is None else f"-g{self.group}"
        return self.base + group + (f"+out{self.outliers}" if self.outliers else "")

    @property
    def is_quantized_here(self) -> bool:
        return self.base in ("int8", "int4")


def parse_weight_format(text: str) -> WeightFormat:
    """``int4-g64+out8`` -> WeightFormat("int4", 64, 8); ValueError naming what is wrong."""
    m = _SPEC.match(text.strip().lower())
    if m is None:
        raise ValueError(f"weight format {text!r} is not <base>[-g<G>|-ch][+out<N>] with base one of "
                         f"{', '.join(BASES)}")
    base = m["base"]
    if m["channel"] and base != "int8":
        raise ValueError(f"weight format {text!r}: -ch (one scale per output channel) is for int8 only")
    group = int(m["group"]) if m["group"] else {"int4": DEFAULT_INT4_GROUP, "int8": DEFAULT_INT8_GROUP}.get(base)
    return WeightFormat(base, None if m["channel"] else group, int(m["out"] or 0))
