"""The C++ quantized-weight kernel (kvserve/model/csrc/) against references.

Every GGUF type the kernels read (random block bytes: codes, sub-scales and K-quant scales all
random) and the int8 / int4 formats, at several row counts and output widths that are not
multiples of the 16-row tile, on every instruction set this CPU runs:

* exactly the kernel's arithmetic, in float64 (blocks.mirror: the activations rounded to int8
  per half block of 16 as the kernel rounds them): within float32 accumulation error, 4e-6 of the
  sum of |terms| of each output (about 60 ulp; a wrong code, scale or lane is off by far more);
* the float product with the dequantized weights (``gguf.quants.dequantize`` of the same
  bytes for GGUF types): within the activations' rounding, |error| <= sum |w| x amax / 254 per
  block, plus the same float slack;
* a row's result never depends on the rest of its batch: bit for bit.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from blocks import mirror, quantize_activations, random_packed

from kvserve.model.cpu_extension import load_extension, supported_isas
from kvserve.model.formats.cpu import CpuPackedEmbedding, CpuPackedProduct
from kvserve.model.formats.packing import (
    GGUF_TYPES,
    Outliers,
    PackedWeight,
    dequantize,
    pack_gguf,
    quantize_int4,
    quantize_int8,
    stack,
)
from kvserve.model.formats.random_blocks import SCALE_FIELDS, random_gguf_bytes
from kvserve.model.linear import rms_norm

ISAS = supported_isas()
ROWS = (1, 2, 7, 16, 37)
REL = 4e-6


def ext_for(isa: str):
    ext = load_extension(isa)
    if ext is None:
        pytest.skip(f"the {isa} build of the kernel is unavailable here")
    return ext


def weights(name: str, rows: int, cols: int, seed: int = 0) -> PackedWeight:
    if name in GGUF_TYPES:
        return random_packed(name, rows, cols, seed)
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05
    kind, _, group = name.partition("-")
    size = cols if group == "ch" else int(group[1:])
    return quantize_int8(w, size) if kind == "int8" else quantize_int4(w, size)


FORMATS = [*GGUF_TYPES, "int8-g32", "int8-ch", "int4-g32", "int4-g64"]


def is_k_quant(fmt: str) -> bool:
    """Whether ``fmt`` is one of the K-quants (their matrices take K in whole super-blocks of 256)."""
    return fmt in GGUF_TYPES and GGUF_TYPES[fmt][1] == 256


def check(y: torch.Tensor, x: torch.Tensor, w: PackedWeight) -> None:
    ref, bound = mirror(x, w)
    err = (y.double() - ref).abs()
    assert bool((err <= REL * bound + 1e-30).all()), float((err / (bound + 1e-30)).max())
    # against the float product: the activations' rounding, at most half a step per element
    float_ref = x.double() @ dequantize(w).double().T + (0 if w.bias is None else w.bias.double())
    step = x.double().reshape(x.shape[0], -1, 16).abs().amax(-1) / 127 / 2          # [rows, halves]
    wsum = dequantize(w).double().abs().reshape(w.rows, -1, 16).sum(-1)              # [out, halves]
    assert bool(((y.double() - float_ref).abs() <= step @ wsum.T + REL * bound + 1e-12).all())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_at_every_row_count_matches_the_references(isa: str, fmt: str) -> None:
    ext = ext_for(isa)
    cols = 512 if is_k_quant(fmt) else 192                 # K-quants: whole super-blocks
    w = weights(fmt, 40, cols, seed=len(fmt))
    product = CpuPackedProduct(ext, w)
    g = torch.Generator().manual_seed(1)
    for rows in ROWS:
        x = torch.randn(rows, cols, generator=g)
        check(product(x), x, w)


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_chunks_of_512_rows(fmt: str) -> None:
    """Past 4 x the kernel's rows at once (32 with AVX-512, 16 with AVX2) a tile is unpacked once
    into scratch and every row runs over it."""
    ext = ext_for(ISAS[0])
    cols = 256 if is_k_quant(fmt) else 128
    w = weights(fmt, 24, cols, seed=3)
    x = torch.randn(512, cols, generator=torch.Generator().manual_seed(2))
    check(CpuPackedProduct(ext, w)(x), x, w)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", list(GGUF_TYPES))
def test_the_largest_codes_times_the_largest_activations_are_exact(isa: str, fmt: str) -> None:
    """Every code and sub-scale at its largest, every activation code at +-127: the integer
    sums at their largest (the AVX2 kernel sums a half block's products in int16 before widening
    them; a saturated sum would be off by thousands of steps): streamed or unpacked in registers
    (1, 2 and 9 rows: decode rows and a verify step's groups of rows) and unpacked into scratch (33
    rows, past 4 x the kernel's rows at once)."""
    ext = ext_for(isa)
    w = largest_codes(fmt)
    product = CpuPackedProduct(ext, w)
    for rows in (1, 2, 9, 33):
        x = alternating_ones(rows, w.cols)
        check(product(x), x, w)


def every_kind_stacked() -> PackedWeight:
    """One weight of 8 segments, one per GGUF kind, most of them not whole tiles of 16 rows."""
    return stack([weights("Q4_1", 40, 256, 1), weights("Q6_K", 24, 256, 2), weights("Q8_0", 8, 256, 3),
                  weights("Q5_0", 16, 256, 4), weights("Q5_K", 20, 256, 5), weights("Q4_K", 16, 256, 6),
                  weights("Q4_0", 8, 256, 7), weights("Q5_1", 8, 256, 8)])


def largest_codes(fmt: str) -> PackedWeight:
    """16 rows in GGUF type ``fmt`` with every code and sub-scale byte at its largest (0xFF), the
    fp16 scales random."""
    cols = 256 if is_k_quant(fmt) else 64
    nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[fmt]][1]
    raw = random_gguf_bytes(fmt, 16, cols, seed=0).reshape(-1, nbytes)
    scales = {o for f in SCALE_FIELDS[fmt] for o in (f, f + 1)}
    raw[:, [i for i in range(nbytes) if i not in scales]] = 0xFF
    return pack_gguf(fmt, raw.reshape(-1), 16, cols)


