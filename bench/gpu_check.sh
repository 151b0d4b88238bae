#!/usr/bin/env bash
# The GPU window (issue 26): two suites, one device call each, both inside one 15-minute window,
# on a GPU machine that compiles nothing (its minutes are for running):
#
#     GPU_SUITE=first   bash bench/gpu_check.sh   # everything that decides correctness (<= 8 min)
#     GPU_SUITE=figures bash bench/gpu_check.sh   # the numbers, and which switches win (<= 5 min)
#
# Here, before the call (bench/README.md, "The GPU window", says it whole):
#     bash bench/gpu_build.sh     # .gpu-prebuilt: the extensions for Python 3.12 / numpy 2.5 / sm_90a
#     bash bench/gpu_wheels.sh    # .whl: what the GPU machine's image lacks
#     python -m bench.gpu_prebuilt travel .whl .gpu-prebuilt    # under the 64 MiB a call carries
# and the device calls, carrying .whl and .gpu-prebuilt, the second right after the first:
#     GPU_SUITE=first bash bench/gpu_check.sh         # <= 500 s
#     GPU_SUITE=figures bash bench/gpu_check.sh       # <= 290 s
#
# first:   setup (carried wheels, the prebuilt extensions checked against the tree's sources and
#          installed, every import, the device); serve (python -m server as a user starts it, a
#          streamed chat through the openai client, bench.serve at concurrency 1 and 64, /metrics
#          idle afterwards); tests_default (every default-path GPU test: ops, models, logprobs,
#          families, block tables and graphs); tests_quant (GGUF, Marlin, FP8 dequantize and GEMM
#          at the large shapes, quantized models); tests_switches (the correctness tests of every
#          kernel behind a KernelConfig switch, no benchmark); then the verdicts per test file and
#          per switch (bench/gpu_summary.py tests: switches.json).
# figures: kernels (bench.kernels on the goals' shapes, defaults and every switch that passed in
#          first: --without the others), winners (each passing switch against its default),
#          throughput (8B-shaped bf16 / FP8 / int4 decode at batch 1 and 16 against the
#          weight-read bound, then again with the passing decode-side switches), spec
#          (speculative decoding, bench/gpu_spec.py: n-gram and a 1B-shaped draft model against
#          no speculation on an 8B-shaped target at batch 1 and 8, graphs_verify off and, when
#          its tests passed in first, on; its table by bench/gpu_summary.py spec), serve (the 1B
#          table at concurrency 1, 16, 64, 256 with the TPOT bound), step_profile (host against
#          device time per step on that 1B checkpoint), allreduce (bench/allreduce_gpu.py: Taper's
#          NCCL all-reduce against CuPy's own call, decode and prefill sizes, in what is left).
#
# Each step runs under `timeout` with its cap, clamped to what is left of the suite's budget, and
# is skipped when that is under its minimum; the test steps run their files side by side, one
# pytest process each (a CUDA context one file breaks cannot fail another), each writing JUnit
# XML. A step that cannot run says why in the summary table; nothing is skipped silently. Without
# a device (this machine, CI) every GPU step reports "not run: no device": a dry run of the
# scripts end to end (GPU_DRY_TESTS=1 runs the test steps anyway, each test skipped;
# GPU_DRY_SPEC=1 the spec step in its CPU form). Logs go to $GPU_LOGS (default /tmp/gpu-logs,
# kept between the suites: figures reads first's verdicts); $OUT (default /tmp/out) gets SUITE-summary.txt and SUITE-logs.tgz.
# Exit status 0 when every step that ran passed (throughput and winners never fail it).
set -o pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/.." || exit 2
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
SUITE="${GPU_SUITE:-first}"
OUT="${OUT:-/tmp/out}"
LOGS="${GPU_LOGS:-/tmp/gpu-logs}"
MODEL_1B=/tmp/taper-llama-1b-random     # made by first's serve step, reused by figures'
mkdir -p "$OUT" "$LOGS"
PY_TAG=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
# the carried wheels (CPython 3.12's), installed there by setup
if [ "$PY_TAG" = 312 ]; then export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"; fi
# the CPU references of several test processes share the machine's cores
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-3}" OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-3}"

case "$SUITE" in
    first) TOTAL_S="${GPU_TOTAL_S:-500}" ;;
    figures) TOTAL_S="${GPU_TOTAL_S:-290}" ;;
    *) echo "GPU_SUITE=$SUITE: the suites are first and figures" >&2; exit 2 ;;
