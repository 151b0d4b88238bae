#!/usr/bin/env bash
# One command for a GPU machine, from the repository root, in five suites of one 10-minute call
# each:
#
#     bash bench/gpu_check.sh                  # core: the float ops and models (issue 4)
#     GPU_SUITE=quant bash bench/gpu_check.sh  # the quantized formats (issue 6)
#     GPU_SUITE=serve bash bench/gpu_check.sh  # python -m server end to end (issue 11)
#     GPU_SUITE=tuned bash bench/gpu_check.sh  # the tuned decode kernels behind --kernels (issue 12)
#     GPU_SUITE=tuned_prefill bash bench/gpu_check.sh  # prefill attention fa2/fa3, fused MoE
#
# The GPU machine has no network and lacks part of what Taper and its tests import (nvidia-cutlass
# for the build, gguf, compressed-tensors, pydantic, the server stack, the openai client):
# `bash bench/gpu_wheels.sh` downloads them for its Python 3.12 into the ignored folder .whl (its
# header lists them); name .whl in the device call's `carry`. Setup fails, naming the module, when
# one is still missing, so no test fails later on an import.
#
# 1. setup: prints the machine (nvidia-smi, versions), installs carried wheels (.whl/*.whl) into
#    /tmp/site, builds Taper for sm_90a (TAPER_CUDA_ARCHS=90a pip install --no-build-isolation
#    --no-deps -e .; setting the variable also makes the build compile the CUDA kernels where
#    nvidia-smi shows no GPU), checks that every module the suites import is there and that the
#    CUDA extension imports and sees a device;
# core and quant suites:
# 2. gpu_tests: tests/gpu (one process per file, so a broken CUDA context in one cannot fail the
#    others);
# 3. kernels: python -m bench.kernels (--quick when little time is left), JSON beside the log;
# 4. cpu_tests: the CPU tests that matter most there (the engine and its import chain, the
#    extensions' exports; CI runs them too, so they come after the GPU-only steps);
# 5. throughput: python -m bench.throughput --backend cuda (reported, never fails the script);
# serve suite:
# 2. serve: python -m bench.serve_check (a Llama-3.2-1B-shaped checkpoint made on the device,
#    python -m server, a streamed chat through the openai client, bench.serve at concurrency 1,
#    16, 64, 256, /metrics idle afterwards, the table with the TPOT bound).
#
# Everything goes to ${OUT:-/tmp/out} (at most 8 files: the steps' logs, kernels.json,
# throughput.json or server.log and serve_table.md, summary.txt). Each step runs under `timeout`
# with its own cap, clamped so the whole stays under 9 minutes; a step that does not get its
# minimum is skipped. The summary is printed last. Exit status: 0 when every step but throughput
# passed.
set -o pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/.." || exit 2
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
TOTAL_S=530                      # 8 min 50 s for everything
END=$((SECONDS + TOTAL_S))

NAMES=() RESULTS=() TIMES=()

# run_step NAME CAP MIN CMD...: CMD under timeout (SIGINT first, so pytest prints its summary),
# output to $OUT/NAME.log and the terminal; the limit is CAP clamped to the time left, and the step
# is skipped when that is under MIN.
run_step() {
    local name=$1 cap=$2 min=$3
    shift 3
    local left=$((END - SECONDS)) limit=$cap
    ((left < limit)) && limit=$left
    if ((limit < min)); then
        echo "==== $name: skipped, ${left}s left (needs ${min}s)" | tee -a "$OUT/$name.log"
        NAMES+=("$name") RESULTS+=("skipped (no time)") TIMES+=(0)
        return 99
    fi
    echo
    echo "==== $name (limit ${limit}s): $*"
    local t0=$SECONDS rc
    timeout -s INT -k 15 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
    rc=$?
    local res="ok"
    if ((rc == 124 || rc == 137)); then
        res="TIMEOUT after ${limit}s"
    elif ((rc != 0)); then
        res="FAILED (rc $rc)"
    fi
    NAMES+=("$name") RESULTS+=("$res") TIMES+=($((SECONDS - t0)))
    return $rc
}

skip_step() {
    NAMES+=("$1") RESULTS+=("not run: $2") TIMES+=(0)
    echo "==== $1: not run: $2" | tee -a "$OUT/$1.log"
}

