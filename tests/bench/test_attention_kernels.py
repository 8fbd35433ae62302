"""``python -m kvserve.bench.attention_kernels`` runs on each model's attention shape."""

from __future__ import annotations

import pytest

from kvserve.attention import cpu
from kvserve.bench import attention_kernels
from kvserve.bench.attention_kernels import SHAPES, Stat


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-1.5b"])
def test_each_shape_is_timed_against_the_torch_path(name: str, monkeypatch, capsys) -> None:
    if not cpu.is_available():
        pytest.skip("the C++ CPU attention kernel is unavailable here")
    monkeypatch.setattr(attention_kernels, "read_bandwidth", lambda nbytes, repeats: Stat(1.0, 1.0, 1.0))
    attention_kernels.main(["--formats", "fp16,int8", "--shapes", "1x40", "--layers", "1", "--repeats", "1",
                            "--threads", "1", "--model-shape", name])
    out = capsys.readouterr().out
    shape = SHAPES[name]
    assert f"{shape.kv_heads} KV heads x {shape.group} query heads, head_dim {shape.head_dim}" in out
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("|")]
    rows = [r for r in cells if r[0] == "1x40"]
    assert [r[1] for r in rows] == ["fp16", "int8"]
    # the KV bytes of one call: 3 blocks of 16 tokens, both halves (int8: a float16 scale per row)
    rows_per_half = 3 * 16 * shape.kv_heads
    assert [float(r[7]) for r in rows] == [round(2 * rows_per_half * shape.head_dim * 2 / 1e6, 2),
                                           round(2 * rows_per_half * (shape.head_dim + 2) / 1e6, 2)]
    assert all(float(r[-1]) < 1e-4 for r in rows)  # the kernel agrees with the torch path
