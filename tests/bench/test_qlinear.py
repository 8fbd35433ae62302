"""``python -m kvserve.bench.qlinear`` runs and reports every type it is given."""

from __future__ import annotations

import pytest

from kvserve.bench import qlinear
from kvserve.model.cpu_extension import load_extension, supported_isas


def test_one_layer_of_each_type_is_timed(monkeypatch, capsys) -> None:
    if load_extension() is None:
        pytest.skip("the C++ kernel is unavailable here")
    monkeypatch.setattr(qlinear, "read_bandwidth", lambda: 1e10)
    monkeypatch.setattr(qlinear, "PEAK_ROUNDS", 1000)
    assert qlinear.main(["--types", "Q5_0,Q5_K", "--layers", "1", "--rows", "1,17", "--repeats", "1",
                         "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "integer peak" in out and "of int8 peak" in out
    lines = [line for line in out.splitlines() if line.startswith("|") and "Q5" in line]
    assert [line.split("|")[1].strip() + " " + line.split("|")[2].strip() for line in lines] == \
        ["Q5_0 1", "Q5_K 1", "Q5_0 17", "Q5_K 17"]


def test_a_type_no_kernel_reads_is_refused() -> None:
    with pytest.raises(SystemExit, match="no kernel reads Q3_K"):
        qlinear.main(["--types", "Q3_K"])


@pytest.mark.parametrize("isa", supported_isas())
def test_the_integer_peak_runs_in_every_build(isa: str) -> None:
    """Every build's peak loop runs and counts its multiply-adds: 8 chains x 64 a round, per thread."""
    ext = load_extension(isa)
    if ext is None:
        pytest.skip(f"the {isa} build is unavailable here")
    assert 0 < ext.int8_peak(10_000) < 1e14
    assert ext.amx_peak(1_000) == 0.0 if not ext.amx() else 0 < ext.amx_peak(1_000) < 1e15


@pytest.fixture
def amx_ext(monkeypatch):
    """The kernel where AMX runs (else the test is skipped), the benchmark's peaks and bandwidth cut short."""
    ext = load_extension()
    if ext is None or not ext.amx():
        pytest.skip("this CPU (or its OS) runs no AMX int8 tiles")
    monkeypatch.setattr(qlinear, "read_bandwidth", lambda: 1e10)
    monkeypatch.setattr(qlinear, "PEAK_ROUNDS", 1000)
    monkeypatch.setattr(qlinear, "AMX_PEAK_ROUNDS", 1000)
    yield ext
    ext.set_amx(True)


def test_where_the_cpu_has_amx_each_batch_is_timed_both_ways(amx_ext, capsys) -> None:
    ext = amx_ext
    assert qlinear.main(["--types", "Q4_K", "--layers", "1", "--rows", f"1,{ext.amx_rows}", "--repeats", "2",
                         "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert f"batches of {ext.amx_rows} rows or more take the tiles" in out
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("| Q4_K")]
    assert [c[:2] for c in cells] == [["Q4_K", "1"], ["Q4_K", str(ext.amx_rows)]]
    assert cells[0][-2:] == ["(vector)", "-"]
    assert cells[1][-2].split()[0].endswith("x") and cells[1][-1].endswith("%")
    assert ext.amx()                                  # switched back on


def test_with_amx_switched_off_the_run_keeps_it_off(amx_ext, capsys) -> None:
    """``KVSERVE_AMX=0`` (``set_amx(False)``): one path, the vector unit's, and still off after."""
    ext = amx_ext
    ext.set_amx(False)
    assert qlinear.main(["--types", "Q4_K", "--layers", "1", "--rows", f"{ext.amx_rows}", "--repeats", "1",
                         "--threads", "1"]) == 0
    assert not ext.amx()
    out = capsys.readouterr().out
    assert "take the tiles" not in out and "vector ms" not in out