setup() {
    echo "== $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(hostname), $(nproc) cores"
    nvidia-smi || echo "nvidia-smi failed"
    nvcc --version | tail -2 || echo "no nvcc"
    "$PY" - <<'PY'
import importlib, platform, sys
print("python", sys.version.split()[0], platform.machine())
for name in ("numpy", "cupy", "ml_dtypes", "Cython", "setuptools", "torch", "transformers",
             "safetensors", "tokenizers", "pytest"):
    try:
        print(f"  {name} {importlib.import_module(name).__version__}")
    except Exception as e:
        print(f"  {name}: {type(e).__name__}: {e}")
PY
    if [ -d .git ]; then git log -1 --format='commit %h %s' 2>/dev/null; fi
    if compgen -G ".whl/*.whl" > /dev/null; then
        echo "== installing carried wheels: $(ls .whl)"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || return 1
    fi
    echo "== build (TAPER_CUDA_ARCHS=90a)"
    TAPER_CUDA_ARCHS=90a "$PY" -m pip install --no-build-isolation --no-deps -e . || return 1
    cat build/taper-build.log 2>/dev/null     # what setup.py built, each nvcc file's time
    local fa3_obj
    fa3_obj=$(ls build/cuda-objects/cuda__attention_prefill_fa3.cu.o 2>/dev/null | head -1)
    if [ "$SUITE" = tuned_prefill ]; then  # kernels prefill=fa3: HGMMA in its SASS, no local memory
        if [ -n "$fa3_obj" ] && command -v cuobjdump > /dev/null; then
            echo "== fa3 SASS: $(cuobjdump -sass "$fa3_obj" | grep -c HGMMA) HGMMA," \
                 "$(cuobjdump -sass "$fa3_obj" | grep -cE '\b(LDL|STL)\b') LDL/STL"
        else
            echo "== fa3 SASS: not checked (object '${fa3_obj}' or cuobjdump missing)"
        fi
    fi
    "$PY" - <<'PY' || return 1
import importlib
need = {"gguf": "gguf", "compressed_tensors": "compressed-tensors", "pydantic": "pydantic",
        "quart": "quart", "hypercorn": "hypercorn", "openai": "openai", "jsonschema": "jsonschema",
        "threadpoolctl": "threadpoolctl", "server.app": "the server stack"}
missing = []
for module, wheel in need.items():
    try:
        importlib.import_module(module)
    except Exception as e:
        missing.append(f"{module} ({wheel}: {type(e).__name__}: {e})")
if missing:
    raise SystemExit("missing on this machine, carry them (bash bench/gpu_wheels.sh): "
                     + "; ".join(missing))
print("every module the suites import is here")
PY
    "$PY" -c "
import pyx.cuda_backend as cb
n = cb.device_count()
print(f'pyx.cuda_backend imports: {n} device(s)')
raise SystemExit(0 if n > 0 else 3)
"
}

gpu_tests() {  # one process per file: a CUDA context broken by one cannot fail the others
    local rc=0 f
    for f in $GPU_TEST_FILES; do
        "$PY" -m pytest -v -rfEs -p no:cacheprovider $TIMEOUT_PLUGIN "tests/gpu/$f" || rc=$?
    done
    return $rc
}

# The suite: "core" (default; issue 4: the float ops and models, every kernel benchmark but the
# quantized GEMMs, bf16 throughput), "quant" (issue 6: the quantized formats, their GEMM
# benchmark, FP8 and int4 throughput) or "tuned" (issue 12: the kernels behind KernelConfig
# switches, their tests and benchmark rows). Each fits one 10-minute device call.
SUITE="${GPU_SUITE:-core}"
GPU_TESTS_CAP=180
KERNEL_SHAPES=""
THROUGHPUT_KERNELS=""         # bench.throughput --kernels: the KernelConfig of its engine
if [ "$SUITE" = quant ]; then
    GPU_TESTS_CAP=240           # test_cuda_quant_gemm alone took ~90 s on the H100
    GPU_TEST_FILES="test_cuda_gguf.py test_cuda_marlin.py test_cuda_fp8.py test_cuda_quant_gemm.py test_cuda_quant_model.py"
    KERNEL_OPS="qgemm"
    THROUGHPUT_ARGS="--quant fp8 int4"
elif [ "$SUITE" = serve ]; then
    :