def alternating_ones(rows: int, cols: int) -> torch.Tensor:
    """Rows of +1 and -1 in turn: every activation code at +-127."""
    x = torch.ones(rows, cols)
    x[1::2] = -1.0
    return x


@pytest.mark.parametrize("isa", ISAS)
def test_a_rows_result_never_depends_on_its_batch(isa: str) -> None:
    ext = ext_for(isa)
    product = CpuPackedProduct(ext, every_kind_stacked())
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(0))
    full = product(x)
    for rows in (1, 2, 3, 8, 9, 17, 33):
        assert torch.equal(product(x[:rows]), full[:rows]), rows
    for row in (0, 13, 39):
        assert torch.equal(product(x[row:row + 1]), full[row:row + 1]), row
    assert torch.equal(product(x[::3]), full[::3])              # a strided batch


def test_gguf_bytes_dequantize_exactly_as_gguf_does_and_the_kernel_reads_the_same_values() -> None:
    """The packed planes are the file's bits moved: dequantizing them (in torch and in C++)
    gives gguf.quants.dequantize's values exactly, Q/K row permutation included."""
    ext = ext_for(ISAS[0])
    for type_name in GGUF_TYPES:
        rows, cols = 48, 512
        raw = random_gguf_bytes(type_name, rows, cols, seed=7)
        expected = gguf.quants.dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType[type_name])
        order = np.random.default_rng(0).permutation(rows)
        w = pack_gguf(type_name, raw, rows, cols, order)
        assert torch.equal(dequantize(w), torch.from_numpy(expected[order].astype(np.float32))), type_name
        ids = torch.tensor([0, 47, 5, 5, 16])
        looked_up = CpuPackedEmbedding(CpuPackedProduct(ext, w))(ids)
        assert torch.equal(looked_up, dequantize(w)[ids]), type_name
        assert w.nbytes <= rows * cols // GGUF_TYPES[type_name][1] * GGUF_TYPES[type_name][2] * 1.03