esac
END=$((SECONDS + TOTAL_S))
NAMES=() RESULTS=() TIMES=()

record() { NAMES+=("$1") RESULTS+=("$2") TIMES+=("$3"); }

# limit_for CAP MIN: the step's time limit (CAP clamped to the time left), or nothing when that
# is under MIN
limit_for() {
    local left=$((END - SECONDS)) limit=$1
    ((left < limit)) && limit=$left
    ((limit < $2)) || echo "$limit"
}

outcome() {  # rc limit -> the summary's words
    if (($1 == 124 || $1 == 137)); then echo "TIMEOUT after ${2}s"
    elif (($1 != 0)); then echo "FAILED (rc $1)"
    else echo "ok"; fi
}

# run_step NAME CAP MIN CMD...: CMD under timeout (SIGINT first, so pytest and the benchmarks
# print what they have), output to $LOGS/NAME.log and the terminal
run_step() {
    local name=$1 cap=$2 min=$3 limit
    shift 3
    limit=$(limit_for "$cap" "$min")
    if [ -z "$limit" ]; then
        record "$name" "not run: $((END - SECONDS))s left, needs ${min}s" 0
        return 99
    fi
    echo
    echo "==== $name (limit ${limit}s): $*"
    local t0=$SECONDS rc
    timeout -s INT -k 15 "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
    rc=$?
    record "$name" "$(outcome $rc "$limit")" $((SECONDS - t0))
    return $rc
}

