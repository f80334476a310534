"""Checkpoint tensors read by the slice: what a tensor-parallel rank loads of a safetensors checkpoint.

A `Source` stands for one tensor of the runtime's state dict without reading it: a safetensors
tensor (`Leaf`), or the runtime's fusion of several (`Cat`, `Stack`: experts stacked, q/k/v conv
parts concatenated, hub_names.Assembler). `narrow` keeps a window of it, still unread; `read()`
reads only that window, from each leaf through safe_open(...).get_slice, which copies just the
requested rows out of the memory-mapped file. shard.py's `take` reads the rank's sections of a
Source (its heads' rows or columns); what no split touches (norms, routers, latents shared by all
heads) is read whole at the end. `sample` reads a few elements of a whole tensor, for the model
fingerprint, from the file's bytes directly.

`Reads` counts the bytes read, so a test can see that a rank reads about 1/N of the checkpoint.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import torch

_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


class Reads:
    """Bytes read from a checkpoint's files through Sources: of tensors (`bytes`) and of the
    fingerprint's samples (`sample_bytes`)."""

    def __init__(self):
        self.bytes = 0
        self.sample_bytes = 0


class Source:
    """One tensor of the checkpoint as the runtime names it, unread. `is_param`: whether the
    model holds it as a parameter (else a buffer)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    is_param: bool = True

    @property
    def data(self) -> Source:  # what shard.py reads of a parameter (`linear.weight.data`)
        return self

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> Source:
        dim = dim % len(self.shape)
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise IndexError(f"narrow({dim}, {start}, {length}) of a {self.shape} tensor")
        if (start, length) == (0, self.shape[dim]):
            return self
        return self._narrow(dim, start, length)

    def __getitem__(self, index) -> torch.Tensor:
        """Rows `index` (a slice of the first dim, step 1), read."""
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("a Source reads slices of its first dim only")
        start, stop, _ = index.indices(self.shape[0])
        return self.narrow(0, start, max(0, stop - start)).read()

    def new_zeros(self, *shape) -> torch.Tensor:
        return torch.zeros(*shape, dtype=self.dtype)

    def _narrow(self, dim: int, start: int, length: int) -> Source:
        raise NotImplementedError

    def read(self) -> torch.Tensor:
        """The tensor (its window), read now."""
        raise NotImplementedError

    def elements(self, flat: torch.Tensor) -> torch.Tensor:
        """The elements at flat (row-major) indices `flat` of the whole tensor, as float64."""
        raise NotImplementedError

    def sample(self, n: int = 256) -> torch.Tensor:
        """flat[::step][:n] of the tensor, step = max(1, numel // n) (loader.model_fingerprint's
        sample), as float32, reading only those elements."""
        numel = self.numel()
        step = max(1, numel // n)
        idx = torch.arange(0, numel, step, dtype=torch.int64)[:n]
        return self.elements(idx).float()


class Leaf(Source):
    """A tensor of one safetensors file, and the window of it kept so far (start, length per dim)."""

    def __init__(self, file: SafetensorsFile, name: str, dtype: torch.dtype | None = None,
                 window: tuple[tuple[int, int], ...] | None = None):
        self.file, self.name = file, name
        self.file_dtype, full = file.dtype_shape(name)
        self.full_shape = full
        self.window = window if window is not None else tuple((0, n) for n in full)
        self.shape = tuple(n for _, n in self.window)
        self.dtype = dtype or self.file_dtype

    def to(self, dtype: torch.dtype) -> Leaf:
        return Leaf(self.file, self.name, dtype, self.window)

    def _narrow(self, dim, start, length):
        window = list(self.window)
        a, _ = window[dim]
        window[dim] = (a + start, length)
        return Leaf(self.file, self.name, self.dtype, tuple(window))

    def read(self) -> torch.Tensor:
        if self.numel() == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        index = tuple(slice(a, a + n) for a, n in self.window)
        t = self.file.handle().get_slice(self.name)[index] if index else self.file.handle().get_tensor(self.name)
        self.file.reads.bytes += t.numel() * t.element_size()
        return t.to(self.dtype)

    def elements(self, flat):
        if self.window != tuple((0, n) for n in self.full_shape):
            raise ValueError("elements of a narrowed leaf")
        return self.file.elements(self.name, flat)


class Cat(Source):
    """Parts concatenated along `dim` (torch.cat)."""

    def __init__(self, parts: list[Source], dim: int = 0):
        self.parts, self.cat_dim = list(parts), dim % len(parts[0].shape)
        first = parts[0].shape
        for p in parts:
            if len(p.shape) != len(first) or any(a != b for i, (a, b) in enumerate(zip(p.shape, first))
                                                 if i != self.cat_dim):
                raise ValueError(f"cat of {[p.shape for p in parts]} along {dim}")
        self.shape = tuple(sum(p.shape[self.cat_dim] for p in parts) if i == self.cat_dim else n
                           for i, n in enumerate(first))
        self.dtype = parts[0].dtype

    def to(self, dtype):
        return Cat([p.to(dtype) for p in self.parts], self.cat_dim)

    def _narrow(self, dim, start, length):
        if dim != self.cat_dim:
            return Cat([p.narrow(dim, start, length) for p in self.parts], self.cat_dim)
        kept, off = [], 0
        for p in self.parts:
            n = p.shape[dim]
            lo, hi = max(start, off), min(start + length, off + n)
            if hi > lo:
                kept.append(p.narrow(dim, lo - off, hi - lo))
            off += n
        return kept[0] if len(kept) == 1 else Cat(kept, dim)

    def read(self):
        return torch.cat([p.read() for p in self.parts], self.cat_dim)

    def elements(self, flat):
        coords = list(np.unravel_index(flat.numpy(), self.shape))
        out = torch.empty(flat.shape, dtype=torch.float64)
        off = 0
        for p in self.parts:
            n = p.shape[self.cat_dim]
            mine = (coords[self.cat_dim] >= off) & (coords[self.cat_dim] < off + n)
            if mine.any():
                local = [c[mine] for c in coords]
                local[self.cat_dim] = local[self.cat_dim] - off
                out[torch.from_numpy(mine)] = p.elements(torch.from_numpy(np.ravel_multi_index(local, p.shape)))
            off += n
        return out


class Stack(Source):
    """Parts of one shape stacked along a new first dim (torch.stack)."""

    def __init__(self, parts: list[Source]):
        self.parts = list(parts)
        if any(p.shape != parts[0].shape for p in parts):
            raise ValueError(f"stack of {[p.shape for p in parts]}")
        self.shape = (len(parts), *parts[0].shape)
        self.dtype = parts[0].dtype

    def to(self, dtype):
        return Stack([p.to(dtype) for p in self.parts])

    def _narrow(self, dim, start, length):
        if dim == 0:
            return Stack(self.parts[start:start + length])
        return Stack([p.narrow(dim - 1, start, length) for p in self.parts])

    def read(self):
        return torch.stack([p.read() for p in self.parts])

    def elements(self, flat):
        per = self.parts[0].numel()
        out = torch.empty(flat.shape, dtype=torch.float64)
        which = flat // per
        for i in torch.unique(which).tolist():
            mine = which == i
            out[mine] = self.parts[i].elements(flat[mine] % per)
        return out


def cat(parts, dim: int = 0):
    """torch.cat for tensors, a Cat for Sources (hub_names.Assembler's fusions)."""
    return Cat(parts, dim) if isinstance(parts[0], Source) else torch.cat(parts, dim)


def stack(parts):
    return Stack(parts) if isinstance(parts[0], Source) else torch.stack(parts)


class SafetensorsFile:
    """One .safetensors file: its header (names, dtypes, shapes, byte offsets), a safe_open handle
    for slices and a memory map for single elements."""

    def __init__(self, path: Path, reads: Reads):
        self.path, self.reads = Path(path), reads
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            self.header = json.loads(f.read(n))
        self.header.pop("__metadata__", None)
        self.data_start = 8 + n
        self._handle = None
        self._map = None

    def names(self) -> list[str]:
        return list(self.header)

    def dtype_shape(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        h = self.header[name]
        return _SAFETENSORS_DTYPES[h["dtype"]], tuple(h["shape"])

    def handle(self):
        if self._handle is None:
            from safetensors import safe_open

            self._handle = safe_open(str(self.path), framework="pt")
        return self._handle

    def elements(self, name: str, flat: torch.Tensor) -> torch.Tensor:
        """Elements at flat indices of tensor `name`, read from the mapped file, as float64."""
        dtype, _ = self.dtype_shape(name)
        size = dtype.itemsize
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        begin = self.data_start + self.header[name]["data_offsets"][0]
        offsets = begin + flat.numpy()[:, None] * size + np.arange(size)[None, :]
        raw = np.ascontiguousarray(self._map[offsets.reshape(-1)])
        self.reads.sample_bytes += raw.size
        return torch.frombuffer(bytearray(raw.tobytes()), dtype=dtype).to(torch.float64) if raw.size else \
            torch.empty(0, dtype=torch.float64)

    def close(self) -> None:
        self._handle = None
        self._map = None
