"""Host-side logic of the CUDA backend, checked on any machine (issue 4, item 6): the extension
imports without a GPU and a launch then fails naming the op, the split-K workspace arithmetic
(the split count: tests/test_decode_splits.py), and the GPU memory plan. The kernels themselves
are tested in tests/gpu/."""
import importlib.util

import numpy as np
import pytest

from engine.runner import cuda_memory

needs_ext = pytest.mark.skipif(importlib.util.find_spec("pyx.cuda_backend") is None,
                               reason="pyx.cuda_backend was not built (no nvcc here, "
                                      "or TAPER_CUDA=0)")


@pytest.fixture(scope="module")
def cb():
    import pyx.cuda_backend as cb
    return cb


@needs_ext
def test_launch_without_device_names_op(cb):
    if cb.device_count():
        pytest.skip("a GPU is present: tests/gpu covers the launches")
    with pytest.raises(cb.CudaError, match=r"^rms_norm: .*\[T=1, H=8, dtype=1\]"):
        cb.launch_rms_norm(0, 0, 0, 1, 8, 1e-5, 1, 0)
    with pytest.raises(cb.CudaError, match=r"^paged_attention \(decode\): "):
        cb.launch_paged_attention_decode(0, 0, 0, 0, 0, 0, 0, 0, 1, 4, 2, 64, 1, 16, 1, 0.125, 0,
                                         0.0, 1, 1, 1, 0, 0, 0)


@needs_ext
def test_cuda_backend_has_the_vision_ops(cb):
    """The vision-language models load on CUDA (engine/models/qwen2_5_vl.py refuses a backend
    without these ops), and the new launchers fail naming their op without a device."""
    from engine.models.gemma3_vl import TOWER_OPS
    from engine.models.qwen2_5_vl import missing_ops
    assert missing_ops(cb.CudaBackend) == []
    assert missing_ops(cb.CudaBackend, TOWER_OPS) == []      # Gemma 3's SigLIP tower
    if cb.device_count():
        return
    with pytest.raises(cb.CudaError, match=r"^gelu: .*\[n=8, dtype=1\]"):
        cb.launch_gelu(0, 0, 8, 1, 0)
    with pytest.raises(cb.CudaError, match=r"^encoder_attention: .*\[N=4, S=1, H=2, D=80"):
        cb.launch_encoder_attention(0, 0, 0, 0, 0, 4, 1, 2, 80, 0.1, 1, 0)
    with pytest.raises(cb.CudaError, match=r"^encoder_attention: .*D=512"):   # past the kernel's
        cb.launch_encoder_attention(0, 0, 0, 0, 0, 4, 1, 2, 512, 0.1, 1, 0)


@needs_ext
def test_sample_fused_launch_checks_and_names_op(cb):
    """The fused sampler's launcher: a missing array is an argument error before any launch,
    and without a device the launch fails naming the op and the sizes."""
    if cb.device_count():
        pytest.skip("a GPU is present: tests/gpu covers the launches")
    fake = [8] * 8   # logits, greedy, temperature, top_k, top_p, min_p, seeds, positions
    no_pen = [0] * 5
    with pytest.raises(cb.CudaError, match=r"^sample_fused: arguments the kernel cannot run "
                                            r"with \(status -1\) \[B=1, V=10, N=2\]"):
        cb.launch_sample_fused(*fake, *no_pen, 8, 1, 10, 2, 0)   # N = 2 entries, no arrays
    with pytest.raises(cb.CudaError, match=r"^sample_fused: .*\(status [1-9]\d*\) "
                                            r"\[B=1, V=10, N=0\]"):
        cb.launch_sample_fused(*fake, *no_pen, 8, 1, 10, 0, 0)


@needs_ext
def test_backend_needs_a_device(cb):
    if cb.device_count():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="no CUDA device 0"):
        cb.CudaBackend()


@needs_ext
def test_decode_workspace_bytes(cb):
    assert cb.decode_workspace_bytes(4, 32, 128, 1) == 0
    # per (sequence, query head, partition): D float partial outputs plus a max and a sum
    one = cb.decode_workspace_bytes(1, 1, 128, 2)
    assert one >= 2 * (128 + 2) * 4
    assert cb.decode_workspace_bytes(3, 5, 128, 2) == 15 * one


@needs_ext
def test_prefill_kernel_choice(cb):
    """KernelConfig's prefill values are the launcher's variants, in its numbering; a bad
    kernel choice stops the backend's construction before it looks for a device, naming the
    key and the choices."""
    from pyx.kernel_config import CHOICES
    assert set(cb.PREFILL_VARIANTS) == set(CHOICES["prefill"].values)
    assert [cb.PREFILL_VARIANTS[n] for n in ("simple", "fa2", "fa3")] == [0, 1, 2]
    with pytest.raises(ValueError, match=r"prefill='mma' is not a choice; prefill takes fa3 "
                                         r"\| fa2 \| simple"):
        cb.CudaBackend(kernels="prefill=mma")
    with pytest.raises(ValueError, match=r"marlin='v2' is not a choice"):
        cb.CudaBackend(kernels={"marlin": "v2"})