# test_step NAME CAP MIN FILE...: tests/gpu/FILE side by side, one pytest process each (own
# limit, JUnit XML to $LOGS/junit-FILE.xml, output to $LOGS/FILE.log). FILE:PART:EXPR runs the
# file's tests that pytest's -k EXPR selects, as FILE-PART: one file's slow halves side by side.
test_step() {
    local name=$1 cap=$2 min=$3 limit
    shift 3
    if [ -n "${GPU_FILES:-}" ]; then
        local keep=() f
        for f in "$@"; do [[ $f =~ $GPU_FILES ]] && keep+=("$f"); done
        set -- "${keep[@]}"
        if (($# == 0)); then record "$name" "not run: no file matches GPU_FILES" 0; return 99; fi
    fi
    limit=$(limit_for "$cap" "$min")
    if [ -z "$limit" ]; then
        record "$name" "not run: $((END - SECONDS))s left, needs ${min}s" 0
        return 99
    fi
    echo
    echo "==== $name (limit ${limit}s): $* side by side"
    local t0=$SECONDS f pids=() stems=() rc=0 timed_out=0
    for f in "$@"; do
        local file=${f%%:*} stem=${f%%.py*} select=()
        if [[ $f == *:*:* ]]; then
            local part=${f#*:}
            stem="$stem-${part%%:*}" select=(-k "${part#*:}")
        fi
        timeout -s INT -k 15 "$limit" "$PY" -m pytest -q -rfE -p no:cacheprovider \
            --timeout=150 --junitxml="$LOGS/junit-$stem.xml" "${select[@]}" "tests/gpu/$file" \
            > "$LOGS/$stem.log" 2>&1 &
        pids+=($!) stems+=("$stem")
    done
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}"
        local r=$?
        local stem=${stems[$i]}
        echo "  $stem: $(tail -n 1 "$LOGS/$stem.log" | cut -c1-120) (rc $r)"
        if ((r == 124 || r == 137)); then timed_out=1; fi
        ((r == 0)) || rc=$r
    done
    local res
    res=$(outcome "$rc" "$limit")
    ((timed_out)) && res="TIMEOUT after ${limit}s"
    record "$name" "$res" $((SECONDS - t0))
    return $rc
}

setup() {
    echo "== $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(hostname), $(nproc) cores"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem \
        --format=csv 2>/dev/null || echo "nvidia-smi: none (no NVIDIA driver here)"
    "$PY" - <<'PY'
import importlib, platform, sys
print("python", sys.version.split()[0], platform.machine())
for name in ("numpy", "cupy", "ml_dtypes", "torch", "transformers", "pytest"):
    try:
        print(f"  {name} {importlib.import_module(name).__version__}")
    except Exception as e:
        print(f"  {name}: {type(e).__name__}: {e}")
PY
    if compgen -G ".whl/*.whl" > /dev/null && [ ! -d /tmp/site ]; then
        if [ "$PY_TAG" = 312 ]; then
            echo "== installing the carried wheels into /tmp/site"
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target /tmp/site .whl/*.whl || return 1
        else
            echo "== carried wheels are for CPython 3.12, this is $PY_TAG: not installed"
        fi
    fi
    if [ -f .gpu-prebuilt/BUILD.json ]; then
        if "$PY" -m bench.gpu_prebuilt install .gpu-prebuilt; then
            echo "prebuilt extensions installed" > "$LOGS/build.txt"
        elif [ "$PY_TAG" = 312 ] && command -v nvcc > /dev/null; then
            echo "== FALLBACK: building here (TAPER_CUDA_ARCHS=90a), the prebuilt does not apply"
            echo "FALLBACK build on the GPU machine" > "$LOGS/build.txt"
            TAPER_CUDA_ARCHS=90a "$PY" -m pip install -q --no-build-isolation --no-deps -e . \
                || return 1
        else
            echo "== the prebuilt does not apply here; testing the tree's own build"
            echo "the tree's own build (the prebuilt does not apply)" > "$LOGS/build.txt"
        fi
    else
        echo "== no .gpu-prebuilt (bash bench/gpu_build.sh makes it); the tree's own build"
        echo "the tree's own build (nothing prebuilt carried)" > "$LOGS/build.txt"
    fi
    local so
    so=$(ls pyx/cuda_backend*.so 2>/dev/null | head -1)
    if [ "$SUITE" = first ] && [ -n "$so" ] && command -v cuobjdump > /dev/null; then
        # Hopper's matrix instructions
        timeout 60 cuobjdump -sass "$so" > "$LOGS/sass.txt" 2>&1
        echo "== SASS of $so: $(grep -c HGMMA "$LOGS/sass.txt") HGMMA (fa3's wgmma)," \
             "$(grep -c QGMMA "$LOGS/sass.txt") QGMMA (CUTLASS FP8)," \
             "$(grep -cE '\b(LDL|STL)\b' "$LOGS/sass.txt") LDL/STL (local memory)"
        rm -f "$LOGS/sass.txt"
    fi
    "$PY" - <<'PY' || return 1
import importlib
need = {"pyx.cpu_backend": "Taper's build", "gguf": "gguf", "compressed_tensors":
        "compressed-tensors", "pydantic": "pydantic", "quart": "quart", "hypercorn": "hypercorn",
        "openai": "openai", "jsonschema": "jsonschema", "llguidance": "llguidance",
        "threadpoolctl": "threadpoolctl", "server.app": "the server stack"}
missing = []
for module, wheel in need.items():
    try:
        importlib.import_module(module)
    except Exception as e:
        missing.append(f"{module} ({wheel}: {type(e).__name__}: {e})")
if missing:
    raise SystemExit("missing here (bash bench/gpu_wheels.sh, bench/gpu_build.sh): "
                     + "; ".join(missing))
print("every module the suites import is here")
PY
    "$PY" -c "
try:
    import pyx.cuda_backend as cb
except ImportError as e:
    raise SystemExit(f'no device: pyx.cuda_backend does not import ({e})') from None
n = cb.device_count()
print(f'pyx.cuda_backend imports: {n} device(s)')
import sys
sys.exit(0 if n > 0 else 3)
" || { local rc=$?; ((rc == 1)) && return 3; return $rc; }
}

# internal entry point, so that `timeout` can run a shell function
if [ "${1:-}" = __setup ]; then setup; exit $?; fi

run_step setup 90 20 bash "$SELF" __setup
SETUP_RC=$?
DEVICE=1
((SETUP_RC == 0)) || DEVICE=0
WHY_NOT="setup failed (rc $SETUP_RC)"
if ((SETUP_RC == 3)); then
    WHY_NOT="no device"
    RESULTS[0]="no device"
fi

# GPU_STEPS (names, space-separated) runs only those steps; GPU_FILES (a regex) only the test
# files it matches: a second window's rerun of what the first could not settle.
selected() { [ -z "${GPU_STEPS:-}" ] || [[ " $GPU_STEPS " == *" $1 "* ]]; }

# STEP_KIND NAME ...: run it, or record why not. GPU_DRY_TESTS=1 runs the test steps without a
# device too (each test is skipped, naming why): the scripts checked end to end on a CPU.
gpu_step() {
    local kind=$1
    shift
    if ! selected "$1"; then
        record "$1" "not run: not in GPU_STEPS" 0
    elif ((DEVICE)) || { [ "$kind" = test_step ] && [ "${GPU_DRY_TESTS:-0}" = 1 ]; }; then
        "$kind" "$@"
    else
        record "$1" "not run: $WHY_NOT" 0
    fi
}

if [ "$SUITE" = first ]; then
    rm -f "$LOGS"/junit-*.xml "$LOGS/switches.json"
    gpu_step run_step serve 110 60 "$PY" -m bench.serve_check --out "$LOGS" --model "$MODEL_1B" \
        --concurrency 1 64 --prompts-per-client 2 --output-len 64
    # (W3 ran the first six files in 32 s; the seven since, untimed, get the rest of the cap)
    gpu_step test_step tests_default 160 30 test_cuda_ops.py test_cuda_model.py \
        test_cuda_logprobs.py test_cuda_families.py test_cuda_block_tables.py test_cuda_mla.py \
        test_cuda_features.py test_cuda_tensor_parallel.py test_cuda_tensor_parallel_mla.py \
        test_cuda_pipeline_parallel.py test_cuda_hybrid.py test_cuda_lora.py test_cuda_vision.py \
        test_cuda_gemma4_e_shapes.py test_cuda_pipeline_parallel_mla.py \
        test_cuda_parallel_speculation.py \
        "test_cuda_quirk_families.py:ops:not family and not minimax" \
        "test_cuda_quirk_families.py:models:family or minimax"
    # the quantized GEMMs' host work (quantizing, repacking 8B-sized weights) in two processes
    gpu_step test_step tests_quant 180 40 test_cuda_gguf.py test_cuda_marlin.py test_cuda_fp8.py \
        "test_cuda_quant_gemm.py:gguf:q4_ or q8_ or q6_" "test_cuda_quant_gemm.py:int4_fp8:int4 or fp8" \
        test_cuda_quant_model.py
    gpu_step test_step tests_switches 100 40 test_cuda_flash_decode.py test_cuda_fp8_gemv.py \
        test_cuda_fused_sampling.py test_cuda_prefill_fa2.py test_cuda_moe.py \
        test_cuda_graphs_verify_lora.py
    "$PY" -m bench.gpu_summary tests "$LOGS" > "$LOGS/verdicts.txt" 2>&1
else
    WITHOUT=$("$PY" -m bench.gpu_summary without "$LOGS")
    # the shapes the goals name: 8B decode attention at batch 1 and 16 over 8k tokens, prefill
    # at 4k tokens (D=128), the quantized GEMMs of decode (M 1-16: the FP8 GEMV's crossover) on
    # gate_up and down
    # shellcheck disable=SC2086
    gpu_step run_step kernels 75 30 "$PY" -m bench.kernels \
        ${GPU_KERNEL_OPS:-decode_attention prefill_attention qgemm filter_logits sample_fused moe} \
        --shape B=1,16 --shape ctx=8192 \
        --shape prefill=1x4096 --shape QM=1,2,4,8,16 --shape qlayers=gate_up,down --shape SB=64 \
        --shape MT=1,64 --runs 20 --without "$WITHOUT" --json "$LOGS/kernels.json"
    if [ -f "$LOGS/kernels.json" ]; then
        "$PY" -m bench.gpu_summary winners "$LOGS" 2>&1 | tee "$LOGS/winners.txt"
    fi
    gpu_step run_step throughput 80 40 "$PY" -m bench.throughput --backend cuda \
        --quant bf16 fp8 int4 --batch 1 16 --json "$LOGS/throughput.json"
    # the decode-side switches that passed their tests, end to end
    TRY=""
    # fp8=cutlass with fp8_gemv=on: e4m3 weights only, the GEMV up to FP8_GEMV_MAX_M rows and
    # CUTLASS above (the H200's W3: the GEMV wins at M=1, loses 3-5x at M=16)
    for s in fp8=cutlass fp8_gemv=on sampling=fused; do
        case ",$WITHOUT," in *",$s,"*) ;; *) TRY="$TRY${TRY:+,}$s" ;; esac
    done
    if [ -n "$TRY" ] || ((DEVICE == 0)); then
        gpu_step run_step throughput_switches 70 40 "$PY" -m bench.throughput --backend cuda \
            --quant bf16 fp8 int4 --batch 1 16 --kernels "$TRY" \
            --json "$LOGS/throughput_switches.json"
    else
        record throughput_switches "not run: no decode-side switch passed" 0
    fi
    # speculative decoding (issue 30): verify graphs only where their tests passed in first
    SPEC_GRAPHS="off on"
    case ",$WITHOUT," in *",graphs_verify=on,"*) SPEC_GRAPHS="off" ;; esac
    rm -f "$LOGS/spec.json" "$LOGS/spec.txt"
    # shellcheck disable=SC2206
    SPEC_ARGS=(--batch 1 8 --k 4 --gen-len 128 --graphs-verify $SPEC_GRAPHS
               --json "$LOGS/spec.json")
    if ((DEVICE == 0)) && [ "${GPU_DRY_SPEC:-0}" = 1 ] && selected spec; then
        # GPU_DRY_SPEC=1: without a device, the step's CPU form (tiny shapes, no graphs) through
        # the same arguments, files and table: the wiring checked end to end on a CPU
        run_step spec 60 5 "$PY" -m bench.gpu_spec "${SPEC_ARGS[@]}" --backend cpu --tiny \
            --gen-len 16
    else
        gpu_step run_step spec 60 30 "$PY" -m bench.gpu_spec "${SPEC_ARGS[@]}"
    fi
    if [ -f "$LOGS/spec.json" ]; then
        "$PY" -m bench.gpu_summary spec "$LOGS" > "$LOGS/spec.txt" 2>&1
        [ "$SPEC_GRAPHS" = off ] && echo "graphs_verify=on not run: its tests did not pass in" \
            "first" >> "$LOGS/spec.txt"
    fi
    SERVE_MODEL=()
    [ -d "$MODEL_1B" ] && SERVE_MODEL=(--model "$MODEL_1B")
    gpu_step run_step serve 100 50 "$PY" -m bench.serve_check --out "$LOGS" "${SERVE_MODEL[@]}" \
        --concurrency 1 16 64 256
    # where a decode step's time goes on the device (the TPOT at concurrency 1 is 3.4x its bound:
    # host or kernels?), on the checkpoint serve made
    if [ -d "$MODEL_1B" ] || ((DEVICE == 0)); then
        gpu_step run_step step_profile 45 25 "$PY" -m bench.step_profile --model "$MODEL_1B" \
            --backend cuda --concurrency 1 64 --prompt-len 512 --gen-len 64
    else
        record step_profile "not run: no 1B checkpoint (serve did not make it)" 0
    fi
    # the all-reduce's fixed cost through Taper's NCCL communicator against CuPy's own call
    # (issue 28; a world of one rank on one device), in what the suite has left
    gpu_step run_step allreduce 25 10 "$PY" -m bench.allreduce_gpu --hidden 4096 8192
fi

# ---- the summary, most important last: the figures, the verdicts, the steps
{
    echo
    echo "================ gpu_check $SUITE: $(cat "$LOGS/build.txt" 2>/dev/null) ================"
    if [ "$SUITE" = figures ]; then
        for log in kernels throughput throughput_switches step_profile allreduce; do
            [ -s "$LOGS/$log.log" ] || continue
            echo "-- $log:"
            grep -E '^(== |device|weights| *(bf16|fp8|int4) B=|  |\| *[0-9])' "$LOGS/$log.log" \
                | cut -c1-160 \
                | tail -n 40
        done
        [ -s "$LOGS/winners.txt" ] && { echo "-- winners:"; cat "$LOGS/winners.txt"; }
        [ -s "$LOGS/spec.txt" ] && { echo "-- spec:"; cat "$LOGS/spec.txt"; }
    fi
    if [ -s "$LOGS/serve.log" ]; then
        echo "-- serve:"
        grep -E '^(checkpoint|weights|server up|streamed chat|after the runs|FAILED|\|)' \
            "$LOGS/serve.log" | cut -c1-200
    fi
    [ -s "$LOGS/verdicts.txt" ] && [ "$SUITE" = first ] && cat "$LOGS/verdicts.txt"
    echo "-- steps ($SECONDS s of a ${TOTAL_S} s budget):"
    for i in "${!NAMES[@]}"; do
        printf '  %-20s %-40s %4ss\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${TIMES[$i]}"
    done
    ((DEVICE)) || echo "  (dry run: $WHY_NOT; every GPU step above says so)"
} | tee "$OUT/$SUITE-summary.txt"
tar czf "$OUT/$SUITE-logs.tgz" -C "$LOGS" . 2>/dev/null

for i in "${!NAMES[@]}"; do
    case "${NAMES[$i]}" in throughput*) continue ;; esac
    case "${RESULTS[$i]}" in
        ok|"no device"|"not run: no device"|"not run: not in GPU_STEPS") ;;
        "not run: no file matches GPU_FILES") ;;
        *) exit 1 ;;
    esac
done
exit 0
