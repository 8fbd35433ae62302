"""`kvserve build-extensions` (kvserve.extensions.build_ahead): what it builds, finds and reports."""

from __future__ import annotations

import io
import shutil
from argparse import Namespace

import pytest

from kvserve import cli
from kvserve.attention.cpu_extension import ATTENTION
from kvserve.extensions import build_ahead, cache_dir, detect_isa, extension_name, load, supported_isas
from kvserve.kv.budget.pages import PAGES
from kvserve.model.cpu_extension import QLINEAR

NAMED = {"kvserve.model.cpu_extension:QLINEAR": QLINEAR, "kvserve.attention.cpu_extension:ATTENTION": ATTENTION,
         "kvserve.kv.budget.pages:PAGES": PAGES}


def test_the_cli_names_every_extension():
    assert set(cli.EXTENSIONS) == set(NAMED)


def test_cached_builds_are_found_without_building(tmp_path, monkeypatch):
    """Builds already in the cache dir are reported ``cached`` and nothing is compiled: the
    compiler named is missing, so a build would fail."""
    pages = [(isa, extension_name(PAGES, isa)) for isa in supported_isas(PAGES)]
    for isa, _ in pages:
        assert load(PAGES, isa) is not None        # the user's cache (built by setup.sh or earlier tests)
    built = cache_dir()
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    (tmp_path / "ext").mkdir()
    for _, name in pages:
        shutil.copy(built / f"{name}.so", tmp_path / "ext" / f"{name}.so")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))

    widest = build_ahead(["kvserve.kv.budget.pages:PAGES"])
    assert [(r.isa, r.status, r.path) for r in widest] == [
        (detect_isa(PAGES), "cached", tmp_path / "ext" / f"{extension_name(PAGES, detect_isa(PAGES))}.so")]
    every = build_ahead(["kvserve.kv.budget.pages:PAGES"], every_isa=True, jobs=2)
    assert [(r.isa, r.status, r.path.name) for r in every] == [(isa, "cached", f"{name}.so") for isa, name in pages]
    assert every[0].title == PAGES.title


def test_a_failed_build_is_reported_and_the_command_fails(tmp_path, monkeypatch):
    """In an empty cache dir with no compiler every build runs (in worker processes) and fails;
    the command says so and exits 1."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    out = io.StringIO()
    assert cli.cmd_build_extensions(Namespace(every_isa=False, jobs=2), out) == 1
    lines = out.getvalue().splitlines()
    assert [line.split()[:2] for line in lines[:3]] == [["failed", detect_isa(ext)] for ext in NAMED.values()]
    assert lines[3] == (f"0 of 3 ready in {tmp_path / 'ext'}; 3 failed (the warnings above say why, and what "
                        "kvserve does without them)")


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="jobs must be >= 1, got 0"):
        build_ahead(["kvserve.kv.budget.pages:PAGES"], jobs=0)
    with pytest.raises(TypeError, match="'kvserve.kv.budget.pages:HOST' names no CppExtension"):
        build_ahead(["kvserve.kv.budget.pages:HOST"])


def test_the_command_line_parses():
    args = cli.build_parser().parse_args(["build-extensions", "--every-isa", "--jobs", "3"])
    assert (args.command, args.every_isa, args.jobs) == ("build-extensions", True, 3)
