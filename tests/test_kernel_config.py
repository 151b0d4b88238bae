"""KernelConfig (pyx/kernel_config.py): parsing and validation, its way from `--kernels` and
`LLM(kernels=...)` through EngineConfig to the backend, the start-up log, and the CPU backend
reading cpu_isa, act_split and moe from it (the numerics of act_split: tests/test_quant_k.py,
test_quant_legacy.py, test_gguf.py; moe=fused: test_moe_fused.py)."""
import dataclasses
import logging
import subprocess
import sys

import numpy as np
import pytest

from engine import KernelConfig
from engine.config import EngineConfig
from pyx.cpu_backend import CpuBackend, dequantize_weight, quantize_weight
from pyx.kernel_config import CHOICES, REMOVED_VARIABLES, RETIRED_VARIABLES, retired_variables

# The defaults: on a GPU the kernels that won the last GPU window; on the CPU the fastest path,
# with exact activations in the quantized qkv projection (issue 32: act_split=qkv).
DEFAULTS = ("prefill=fa3,decode=split,marlin=simple,fp8=dequant,fp8_gemv=off,"
            "sampling=simple,moe=simple,graphs_lora=off,graphs_verify=off,graphs_parallel=off,"
            "cpu_isa=auto,act_split=qkv,quant_prefill=int8,gemv_prefetch=auto")


# ---- the value

def test_defaults_are_the_kernels_engines_ran_before():
    assert str(KernelConfig()) == DEFAULTS
    assert KernelConfig.parse(None) == KernelConfig.parse("") == KernelConfig.parse({}) \
        == KernelConfig()
    assert [f.name for f in dataclasses.fields(KernelConfig)] == [*CHOICES, "sources"]


def test_parse_string_dict_and_instance():
    k = KernelConfig.parse(" prefill=fa2, decode=split ,marlin=pipeline,", "--kernels")
    assert (k.prefill, k.decode, k.marlin, k.fp8, k.cpu_isa) == ("fa2", "split", "pipeline",
                                                                  "dequant", "auto")
    assert k == KernelConfig(prefill="fa2", decode="split", marlin="pipeline")
    assert KernelConfig.parse({"act_split": "on", "cpu_isa": "scalar"}) == \
        KernelConfig(act_split="on", cpu_isa="scalar")
    assert KernelConfig.parse(k, "elsewhere") is k
    every = ",".join(f"{key}={c.values[-1]}" for key, c in CHOICES.items())
    assert str(KernelConfig.parse(every)) == every      # round trip, every key
    with pytest.raises(dataclasses.FrozenInstanceError):
        k.prefill = "simple"


@pytest.mark.parametrize("spec,message", [
    ("prefil=fa2", r"^--kernels: unknown key 'prefil'; the keys are prefill, decode, marlin, fp8, "
                   r"fp8_gemv, sampling, moe, graphs_lora, graphs_verify, graphs_parallel, "
                   r"cpu_isa, act_split, quant_prefill, gemv_prefetch$"),
    ("prefill=fa9", r"^--kernels: prefill='fa9' is not a choice; prefill takes fa3 \| fa2 \| "
                    r"simple \(default fa3\)$"),
    ("decode=split,fp8_gemv=1", r"^--kernels: fp8_gemv='1' is not a choice; fp8_gemv takes off \| "
                                r"on \(default off\)$"),
    ("prefill", r"^--kernels: 'prefill' is not key=value \(e.g. prefill=fa2,decode=split\)$"),
    ("moe=fused,moe=simple", r"^--kernels: moe is given twice$"),
    ("prefill=FA2", r"prefill='FA2' is not a choice"),
    # kernels deleted after the 2026-11-28 GPU window: the same errors as any unknown choice
    ("prefill=mma", r"^--kernels: prefill='mma' is not a choice; prefill takes fa3 \| fa2 \| "
                    r"simple \(default fa3\)$"),
    ("marlin=v2", r"^--kernels: marlin='v2' is not a choice; marlin takes simple \| pipeline "
                  r"\(default simple\)$"),
    ("filter=radix", r"^--kernels: unknown key 'filter'; the keys are prefill, decode, marlin, "),
])
def test_bad_spec_names_the_key_or_value(spec, message):
    with pytest.raises(ValueError, match=message):
        KernelConfig.parse(spec, "--kernels")


def test_bad_dict_constructor_and_type():
    with pytest.raises(ValueError, match=r"^kernels: marlin=True is not a choice; marlin takes "
                                         r"simple \| pipeline \(default simple\)$"):
        KernelConfig.parse({"marlin": True})
    with pytest.raises(ValueError, match=r"^KernelConfig: cpu_isa='sse9' is not a choice"):
        KernelConfig(cpu_isa="sse9")
    with pytest.raises(TypeError, match=r"expected a 'key=value,\.\.\.' string, a dict or a "
                                        r"KernelConfig, got list"):
        KernelConfig.parse(["prefill=fa2"])


