"""Float64 reference of the quantized-KV codec, written from its math (not
from a kernel), for the tests.

Per rotation block of n coordinates, with Ĥ = H_n / √n the orthonormal
Sylvester Hadamard matrix and s the ±1 signs of the seed:
    y = Ĥ(s ⊙ x);  r = ‖y‖;  u = y·√n / r;
    code = index of the nearest Lloyd–Max centroid of N(0, 1) (boundaries
           at the midpoints; a tie goes to the lower index);
    x̂ = s ⊙ Ĥᵀ(c[code] · r / √n).
Signs: coordinate j is -1 when the top bit of the (j+1)-th output of
splitmix64 started at state ``seed`` is set. Codes are packed little-endian
(code j at bits [j*bits, (j+1)*bits) of the row), rows padded to 16 bytes.
"""
from __future__ import annotations

import functools

import numpy as np

from ._lloyd_max import design

#: Rotation block of each supported head dim.
BLOCKS = {64: 64, 128: 128, 256: 256, 512: 512, 80: 16, 96: 32, 192: 64}
_MASK64 = (1 << 64) - 1


def splitmix64(seed: int, count: int) -> list[int]:
    """The first ``count`` outputs of splitmix64 started at state ``seed``."""
    out, state = [], seed & _MASK64
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        out.append(z ^ (z >> 31))
    return out


@functools.cache
def signs(seed: int, head_dim: int) -> np.ndarray:
    """float64 ±1 [head_dim]: -1 where the output's top bit is set."""
    return np.array([-1.0 if v >> 63 else 1.0 for v in splitmix64(seed, head_dim)])


@functools.cache
def hadamard(n: int) -> np.ndarray:
    """The orthonormal Sylvester Hadamard matrix Ĥ_n (natural order)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return np.asarray(h / np.sqrt(n))


def row_bytes(head_dim: int, bits: int) -> int:
    """Bytes of packed codes per row: head_dim * bits / 8 rounded up to 16."""
    return -(-head_dim * bits // 8 // 16) * 16


def _blocks(a: np.ndarray, head_dim: int) -> np.ndarray:
    n = BLOCKS[head_dim]
    return a.reshape(a.shape[:-1] + (head_dim // n, n))


def rotate(x: np.ndarray, seed: int) -> np.ndarray:
    """y = Ĥ(s ⊙ x) per block, float64 [..., num_blocks, n]."""
    d = x.shape[-1]
    xb = _blocks(np.asarray(x, np.float64) * signs(seed, d), d)
    return np.asarray(xb @ hadamard(BLOCKS[d]).T)


def encode(x: np.ndarray, bits: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes int64 [..., D], norms float64 [..., num_blocks], u float64
    [..., D]) of the rows x (already rounded to their dtype)."""
    d = x.shape[-1]
    n = BLOCKS[d]
    y = rotate(x, seed)
    r = np.linalg.norm(y, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        u = np.where(r[..., None] > 0, y * np.sqrt(n) / r[..., None], 0.0)
    _, boundaries, _ = design(bits)
    codes = np.searchsorted(boundaries, u, side="left")  # count of boundaries < u
    return codes.reshape(x.shape), r, u.reshape(x.shape)


def decode(codes: np.ndarray, norms: np.ndarray, bits: int, seed: int) -> np.ndarray:
    """x̂ float64 [..., D] of unpacked codes [..., D] and norms [..., num_blocks]."""
    d = codes.shape[-1]
    n = BLOCKS[d]
    centroids, _, _ = design(bits)
    w = _blocks(centroids[codes], d) * (np.asarray(norms, np.float64)[..., None] / np.sqrt(n))
    return np.asarray((w @ hadamard(n)).reshape(codes.shape) * signs(seed, d))


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 [..., row_bytes] of codes [..., D]: code j at bits
    [j*bits, (j+1)*bits) of the row read as a little-endian integer."""
    d = codes.shape[-1]
    bit_planes = (codes[..., None].astype(np.uint64) >> np.arange(bits, dtype=np.uint64)) & 1
    packed = np.packbits(bit_planes.reshape(codes.shape[:-1] + (d * bits,)).astype(np.uint8), axis=-1,
                         bitorder="little")
    pad = row_bytes(d, bits) - packed.shape[-1]
    return np.concatenate([packed, np.zeros(packed.shape[:-1] + (pad,), np.uint8)], axis=-1)


def unpack(packed: np.ndarray, bits: int, head_dim: int) -> np.ndarray:
    """int64 codes [..., head_dim] of packed rows (the inverse of pack)."""
    stream = np.unpackbits(packed, axis=-1, bitorder="little")[..., :head_dim * bits]
    planes = stream.reshape(packed.shape[:-1] + (head_dim, bits)).astype(np.int64)
    return np.asarray((planes << np.arange(bits)).sum(axis=-1))
