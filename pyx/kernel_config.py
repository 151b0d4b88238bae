"""KernelConfig: which kernel each backend runs where it has a choice, and the CPU's numerics.

One frozen value per engine, never the process environment (DESIGN.md section 8): the server's
`--kernels prefill=fa2,decode=split,marlin=pipeline`, `LLM(kernels=...)` (that string, a dict or a
KernelConfig), EngineConfig.kernels, then `CpuBackend(kernels=...)` / `CudaBackend(kernels=...)`,
which read it once when they are built. The engine logs it at start-up, each choice with its
source. It lives in pyx/ (pure Python, no engine import) because the backends read it.

The first value of every key is its default: on a GPU the kernel that passed its tests and was
fastest in the last GPU window (bench/RESULTS.md, "GPU window"; prefill=fa3 and decode=split won on
an H200 on 2026-11-28), on the CPU the fastest path, except act_split=qkv: the quantized qkv
projection's decode activations kept exact, which keeps Taper's greedy tokens on a quantized file's
weights further than llama.cpp's for 4-9 % of the batch-1 decode time (issue 32; bench/RESULTS.md,
Numerics). The others are kept behind the switch: general fallbacks, kernels whose GPU tests or
figures have not made them the default yet, llama.cpp's rounding everywhere (act_split=off, the
fastest) or the CPU's exact activations everywhere (on). prefill=mma, marlin=v2 and filter=radix
lost to the defaults in that window and were deleted (REMOVED_VARIABLES). A key a backend does not
read (a CUDA kernel on the CPU backend) is logged as unused when it was set.

The environment variables that used to make these choices (TAPER_CUDA_PREFILL, TAPER_CPU_ISA,
TAPER_QUANT_ACT_SPLIT, ...: RETIRED_VARIABLES, REMOVED_VARIABLES) are no longer read;
`retired_variables()` names the ones still set, so that start-up can warn with the `--kernels`
spelling that replaces each, or say that the kernel it chose was removed.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Choice:
    values: tuple[str, ...]     # the first is the default
    backends: tuple[str, ...]   # the backends that read it
    help: str


CHOICES: dict[str, Choice] = {
    "prefill": Choice(("fa3", "fa2", "simple"), ("cuda",),
                      "prefill attention: FlashAttention-2 style with GQA packing in its Hopper "
                      "form (wgmma; fa2 on other GPUs), fa2 itself, or the simple one (the one "
                      "kernel for head sizes and dtypes the others lack: any choice falls back "
                      "to it there)"),
    "decode": Choice(("split", "simple"), ("cuda",),
                     "decode attention: split-K flash-decoding (pyx/decode_splits.py picks the "
                     "split count), or one pass per sequence"),
    "marlin": Choice(("simple", "pipeline"), ("cuda",),
                     "int4 W4A16 Marlin GEMM: the simple kernel, or the pipelined one"),
    "fp8": Choice(("dequant", "cutlass"), ("cuda",),
                  "FP8 block-wise weights: dequantized once to the activation dtype, or kept "
                  "e4m3 for the CUTLASS block-scaled GEMM (sm_90a)"),
    "fp8_gemv": Choice(("off", "on"), ("cuda",),
                       "FP8 block-wise weights kept e4m3 for the small-M FP8 GEMV (sm80+)"),
    "sampling": Choice(("simple", "fused"), ("cuda",),
                       "sampling: op by op, or penalties, filters and the draw in one launch"),
    "moe": Choice(("simple", "fused"), ("cuda", "cpu"),
                  "MoE experts: one linear per expert (on the CPU every expert of a layer in "
                  "one moe_experts call, the same numbers), or moe_align and grouped GEMMs over "
                  "stacked experts"),
    "graphs_lora": Choice(("off", "on"), ("cuda",),
                          "CUDA graphs over steps with LoRA adapter rows: the rows' adapter "
                          "slots in a static device buffer, read by the slot-per-row LoRA "
                          "kernels (cuda/lora.cu), or such steps run eagerly"),
    "graphs_verify": Choice(("off", "on"), ("cuda",),
                            "CUDA graphs over speculative decoding's verify steps (k + 1 tokens "
                            "for every sequence, n-gram and draft-model methods), or such steps "
                            "run eagerly"),
    "graphs_parallel": Choice(("off", "on"), ("cuda",),
                              "CUDA graphs on tensor- and pipeline-parallel ranks (each rank's "
                              "NCCL all-reduces inside its graphs, each stage's graphs around "
                              "the hand-over of its stream, rank 0 naming the bucket every rank "
                              "replays), or such ranks run every step eagerly"),
    "cpu_isa": Choice(("auto", "scalar", "avx2", "avx512"), ("cpu",),
                      "CPU kernels' ISA path (auto: the best this CPU runs)"),
    "act_split": Choice(("qkv", "off", "on"), ("cpu",),
                        "ggml decode matmuls: each activation row written as two 8-bit rows "
                        "(~250x closer to exact, twice the integer work) in the attention's qkv "
                        "projection only, whose rounding the attention scores amplify most; in "
                        "none (rounded to 8 bits once, exactly as llama.cpp); or in all"),
    "quant_prefill": Choice(("int8", "int8_all", "f32"), ("cpu",),
                            "K-type (Q2_K..Q6_K) matmuls of 4 or more token rows (33 for Q2_K, "
                            "Q3_K) on AVX-512: int8 x int8 on the Q8_K activations "
                            "(pyx/quant_gemm.c: the decode loop's results bit for bit, act_split "
                            "honoured), and legacy-type (Q4_0..Q8_0) ones of 3-4 rows on "
                            "AVX512_VNNI (quant_gemm_legacy.c, in the loop's place: its results); "
                            "int8_all: the legacy types from 3 rows at every T too (beyond 4 "
                            "rows their activations are then rounded to Q8 as the decode loop "
                            "rounds them, not float32; act_split's two rows keep float32 there); "
                            "f32: as before, that loop, then float32 dequantized weights times "
                            "the float32 activations"),
    "gemv_prefetch": Choice(("auto", "l1", "l2"), ("cpu",),
                            "float weights' small-M linear (decode, AVX-512): software prefetch "
                            "of the next tile into L1, or two tiles ahead into L2; auto picks L2 "
                            "where a tile and the next would take half the L1 or more (its size "
                            "read at start-up; pyx/cpu_kernels.c sk_prefetch_l2). Outputs do not "
                            "depend on it"),
}

# The environment variables these keys replace, and the `--kernels` item for each.
RETIRED_VARIABLES = {
    "TAPER_CUDA_PREFILL": "prefill=fa3|fa2|simple",
    "TAPER_CUDA_SPLIT_K": "decode=split",
    "TAPER_CUDA_MARLIN_PIPELINE": "marlin=pipeline",
    "TAPER_CUDA_FP8_CUTLASS": "fp8=cutlass",
    "TAPER_CUDA_FP8_GEMV": "fp8_gemv=on",
    "TAPER_CUDA_FUSED_SAMPLING": "sampling=fused",
    "TAPER_CUDA_FUSED_MOE": "moe=fused",
    "TAPER_CPU_ISA": "cpu_isa=auto|scalar|avx2|avx512",
    "TAPER_QUANT_ACT_SPLIT": "act_split=on",
}

# The environment variables whose kernels were deleted after a GPU window measured them slower
# than the default (H200, 2026-11-28), and the choice each made.
REMOVED_VARIABLES = {
    "TAPER_CUDA_MMA_PREFILL": "prefill=mma",
    "TAPER_CUDA_MARLIN": "marlin=v2",
    "TAPER_CUDA_RADIX_FILTER": "filter=radix",
}


def _default(key: str) -> str:
    return CHOICES[key].values[0]


def _bad_value(where: str, key: str, value) -> str:
    return (f"{where}: {key}={value!r} is not a choice; {key} takes "
            f"{' | '.join(CHOICES[key].values)} (default {_default(key)})")


@dataclass(frozen=True)
class KernelConfig:
    prefill: str = _default("prefill")
    decode: str = _default("decode")
    marlin: str = _default("marlin")
    fp8: str = _default("fp8")
    fp8_gemv: str = _default("fp8_gemv")
    sampling: str = _default("sampling")
    moe: str = _default("moe")
    graphs_lora: str = _default("graphs_lora")
    graphs_verify: str = _default("graphs_verify")
    graphs_parallel: str = _default("graphs_parallel")
    cpu_isa: str = _default("cpu_isa")
    act_split: str = _default("act_split")
    quant_prefill: str = _default("quant_prefill")
    gemv_prefetch: str = _default("gemv_prefetch")
    # (key, where it was set) for the keys given explicitly: parse() records them; the start-up
    # log reads them. Not part of the value: two configs with the same choices are equal.
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self):
        for key in CHOICES:
            if getattr(self, key) not in CHOICES[key].values:
                raise ValueError(_bad_value("KernelConfig", key, getattr(self, key)))

    @classmethod
    def parse(cls, spec, source: str = "kernels") -> "KernelConfig":
        """A KernelConfig from None (every default), a KernelConfig (returned as it is), a dict
        {key: value} or a string "key=value,key=value" (the --kernels syntax; spaces around
        items are ignored). `source` names where it came from, for error messages and the
        start-up log. A bad key or value is a ValueError naming it and listing the valid ones."""
        if spec is None:
            return cls()
        if isinstance(spec, cls):
            return spec
        if isinstance(spec, str):
            items = []
            for item in spec.split(","):
                item = item.strip()
                if not item:
                    continue
                key, eq, value = item.partition("=")
                if not eq:
                    raise ValueError(f"{source}: {item!r} is not key=value (e.g. "
                                     f"prefill=fa2,decode=split)")
                items.append((key.strip(), value.strip()))
        elif isinstance(spec, Mapping):
            items = list(spec.items())
        else:
            raise TypeError(f"{source}: expected a 'key=value,...' string, a dict or a "
                            f"KernelConfig, got {type(spec).__name__}")
        values: dict[str, str] = {}
        for key, value in items:
            if key not in CHOICES:
                raise ValueError(f"{source}: unknown key {key!r}; the keys are "
                                 f"{', '.join(CHOICES)}")
            if key in values:
                raise ValueError(f"{source}: {key} is given twice")
            if value not in CHOICES[key].values:
                raise ValueError(_bad_value(source, key, value))
            values[key] = value
        return cls(**values, sources=tuple((key, source) for key in values))

    @staticmethod
    def choices_help() -> str:
        """--kernels' help: every key with its values, the default first, and the backends
        that read it."""
        return "; ".join(f"{key}={'|'.join(c.values)} ({', '.join(c.backends)})"
                         for key, c in CHOICES.items())

    def __str__(self) -> str:
        """Every choice in the --kernels syntax (parse() reads it back)."""
        return ",".join(f"{key}={getattr(self, key)}" for key in CHOICES)

    def source_of(self, key: str) -> str:
        """Where the choice of `key` came from: the source parse() recorded, else "default"
        (or "KernelConfig" for a value other than the default given to the constructor)."""
        recorded = dict(self.sources).get(key)
        if recorded is not None:
            return recorded
        return "default" if getattr(self, key) == _default(key) else "KernelConfig"

    def describe(self, backend: str) -> tuple[str, list[str]]:
        """The start-up log's line for a `backend` ("cpu" | "cuda") -- each choice it reads, with
        its source -- and the explicitly set keys it does not read."""
        line = ", ".join(f"{key}={getattr(self, key)} ({self.source_of(key)})"
                         for key, c in CHOICES.items() if backend in c.backends)
        unused = [f"{key}={getattr(self, key)} ({self.source_of(key)})"
                  for key, c in CHOICES.items()
                  if backend not in c.backends and self.source_of(key) != "default"]
        return line, unused


def retired_variables(environ: Mapping[str, str] = os.environ) -> list[str]:
    """For each retired variable set in `environ`: a warning naming the --kernels item that
    replaces it, or saying that the kernel it chose was removed (the variable itself is
    ignored)."""
    replaced = [f"{name} is no longer read; use --kernels {item} (or LLM(kernels=...))"
                for name, item in RETIRED_VARIABLES.items() if environ.get(name, "") != ""]
    removed = [f"{name} is no longer read; the kernel it chose ({item}) was removed, the "
               f"default runs" for name, item in REMOVED_VARIABLES.items()
               if environ.get(name, "") != ""]
    return replaced + removed
