#!/usr/bin/env bash
# Issue 52's GPU checks in one run on a lent GPU machine (the device tool), in under 10 minutes.
#
# Here, on a CPU machine, once: the packages the GPU machine's image lacks (kvserve imports gguf
# and llguidance; torch, triton, numpy, pytest and pytest-xdist are there), as wheels for its
# Python 3.12, into .whl/ (ignored by git; the device tool's call carries it):
#
#     bash scripts/gpu_check.sh --fetch-wheels
#
# There (device tool: run with carry [".whl"], timeout_s 600):
#
#     bash scripts/gpu_check.sh [OUT]        # tables and logs under OUT (default: $OUT, else gpu-check/)
#
# Steps, each under its own time limit so that a slow one cannot starve the rest:
#   1. env.txt        the device, driver, torch and triton versions
#   2. tests.txt      the GPU tests over the machine's cores (pytest -n), one Triton cache shared by
#                     the workers: the Triton attention kernels (tests/attention/test_triton.py), the
#                     packed-weight kernel (tests/model/formats/test_triton_packed.py), the backends
#                     in the engine (tests/engine/test_attention_backends.py); junit.xml beside it
#                     names every test that ran, so a run cut off by its limit says what it missed
#   3. attention.txt  the Triton decode kernels against the torch path and SDPA on a contiguous
#                     cache, with the device's copy bandwidth (python -m kvserve.bench.attention_kernels_cuda)
#   4. decode-*.txt   the whole decode step (kvserve bench kv-decode --device cuda) on random-weight
#                     models of SmolLM2-135M's and Qwen2.5-Coder-1.5B's shapes (no file travels),
#                     each configuration eager and with CUDA graphs (--graphs both) in the same run,
#                     against the device's read bandwidth: 135M at batch 1 (the graphs' goal), 135M
#                     at 4 x 4,000 per KV format, the 1.5B at 16 x 2,000
#
# The tests include the CUDA graphs' (tests/engine/test_decode_graphs.py: replay = the eager
# step's tokens). Not here: transformers' generate as the decode baseline (not in the machine's
# image; its wheels and their dependencies would have to travel too).
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=(gguf==0.19.0 llguidance==1.9.1)
TESTS=(tests/attention/test_triton.py tests/model/formats/test_triton_packed.py tests/engine/test_attention_backends.py
       tests/engine/test_decode_graphs.py)
TEST_LIMIT_S=${TEST_LIMIT_S:-270}
BENCH_LIMIT_S=${BENCH_LIMIT_S:-100}
DECODE_LIMIT_S=${DECODE_LIMIT_S:-70}     # each of the three decode runs

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 \
        -d .whl "${WHEELS[@]}"
    exit $?
fi

out=${1:-${OUT:-gpu-check}}
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "could not install the carried wheels" | tee "$out/env.txt"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
unset TRITON_INTERPRET

{
    date -u
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "no CUDA device: nothing to check" | tee -a "$out/env.txt"; exit 1; }

workers=$(( $(nproc) > 2 ? $(nproc) - 2 : 1 ))
echo "== tests: ${TESTS[*]} on $workers workers, at most ${TEST_LIMIT_S} s"
timeout -k 10 "$TEST_LIMIT_S" python3 -m pytest -q -n "$workers" -p no:cacheprovider --junitxml="$out/junit.xml" \
    "${TESTS[@]}" > "$out/tests.txt" 2>&1
echo "tests exit status $?" >> "$out/tests.txt"
tail -n 25 "$out/tests.txt"

echo "== attention kernels, at most ${BENCH_LIMIT_S} s"
timeout -k 10 "$BENCH_LIMIT_S" python3 -m kvserve.bench.attention_kernels_cuda --repeats 30 > "$out/attention.txt" 2>&1
echo "bench exit status $?" >> "$out/attention.txt"
cat "$out/attention.txt"

# the whole decode step: (name, kv-decode arguments); bfloat16 (the random models' dtype on CUDA)
DECODES=(
    "decode-135m-b1|--random-model smollm2-135m --seqs 1 --context 512 --format native --format int8"
    "decode-135m-4x4k|--random-model smollm2-135m --seqs 4 --context 4000 --format native --format fp8 --format int8 --format kivi2"
    "decode-1.5b-16x2k|--random-model qwen2.5-coder-1.5b --seqs 16 --context 2000 --format native --format int8"
)
for entry in "${DECODES[@]}"; do
    name=${entry%%|*}
    echo "== $name, at most ${DECODE_LIMIT_S} s"
    # shellcheck disable=SC2086  (the arguments split on purpose)
    timeout -k 10 "$DECODE_LIMIT_S" python3 -m kvserve.cli bench kv-decode --device cuda --backend auto --graphs both \
        --steps 32 --repeats 3 --kv-cache-gb 4 --json "$out/$name.json" ${entry#*|} > "$out/$name.txt" 2>&1
    echo "bench exit status $?" >> "$out/$name.txt"
    cat "$out/$name.txt"
done
