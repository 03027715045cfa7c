"""A GGUF file's metadata and tensor table, read without building an object per array element.

The gguf package's GGUFReader decodes every metadata array into one numpy view per element: a
151k-token vocabulary and its merges become ~600k small arrays, 12 s and ~490 MiB of Python objects
on a Qwen3 file, which the allocator keeps after they are freed (so the process's resident set
stays that much higher for its whole life). This reader walks the same layout (GGUF v2 / v3,
little-endian: ggml's docs/gguf.md) once: scalars as Python values, numeric arrays as one numpy
array each, string arrays as a list of str, and the tensors as views into one read-only memory map.
Nothing is executed; a file whose table points outside it is a ValueError naming what is wrong.
The type codes and block sizes are the gguf package's (GGMLQuantizationType, GGML_QUANT_SIZES)."""
import mmap
import struct
from dataclasses import dataclass

import numpy as np

# Metadata value types (GGUFValueType): code -> (struct format, numpy dtype) of the fixed-size ones
SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16), 4: ("<I", np.uint32),
           5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_), 10: ("<Q", np.uint64),
           11: ("<q", np.int64), 12: ("<d", np.float64)}
STRING, ARRAY = 8, 9
# Plain element types of tensors: their numpy dtype (the rest are byte rows of blocks)
PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
         "I64": np.int64}


@dataclass
class Tensor:
    name: str
    tensor_type: object      # gguf.GGMLQuantizationType
    shape: np.ndarray        # ggml order: the fastest dimension first
    n_bytes: int
    data_offset: int
    data: np.ndarray         # a view into the map: plain types as values, block formats as uint8 rows


class GGUFMetadata:
    """fields: key -> value (int / float / bool / str, or a list / numpy array for an array);
    tensors: the tensor table, in file order. close() drops the map."""

    def __init__(self, path: str):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf, self._pos = self._map, 0
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"bad magic {bytes(buf[:4])!r} (not a GGUF file)")
        self._pos = 4
        version = self._scalar(4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (a big-endian file, or a version this reader does not know)")
        n_tensors, n_fields = self._scalar(10), self._scalar(10)
        self.fields = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._scalar(4))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar(4)
            if n_dims > 8:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
            dims = np.array([self._scalar(10) for _ in range(n_dims)], dtype=np.int64)
            infos.append((name, dims, self._scalar(4), self._scalar(10)))
        alignment = int(self.fields.get("general.alignment", 32))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment} is not a power of two")
        start = -(-self._pos // alignment) * alignment
        size, names = len(buf), set()
        self.tensors = []
        for name, dims, code, offset in infos:
            if name in names:
                raise ValueError(f"tensor {name!r} appears twice")
            names.add(name)
            try:
                kind = GGMLQuantizationType(code)
            except ValueError:
                raise ValueError(f"tensor {name!r} has type code {code}, which the gguf package does not know") from None
            block, type_size = GGML_QUANT_SIZES[kind]
            n = int(np.prod(dims)) if len(dims) else 1
            if n % block or (len(dims) and dims[0] % block):
                raise ValueError(f"tensor {name!r}: {n} {kind.name} values are not whole blocks of {block}")
            n_bytes, at = n // block * type_size, start + offset
            if at + n_bytes > size:
                raise ValueError(f"tensor {name!r} lies past the end of the file (truncated?)")
            shape = tuple(int(d) for d in reversed(dims.tolist()))
            if kind.name in PLAIN:
                data = np.frombuffer(buf, PLAIN[kind.name], n, at).reshape(shape)
            else:
                data = np.frombuffer(buf, np.uint8, n_bytes, at).reshape(*shape[:-1], shape[-1] // block * type_size)
            self.tensors.append(Tensor(name, kind, dims, n_bytes, at, data))

    # ---- the metadata's encoding ---------------------------------------------------------------------
    def _take(self, n: int) -> memoryview:
        if self._pos + n > len(self._map):
            raise ValueError("the metadata runs past the end of the file (truncated?)")
        out = memoryview(self._map)[self._pos:self._pos + n]
        self._pos += n
        return out

    def _scalar(self, code: int):
        fmt, _ = SCALARS[code]
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return bytes(self._take(self._scalar(10))).decode("utf-8", errors="replace")

    def _value(self, code: int):
        if code in SCALARS:
            return self._scalar(code)
        if code == STRING:
            return self._string()
        if code != ARRAY:
            raise ValueError(f"metadata value type {code} is not GGUF's")
        item, count = self._scalar(4), self._scalar(10)
        if item in SCALARS:  # one array, copied out of the map
            dtype = np.dtype(SCALARS[item][1]).newbyteorder("<")
            return np.frombuffer(self._take(count * dtype.itemsize), dtype).copy()
        if item == STRING:
            return self._strings(count)
        inner = [self._value(item) for _ in range(count)]  # arrays of arrays (rare, small)
        return [v.tolist() if isinstance(v, np.ndarray) else v for v in inner]

    def _strings(self, count: int) -> list[str]:
        out, buf, pos, end = [], self._map, self._pos, len(self._map)
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise ValueError("the metadata runs past the end of the file (truncated?)")
            n = unpack(buf, pos)[0]
            if pos + 8 + n > end:
                raise ValueError("the metadata runs past the end of the file (truncated?)")
            out.append(buf[pos + 8:pos + 8 + n].decode("utf-8", errors="replace"))
            pos += 8 + n
        self._pos = pos
        return out

    def release(self, tensor: Tensor) -> None:
        """Drop the tensor's pages from this process's resident set (MADV_DONTNEED: they stay in
        the page cache, and a later read maps them again), once its bytes were copied out: the
        whole file then never counts toward the peak beside the copies."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = tensor.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(-(-(tensor.data_offset + tensor.n_bytes) // mmap.PAGESIZE) * mmap.PAGESIZE, len(self._map))
        try:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):  # advice only
            pass

    def close(self) -> None:
        """Drop the tensor views' map (views made from it must be gone: copies were yielded)."""
        self.tensors = []
        try:
            self._map.close()
        except BufferError:  # a view still held somewhere: the map goes with it
            pass