def test_sources_and_the_start_up_line():
    k = KernelConfig.parse("prefill=fa2,act_split=off", "--kernels")
    assert k.source_of("prefill") == k.source_of("act_split") == "--kernels"
    assert k.source_of("decode") == "default"
    assert KernelConfig(decode="simple").source_of("decode") == "KernelConfig"
    # where a choice came from is not its value
    assert k == KernelConfig(prefill="fa2", act_split="off")
    line, unused = k.describe("cuda")
    assert line == ("prefill=fa2 (--kernels), decode=split (default), marlin=simple (default), "
                    "fp8=dequant (default), fp8_gemv=off (default), sampling=simple (default), "
                    "moe=simple (default), graphs_lora=off (default), "
                    "graphs_verify=off (default), graphs_parallel=off (default)")
    assert unused == ["act_split=off (--kernels)"]
    line, unused = k.describe("cpu")
    assert line == ("moe=simple (default), cpu_isa=auto (default), act_split=off (--kernels), "
                    "quant_prefill=int8 (default), gemv_prefetch=auto (default)")
    assert unused == ["prefill=fa2 (--kernels)"]


def test_retired_variables_name_their_replacement():
    assert retired_variables({}) == [] == retired_variables({"TAPER_CUDA_SPLIT_K": ""})
    assert retired_variables({"TAPER_CUDA_SPLIT_K": "1", "TAPER_CPU_ISA": "avx2", "HOME": "/"}) == [
        "TAPER_CUDA_SPLIT_K is no longer read; use --kernels decode=split (or LLM(kernels=...))",
        "TAPER_CPU_ISA is no longer read; use --kernels cpu_isa=auto|scalar|avx2|avx512 (or "
        "LLM(kernels=...))"]
    for item in RETIRED_VARIABLES.values():   # every replacement is a real key and value
        key, values = item.split("=")
        assert set(values.split("|")) <= set(CHOICES[key].values)


def test_removed_kernels_variables_say_the_kernel_is_gone():
    assert retired_variables({"TAPER_CUDA_MARLIN": "v2", "TAPER_CUDA_SPLIT_K": "1",
                              "TAPER_CUDA_RADIX_FILTER": "1"}) == [
        "TAPER_CUDA_SPLIT_K is no longer read; use --kernels decode=split (or LLM(kernels=...))",
        "TAPER_CUDA_MARLIN is no longer read; the kernel it chose (marlin=v2) was removed, the "
        "default runs",
        "TAPER_CUDA_RADIX_FILTER is no longer read; the kernel it chose (filter=radix) was "
        "removed, the default runs"]
    assert retired_variables({"TAPER_CUDA_MMA_PREFILL": "1"}) == [
        "TAPER_CUDA_MMA_PREFILL is no longer read; the kernel it chose (prefill=mma) was removed, "
        "the default runs"]
    for item in REMOVED_VARIABLES.values():   # none of them is a choice any more
        key, value = item.split("=")
        assert key not in CHOICES or value not in CHOICES[key].values


# ---- EngineConfig, the CPU backend

def test_engine_config_makes_it_a_kernel_config():
    assert EngineConfig(model="m").kernels == KernelConfig()
    config = EngineConfig(model="m", kernels="decode=split,moe=fused")
    assert config.kernels == KernelConfig(decode="split", moe="fused")
    assert config.kernels.source_of("moe") == "kernels"
    assert EngineConfig(model="m", kernels={"fp8": "cutlass"}).kernels.fp8 == "cutlass"
    given = KernelConfig.parse("sampling=fused", "--kernels")
    assert EngineConfig(model="m", kernels=given).kernels is given
    with pytest.raises(ValueError, match=r"^kernels: unknown key 'splitk'"):
        EngineConfig(model="m", kernels="splitk=on")


def test_cpu_backend_reads_its_choices():
    default = CpuBackend()
    assert (default.act_split, default.act_split_qkv, default.fused_moe, default.fused_sampling,
            default.kernels) == (False, True, False, False, KernelConfig())
    assert "act_split='qkv'" in repr(default)
    b = CpuBackend(kernels="act_split=on,moe=fused,cpu_isa=scalar")
    assert (b.act_split, b.act_split_qkv, b.fused_moe, b.isa) == (True, True, True, "scalar")
    assert "act_split='on'" in repr(b)
    off = CpuBackend(kernels="act_split=off")
    assert (off.act_split, off.act_split_qkv) == (False, False)


def test_act_split_reaches_the_quantized_matmul():
    """One decode row through Q8_0 weights: the two-row activations land ~250x closer to the
    float64 product than the one-row (ggml) rounding."""
    rng = np.random.default_rng(3)
    K, N = 256, 64
    w = quantize_weight(rng.standard_normal((N, K)).astype(np.float32), 8)   # Q8_0
    x = rng.standard_normal((1, K)).astype(np.float32)
    exact = x.astype(np.float64) @ dequantize_weight(w).astype(np.float64).T
    err = {}
    for split in ("off", "on"):
        out = np.empty((1, N), np.float32)
        CpuBackend(isa="scalar", kernels={"act_split": split}).linear(x, w, None, out)
        err[split] = np.abs(out - exact).max()
    assert err["on"] * 20 < err["off"]


