"""Runs the C-ABI fuzzer (fuzz_abi.py) for a number of seeded cases.

    python tests/fuzz/run_fuzz.py --backend cpu --cases 9000 [--seed 0] [--time-limit 120]

Every case is reproducible from (backend, seed): `--seed S --cases 1`.
Before each call the case is written to --state (default
$TMPDIR/flashmetal-fuzz-state.txt), so a crash leaves the case that
crashed behind. Prints one JSON summary line; exit status 1 when a
contract check failed (the first failures are listed).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fuzz_abi as F  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=0.0, help="stop early after this many seconds")
    ap.add_argument("--op", default=None)
    ap.add_argument("--state", default=os.path.join(tempfile.gettempdir(), "flashmetal-fuzz-state.txt"))
    a = ap.parse_args()

    regs = F.Registries(sorted({a.backend, "cpu"}))
    counts: collections.Counter = collections.Counter()
    failures: list[str] = []
    t0 = time.monotonic()
    done = 0
    F.BEFORE_CALL = lambda case, seed: _state(a.state, a.backend, seed, case)
    for seed in range(a.seed, a.seed + a.cases):
        if a.time_limit and time.monotonic() - t0 > a.time_limit:
            break
        try:
            case = F.run_case(seed, a.backend, regs, op=a.op)
            counts[f"{case.op}:{'mutated' if case.mutations else 'valid'}"] += 1
            counts[f"status{case.status}"] += 1
            counts.update(case.notes)
        except AssertionError as e:
            failures.append(f"seed {seed}: {e}")
            counts["FAILED"] += 1
        done += 1
    regs.close()
    if a.backend == "metal-sim":
        # A call the library answered with an error must still have kept
        # every Metal rule on the way there.
        from flashmetal.registry import metal_sim_counters, metal_sim_last_violation
        if metal_sim_counters()["violations"]:
            failures.append(f"Metal rules broken; the last: {metal_sim_last_violation()}")
    summary = {"backend": a.backend, "cases": done, "seconds": round(time.monotonic() - t0, 1),
               "failures": len(failures), "counts": dict(sorted(counts.items())), "first_failures": failures[:10]}
    print(json.dumps(summary))
    return 1 if failures else 0


def _state(path: str, backend: str, seed: int, case) -> None:
    with open(path, "w") as f:
        f.write(f"backend={backend} seed={seed} op={case.op} mutations={case.mutations}\n")
        for n, t in case.tensors.items():
            f.write(f"  {n}: dtype={t.dtype} shape={t.shape} ndim={t.ndim} nbytes={t.nbytes} null={t.null}\n")
        f.write(f"  opts={case.opts} args={case.args} registry={case.registry}\n")


if __name__ == "__main__":
    sys.exit(main())
