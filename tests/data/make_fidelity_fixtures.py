"""Record what tests/test_gguf_fidelity.py checks: how far llama.cpp's greedy decoding of the tests'
tiny Llama, quantized by llama.cpp's own quantizer, agrees with each file's own weights.

    PYTHONPATH=<a directory holding llama_cpp (and diskcache)> \\
        python tests/data/make_fidelity_fixtures.py

For each ftype of bench.make_checkpoint.QUANT_FTYPES, llama.cpp's quantizer (llama-cpp-python
0.3.36, default parameters) turns tests/data/gguf/llama-f32.gguf into
bench/.cache/tiny-llama-<ftype>.gguf, token_embd (the tied output too) in the type it chooses (Q8_0
in the Q8_0 file, Q6_K in the others), and for F32EO_FTYPES into tiny-llama-<ftype>-f32eo.gguf with
token_embd kept F32 (as --isq keeps it). Recorded in tests/data/gguf/fidelity_fixtures.json:

- per file, each tensor's ggml type and the sha256 of its data: the test rebuilds the file from
  the F32 fixture with Taper's quantizer (byte-identical to llama.cpp's) and checks them, so no
  quantized file is committed;
- per prompt kind of bench.numerics_llamacpp (`short`: BOS and 1-3 tokens, prefilled by the
  decode matmul; `chat`: a user turn of 11-63 tokens; `long`: 342-431 tokens, past the RoPE's
  64-token original context), every PROMPT_EVERY[kind]-th prompt's ids;
- per file and prompt, the reference's greedy tokens up to its first near-tie (top-two margin
  under bench.numerics_llamacpp.TIE; transformers in float64 on the file's weights dequantized by
  the gguf package), and for llama.cpp (f32 KV cache, teacher-forced on those tokens: the prompt
  in one eval, then one token per eval) how many of them its free-running greedy decode
  reproduces (the leading run of its argmax) and its max |logit - reference| at each of them.
  Taper's figures at recording time are kept beside them for the record; the test computes its
  own.

Only this script and bench/numerics_llamacpp.py import llama_cpp; the test suite never does.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(HERE, "gguf", "fidelity_fixtures.json")
# A quarter of bench.numerics_llamacpp's short and chat prompts and an eighth of its long ones:
# enough for the totals to separate Taper's default from llama.cpp, few enough for a test.
PROMPT_EVERY = {"short": 4, "chat": 4, "long": 8}
# The ftypes also recorded with token_embd (the tied output) in F32: one per activation format
# (Q8_0, Q8_1 for the legacy types with a minimum, Q8_K).
F32EO_FTYPES = ("q8_0", "q4_1", "q4_k_m")


def tensor_records(path) -> dict:
    """{GGUF tensor name: [ggml type name, sha256 of its data as stored]}."""
    import numpy as np
    from gguf import GGUFReader
    return {t.name: [t.tensor_type.name,
                     hashlib.sha256(np.ascontiguousarray(t.data).tobytes()).hexdigest()]
            for t in GGUFReader(str(path)).tensors}


def main() -> None:
    sys.path.insert(0, ROOT)
    import importlib.metadata as md

    import llama_cpp

    from bench.make_checkpoint import QUANT_FTYPES
    from bench.numerics_llamacpp import AGREEMENT_STEPS, TIE, greedy_agreement, tiny_llama
    from pyx.cpu_backend import CpuBackend

    versions = {p: md.version(p) for p in ("transformers", "torch", "gguf", "numpy")}
    versions["llama_cpp_python"] = llama_cpp.__version__
    record = {"versions": versions, "tie": TIE, "steps": AGREEMENT_STEPS,
              "taper_isa": CpuBackend().isa, "prompts": {}, "files": {}}
    for qtype in QUANT_FTYPES:
        for f32eo in (False, True) if qtype in F32EO_FTYPES else (False,):
            t0 = time.time()
            path = tiny_llama(qtype, f32eo)
            name = qtype + ("-f32eo" if f32eo else "")
            entry = {"tensors": tensor_records(path), "kinds": {}}
            for kind, every in PROMPT_EVERY.items():
                r = greedy_agreement(path, kind, threads=1, every=every)
                record["prompts"].setdefault(kind, r["prompts"])
                assert record["prompts"][kind] == r["prompts"]
                engines = {label: {"lead": e["lead"],
                                   "maxabs": [[round(float(v), 5) for v in m]
                                              for m in e["maxabs"]]}
                           for label, e in r["engines"].items()}
                entry["kinds"][kind] = {
                    "reference": [t[:n] for t, n in zip(r["ref_tokens"], r["trusted"])],
                    "llama.cpp": engines.pop("llama.cpp"),
                    "taper_at_recording": {k: sum(v["lead"]) for k, v in engines.items()},
                }
                llama = entry["kinds"][kind]["llama.cpp"]
                print(f"{name} {kind}: trusted {sum(r['trusted'])}, llama.cpp "
                      f"{sum(llama['lead'])}, " + ", ".join(
                          f"{k} {v}" for k, v in entry["kinds"][kind]["taper_at_recording"]
                          .items()), flush=True)
            record["files"][name] = entry
            print(f"  {name} done in {time.time() - t0:.0f}s", flush=True)
    with open(OUT, "w") as f:
        json.dump(record, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