elif [ "$SUITE" = tuned ]; then
    # the decode-side kernels behind --kernels switches: flash-decoding (decode=split), the FP8
    # GEMV (fp8_gemv=on), the radix filter (filter=radix), the fused sampler (sampling=fused)
    # and Marlin v2 (marlin=v2): their tests; decode
    # attention over bf16 and FP8 caches with the rule's split count and forced ones beside it;
    # the filter both ways; the fused sampler beside the op-by-op path; the quantized GEMMs
    # (fp8-gemv and marlin-v2 rows beside bf16, fp8-cutlass) at small M and at M = 1024
    GPU_TESTS_CAP=300           # 32k-key decode batches, Llama-3-8B-sized FP8 and int4 weights
    GPU_TEST_FILES="test_cuda_flash_decode.py test_cuda_fp8_gemv.py test_cuda_radix_filter.py"
    GPU_TEST_FILES="$GPU_TEST_FILES test_cuda_fused_sampling.py test_cuda_marlin_v2.py"
    KERNEL_OPS="decode_attention filter_logits sample_fused qgemm"
    KERNEL_SHAPES="--shape splits=2,4,8,16,32,64 --shape QM=1,4,16,64,1024"
    KERNEL_SHAPES="$KERNEL_SHAPES --shape qlayers=gate_up,down"
    THROUGHPUT_ARGS="--quant fp8 int4"
    # FP8 decode with both on, int4 decode on Marlin v2
    THROUGHPUT_KERNELS="fp8_gemv=on,decode=split,marlin=v2"
elif [ "$SUITE" = tuned_prefill ]; then
    # the prefill-side kernels behind --kernels switches: the FlashAttention-2 prefill
    # (prefill=fa2) and its Hopper form (=fa3; the same test file runs both), and the fused MoE
    # grouped GEMM (moe=fused): their tests; prefill attention (simple,
    # mma, fa2, fa3) at 1x4096, 4x2048 and a 1024-row chunk after 3072 cached tokens; the MoE
    # grouped GEMM against the active experts' bytes; bf16 throughput with fa2 prefill
    GPU_TESTS_CAP=300
    GPU_TEST_FILES="test_cuda_prefill_fa2.py test_cuda_moe.py"
    KERNEL_OPS="prefill_attention moe"
    KERNEL_SHAPES="--shape prefill=1x4096,4x2048,1x1024+3072 --shape MT=1,64,4096"
    THROUGHPUT_ARGS=""
    THROUGHPUT_KERNELS="prefill=fa2"
elif [ "$SUITE" = core ]; then
    GPU_TEST_FILES="test_cuda_ops.py test_cuda_model.py test_cuda_logprobs.py test_cuda_families.py"
    GPU_TEST_FILES="$GPU_TEST_FILES test_cuda_block_tables.py"   # device block tables, graphs
    KERNEL_OPS="embedding scale rms_norm fused_add_rms_norm layer_norm fused_add_layer_norm"
    KERNEL_OPS="$KERNEL_OPS rotary_embedding silu_and_mul"
    KERNEL_OPS="$KERNEL_OPS reshape_and_cache decode_attention prefill_attention linear argmax"
    KERNEL_OPS="$KERNEL_OPS gumbel_sample filter_logits apply_token_bitmask"
    THROUGHPUT_ARGS=""
else
    echo "GPU_SUITE=$SUITE: the suites are core, quant, serve, tuned and tuned_prefill" >&2
    exit 2
fi
export GPU_TEST_FILES

if compgen -G ".whl/*.whl" > /dev/null; then
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
TIMEOUT_PLUGIN=""
if "$PY" -c "import pytest_timeout" 2>/dev/null; then TIMEOUT_PLUGIN="--timeout=240"; fi
export PY TIMEOUT_PLUGIN
# internal entry points, so that `timeout` can run a shell function
case "${1:-}" in
    __setup) setup; exit $? ;;
    __gpu_tests) gpu_tests; exit $? ;;
esac

: > "$OUT/setup.log"
run_step setup 270 60 bash "$SELF" __setup
SETUP_RC=$?