def test_act_split_qkv_reaches_only_the_qkv_projection():
    """act_split=qkv (the default): a ggml-block weight placed with role "qkv" multiplies with
    two-row activations, any other with one-row ones; act_split=off leaves the qkv one rounded
    too. Float weights are placed as they are."""
    rng = np.random.default_rng(3)
    K, N = 256, 64
    w = quantize_weight(rng.standard_normal((N, K)).astype(np.float32), 8)   # Q8_0
    x = rng.standard_normal((1, K)).astype(np.float32)
    exact = x.astype(np.float64) @ dequantize_weight(w).astype(np.float64).T

    def err(backend, role):
        out = np.empty((1, N), np.float32)
        placed = backend.place_weight(w, role=role)
        backend.linear(x, placed, None, out)
        return np.abs(out - exact).max(), placed.exact_activations
    qkv, off = CpuBackend(isa="scalar"), CpuBackend(isa="scalar", kernels="act_split=off")
    (e_qkv, marked), (e_other, other_marked) = err(qkv, "qkv"), err(qkv, None)
    (e_off, off_marked) = err(off, "qkv")
    assert (marked, other_marked, off_marked) == (True, False, False)
    assert e_qkv * 20 < e_other and e_off == e_other
    assert not w.exact_activations                          # the loaded weight is not changed
    f = rng.standard_normal((N, K)).astype(np.float32)
    assert qkv.place_weight(f, role="qkv") is f


# ---- LLM(kernels=...) and the start-up log

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from checkpoints import tiny_checkpoint
    return tiny_checkpoint(tmp_path_factory.mktemp("kernels"))


def test_llm_kernels_reach_the_backend_and_the_log(tiny_dir, caplog, monkeypatch):
    from engine import LLM
    monkeypatch.setenv("TAPER_QUANT_ACT_SPLIT", "1")     # retired: warned about, not read
    with caplog.at_level(logging.INFO, logger="taper.engine"):
        llm = LLM(tiny_dir, num_kv_blocks=8, kernels="cpu_isa=scalar,moe=fused,prefill=fa2")
    backend = llm.engine.backend
    assert (backend.isa, backend.fused_moe, backend.act_split) == ("scalar", True, False)
    assert llm.engine.config.kernels == KernelConfig(cpu_isa="scalar", moe="fused",
                                                     prefill="fa2")
    assert ("kernels (cpu backend): moe=fused (kernels), cpu_isa=scalar (kernels), "
            "act_split=qkv (default)") in caplog.text
    assert ("kernels prefill=fa2 (kernels): the cpu backend has no such choice; ignored"
            in caplog.text)
    assert "TAPER_QUANT_ACT_SPLIT is no longer read; use --kernels act_split=on" in caplog.text

    llm = LLM(tiny_dir, num_kv_blocks=8, kernels=KernelConfig(act_split="on"))
    assert llm.engine.backend.act_split and not llm.engine.backend.fused_moe
    with pytest.raises(ValueError, match=r"^kernels: moe='grouped' is not a choice"):
        LLM(tiny_dir, num_kv_blocks=8, kernels={"moe": "grouped"})


# ---- the server's flag

def test_server_help_shows_kernels():
    out = subprocess.run([sys.executable, "-m", "server", "--help"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    flat = " ".join(out.split())
    assert "--kernels KEY=VALUE,..." in flat
    assert "e.g. prefill=fa2,decode=split,marlin=pipeline" in flat
    for key, c in CHOICES.items():
        assert f"{key}={'|'.join(c.values)} ({', '.join(c.backends)})" in flat, key


def test_server_kernels_flag_reaches_the_engine_config():
    from server.__main__ import build_parser, check_args, engine_config
    p = build_parser()
    args = p.parse_args(["--w", "/m", "--cpu", "--kernels", "act_split=on,prefill=simple"])
    assert check_args(args) is None
    config = engine_config(args)
    assert config.kernels == KernelConfig(act_split="on", prefill="simple")
    assert config.kernels.source_of("act_split") == "--kernels"
    assert engine_config(p.parse_args(["--w", "/m", "--cpu"])).kernels == KernelConfig()
    bad = p.parse_args(["--w", "/m", "--cpu", "--kernels", "decode=splitk"])
    assert check_args(bad) == ("--kernels: decode='splitk' is not a choice; decode takes split | "
                               "simple (default split)")
    gone = p.parse_args(["--w", "/m", "--cpu", "--kernels", "prefill=mma"])
    assert check_args(gone) == ("--kernels: prefill='mma' is not a choice; prefill takes fa3 | "
                                "fa2 | simple (default fa3)")
