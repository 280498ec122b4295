"""Lloyd–Max quantizers of the unit Gaussian N(0, 1), designed in float64,
and the C/MSL header of their float32 tables that the library embeds.

A quantizer of L = 2**bits levels is optimal in mean squared error when every
boundary is the midpoint of its two neighbouring centroids and every centroid
is the conditional mean of its cell (Lloyd 1957, Max 1960). The design
iterates those two conditions: Lloyd's fixed-point iteration from uniform
quantiles, then Newton's method on the same fixed point (its Jacobian is
tridiagonal), which converges quadratically: the step after the first
one under 1e-10 leaves every centroid within 1e-12 of its cell's mean
(checked), at the rounding floor of float64. The quantizers are
symmetric, so only the positive half is designed and the negative half
mirrors it exactly (the middle boundary is exactly 0).

``make kv-codec-tables`` (``python python/flashmetal/_lloyd_max.py >
Resources/shaders/kv_codec_tables.h``) writes the header the library embeds;
tests/python/test_kv_codec.py checks that the checked-in header equals this
output, so the tables cannot drift from their design.
"""
from __future__ import annotations

import functools
import math
import sys

import numpy as np

WIDTHS = (2, 3, 4, 5, 6, 8)

_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _pdf(t: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.where(np.isinf(t), 0.0, _INV_SQRT_2PI * np.exp(-0.5 * t * t))


def _upper_tail(t: np.ndarray) -> np.ndarray:
    """P(X > t) = erfc(t / sqrt 2) / 2, accurate in the upper tail."""
    return np.array([0.5 * math.erfc(v / _SQRT2) for v in t.tolist()])


def _cells(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lower and upper ends of the positive-half cells of centroids p."""
    mid = 0.5 * (p[:-1] + p[1:])
    return np.concatenate([[0.0], mid]), np.concatenate([mid, [math.inf]])


def _centroids(p: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The conditional means g of the cells [a, b) that p's midpoints make,
    with the cells' probabilities and ends."""
    a, b = _cells(p)
    prob = _upper_tail(a) - _upper_tail(b)
    g = (_pdf(a) - _pdf(b)) / prob
    return g, prob, a, b, _pdf(a)


def _newton_step(p: np.ndarray) -> np.ndarray:
    g, prob, a, b, pa = _centroids(p)
    pb = _pdf(b)
    k = p.size
    # dg_j/da_j and dg_j/db_j; a_j (j >= 1) and b_j (j < k-1) are midpoints.
    da = pa * (g - a) / prob
    with np.errstate(invalid="ignore"):
        db = np.where(np.isinf(b), 0.0, pb * (b - g) / prob)
    jac = np.zeros((k, k))
    for j in range(k):
        if j >= 1:
            jac[j, j - 1] += 0.5 * da[j]
            jac[j, j] += 0.5 * da[j]
        if j < k - 1:
            jac[j, j] += 0.5 * db[j]
            jac[j, j + 1] += 0.5 * db[j]
    # F(p) = p - g(p) = 0; F' = I - dg/dp.
    return p - np.linalg.solve(np.eye(k) - jac, p - g)


@functools.cache
def design(bits: int) -> tuple[np.ndarray, np.ndarray, float]:
    """The Lloyd–Max quantizer of N(0, 1) with 2**bits levels, in float64:
    (centroids [L] ascending, boundaries [L-1] the midpoints, distortion
    E[(X - Q(X))^2])."""
    if bits not in WIDTHS:
        raise ValueError(f"bits must be one of {WIDTHS}, got {bits}")
    k = 2 ** (bits - 1)
    # Start at the centres of equal-probability cells of the positive half.
    q = (np.arange(k) + 0.5) / (2 * k)
    p = np.array([_inverse_upper_tail(v) for v in q.tolist()])[::-1].copy()
    for _ in range(200):
        p = _centroids(p)[0]
    for _ in range(50):
        nxt = _newton_step(p)
        moved = float(np.max(np.abs(nxt - p)))
        p = nxt
        if moved <= 1e-10:  # quadratic convergence: one more step reaches rounding
            p = _newton_step(p)
            break
    else:
        raise RuntimeError(f"Lloyd–Max design for {bits} bits did not converge")
    if float(np.max(np.abs(_centroids(p)[0] - p))) > 1e-12:
        raise RuntimeError(f"Lloyd–Max design for {bits} bits is not a fixed point")
    centroids = np.concatenate([-p[::-1], p])
    boundaries = 0.5 * (centroids[:-1] + centroids[1:])
    return centroids, boundaries, _distortion(p)


def _distortion(p: np.ndarray) -> float:
    """E[(X - Q(X))^2] of the symmetric quantizer with positive centroids p:
    twice the positive half's sum of integral_a^b (x - c)^2 phi(x) dx
    = P + a phi(a) - b phi(b) - 2 c (phi(a) - phi(b)) + c^2 P."""
    a, b = _cells(p)
    prob = _upper_tail(a) - _upper_tail(b)
    pa, pb = _pdf(a), _pdf(b)
    with np.errstate(invalid="ignore"):
        bpb = np.where(np.isinf(b), 0.0, b * pb)
    cell = prob + a * pa - bpb - 2.0 * p * (pa - pb) + p * p * prob
    return float(2.0 * np.sum(cell))


def _inverse_upper_tail(q: float) -> float:
    """t with P(X > t) = q, by bisection (only the starting point needs it)."""
    lo, hi = 0.0, 40.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if 0.5 * math.erfc(mid / _SQRT2) > q:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _literal(v: float) -> str:
    """A float32 value as a C/MSL float literal that rounds back to it."""
    s = f"{float(np.float32(v)):.9g}"
    if not any(ch in s for ch in ".en"):
        s += ".0"
    return s + "f"


def render_header() -> str:
    """The text of Resources/shaders/kv_codec_tables.h."""
    out = [
        "/* kv_codec_tables.h — Lloyd–Max quantizers of N(0, 1), rounded to float32.",
        " * GENERATED by `make kv-codec-tables` (python/flashmetal/_lloyd_max.py)",
        " * from a float64 design; do not edit. A test checks this file equals its output.",
        " *",
        " * FM_KVQ_C<b>: the 2^b centroids, ascending; FM_KVQ_B<b>: the 2^b - 1",
        " * boundaries, each the float64 midpoint of its two centroids. Distortion",
        " * E[(X - Q(X))^2] of the float64 design:",
    ]
    for bits in WIDTHS:
        out.append(f" *   {bits} bits: {design(bits)[2]:.6g}")
    out += [
        " * Read by C (the cpu kernels), C++ (the simulator) and MSL (the shaders).",
        " */",
        "#ifndef FM_KV_CODEC_TABLES_H",
        "#define FM_KV_CODEC_TABLES_H",
        "",
        "#if defined(__METAL_VERSION__)",
        "#define FM_KVQ_TABLE constant",
        "#else",
        "#define FM_KVQ_TABLE static const",
        "#endif",
        "",
    ]
    for bits in WIDTHS:
        c, b, _ = design(bits)
        for name, values in ((f"FM_KVQ_C{bits}", c), (f"FM_KVQ_B{bits}", b)):
            out.append(f"FM_KVQ_TABLE float {name}[{values.size}] = {{")
            lits = [_literal(v) for v in values]
            for i in range(0, len(lits), 6):
                out.append("    " + ", ".join(lits[i:i + 6]) + ",")
            out.append("};")
        out.append("")
    out.append("#endif /* FM_KV_CODEC_TABLES_H */")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render_header())
