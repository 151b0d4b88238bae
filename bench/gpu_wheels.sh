#!/usr/bin/env bash
# Downloads, into .whl/ (git-ignored through .git/info/exclude), every wheel that bench/gpu_check.sh
# needs on the lent GPU machine and that its image lacks. That machine has no network, Python
# 3.12, and (2026-11 image) numpy, CuPy, ml_dtypes, torch, transformers, safetensors, tokenizers,
# huggingface_hub, jinja2, prometheus_client, anyio, aiofiles, click, h11, werkzeug, pytest,
# pytest-timeout, threadpoolctl, tqdm, sentencepiece, pyyaml, requests, psutil. Carried here:
#
#   nvidia-cutlass       CUTLASS's headers, for gpu_check.sh's fallback build on the GPU machine
#                        where the prebuilt extensions (bench/gpu_build.sh) do not apply
#   gguf                 GGUF reading and quantization types (engine, tests/gpu, bench.kernels)
#   compressed-tensors   packs the int4 test fixtures; needs loguru and pydantic
#   pydantic (+ pydantic-core, annotated-types, typing-inspection, typing-extensions)
#                        the server's request models, compressed-tensors, openai
#   quart, hypercorn (+ flask, blinker, itsdangerous, werkzeug, h2, hpack, hyperframe, priority,
#                        wsproto)  the server stack
#   openai (+ httpx2, httpcore2, truststore, jiter, sniffio, idna, h11)
#                        the official client of the serve suite
#   jsonschema (+ referencing, rpds-py, jsonschema-specifications, attrs)  test_server's schemas
#   llguidance           structured outputs' grammars (the engine imports it on first use)
#
# Versions are the ones requirements-test.txt and a fresh `pip install .` resolve to on the
# development machine, so the GPU machine runs what CI runs. One version of each: pip refuses two.
#
#     bash bench/gpu_wheels.sh      # then name .whl in the device call's carry
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mkdir -p .whl

WHEELS=(
    nvidia-cutlass==4.2.0.0
    gguf==0.19.0
    compressed-tensors==0.20.0 loguru==0.7.3
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing-extensions==4.16.0
    quart==0.22.0 hypercorn==0.18.0 flask==3.1.3 blinker==1.9.0 itsdangerous==2.2.0
    werkzeug==3.1.9 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 priority==2.0.0 wsproto==1.3.2
    openai==3.54.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0
    sniffio==1.3.1 idna==3.20 h11==0.16.0
    jsonschema==4.26.0 referencing==0.37.0 rpds-py==2026.9.1 jsonschema-specifications==2025.9.1
    attrs==26.1.0
    llguidance==1.9.1
)
# Binary wheels for CPython 3.12 on x86-64 Linux (manylinux tags pip must match exactly).
PLATFORMS=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 \
           manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    PLATFORMS+=(--platform "${tag}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d .whl "${WHEELS[@]}"
echo "$(ls .whl | wc -l) wheels in .whl ($(du -sh .whl | cut -f1)):"
ls .whl
