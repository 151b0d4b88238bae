"""Memory-mapped safetensors loading without torch, single file or sharded.

We parse the format ourselves (8-byte little-endian header length, a JSON header of
{name: {dtype, shape, data_offsets}}, then the data) and hand out np.memmap views, so bf16 comes out
as ml_dtypes.bfloat16 with no copy. Tensors that keep their stored dtype stay file-backed.

dtype policy: 1-D tensors (norm weights, biases, scales) become float32; matrices keep the
checkpoint's dtype under "auto" when the kernels read it (f32, bf16, f16; others become f32) and
are converted when f32/bf16/f16 is asked for.
"""
from __future__ import annotations

import json
import logging
import math
import os
import struct

import ml_dtypes
import numpy as np
from tqdm import tqdm

logger = logging.getLogger("taper.loader")

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8), "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}

_DTYPE_ALIASES = {
    "auto": None, "f32": np.float32, "float32": np.float32, "bf16": ml_dtypes.bfloat16,
    "bfloat16": ml_dtypes.bfloat16, "f16": np.float16, "float16": np.float16,
}


_F8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
# A quantized checkpoint's scales: converting f16 to bf16 (or back) would round them.
_QUANT_SCALE_SUFFIXES = (".scales", ".weight_scale_inv", ".weight_scale", ".input_scale")

# What the matrix kernels read directly.
_COMPUTE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated or inconsistent."""


def resolve_dtype(dtype) -> np.dtype | None:
    """None for "auto", else the numpy dtype for big matrices."""
    if isinstance(dtype, str):
        if dtype not in _DTYPE_ALIASES:
            raise ValueError(f"dtype must be auto, f32, bf16 or f16, got {dtype!r}")
        dtype = _DTYPE_ALIASES[dtype]
    return None if dtype is None else np.dtype(dtype)


def target_dtype(array: np.ndarray, dtype: np.dtype | None) -> np.dtype:
    """The dtype a tensor is loaded as (module docstring: dtype policy)."""
    if array.dtype.kind in "iub":
        return array.dtype
    if array.ndim <= 1 or (dtype is None and array.dtype not in _COMPUTE_DTYPES):
        return np.dtype(np.float32)  # vectors, and f64 / f8 matrices: the kernels take f32
    return array.dtype if dtype is None else dtype


def read_header(path: str) -> tuple[dict, int]:
    """(header without __metadata__, byte offset where the data starts). The header's length and
    every entry are checked before use, so a corrupt file is named with what is wrong with it;
    the data is not read."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file ({size} bytes: shorter than "
                                  "the 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:       # garbage reads as a huge length: never try to allocate it
            raise CheckpointError(f"{path}: not a safetensors file, or truncated: its first 8 "
                                  f"bytes give a header length of {n} bytes, beyond the file's "
                                  f"{size}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as e:     # JSONDecodeError, or UnicodeDecodeError for bytes that are not UTF-8
        raise CheckpointError(f"{path}: the {n}-byte JSON header cannot be parsed "
                              f"({type(e).__name__}: {e}): not a safetensors file, or corrupt") \
            from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the JSON header is a {type(header).__name__}, not an "
                              "object of tensors")
    header.pop("__metadata__", None)
    for name, info in header.items():
        _check_entry(path, name, info)
    return header, 8 + n


def _check_entry(path: str, name: str, info) -> None:
    """A header entry is {dtype, shape, data_offsets} with non-negative integers in order."""
    def is_count(x):
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise CheckpointError(f"{path}: header entry {name!r} is not "
                              f"{{dtype, shape, data_offsets}}: {str(info)[:200]}")
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(map(is_count, shape)):
        raise CheckpointError(f"{path}: tensor {name} has shape {shape!r}; expected a list of "
                              "non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(is_count, offsets))
            or offsets[0] > offsets[1]):
        raise CheckpointError(f"{path}: tensor {name} has data_offsets {offsets!r}; expected "
                              "[begin, end] with 0 <= begin <= end")


