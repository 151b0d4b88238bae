"""tests/gpu: the CUDA backend against the CPU backend and the NumPy oracle (issue 4).

Every test in this folder is skipped at collection, with the reason, unless `pyx.cuda_backend`
imports (Taper was built with nvcc), its `device_count()` sees a device and CuPy works. The test
modules import nothing GPU-specific at module level, so they collect on any machine.

cuda_backend() binds the backend it returns to the test's thread (bind_thread): several backends
live in one session, each with its own stream, and CuPy allocates, copies and frees on the thread's
current stream. A test that took a backend made earlier, without binding it, queued its copies and
allocations on the newest backend's stream while its kernels ran on their own: inputs still being
copied (the NaN tails of the 2026-11-24 H100 run's large quantized GEMMs) and pool memory reused
under a running kernel.

Backends are cached for the whole session and never freed: each CudaBackend gives the device's
shared cuBLAS handle its own workspace, so a backend must outlive every other one that uses the
handle after it. Tests that need a kernel choice (decode=simple, prefill=fa2, ...: the
KernelConfig a backend reads when it is built) get a backend built with it, cached the same way.
"""
from __future__ import annotations

import pathlib

import pytest

HERE = pathlib.Path(__file__).resolve().parent


def _why_no_gpu() -> str | None:
    try:
        from pyx.cuda_backend import device_count
    except Exception as e:  # built without nvcc (or TAPER_CUDA=0): no extension
        return f"pyx.cuda_backend does not import ({type(e).__name__}: {e})"
    try:
        n = device_count()
    except Exception as e:
        return f"pyx.cuda_backend.device_count() failed ({type(e).__name__}: {e})"
    if n < 1:
        return "no CUDA device (pyx.cuda_backend.device_count() == 0)"
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return f"CuPy is not usable ({type(e).__name__}: {e})"
    return None


GPU_SKIP_REASON = _why_no_gpu()


def pytest_collection_modifyitems(config, items):
    if GPU_SKIP_REASON is None:
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if HERE in pathlib.Path(item.path).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def small_kv_pools():
    """bench/gpu_check.sh runs these files side by side on one GPU, one process each: an engine
    built without an explicit pool size takes 5% of the free memory for its KV cache here, not
    the 90% a server takes, so that one file's engines cannot starve another's."""
    from engine.runner import cuda_memory
    saved = cuda_memory.DEFAULT_KV_FRACTION
    cuda_memory.DEFAULT_KV_FRACTION = 0.05
    yield
    cuda_memory.DEFAULT_KV_FRACTION = saved


_BACKENDS: dict = {}


def cuda_backend(dtype: str, kernels: str = ""):
    """The session's CudaBackend for activation `dtype` ("f32" | "bf16" | "f16") built with the
    kernel choices `kernels` ("decode=split", "prefill=fa2", ...: the KernelConfig syntax) and
    every other choice at its default."""
    from pyx.cuda_backend import CudaBackend
    from pyx.kernel_config import KernelConfig

    config = KernelConfig.parse(kernels)
    key = (dtype, str(config))
    if key not in _BACKENDS:
        _BACKENDS[key] = CudaBackend(dtype=dtype, device=0, kernels=config)
    _BACKENDS[key].bind_thread()
    return _BACKENDS[key]


@pytest.fixture(scope="session")
def make_cuda():
    """cuda_backend itself: make_cuda("bf16", "prefill=fa2")."""
    return cuda_backend


@pytest.fixture(params=["f32", "bf16", "f16"])
def cuda(request):
    """The CUDA backend for each activation dtype (switches off)."""
    return cuda_backend(request.param)


@pytest.fixture
def cuda_bf16():
    return cuda_backend("bf16")


@pytest.fixture
def cuda_f32():
    return cuda_backend("f32")


@pytest.fixture(scope="session")
def cpu():
    """The CPU backend (f32 activations): the reference for every CUDA op."""
    from pyx.cpu_backend import CpuBackend
    return CpuBackend()
