"""Serving benchmarks, interleaved in one process like bench.py:

1. paged vs contiguous decode: flash_attn_with_kvcache with one query row
   per sequence over the same keys, in a [B, cap, Hkv, D] cache with
   cache_seqlens and in shuffled pages (target: paging costs <= 10%);
2. varlen prefill of 8 ragged causal sequences vs the same sequences padded
   to the longest (flash_attn_func on [8, Lmax]) vs torch's CPU SDPA on the
   padded batch (target: varlen wins by about the padding fraction).

    python bench/serving_bench.py [--runs N] [--quick]

Writes bench/SERVING_RESULTS.md.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench as common  # noqa: E402  (private library copy, torch, timing helpers)
import numpy as np  # noqa: E402

import flashmetal as fm  # noqa: E402
from flashmetal._arrays import BF16, F16  # noqa: E402

torch = common.torch


def shuffled_pages(rng, cache: np.ndarray, lengths: list[int], page_size: int):
    """The rows of a contiguous cache [B, cap, Hkv, D] moved onto shuffled
    pages: (paged cache [num_pages, page_size, Hkv, D], block_table)."""
    b, cap = cache.shape[:2]
    per = -(-cap // page_size)
    order = rng.permutation(b * per).astype(np.int32)
    table = order.reshape(b, per)
    pages = np.zeros((b * per, page_size) + cache.shape[2:], cache.dtype)
    for i in range(b):
        for j in range(-(-lengths[i] // page_size)):
            rows = cache[i, j * page_size:(j + 1) * page_size]
            pages[table[i, j], :len(rows)] = rows
    return pages, table


def decode_rows(reg, runs: int, quick: bool) -> list[str]:
    rng = np.random.default_rng(0)
    h, hkv, d = 32, 8, 128
    lengths = [4096, 1500, 3000, 700] if not quick else [1024, 300, 700, 100]
    cap = max(lengths)
    lines = ["| dtype | page size | contiguous ms | paged ms | paged / contiguous (median of rounds) |",
             "|---|---|---|---|---|"]
    for dt in (BF16, F16):
        kc, vc = common.rand(rng, (4, cap, hkv, d), dt), common.rand(rng, (4, cap, hkv, d), dt)
        q = common.rand(rng, (4, 1, h, d), dt)
        seqlens = np.array(lengths, np.int32)
        for page_size in (16, 64, 256):
            kp, table = shuffled_pages(np.random.default_rng(page_size), kc, lengths, page_size)
            vp, _ = shuffled_pages(np.random.default_rng(page_size), vc, lengths, page_size)
            t = common.timed({
                "contiguous": lambda: fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, registry=reg),
                "paged": lambda: fm.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table,
                                                            registry=reg),
            }, runs, burst=4)
            # The median of the per-round ratios: each round runs the two back to back, so a load
            # that drifts over the run (the machine is shared) cancels out of the comparison.
            ratio = statistics.median(p / c for p, c in zip(t.raw["paged"], t.raw["contiguous"]))
            lines.append(f"| {dt} | {page_size} | {t['contiguous'] * 1e3:.3f} | {t['paged'] * 1e3:.3f} | "
                         f"{ratio:.3f} {'ok' if ratio <= 1.10 else 'MISS (> 1.10)'} |")
            print(lines[-1], flush=True)
    return lines


def varlen_rows(reg, runs: int, quick: bool) -> list[str]:
    rng = np.random.default_rng(1)
    h, hkv, d = 16, 4, 128
    lengths = [512, 64, 300, 1024, 128, 700, 32, 256] if not quick else [128, 16, 75, 256, 32, 175, 8, 64]
    lmax, total = max(lengths), sum(lengths)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    work = 8 * lmax**2 / sum(n * n for n in lengths)  # causal attention work grows with L^2
    lines = [f"Lengths {lengths}: {total} tokens, padded {8 * lmax} "
             f"(padding {1 - total / (8 * lmax):.0%} of the rows; causal, H={h}, Hkv={hkv}, D={d}); the padded "
             f"batch has {work:.2f}x the attention work (sum of L^2), the bound on padded / varlen.", "",
             "| dtype | varlen ms | padded flashmetal ms | padded torch SDPA ms | padded / varlen | torch / varlen |",
             "|---|---|---|---|---|---|"]
    for dt in (BF16, F16):
        q, k, v = (common.rand(rng, (total, n, d), dt) for n in (h, hkv, hkv))
        qp, kp, vp = (np.zeros((8, lmax, n, d), dt) for n in (h, hkv, hkv))
        for b, n in enumerate(lengths):
            qp[b, :n], kp[b, :n], vp[b, :n] = q[cu[b]:cu[b + 1]], k[cu[b]:cu[b + 1]], v[cu[b]:cu[b + 1]]
        peers = {
            "varlen": lambda: fm.flash_attn_varlen_func(q, k, v, cu, cu, lmax, lmax, causal=True, registry=reg),
            "padded": lambda: fm.flash_attn_func(qp, kp, vp, causal=True, registry=reg),
        }
        if torch is not None:
            tq, tk, tv = (common.to_torch(x.transpose(0, 2, 1, 3), dt) for x in (qp, kp, vp))
            peers["torch"] = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True,
                                                                                      enable_gqa=True)
        t = common.timed(peers, runs)
        tt = t.get("torch")
        torch_ms = "not installed" if tt is None else f"{tt * 1e3:.1f}"
        torch_ratio = "-" if tt is None else f"{tt / t['varlen']:.2f}"
        lines.append(f"| {dt} | {t['varlen'] * 1e3:.1f} | {t['padded'] * 1e3:.1f} | {torch_ms} | "
                     f"{t['padded'] / t['varlen']:.2f} | {torch_ratio} |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    args, _ = ap.parse_known_args()  # bench.py's other options (e.g. --only) are not this script's
    reg = fm.Registry("cpu")
    t0 = time.time()
    decode = decode_rows(reg, args.runs, args.quick)
    varlen = varlen_rows(reg, args.runs, args.quick)
    text = "\n".join([
        "# Serving benchmarks (bench/serving_bench.py)", "",
        f"Machine: {common.cpu_model()} ({platform.machine()}), backend cpu, torch {common.TORCH or 'not installed'}; "
        f"medians of {args.runs} interleaved rounds{' (--quick)' if args.quick else ''}, {time.time() - t0:.0f} s.", "",
        "## Decode: paged vs contiguous cache (4 sequences, H=32, Hkv=8, D=128; 4 back-to-back calls)", "",
        *decode, "", "## Varlen prefill vs padding to the longest", "", *varlen, ""])
    (HERE / "SERVING_RESULTS.md").write_text(text)
    print(f"wrote {HERE / 'SERVING_RESULTS.md'}")


if __name__ == "__main__":
    main()