if [ "$SUITE" = serve ]; then
    : > "$OUT/serve.log"
    if ((SETUP_RC == 0)); then
        run_step serve 330 120 "$PY" -m bench.serve_check --out "$OUT"
    else
        skip_step serve "setup failed (no CUDA build or no device)"
    fi
    {
        echo
        echo "================ gpu_check summary (serve) ================"
        grep -E '^(checkpoint|weights|server up|streamed chat|after the runs|FAILED|\|)' \
            "$OUT/serve.log" | cut -c1-200
        echo "-- steps ($((SECONDS))s of a ${TOTAL_S}s budget):"
        for i in "${!NAMES[@]}"; do
            printf '  %-11s %-28s %4ss\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${TIMES[$i]}"
        done
    } | tee "$OUT/summary.txt"
    for i in "${!NAMES[@]}"; do [ "${RESULTS[$i]}" = "ok" ] || exit 1; done
    exit 0
fi

if ((SETUP_RC == 0)); then
    : > "$OUT/gpu_tests.log"
    run_step gpu_tests "$GPU_TESTS_CAP" 60 bash "$SELF" __gpu_tests
else
    skip_step gpu_tests "setup failed (no CUDA build or no device)"
fi

: > "$OUT/kernels.log"
if ((SETUP_RC == 0)); then
    QUICK=""
    if ((END - SECONDS < 150)); then QUICK="--quick"; fi
    # shellcheck disable=SC2086
    run_step kernels 150 40 "$PY" -m bench.kernels $KERNEL_OPS $KERNEL_SHAPES $QUICK \
        --json "$OUT/kernels.json"
else
    skip_step kernels "setup failed (no CUDA build or no device)"
fi

# CPU-side tests: the engine (its torch guard among them), the extensions' exports and the
# server's start-up imports.
CPU_TESTS=""
for t in test_backend_ops.py test_block_pool.py test_scheduler.py test_sampler.py \
         test_cuda_graph.py test_cuda_host.py test_engine.py test_extensions.py; do
    [ -f "tests/$t" ] && CPU_TESTS="$CPU_TESTS tests/$t"
done
: > "$OUT/cpu_tests.log"
if ((SETUP_RC == 0 || SETUP_RC == 3)); then
    # shellcheck disable=SC2086
    run_step cpu_tests 90 30 "$PY" -m pytest -q -rfE -p no:cacheprovider $TIMEOUT_PLUGIN $CPU_TESTS
else
    skip_step cpu_tests "the build failed"
fi

: > "$OUT/throughput.log"
if ((SETUP_RC == 0)); then
    # shellcheck disable=SC2086
    run_step throughput 150 60 "$PY" -m bench.throughput --backend cuda \
        --kernels "$THROUGHPUT_KERNELS" $THROUGHPUT_ARGS --json "$OUT/throughput.json"
else
    skip_step throughput "setup failed (no CUDA build or no device)"
fi

# ---- summary (also $OUT/summary.txt), most important last: the kernel table, throughput, test
# counts and failures, then each step's result
{
    echo
    echo "================ gpu_check summary ================"
    if [ -s "$OUT/kernels.log" ]; then
        echo "-- kernels (full log: kernels.log, rows: kernels.json):"
        sed -n '/^== /,$p' "$OUT/kernels.log" | cut -c1-150
    fi
    if [ -s "$OUT/throughput.log" ]; then
        echo "-- throughput (last lines):"
        tail -n 12 "$OUT/throughput.log" | cut -c1-200
    fi
    for log in gpu_tests cpu_tests; do
        [ -s "$OUT/$log.log" ] || continue
        echo "-- $log:"
        grep -E '^(FAILED|ERROR) ' "$OUT/$log.log" | head -25 | cut -c1-180 | sed 's/^/  /'
        grep -E '^=+ .*(passed|failed|error|skipped|no tests ran).* =+$' "$OUT/$log.log" \
            | sed 's/^/  /'
        grep -E '^[0-9]+ (passed|failed|errors?|skipped)' "$OUT/$log.log" | sed 's/^/  /'
    done
    echo "-- steps ($((SECONDS))s of a ${TOTAL_S}s budget):"
    for i in "${!NAMES[@]}"; do
        printf '  %-11s %-28s %4ss\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${TIMES[$i]}"
    done
} | tee "$OUT/summary.txt"

for i in "${!NAMES[@]}"; do
    case "${NAMES[$i]}" in
        throughput) ;;
        *) [ "${RESULTS[$i]}" = "ok" ] || exit 1 ;;
    esac
done
exit 0
