"""Every loader error names the file and what is wrong with it: one damaged copy per kind, made
from a valid file (a safetensors file from the safetensors library's writer; a GGUF file from
llama.cpp's converter, tests/data/gguf/), each cut or edited where the valid file's own layout
says, and the message checked for the file and the part that is wrong."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from gguf import GGUFReader
from safetensors.numpy import save_file

from engine.loader.gguf import read_gguf
from engine.loader.safetensors import CheckpointError, load_safetensors
from gguf_fixtures import path_of

# ---- safetensors


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> tuple[bytes, int, dict]:
    """(bytes of a valid two-tensor file, its header length, its header)."""
    path = tmp_path_factory.mktemp("valid") / "model.safetensors"
    save_file({"a": np.arange(16, dtype=np.float32).reshape(4, 4),
               "b": np.ones((64, 64), np.float32)}, str(path))
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    load_safetensors(str(path.parent), progress=False)          # it is valid
    return data, n, json.loads(data[8:8 + n])


def with_header(valid, header) -> bytes:
    """The valid file's data behind another header."""
    data, n, _ = valid
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data[8 + n:]


def load_error(tmp_path, content: bytes) -> tuple[str, str]:
    """(the file's path, the CheckpointError's message) for a checkpoint holding `content`."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as e:
        load_safetensors(str(tmp_path), progress=False)
    assert str(path) in str(e.value)
    return str(path), str(e.value)


def test_shorter_than_the_header_length(valid, tmp_path):
    _, message = load_error(tmp_path, valid[0][:5])
    assert "not a safetensors file (5 bytes: shorter than the 8-byte header length)" in message


def test_garbage_bytes_give_a_header_length_beyond_the_file(valid, tmp_path):
    # the case: read as a length, these bytes asked for an 8 EB read (MemoryError)
    garbage = bytes(range(256)) * 64
    _, message = load_error(tmp_path, garbage)
    n = struct.unpack("<Q", garbage[:8])[0]
    assert f"header length of {n} bytes, beyond the file's {len(garbage)}" in message


def test_a_file_cut_inside_its_header(valid, tmp_path):
    data, n, _ = valid
    _, message = load_error(tmp_path, data[:8 + n // 2])
    assert f"header length of {n} bytes, beyond the file's {8 + n // 2}" in message


@pytest.mark.parametrize("raw, kind", [
    (b'{"a": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}', "JSONDecodeError"),
    (b'{"a": "\xff\xfe"}', "UnicodeDecodeError"),
])
def test_a_header_that_is_not_json(valid, tmp_path, raw, kind):
    _, message = load_error(tmp_path, with_header(valid, raw))
    assert f"the {len(raw)}-byte JSON header cannot be parsed ({kind}" in message


@pytest.mark.parametrize("edit, wanted", [
    (lambda h: list(h), "the JSON header is a list, not an object of tensors"),
    (lambda h: {**h, "a": {"dtype": "F32", "shape": [4, 4]}},
     "header entry 'a' is not {dtype, shape, data_offsets}"),
    (lambda h: {**h, "a": {**h["a"], "shape": [4, -4]}}, "tensor a has shape [4, -4]"),
    (lambda h: {**h, "a": {**h["a"], "data_offsets": [64, 0]}},
     "tensor a has data_offsets [64, 0]; expected [begin, end] with 0 <= begin <= end"),
    (lambda h: {**h, "a": {**h["a"], "dtype": ["F32"]}}, "tensor a has unsupported dtype"),
])
def test_a_malformed_header_entry(valid, tmp_path, edit, wanted):
    _, message = load_error(tmp_path, with_header(valid, edit(valid[2])))
    assert wanted in message


def test_tensor_offsets_outside_the_file(valid, tmp_path):
    data, n, header = valid
    size = len(data) - 8 - n
    header = {**header, "b": {**header["b"], "data_offsets": [size, size + 64 * 64 * 4]}}
    _, message = load_error(tmp_path, with_header(valid, header))
    assert (f"tensor b needs data bytes [{size}, {size + 16384}) but the file holds only "
            f"{size} after its header") in message


def test_truncated_tensor_data(valid, tmp_path):
    data, n, header = valid
    _, message = load_error(tmp_path, data[:-100])
    begin, end = header["b"]["data_offsets"]
    assert (f"file is truncated, or its header corrupt: tensor b needs data bytes "
            f"[{begin}, {end}) but the file holds only {len(data) - 100 - 8 - n}") in message


# ---- GGUF

GGUF = "qwen2-q4_k_m"


@pytest.fixture(scope="module")
def gguf_file():
    """(bytes of a valid GGUF file, its GGUFReader)."""
    path = path_of(GGUF)
    with open(path, "rb") as f:
        return f.read(), GGUFReader(path)


def gguf_error(tmp_path, content: bytes) -> str:
    path = tmp_path / "damaged.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError) as e:
        read_gguf(str(path), progress=False)
    message = str(e.value)
    assert message.startswith(f"{path}: "), message
    return message


def patched(data: bytes, offset: int, value: bytes) -> bytes:
    return data[:offset] + value + data[offset + len(value):]


def test_gguf_bad_magic(gguf_file, tmp_path):
    message = gguf_error(tmp_path, patched(gguf_file[0], 0, b"GGML"))
    assert "not a GGUF file (starts with b'GGML', expected b'GGUF')" in message


def test_gguf_unsupported_version(gguf_file, tmp_path):
    message = gguf_error(tmp_path, patched(gguf_file[0], 4, struct.pack("<I", 99)))
    assert "GGUF version 99 is not supported (versions 2, 3 are)" in message


def test_gguf_cut_in_the_counts(gguf_file, tmp_path):
    message = gguf_error(tmp_path, gguf_file[0][:20])
    assert "truncated or corrupt GGUF file: the metadata key count needs bytes [16, 24) but the " \
           "file has 20" in message


def test_gguf_cut_in_a_metadata_value(gguf_file, tmp_path):
    data, reader = gguf_file
    field = reader.fields["tokenizer.ggml.tokens"]
    message = gguf_error(tmp_path, data[:field.offset + 100])
    assert "truncated or corrupt GGUF file: metadata key tokenizer.ggml.tokens (item " in message
    assert f"but the file has {field.offset + 100}" in message


def test_gguf_cut_in_a_metadata_key_name(gguf_file, tmp_path):
    data, reader = gguf_file
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    third = reader.fields[keys[2]]
    message = gguf_error(tmp_path, data[:third.offset + 10])
    assert (f"the name of metadata key 3 of {len(keys)} (after {keys[1]}) needs bytes "
            f"[{third.offset + 8}, ") in message


def test_gguf_cut_in_a_tensor_info(gguf_file, tmp_path):
    data, reader = gguf_file
    t = reader.tensors[3]
    name_end = t.field.offset + 8 + len(t.name)         # the name, then n_dims, dims, type
    message = gguf_error(tmp_path, data[:name_end + 2])
    assert f"the info of tensor {t.name} needs bytes [{name_end}, {name_end + 4})" in message


def test_gguf_cut_in_the_tensor_data(gguf_file, tmp_path):
    data, reader = gguf_file
    t = reader.tensors[len(reader.tensors) // 2]
    cut = int(t.data_offset) + 10
    message = gguf_error(tmp_path, data[:cut])
    assert (f"truncated GGUF file: tensor {t.name} needs bytes [{t.data_offset}, "
            f"{t.data_offset + t.n_bytes}) but the file has {cut}") in message


def test_gguf_unknown_value_type(gguf_file, tmp_path):
    data, reader = gguf_file
    field = reader.fields["general.name"]
    at = field.offset + 8 + len("general.name")          # the key, then its value type
    message = gguf_error(tmp_path, patched(data, at, struct.pack("<I", 77)))
    assert "corrupt GGUF file: metadata key general.name has unknown value type 77" in message


def test_gguf_unknown_tensor_type(gguf_file, tmp_path):
    data, reader = gguf_file
    t = reader.tensors[3]
    at = t.field.offset + 8 + len(t.name) + 4 + 8 * len(t.shape)
    message = gguf_error(tmp_path, patched(data, at, struct.pack("<I", 200)))
    assert f"corrupt GGUF file: tensor {t.name} has unknown type 200" in message
