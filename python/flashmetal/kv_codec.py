"""Quantized KV caches: a codec (KVCodec) and the codes it makes (QuantizedKV).

A row x of head_dim D is cut into rotation blocks of n coordinates (n = D
for D in 64, 128, 256, 512; 16, 32, 64 for D = 80, 96, 192). Each block is
rotated, y = Ĥ(s ⊙ x) with Ĥ the orthonormal Sylvester Hadamard matrix and
s the ±1 signs of ``seed``; its norm r = ‖y‖ is kept in float32 and every
coordinate of u = y·√n / r is replaced by the index of its nearest Lloyd–Max
centroid of N(0, 1) (ties to the lower). Decoding is
x̂ = s ⊙ Ĥᵀ(c[code] · r / √n).

Storage per row: ``row_bytes`` uint8 of codes (``bits`` per coordinate,
packed little-endian: 8 codes in ``bits`` bytes, the 4-bit low nibble is the
even coordinate; zero padding to a multiple of 16 bytes) and ``num_blocks``
float32 norms. The sign of coordinate j is -1 when the top bit of the
(j+1)-th output of splitmix64 started at state ``seed`` is set.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from . import _native
from ._arrays import F32, U8, as_input, out_array, tensor
from ._errors import InvalidTypeError, InvalidValueError
from ._interop import to_numpy
from .registry import RegistryLike, resolve

_CODEC = "KVCodec"
_ENCODE = "KVCodec.encode"
_EMPTY = "KVCodec.empty"
_DEQUANTIZE = "QuantizedKV.dequantize"
_QKV = "QuantizedKV"


class KVCodec:
    """A quantized-KV codec: ``head_dim`` (one ``supported_head_dims("kv_codec")`` lists),
    ``bits`` per coordinate (2, 3, 4, 5, 6 or 8) and the ``seed`` of its
    rotation signs (an integer in [0, 2**64)).

    Attributes ``block`` (rotation block), ``num_blocks`` (float32 norms per
    row) and ``row_bytes`` (uint8 codes per row) give the storage layout.
    """

    __slots__ = ("head_dim", "bits", "seed", "block", "num_blocks", "row_bytes", "_c")

    def __init__(self, head_dim: int, bits: int, *, seed: int = 0) -> None:
        self.head_dim = _native.index_arg(_CODEC, "head_dim", head_dim)
        self.bits = _native.index_arg(_CODEC, "bits", bits)
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
            raise InvalidTypeError(_CODEC, f"seed must be an integer, got {seed!r}")
        if not 0 <= int(seed) < 2**64:
            raise InvalidValueError(_CODEC, f"seed must be in [0, 2**64), got {int(seed)}")
        self.seed = int(seed)
        self._c = _native.options("FMKVCodec", head_dim=self.head_dim, bits=self.bits, seed=self.seed)
        layout = _native.ffi().new(_native.ctype("FMKVCodecLayout *"))
        _native.call_static("fm_kv_codec_layout", self._c, layout, op=_CODEC)
        self.block = int(layout.block)
        self.num_blocks = int(layout.num_blocks)
        self.row_bytes = int(layout.row_bytes)

    def __repr__(self) -> str:
        return f"KVCodec(head_dim={self.head_dim}, bits={self.bits}, seed={self.seed})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVCodec) and (self.head_dim, self.bits, self.seed) == (
            other.head_dim, other.bits, other.seed)

    def __hash__(self) -> int:
        return hash((self.head_dim, self.bits, self.seed))

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as its arguments (the cffi struct it holds is not picklable).
        return (_codec, (self.head_dim, self.bits, self.seed))

    def bytes_per_row(self) -> int:
        """Bytes one row (one token of one kv head) takes: codes and norms."""
        return self.row_bytes + 4 * self.num_blocks

    def encode(self, x: ArrayLike, *, registry: RegistryLike = None) -> QuantizedKV:
        """Encodes ``x`` ``[..., head_dim]`` (bfloat16, float16 or float32) into
        a new QuantizedKV of shape ``x.shape[:-1]``."""
        reg = resolve(registry, _ENCODE)
        xa = as_input(x, _ENCODE, "x")
        lead = xa.shape[:-1]
        codes = np.empty(lead + (self.row_bytes,), dtype=U8)
        norms = np.empty(lead + (self.num_blocks,), dtype=F32)
        ffi = _native.ffi()
        _native.call(reg, "fm_dispatch_kv_encode", self._c, tensor(ffi, xa), tensor(ffi, codes),
                     tensor(ffi, norms), op=_ENCODE, keep=(xa, codes, norms))
        return QuantizedKV(self, codes, norms)

    def empty(self, shape: Any) -> QuantizedKV:
        """Zeroed storage of leading shape ``shape`` (a cache ``[B, capacity,
        Hkv]`` or a paged one ``[num_pages, page_size, Hkv]``); every row
        dequantizes to zeros until written."""
        if isinstance(shape, (int, np.integer)):
            shape = (shape,)
        try:
            dims = tuple(_native.index_arg(_EMPTY, "shape", d, 0, 2**63 - 1) for d in shape)
        except TypeError:
            raise InvalidTypeError(_EMPTY, f"shape must be a sequence of integers, got {shape!r}") from None
        return QuantizedKV(self, np.zeros(dims + (self.row_bytes,), dtype=U8),
                           np.zeros(dims + (self.num_blocks,), dtype=F32))


def _codec(head_dim: int, bits: int, seed: int) -> KVCodec:
    return KVCodec(head_dim, bits, seed=seed)


class QuantizedKV:
    """Rows encoded by a KVCodec: ``codes`` uint8 ``[*shape, row_bytes]`` and
    ``norms`` float32 ``[*shape, num_blocks]``, with the ``codec`` that reads
    them."""

    __slots__ = ("codec", "codes", "norms")

    def __init__(self, codec: KVCodec, codes: np.ndarray, norms: np.ndarray) -> None:
        if not isinstance(codec, KVCodec):
            raise InvalidTypeError(_QKV, f"codec must be a KVCodec, got {type(codec).__name__}")
        _check_storage(codec, codes, norms)
        self.codec = codec
        self.codes = codes
        self.norms = norms

    @property
    def shape(self) -> tuple[int, ...]:
        """The leading shape: one row of head_dim coordinates per index."""
        return tuple(self.codes.shape[:-1])

    @property
    def nbytes(self) -> int:
        """Bytes of codes and norms."""
        return int(self.codes.nbytes + self.norms.nbytes)

    def __repr__(self) -> str:
        return f"QuantizedKV(shape={self.shape}, codec={self.codec!r})"

    def dequantize(self, *, out: Any = None, registry: RegistryLike = None) -> Any:
        """The decoded rows, float32 ``[*shape, head_dim]`` (into ``out`` when
        given: a C-contiguous float32 array or torch CPU tensor)."""
        reg = resolve(registry, _DEQUANTIZE)
        ca = as_input(self.codes, _DEQUANTIZE, "codes")
        na = as_input(self.norms, _DEQUANTIZE, "norms")
        shape = ca.shape[:-1] + (self.codec.head_dim,)
        if out is None:
            out = dst = np.empty(shape, dtype=F32)
        else:
            dst = out_array(out, _DEQUANTIZE)  # the library checks its shape, dtype and overlaps
        ffi = _native.ffi()
        _native.call(reg, "fm_dispatch_kv_dequantize", self.codec._c, tensor(ffi, ca), tensor(ffi, na),
                     tensor(ffi, dst), op=_DEQUANTIZE, keep=(ca, na, dst))
        return out


def _check_storage(codec: KVCodec, codes: Any, norms: Any) -> None:
    """QuantizedKV's storage rule, checked once when it is made so no later
    call indexes mismatched arrays: codes uint8 ``[*shape, row_bytes]`` and
    norms float32 ``[*shape, num_blocks]`` (numpy arrays, torch tensors or
    other DLPack exporters, read without a copy)."""
    want = {"codes": (U8, codec.row_bytes, "row_bytes"), "norms": (F32, codec.num_blocks, "num_blocks")}
    arrays = {}
    for name, x in (("codes", codes), ("norms", norms)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise InvalidTypeError(_QKV, f"{name} must be an array (numpy, torch or DLPack), got {type(x).__name__}",
                                   argument=name)
        a = to_numpy(x, _QKV, name)
        dtype, last, what = want[name]
        if a.dtype != dtype:
            raise InvalidTypeError(_QKV, f"{name} dtype {a.dtype} must be {dtype}", argument=name)
        if a.ndim < 1 or a.shape[-1] != last:
            raise InvalidValueError(_QKV, f"{name} shape {list(a.shape)} must end in the codec's {what} {last}",
                                    argument=name)
        arrays[name] = a
    if arrays["codes"].shape[:-1] != arrays["norms"].shape[:-1]:
        raise InvalidValueError(_QKV, f"norms shape {list(arrays['norms'].shape)} must be "
                                      f"{list(arrays['codes'].shape[:-1]) + [codec.num_blocks]} (codes' leading "
                                      f"shape, then num_blocks)", argument="norms")