def test_fused_forms_equal_their_compositions() -> None:
    """after_norm, add_into and swiglu_add_into: the prologue (RMSNorm, SwiGLU) and the add in
    the kernel against torch's composition, within the activations' rounding (the prologue's
    last bits may round an activation code the other way: a full step)."""
    ext = ext_for(ISAS[0])
    g = torch.Generator().manual_seed(5)
    w = weights("Q4_1", 48, 128, 1)
    product = CpuPackedProduct(ext, w)
    x = torch.randn(9, 128, generator=g) * 3
    norm = torch.rand(128, generator=g) + 0.5
    normed = rms_norm(x, norm, 1e-5)
    tol = (normed.abs().reshape(9, -1, 16).amax(-1) / 127) @ dequantize(w).abs().reshape(48, -1, 16).sum(-1).T
    torch.testing.assert_close(product.after_norm(x, norm, 1e-5).double(), product(normed).double(),
                               atol=float(tol.max()) + 1e-5, rtol=0)
    residual = torch.randn(9, 48, generator=g)
    got = product.add_into(residual.clone(), x)
    assert torch.equal(got, residual + product(x))
    down = CpuPackedProduct(ext, weights("Q8_0", 48, 64, 2))
    gate_up = torch.randn(9, 128, generator=g)
    gate, up = gate_up.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up
    tol = (act.abs().reshape(9, -1, 16).amax(-1) / 127) @ dequantize(down.packed).abs().reshape(48, -1, 16).sum(-1).T
    torch.testing.assert_close(down.swiglu_add_into(residual.clone(), gate_up).double(),
                               (residual + down(act)).double(), atol=float(tol.max()) + 1e-5, rtol=0)



@pytest.mark.parametrize("isa", ISAS)
def test_the_geglu_prologue_equals_its_composition(isa: str) -> None:
    """Gemma's GeGLU before the down product, in the kernel (GELU's tanh form from the kernel's
    exp2) against torch's gelu(approximate="tanh") * up, within the activations' rounding, on
    every instruction set; large gates too (tanh saturating, both signs)."""
    ext = ext_for(isa)
    g = torch.Generator().manual_seed(11)
    down = CpuPackedProduct(ext, weights("Q5_0", 48, 64, 3))
    gate_up = torch.randn(9, 128, generator=g) * torch.tensor([1.0] * 32 + [12.0] * 32 + [1.0] * 64)
    gate, up = gate_up.chunk(2, dim=-1)
    act = torch.nn.functional.gelu(gate, approximate="tanh") * up
    tol = (act.abs().reshape(9, -1, 16).amax(-1) / 127) @ dequantize(down.packed).abs().reshape(48, -1, 16).sum(-1).T
    torch.testing.assert_close(down.geglu(gate_up).double(), down(act).double(), atol=float(tol.max()) + 1e-4,
                               rtol=0)


def test_bias_and_outlier_channels() -> None:
    ext = ext_for(ISAS[0])
    g = torch.Generator().manual_seed(9)
    dense = torch.randn(40, 96, generator=g) * 0.05
    channels = torch.tensor([3, 50, 95], dtype=torch.int32)
    outlier_w = dense[:, channels.long()].clone()
    kept = dense.clone()
    kept[:, channels.long()] = 0.0
    from dataclasses import replace
    w = replace(quantize_int4(kept, 32), bias=torch.randn(40, generator=g), outliers=Outliers(channels, outlier_w))
    x = torch.randn(5, 96, generator=g)
    x[:, channels.long()] *= 40                              # outliers: far outside the others' range
    y = CpuPackedProduct(ext, w)(x)
    check(y, x, w)


