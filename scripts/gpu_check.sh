#!/usr/bin/env bash
# Issue 52's GPU checks in one run on a lent GPU machine (the device tool), in under 10 minutes.
#
# Here, on a CPU machine, once: the packages the GPU machine's image lacks (kvserve imports gguf
# and llguidance; torch, triton, numpy, pytest and pytest-xdist are there), as wheels for its
# Python 3.12, into .whl/, and transformers with its dependencies (about 31 MB) into .whl/hf/
# (ignored by git; the device tool's call carries it):
#
#     bash scripts/gpu_check.sh --fetch-wheels
#
# There (device tool: run with carry [".whl"], timeout_s 600):
#
#     bash scripts/gpu_check.sh [OUT]        # tables and logs under OUT (default: $OUT, else gpu-check/)
#
# Steps, each under its own time limit (and all within TOTAL_LIMIT_S: a step starts only with time
# left, and its limit is cut to what is left), so that a slow one cannot starve the rest:
#   1. env.txt        the device, driver, torch and triton versions
#   2. tests.txt      the GPU tests over the machine's cores (pytest -n), one Triton cache shared by
#                     the workers: the Triton attention kernels (tests/attention/test_triton.py), the
#                     packed-weight kernel (tests/model/formats/test_triton_packed.py), the backends
#                     in the engine (tests/engine/test_attention_backends.py), the CUDA graphs
#                     (tests/engine/test_decode_graphs.py: replay = the eager step's tokens); junit.xml
#                     beside it names every test that ran, so a run cut off by its limit says what it missed
#   3. attention.txt  the Triton decode kernels against the torch path and SDPA on a contiguous
#                     cache, with the device's copy bandwidth (python -m kvserve.bench.attention_kernels_cuda)
#   4. decode-*.txt   the whole decode step (kvserve bench kv-decode --device cuda) on random-weight
#                     models of SmolLM2-135M's and Qwen2.5-Coder-1.5B's shapes (no file travels),
#                     each configuration eager and with CUDA graphs (--graphs both) in the same run,
#                     against the device's read bandwidth: 135M at batch 1 (the graphs' goal), 135M
#                     at 4 x 4,000 per KV format, the 1.5B at 16 x 2,000
#   5. vs-hf.txt      the 1.5B's shape, kvserve with CUDA graphs against transformers' generate with
#                     its static cache on the same weights, batch 1 and 16 (kvserve bench decode);
#                     only where transformers' wheels were carried (.whl/hf/, installed apart and
#                     ahead of the rest for this step alone)
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=(gguf==0.19.0 llguidance==1.9.1)
HF_WHEELS=(transformers==5.25.0)        # with its dependencies, numpy (the image's) left out
TESTS=(tests/attention/test_triton.py tests/model/formats/test_triton_packed.py tests/engine/test_attention_backends.py
       tests/engine/test_decode_graphs.py)
TOTAL_LIMIT_S=${TOTAL_LIMIT_S:-570}
TEST_LIMIT_S=${TEST_LIMIT_S:-240}
BENCH_LIMIT_S=${BENCH_LIMIT_S:-80}
DECODE_LIMIT_S=${DECODE_LIMIT_S:-60}     # each of the three decode runs
HF_LIMIT_S=${HF_LIMIT_S:-90}

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    platforms=(--python-version 3.12 --implementation cp --platform manylinux_2_31_x86_64
               --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    python3 -m pip download --no-deps --only-binary=:all: "${platforms[@]}" -d .whl "${WHEELS[@]}" || exit $?
    python3 -m pip download --only-binary=:all: "${platforms[@]}" -d .whl/hf "${HF_WHEELS[@]}" || exit $?
    rm -f .whl/hf/numpy-*.whl
    exit 0
fi

started=$SECONDS
# the limit of a step that asks for $1 seconds: what is left of TOTAL_LIMIT_S if less (0: skip it)
limit() {
    local left=$(( TOTAL_LIMIT_S - (SECONDS - started) ))
    (( left < 20 )) && { echo 0; return; }
    echo $(( $1 < left ? $1 : left ))
}

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

# run NAME LIMIT COMMAND...: the command's output into $out/NAME.txt, under its limit (skipped,
# saying so, when no time is left)
run() {
    local name=$1 want=$2 secs
    shift 2
    secs=$(limit "$want")
    if (( secs == 0 )); then
        echo "== $name: skipped, no time left of ${TOTAL_LIMIT_S} s" | tee "$out/$name.txt"
        return
    fi
    echo "== $name, at most $secs s"
    timeout -k 10 "$secs" "$@" > "$out/$name.txt" 2>&1
    echo "exit status $? after $(( SECONDS - started )) s of the run" >> "$out/$name.txt"
    tail -n 30 "$out/$name.txt"
}

workers=$(( $(nproc) > 2 ? $(nproc) - 2 : 1 ))
run tests "$TEST_LIMIT_S" python3 -m pytest -q -n "$workers" -p no:cacheprovider --junitxml="$out/junit.xml" "${TESTS[@]}"
run attention "$BENCH_LIMIT_S" python3 -m kvserve.bench.attention_kernels_cuda --repeats 30

# the whole decode step: NAME|kv-decode arguments; bfloat16 (the random models' dtype on CUDA)
DECODES=(
    "decode-135m-b1|--random-model smollm2-135m --seqs 1 --context 512 --format native --format int8"
    "decode-135m-4x4k|--random-model smollm2-135m --seqs 4 --context 4000 --format native --format fp8 --format int8 --format kivi2"
    "decode-1.5b-16x2k|--random-model qwen2.5-coder-1.5b --seqs 16 --context 2000 --format native --format int8"
)
for entry in "${DECODES[@]}"; do
    name=${entry%%|*}
    # shellcheck disable=SC2086  (the arguments split on purpose)
    run "$name" "$DECODE_LIMIT_S" python3 -m kvserve.cli bench kv-decode --device cuda --backend auto --graphs both \
        --steps 32 --repeats 3 --kv-cache-gb 4 --json "$out/$name.json" ${entry#*|}
done

if compgen -G ".whl/hf/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/hf-site .whl/hf/*.whl \
        && run vs-hf "$HF_LIMIT_S" env PYTHONPATH="/tmp/hf-site:$PYTHONPATH" python3 -m kvserve.cli bench decode \
            --random-model qwen2.5-coder-1.5b --device cuda --cuda-graphs --hf-cache static --batch-sizes 1,16 \
            --new-tokens 64 --repeats 3 --json "$out/vs-hf.json"
else
    echo "== vs-hf: skipped, transformers' wheels were not carried (.whl/hf/)" | tee "$out/vs-hf.txt"
fi
echo "done after $(( SECONDS - started )) s"
