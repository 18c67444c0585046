"""A GGUF file's tensors (memory-mapped, as `gguf.GGUFReader` lists them) and its scalar metadata.

`gguf.GGUFReader` builds a numpy view of every element of every metadata array before it lists a
tensor: a chat model's file carries its tokenizer's vocabulary and merges there, a hundred thousand
strings or so, and reading them was most of an engine's start on a small GGUF model. Loading the
weights needs the architecture and the tensors only (the tokenizer and config come from the HF view
made once per file, engine.loader.gguf_config.hf_view), so this reads the header with `struct` and
steps over the arrays without looking at their elements. Same file layout as llama.cpp's
`gguf.md` and the `gguf` package (little-endian files, versions 2 and 3).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import (GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, READER_SUPPORTED_VERSIONS,
                  GGMLQuantizationType, GGUFReader, GGUFValueType)
from gguf.quants import quant_shape_to_byte_shape

# Scalar metadata types and their numpy types: gguf's reader's own table.
_SCALARS = GGUFReader.gguf_scalar_to_np
# Tensor types the reader views as numbers; every other type as its raw bytes per row (as gguf does).
_NUMPY_TYPES = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class IndexField:
    """A scalar or string metadata value (`contents()` as gguf's ReaderField has it)."""

    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True)
class IndexTensor:
    """The attributes of gguf's ReaderTensor that loading reads."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray       # dims, innermost first (GGUF's order)
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray        # a view of the memory map, outermost dim first


class GGUFIndex:
    """`fields` holds scalar and string values only (arrays are stepped over); `tensors` as gguf's."""

    def __init__(self, path: str | Path):
        path = Path(path)
        self.data = np.memmap(path, mode="r")
        self._name = path.name
        magic, version, num_tensors, num_kv = self._unpack("<IIQQ", 0)
        if magic != GGUF_MAGIC:
            raise ValueError(f"{path.name}: not a GGUF file (magic {magic:#x})")
        if version not in READER_SUPPORTED_VERSIONS:
            raise ValueError(f"{path.name}: GGUF version {version} is not supported (supported: "
                             f"{', '.join(map(str, READER_SUPPORTED_VERSIONS))}; a big-endian file reads "
                             f"as a version above 65535)")
        offset = 24
        self.fields: dict[str, IndexField] = {}
        for _ in range(num_kv):
            key, offset = self._string(offset)
            (value_type,) = self._unpack("<I", offset)
            value, offset = self._value(GGUFValueType(value_type), offset + 4)
            if value is not None:
                self.fields[key] = IndexField(value)
        infos = []
        for _ in range(num_tensors):
            name, offset = self._string(offset)
            (num_dims,) = self._unpack("<I", offset)
            dims = np.frombuffer(self.data, np.uint64, num_dims, offset + 4).copy()
            offset += 4 + 8 * num_dims
            tensor_type, data_offset = self._unpack("<IQ", offset)
            offset += 12
            infos.append((name, dims, GGMLQuantizationType(tensor_type), data_offset))
        alignment = self.fields.get("general.alignment", IndexField(GGUF_DEFAULT_ALIGNMENT)).value
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{path.name}: general.alignment={alignment} is not a power of two")
        start = -(-offset // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"{path.name}: a tensor name appears twice")

    def _unpack(self, fmt: str, offset: int) -> tuple:
        return struct.unpack_from(fmt, self.data, offset)

    def _string(self, offset: int) -> tuple[str, int]:
        (length,) = self._unpack("<Q", offset)
        start = offset + 8
        return bytes(self.data[start:start + length]).decode("utf-8"), start + length

    def _value(self, value_type: GGUFValueType, offset: int) -> tuple[Any, int]:
        """(the value, or None for an array; the offset after it)."""
        if value_type == GGUFValueType.STRING:
            return self._string(offset)
        if value_type in _SCALARS:
            dtype = np.dtype(_SCALARS[value_type]).newbyteorder("<")
            return np.frombuffer(self.data, dtype, 1, offset)[0].item(), offset + dtype.itemsize
        if value_type != GGUFValueType.ARRAY:
            raise ValueError(f"{self._name}: unknown GGUF metadata type {value_type}")
        item_type, count = self._unpack("<IQ", offset)
        return None, self._skip_items(GGUFValueType(item_type), count, offset + 12)

    def _skip_items(self, item_type: GGUFValueType, count: int, offset: int) -> int:
        if item_type in _SCALARS:
            return offset + count * np.dtype(_SCALARS[item_type]).itemsize
        for _ in range(count):  # strings and nested arrays: each item says its own length
            if item_type == GGUFValueType.STRING:
                offset += 8 + self._unpack("<Q", offset)[0]
            else:
                offset = self._value(item_type, offset)[1]
        return offset

    def _tensor(self, start: int, name: str, dims: np.ndarray, tensor_type: GGMLQuantizationType,
                data_offset: int) -> IndexTensor:
        num_elements = int(np.prod(dims))
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        num_bytes = num_elements * type_size // block_size
        np_dims = tuple(reversed(dims.tolist()))
        offset = start + data_offset
        if tensor_type in _NUMPY_TYPES:
            item_type, count = _NUMPY_TYPES[tensor_type], num_elements
        else:
            item_type, count, np_dims = np.uint8, num_bytes, quant_shape_to_byte_shape(np_dims, tensor_type)
        if offset + count * np.dtype(item_type).itemsize > len(self.data):
            raise ValueError(f"{self._name}: tensor {name} runs past the end of the file")
        data = np.frombuffer(self.data, item_type, count, offset).reshape(np_dims)
        return IndexTensor(name, tensor_type, dims, num_elements, num_bytes, offset, data)