def test_bad_inputs_are_refused_with_what_is_wrong() -> None:
    ext = ext_for(ISAS[0])
    product = CpuPackedProduct(ext, weights("Q4_0", 32, 64))
    with pytest.raises(ValueError, match="x has 63 columns, the weight takes 64"):
        product(torch.zeros(2, 63))
    with pytest.raises(ValueError, match="x must be a CPU float32 matrix"):
        product(torch.zeros(2, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="rows must be a contiguous CPU int64 vector|outside"):
        CpuPackedEmbedding(product)(torch.tensor([32]))
    with pytest.raises(ValueError, match="not whole blocks of 32"):
        pack_gguf("Q4_0", np.zeros(18, dtype=np.uint8), 1, 48)
    with pytest.raises(ValueError, match="GGUF type Q3_K is not read in place"):
        pack_gguf("Q3_K", np.zeros(110, dtype=np.uint8), 1, 256)


def test_int8_and_int4_quantization_round_trip_within_half_a_step() -> None:
    w = torch.randn(33, 128, generator=torch.Generator().manual_seed(4))
    for packed, levels in ((quantize_int8(w, 32), 127), (quantize_int8(w, 128), 127), (quantize_int4(w, 64), 15)):
        back = dequantize(packed)
        group = packed.segments[0].group
        blocks = w.reshape(33, -1, group)
        span = blocks.abs().amax(-1) if levels == 127 else blocks.amax(-1) - blocks.amin(-1)
        step = (span / levels).repeat_interleave(group, dim=1)
        assert bool(((back - w).abs() <= step * 0.5 + step * 2e-3 + 1e-7).all())   # + float16 scale rounding


def test_activation_rounding_reference_is_the_kernels() -> None:
    """blocks.quantize_activations is what the kernel computes: a one-row identity weight (int8,
    exact codes) returns the rounded activations themselves."""
    ext = ext_for(ISAS[0])
    eye = torch.eye(64) * (127 / 128)                    # scale 2^-7, code 127: exact in float16
    w = quantize_int8(eye, 32)
    assert torch.equal(dequantize(w), eye)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(CpuPackedProduct(ext, w)(x), quantize_activations(x) * (127 / 128), atol=0, rtol=3e-7)


def test_the_default_models_products_on_real_activations(default_model) -> None:
    """The file's own blocks (Q4_1 layers, Q8_0 embedding / LM head) on real hidden states:
    the kernel's arithmetic exactly as blocks.mirror computes it (real activations hit rounding
    ties that random ones do not), and what the activations' int8 rounding costs against the
    float product, relative to its norm (measured: 2e-3 to 6e-3 per product)."""
    ext = ext_for(ISAS[0])
    w = default_model.weights
    ids = torch.tensor(default_model.tokenizer.encode("The capital of France is Paris, a city on the Seine."))
    embed = w["model.embed_tokens.weight"]
    assert isinstance(embed, PackedWeight)
    h = CpuPackedEmbedding(CpuPackedProduct(ext, embed))(ids)
    assert torch.equal(h, dequantize(embed)[ids])
    for layer in (0, 15, 29):
        p = f"model.layers.{layer}."
        x = rms_norm(h, w[p + "input_layernorm.weight"], 1e-5)
        qkv = stack([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        y = CpuPackedProduct(ext, qkv)(x)
        ref, bound = mirror(x, qkv)
        assert bool(((y.double() - ref).abs() <= REL * bound).all())
        float_ref = x @ dequantize(qkv).T
        assert float((y - float_ref).norm() / float_ref.norm()) < 1e-2
    head = CpuPackedProduct(ext, embed).head(h)
    ref, bound = mirror(h, embed)
    assert bool(((head.double() - ref).abs() <= REL * bound).all())
