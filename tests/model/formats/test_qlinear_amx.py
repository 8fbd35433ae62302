"""The products' AMX path (kvserve/model/csrc/amx.h), where this CPU has AMX's int8 tiles.

Batches of ``amx_rows`` rows and more take the tiles; their integer sums are those of the
vector unit's instructions and the float steps the same, in the same order, so every result is
checked bit for bit against the same call with the tiles switched off (itself checked against
float64 references in test_qlinear_cpu.py), and once more against the references here. Skipped
where the CPU (or the OS) gives no AMX: CI boxes without it run the vector paths only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
import torch
from test_qlinear_cpu import (
    FORMATS,
    alternating_ones,
    check,
    every_kind_stacked,
    is_k_quant,
    largest_codes,
    weights,
)

from kvserve.model.cpu_extension import load_extension, supported_isas
from kvserve.model.formats.cpu import CpuPackedProduct
from kvserve.model.formats.packing import GGUF_TYPES, Outliers, quantize_int4


@pytest.fixture
def ext() -> Iterator[object]:
    if supported_isas()[0] != "avx512vnni":
        pytest.skip("AMX is built into the AVX-512 VNNI build only; this CPU has no AVX-512 VNNI")
    module = load_extension("avx512vnni")
    if module is None or not module.amx():
        pytest.skip("this CPU (or its OS) runs no AMX int8 tiles")
    yield module
    module.set_amx(True)


def both_ways(ext, run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``run()`` with the tiles, then with the vector unit alone."""
    ext.set_amx(True)
    tiles = run()
    ext.set_amx(False)
    vector = run()
    ext.set_amx(True)
    return tiles, vector


def test_amx_takes_batches_from_its_row_count(ext) -> None:
    assert ext.amx_rows == 64
    assert ext.set_amx(False) is True and ext.amx() is False
    assert ext.set_amx(True) is False and ext.amx() is True


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_gives_the_vector_units_bits(ext, fmt: str) -> None:
    cols = 512 if is_k_quant(fmt) else 192
    w = weights(fmt, 40, cols, seed=len(fmt))
    product = CpuPackedProduct(ext, w)
    g = torch.Generator().manual_seed(3)
    for rows in (64, 65, 100, 129):                    # whole groups of 16 and a padded last one
        x = torch.randn(rows, cols, generator=g)
        tiles, vector = both_ways(ext, lambda x=x: product(x))
        assert torch.equal(tiles, vector), rows
        if rows == 65:
            check(tiles, x, w)


def test_a_rows_result_never_depends_on_its_batch(ext) -> None:
    """Rows of a batch on the tiles equal the same rows alone (one row: the decode path) and in
    batches too small for the tiles, across segments of every kind in one weight."""
    product = CpuPackedProduct(ext, every_kind_stacked())
    x = torch.randn(90, 256, generator=torch.Generator().manual_seed(0))
    full = product(x)
    for rows in (1, 9, 33, 63, 64, 80):
        assert torch.equal(product(x[:rows]), full[:rows]), rows
    for row in (0, 47, 89):
        assert torch.equal(product(x[row:row + 1]), full[row:row + 1]), row


def test_fused_forms_bias_and_outliers_give_the_vector_units_bits(ext) -> None:
    g = torch.Generator().manual_seed(5)
    product = CpuPackedProduct(ext, weights("Q4_K", 48, 256, 1))
    x = torch.randn(70, 256, generator=g) * 3
    norm = torch.rand(256, generator=g) + 0.5
    residual = torch.randn(70, 48, generator=g)
    down = CpuPackedProduct(ext, weights("Q6_K", 48, 256, 2))
    gate_up = torch.randn(70, 512, generator=g)
    for run in (lambda: product.after_norm(x, norm, 1e-5), lambda: product.add_into(residual.clone(), x),
                lambda: down.swiglu_add_into(residual.clone(), gate_up), lambda: down.geglu(gate_up)):
        tiles, vector = both_ways(ext, run)
        assert torch.equal(tiles, vector)
    dense = torch.randn(40, 96, generator=g) * 0.05
    channels = torch.tensor([3, 50, 95], dtype=torch.int32)
    kept = dense.clone()
    kept[:, channels.long()] = 0.0
    w = replace(quantize_int4(kept, 32), bias=torch.randn(40, generator=g),
                outliers=Outliers(channels, dense[:, channels.long()].clone()))
    xo = torch.randn(77, 96, generator=g)
    xo[:, channels.long()] *= 40
    outlying = CpuPackedProduct(ext, w)
    tiles, vector = both_ways(ext, lambda: outlying(xo))
    assert torch.equal(tiles, vector)
    check(tiles, xo, w)


@pytest.mark.parametrize("fmt", list(GGUF_TYPES))
def test_the_largest_codes_times_the_largest_activations_are_exact(ext, fmt: str) -> None:
    w = largest_codes(fmt)
    x = alternating_ones(64, w.cols)
    tiles, vector = both_ways(ext, lambda: CpuPackedProduct(ext, w)(x))
    assert torch.equal(tiles, vector)
    check(tiles, x, w)


def test_kvserve_amx_switches_the_tiles_off_and_refuses_other_values(ext, monkeypatch) -> None:
    load = load_extension.__wrapped__               # uncached: each call reads the variable again
    monkeypatch.setenv("KVSERVE_AMX", "0")
    assert load("avx512vnni").amx() is False
    monkeypatch.setenv("KVSERVE_AMX", "1")
    assert load("avx512vnni").amx() is True
    monkeypatch.setenv("KVSERVE_AMX", "off")
    with pytest.raises(ValueError, match="KVSERVE_AMX='off': set it to 0"):
        load("avx512vnni")
