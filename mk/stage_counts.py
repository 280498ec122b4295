"""The counts of one `make test` stage, and the total of them all.

    stage_counts.py STAGE STATUS LOG SECONDS
                                       prints "STAGE PASSED FAILED SKIPPED SECONDS"
    stage_counts.py --total SUMMARY [WALL]
                                       prints each stage with its wall time and
                                       the run's (WALL seconds, else the sum of
                                       the stages'), then the one line "N
                                       passed, N failed, N skipped"; exit 1
                                       when anything failed

A stage's counts are its pytest summaries ("3 passed, 1 skipped in 2.0s")
and XCTest's "Executed N tests, with M failures", summed over its log; a
stage that prints neither counts as one test. A stage that exited non-zero
counts at least one failure, whatever its log says.
"""
from __future__ import annotations

import re
import sys

_PYTEST = re.compile(r"^=*\s*((?:\d+ (?:passed|failed|skipped|errors?|deselected|xfailed|xpassed|warnings?)"
                     r"(?:, )?)+) in [0-9.]+s")
_PYTEST_ITEM = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)")
_XCTEST = re.compile(r"Executed (\d+) tests?, with (\d+) failures?")


def counts(status: int, log: str) -> tuple[int, int, int]:
    passed = failed = skipped = 0
    found = False
    xctest = [m for m in (_XCTEST.search(line) for line in log.splitlines()) if m]
    if xctest:  # the last line sums every suite
        n, f = int(xctest[-1].group(1)), int(xctest[-1].group(2))
        passed, failed, found = n - f, f, True
    for line in log.splitlines():
        m = _PYTEST.match(line.strip())
        if not m:
            continue
        found = True
        for n, kind in _PYTEST_ITEM.findall(m.group(1)):
            if kind in ("passed", "xfailed", "xpassed"):
                passed += int(n)
            elif kind == "skipped":
                skipped += int(n)
            else:
                failed += int(n)
    if not found:
        passed, failed = (1, 0) if status == 0 else (0, 1)
    elif status != 0 and failed == 0:
        failed = 1
    return passed, failed, skipped


def total(summary: str, wall: int | None = None) -> int:
    p = f = s = t = 0
    with open(summary, encoding="utf-8") as fh:
        for line in fh:
            name, a, b, c, secs = line.split()
            print(f"  {name}: {a} passed, {b} failed, {c} skipped ({secs} s)")
            p, f, s, t = p + int(a), f + int(b), s + int(c), t + int(secs)
    if wall is None:
        print(f"  wall time: {t / 60:.1f} min")
    else:
        print(f"  wall time: {wall / 60:.1f} min (the stages' sum: {t / 60:.1f} min, some run side by side)")
    print(f"{p} passed, {f} failed, {s} skipped")
    return 1 if f else 0


def main(argv: list[str]) -> int:
    if argv[1] == "--total":
        return total(argv[2], int(argv[3]) if len(argv) > 3 else None)
    stage, status, path, secs = argv[1], int(argv[2]), argv[3], int(argv[4])
    with open(path, encoding="utf-8", errors="replace") as fh:
        p, f, s = counts(status, fh.read())
    print(f"{stage} {p} {f} {s} {secs}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