def checkpoint_files(model_dir: str) -> tuple[list[str], dict[str, str] | None]:
    """(safetensors files, weight_map from the index or None for a single file)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index: {type(e).__name__}: "
                                  f"{e}") from None
        for name in files:
            if not os.path.isfile(os.path.join(model_dir, name)):
                raise CheckpointError(f"{model_dir}: shard {name} listed in "
                                      "model.safetensors.index.json is missing")
        return [os.path.join(model_dir, n) for n in files], weight_map
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single], None
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    # Mistral's own-format consolidated.safetensors duplicates the HF-named shards beside it.
    if any(not f.startswith("consolidated") for f in files):
        files = [f for f in files if not f.startswith("consolidated")]
    if not files:
        raise CheckpointError(f"{model_dir}: no .safetensors files found")
    return [os.path.join(model_dir, n) for n in files], None


def open_file(path: str) -> dict[str, np.ndarray]:
    """Every tensor of one file as a read-only memory-mapped array in its stored dtype."""
    header, data_start = read_header(path)
    data_size = os.path.getsize(path) - data_start
    mm = np.memmap(path, dtype=np.uint8, mode="r") if data_size > 0 else np.zeros(0, np.uint8)
    tensors = {}
    for name, info in header.items():
        if not isinstance(info["dtype"], str) or info["dtype"] not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        dt = _DTYPES[info["dtype"]]
        shape = tuple(info["shape"])
        begin, end = info["data_offsets"]
        expected = math.prod(shape) * dt.itemsize
        if end - begin != expected:
            raise CheckpointError(f"{path}: tensor {name} has shape {list(shape)} {info['dtype']} "
                                  f"({expected} bytes) but its data_offsets span {end - begin} bytes")
        if end > data_size:
            raise CheckpointError(f"{path}: file is truncated, or its header corrupt: tensor "
                                  f"{name} needs data bytes [{begin}, {end}) but the file holds "
                                  f"only {data_size} after its header")
        offset = data_start + begin
        if offset % dt.itemsize:
            arr = np.frombuffer(mm[offset:offset + expected].tobytes(), dtype=dt).reshape(shape)
        else:
            arr = np.ndarray(shape, dtype=dt, buffer=mm, offset=offset)
        tensors[name] = arr
    return tensors


def mem_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def load_safetensors(model_dir: str, dtype="auto", progress: bool = True,
                     check_memory: bool = True, quantized: bool = False,
                     shard=None) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint in model_dir, converted by the dtype policy. In a
    `quantized` checkpoint (GPTQ, AWQ, compressed-tensors, FP8) the F8 codes and the quantization
    scales stay as stored, for engine/loader/quant_formats.py to take. shard(name, tensor, whole
    shapes by name): a tensor-parallel rank's part of each memory-mapped tensor
    (engine/parallel/sharding.py), cut before anything is read or converted, or None for a
    tensor of another pipeline stage."""
    want = resolve_dtype(dtype)

    def target(name, arr):
        kept = quantized and (arr.dtype in _F8_DTYPES or name.endswith(_QUANT_SCALE_SUFFIXES))
        return arr.dtype if kept else target_dtype(arr, want)

    files, weight_map = checkpoint_files(model_dir)
    opened = {path: open_file(path) for path in files}

    if weight_map is not None:
        for name, shard_file in weight_map.items():
            if name not in opened[os.path.join(model_dir, shard_file)]:
                raise CheckpointError(f"{os.path.join(model_dir, shard_file)}: tensor {name} is "
                                      "listed in model.safetensors.index.json but missing from "
                                      "the file")
    owner = {}
    for path, tensors in opened.items():
        for name in tensors:
            if name in owner:
                raise CheckpointError(f"tensor {name} appears in both {owner[name]} and {path}")
            owner[name] = path
    if shard is not None:       # (None: a tensor the rank does not hold at all)
        shapes = {n: a.shape for tensors in opened.values() for n, a in tensors.items()}
        opened = {path: {n: s for n, a in tensors.items()
                         if (s := shard(n, a, shapes)) is not None}
                  for path, tensors in opened.items()}

    needed = sum(a.size * target(n, a).itemsize
                 for tensors in opened.values() for n, a in tensors.items())
    available = mem_available_bytes()
    message = f"loading {model_dir}: needs {needed / 1e9:.2f} GB"
    if available is not None:
        message += f", {available / 1e9:.2f} GB available"
    logger.info(message)
    if check_memory and available is not None and needed > available:
        raise MemoryError(f"{message}: the weights do not fit in memory "
                          "(try a smaller dtype or a machine with more RAM)")

    weights = {}
    total = sum(len(t) for t in opened.values())
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress or None,
              leave=False) as bar:
        for path in files:
            for name, arr in opened.pop(path).items():
                want_dt = target(name, arr)
                weights[name] = arr if arr.dtype == want_dt else arr.astype(want_dt)
                bar.update(1)
    return weights


def add_model_prefix(weights: dict) -> dict:
    """A headless transformer's tensors (LlamaModel.save_pretrained: `layers.0...`, `norm.weight`)
    under the causal LM's names (`model.layers.0...`); an lm_head keeps its name."""
    return {(n if n.startswith("lm_head.") else "model." + n): w for n, w in weights.items()}
