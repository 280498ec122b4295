#!/usr/bin/env python3
"""Attention-output quality of quantized KV caches: every K-bits x V-bits
pair of KVCodec widths, decode over the codes (flash_attn_decode with
QuantizedKV caches) against float64 attention over the unquantized caches.

Inputs: D = 128, H = 8 query heads over Hkv = 2, 1024 keys, N(0, 1) K and V.
"diffuse": N(0, 1) queries at scale 1/sqrt(D) (attention spread over many
keys); "peaked": each query is 0.7x a random key of its kv head plus N(0, 1)
noise (about two thirds of the mass on that key, the rest spread). Reported per pair: the mean cosine between
the outputs and max ||ΔO|| / rms ||v|| over rows.

  .venv/bin/python bench/kv_codec_quality.py [--backend cpu]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import flashmetal as fm  # noqa: E402
from flashmetal import reference  # noqa: E402

WIDTHS = (2, 3, 4, 5, 6, 8)
D, H, HKV, KEYS = 128, 8, 2, 1024


def inputs(rng: np.random.Generator, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    k = rng.standard_normal((1, HKV, KEYS, D)).astype(np.float32)
    v = rng.standard_normal((1, HKV, KEYS, D)).astype(np.float32)
    if kind == "diffuse":
        q = rng.standard_normal((1, H, D))
    else:
        pick = rng.integers(0, KEYS, size=H)
        q = 0.7 * k[0, np.arange(H) // (H // HKV), pick] + rng.standard_normal((H, D))
        q = q[None]
    return q.astype(np.float32), k, v


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="cpu")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with fm.Registry(args.backend) as reg:
        for kind in ("diffuse", "peaked"):
            q, k, v = inputs(rng, kind)
            exact = reference.decode(q, k, v, KEYS)
            rms_v = float(np.sqrt(np.mean(np.sum(v.astype(np.float64) ** 2, -1))))
            print(f"\n{kind}: mean cosine / max ||dO|| / rms ||v|| (rows: K bits, columns: V bits)\n")
            print("| K \\ V | " + " | ".join(str(b) for b in WIDTHS) + " |")
            print("|---|" + "---|" * len(WIDTHS))
            for kb in WIDTHS:
                kq = fm.KVCodec(D, kb, seed=1).encode(k, registry=reg)
                cells = []
                for vb in WIDTHS:
                    vq = fm.KVCodec(D, vb, seed=2).encode(v, registry=reg)
                    o = fm.flash_attn_decode(q, kq, vq, KEYS, registry=reg).astype(np.float64)
                    cos = np.sum(o * exact, -1) / (np.linalg.norm(o, axis=-1) * np.linalg.norm(exact, axis=-1))
                    err = np.max(np.linalg.norm(o - exact, axis=-1)) / rms_v
                    cells.append(f"{np.mean(cos):.5f} / {err:.4f}")
                print(f"| {kb} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