@needs_ext
def test_prefill_variant_launch_without_device_names_op(cb):
    """Variants 1 (fa2) and 2 (fa3, which falls back to fa2 off compute capability 9.0) pass
    the launcher's argument checks and reach the device (absent here), while a variant number
    the launcher lacks (3, the fa3 of the old numbering, where 1 was the deleted mma kernel) is
    an argument error."""
    if cb.device_count():
        pytest.skip("a GPU is present: tests/gpu covers the launches")
    args = (16, 16, 16, 16, 0, 0, 16, 16, 16, 64, 1, 4, 2, 64, 4, 16, 2, 0.125, 0, 0.0, 1, 1)
    for variant in (1, 2):
        with pytest.raises(cb.CudaError, match=r"paged_attention \(prefill\)") as e:
            cb.launch_paged_attention_prefill(*args, variant, 0)
        assert "status -1" not in str(e.value)
    for variant in (3, -1):
        with pytest.raises(cb.CudaError, match="status -1"):
            cb.launch_paged_attention_prefill(*args, variant, 0)


@needs_ext
def test_marlin_variant_launch_without_device_names_op(cb):
    """The simple (0) and pipelined (1) Marlin kernels pass the launcher's argument checks and
    reach the device (absent here); 2, Marlin v2 before it was deleted, is an argument error."""
    if cb.device_count():
        pytest.skip("a GPU is present: tests/gpu covers the launches")
    # x, qweight, scales, zeros (none), out; M, N, K, group size; bf16
    args = (16, 16, 16, 0, 16, 1, 64, 128, 128, 1)
    for variant in (0, 1):
        ws = cb.marlin_workspace_bytes(1, 64, 128, variant)
        with pytest.raises(cb.CudaError, match=r"^linear \(marlin_gemm\)") as e:
            cb.launch_marlin_gemm(*args, variant, 256 if ws else 0, ws, 0)
        assert "status -1" not in str(e.value)
    with pytest.raises(cb.CudaError, match="status -1"):
        cb.launch_marlin_gemm(*args, 2, 0, 0, 0)


def _cupy_cublas_importable():
    try:
        from cupy_backends.cuda.libs import cublas  # noqa: F401 (needs libcublas)
    except Exception:
        return False
    return True


@needs_ext
def test_cublas_entry_points(cb):
    """The backend calls cuBLAS through function pointers taken from the libcublas CuPy loaded
    (CuPy's own wrappers refuse to run while a stream captures a CUDA graph). Runs wherever
    libcublas can be loaded, GPU or not."""
    if not _cupy_cublas_importable():
        pytest.skip("CuPy's cuBLAS binding does not import here (CuPy, the [cuda13] extra, "
                    "and libcublas belong to GPU machines)")
    name = cb._load_cublas()
    assert "libcublas.so" in name and "libcublasLt" not in name
    assert cb._load_cublas() == name                        # loaded once
    assert "libcublas.so" in cb._mapped_cublas_path()
    import ctypes
    lib = ctypes.CDLL(name)
    assert cb._cublas_symbol(lib, "no_such_symbol") == 0
    assert cb._cublas_symbol(lib, "no_such_symbol", "cublasGemmEx") != 0


def test_kv_budget():
    # --mem wins; else the fraction of what is free after the graph reservation
    assert cuda_memory.kv_budget_bytes(10 << 30, 1 << 30, 0.5, 100)[0] == 100 << 20
    assert cuda_memory.kv_budget_bytes(10 << 30, 1 << 30, 0.5, None)[0] == 9 << 29
    assert cuda_memory.kv_budget_bytes(10 << 30, 0, None, None)[0] == int((10 << 30) * 0.9)
    assert cuda_memory.kv_budget_bytes(1 << 20, 2 << 20, 0.9, None)[0] == 0


def test_profile_forward_runs_on_cpu(tmp_path):
    """The profiling batch is valid input for the real graph (run here on the CPU backend):
    several sequences when the step is longer than the context, nothing written to the cache."""
    from checkpoints import tiny_checkpoint
    from engine.loader.model_loader import load_model
    from pyx.cpu_backend import CpuBackend

    backend = CpuBackend()
    model, _ = load_model(tiny_checkpoint(tmp_path), backend, progress=False)
    calls = []
    forward = model.forward
    model.forward = lambda batch, caches: calls.append((batch, caches)) or forward(batch, caches)
    cuda_memory.profile_forward(model, backend, max_num_batched_tokens=600, max_num_seqs=8,
                                block_size=16)
    (batch, caches), = calls
    assert batch.num_tokens == 600 and batch.num_seqs == 3       # max_model_len is 256
    assert list(batch.seq_lens) == [256, 256, 88]
    assert (batch.slot_mapping == -1).all() and len(batch.logits_indices) == 8
    assert all(not k.any() and not v.any() for k, v in caches)   # nothing was written
    assert model.workspace is not None


def test_engine_config_backend_choice():
    from engine.config import EngineConfig
    with pytest.raises(ValueError, match="backend must be auto, cpu or cuda"):
        EngineConfig(model="m", backend="gpu")
    with pytest.raises(ValueError, match="device must be >= 0"):
        EngineConfig(model="m", backend="cuda", device=-1)


@needs_ext
def test_engine_on_cuda_without_device_says_so(tmp_path):
    from checkpoints import tiny_checkpoint
    from engine.llm import LLM
    from pyx.cuda_backend import device_count
    if device_count():
        pytest.skip("a GPU is present")
    model = tiny_checkpoint(tmp_path)
    with pytest.raises(RuntimeError, match="no CUDA device 0"):
        LLM(model, backend="cuda")
