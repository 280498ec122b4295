#!/usr/bin/env python3
"""The closing line of `make test`, the same on every OS: where it ran, the
backends pytest ran its numeric tests on (tests/python/conftest.py decides),
any the environment left out and why, and the make targets that passed.

On macOS the metal backend is part of the run unless FLASHMETAL_TEST_METAL=0
leaves it out: a Mac whose metal backend does not open fails here rather than
passing on cpu and sim alone.

Usage: summary.py --os UNAME --arch ARCH TARGET...
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "python"))
import conftest  # noqa: E402  (the one list of backends the tests use)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--os", required=True)
    ap.add_argument("--arch", required=True)
    ap.add_argument("targets", nargs="*")
    args = ap.parse_args()
    left_out = conftest.left_out()
    if args.os == "Darwin" and "metal" not in conftest.BACKENDS and "metal" not in left_out:
        try:
            conftest.flashmetal.Registry("metal").close()
            why = "it opens now but did not when the tests ran"
        except Exception as e:  # noqa: BLE001  (whatever it is, it is the reason to print)
            why = f"{type(e).__name__}: {e}"
        print(f"make test: FAILED on Darwin: no numeric test ran on the metal backend ({why}); "
              "FLASHMETAL_TEST_METAL=0 runs the rest without it")
        return 1
    skipped = "".join(f"; {name} left out ({why})" for name, why in sorted(left_out.items()))
    print(f"make test: passed on {args.os} {args.arch}: numeric tests on {', '.join(conftest.BACKENDS)}{skipped}; "
          f"{len(args.targets)} targets: {' '.join(args.targets)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
