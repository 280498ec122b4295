"""Decode and chunked prefill over quantized KV caches vs the bf16 cache,
interleaved in one process like bench.py: flash_attn_with_kvcache with one
query row per sequence (decode), and with a causal chunk of query rows over
a quantized past (the tiled prefill over codes), B=1, H=16, Hkv=8, D=128,
over the same keys held as bf16, as tq8 (K and V 8-bit codes), tq4 and
K8/V4, plus the bytes each format stores per token (all kv heads, K and V).

    python bench/codes_bench.py [--runs N] [--quick] [--long]

--long adds 128k keys to the decode table. Writes bench/CODES_RESULTS.md,
keeping its hand-written "## Notes" section.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench as common  # noqa: E402  (private library copy, timing helpers)
import numpy as np  # noqa: E402

import flashmetal as fm  # noqa: E402
from flashmetal._arrays import BF16  # noqa: E402

H, HKV, D = 16, 8, 128
FORMATS = {"tq8": (8, 8), "tq4": (4, 4), "K8/V4": (8, 4)}


def bytes_per_token(kbits: int | None, vbits: int | None) -> int:
    """K and V bytes of one token over all kv heads (None: bf16)."""
    side = [2 * D if b is None else fm.KVCodec(D, b).bytes_per_row() for b in (kbits, vbits)]
    return HKV * sum(side)


def rows(reg, runs: int, lengths: list[int], chunk: int = 1) -> list[str]:
    """One table row per (keys, format): `chunk` causal query rows at the
    end of `keys` keys (1: a decode step)."""
    lines = ["| keys | format | bytes/token | ms | bf16 ms | bf16 / format (median of rounds) |",
             "|---|---|---:|---:|---:|---:|"]
    for n in lengths:
        rng = np.random.default_rng(n)
        k = common.rand(rng, (1, n, HKV, D), BF16)
        v = common.rand(rng, (1, n, HKV, D), BF16)
        q = common.rand(rng, (1, chunk, H, D), BF16)
        seqlens = np.array([n], np.int32)
        causal = chunk > 1
        peers = {"bf16": lambda k=k, v=v: fm.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=causal,
                                                                     registry=reg)}
        for name, (kb, vb) in FORMATS.items():
            kq = fm.KVCodec(D, kb, seed=1).encode(k, registry=reg)
            vq = fm.KVCodec(D, vb, seed=2).encode(v, registry=reg)
            peers[name] = (lambda kq=kq, vq=vq: fm.flash_attn_with_kvcache(q, kq, vq, cache_seqlens=seqlens,
                                                                         causal=causal, registry=reg))
        t = common.timed(peers, runs, burst=2 if chunk == 1 else 1)
        for name, (kb, vb) in [("bf16", (None, None))] + list(FORMATS.items()):
            ratio = statistics.median(b / f for b, f in zip(t.raw["bf16"], t.raw[name]))
            lines.append(f"| {n} | {name} | {bytes_per_token(kb, vb)} | {t[name] * 1e3:.3f} | "
                         f"{t['bf16'] * 1e3:.3f} | {ratio:.2f}x |")
            print(lines[-1], flush=True)
        del k, v, peers
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--long", action="store_true", help="also 128k keys")
    args, _ = ap.parse_known_args()  # bench.py's other options (e.g. --only) are not this script's
    reg = fm.Registry("cpu")
    t0, load0 = time.time(), os.getloadavg()[0]
    lengths = [1024] if args.quick else [8192, 32768] + ([131072] if args.long else [])
    table = rows(reg, args.runs, lengths)
    chunk, past = (32, [512]) if args.quick else (128, [2048, 8192])
    prefill = rows(reg, args.runs, past, chunk=chunk)
    result = HERE / "CODES_RESULTS.md"
    about = fm.info("cpu")
    title = common.class_title({"isa": about["cpu_isa"]})
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = "\n".join([
        "# Decode and chunked prefill over quantized KV caches (bench/codes_bench.py)", "",
        f"flash_attn_with_kvcache, B=1, H={H}, Hkv={HKV}, D={D}; bf16 q. Ratio > 1: the format runs faster than "
        "the bf16 cache. One section per machine class: a run replaces its class's tables and keeps the "
        "others' (the cpu paths differ by ISA, and so do the ratios).", "",
        f"## Machine class: {title}", "",
        f"Run {when}. Machine: {common.cpu_model()} ({platform.machine()}), backend cpu, ISA path "
        f"{about['cpu_isa']}{' (VBMI)' if about['cpu_vbmi'] else ''}; medians of {args.runs} interleaved "
        f"rounds{' (--quick)' if args.quick else ''}, {time.time() - t0:.0f} s. Load average (1 min) "
        f"{load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end, on {os.cpu_count()} cores (above ~1: "
        "other jobs shared the cores).", "",
        "### Decode: one query row (2 back-to-back calls per round)", "", *table, "",
        f"### Chunked prefill: {chunk} causal query rows at the end of the keys (the tiled prefill over codes "
        "against the bf16 cache's prefill)", "", *prefill, "",
        *common.previous_run_sections(result, {title}), *common.kept_sections(result, {title}),
        *common.notes(result)])
    result.write_text(text)
    print(f"wrote {HERE / 'CODES_RESULTS.md'}")


if __name__ == "__main__":
    main()
