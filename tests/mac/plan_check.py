#!/usr/bin/env python3
"""plan_check.py — `make test` as an Apple-silicon Mac plans it, checked for
commands that exist only on Linux.

Runs `make -n -B test-plan UNAME=Darwin ARCH=arm64` (every stage of `make
test` as a prerequisite, every recipe printed, none run, as on a clean clone) with a stand-in `uname` answering Darwin / arm64
first on PATH, and fails on any planned line that a Mac cannot run: Debian's
package tools, qemu, ELF-only tools and checks, Linux targets, sysroots and
paths, ELF shared objects. It also fails unless the plan builds and tests the
macOS library (libflashmetal.dylib), and when a fragment reads the OS other
than through the Makefile's UNAME / ARCH.

  plan_check.py              check the Mac plan
  plan_check.py --self-test  first prove the checker: each planted Linux-only
                             line is caught, a fragment that plants an apt-get
                             step into `make test` fails the check, and the
                             same Makefile planned for Linux (which does install
                             Debian packages and run qemu) is caught; then check
"""
from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# (what, pattern): a planned line matching any of these cannot run on a Mac.
LINUX_ONLY = [
    ("Debian package tool", r"\b(?:dpkg(?:-query)?|apt-get|apt|aptitude)\b"),
    ("sudo (a Mac's make test installs nothing system-wide)", r"\bsudo\b"),
    ("qemu", r"\bqemu-"),
    ("ELF-only tool", r"\b(?:ldd|readelf|patchelf|ldconfig)\b"),
    ("ELF header read (od of e_machine)", r"\bod\s+-"),
    ("ELF check through file(1)", r"\bfile\b[^|;]*\|\s*grep\b[^|;]*\b(?:ELF|aarch64)\b"),
    ("Linux target triple or sysroot", r"linux-gnu"),
    ("lld as the linker", r"-fuse-ld=lld"),
    ("Debian's LLVM", r"/usr/lib/llvm-\d+"),
    ("Linux library path", r"/usr/lib/(?:x86_64|aarch64)-linux|/usr/lib64\b"),
    ("/proc", r"/proc/"),
    ("ELF shared object", r"\.so(?:\.\d+)*\b(?![\w/-])"),
    ("Linux loader variable", r"\bLD_(?:PRELOAD|LIBRARY_PATH)\b"),
    ("GNU linker option", r"--version-script|-z\s*nodelete|-static-stdlib"),
]
MUST_PLAN = [
    ("the macOS library built and copied", r"libflashmetal\.dylib"),
    ("swift build", r"\bswift\b.*\bbuild\b"),
    ("the numeric pytest run", r"-m pytest tests/python\b"),
    ("the closing summary", r"tests/summary\.py --os Darwin --arch arm64"),
]
RE_OS_READ = re.compile(r"\buname\b|\bOSTYPE\b|sys\.platform")

FAKE_UNAME = """#!/bin/sh
# uname as an Apple-silicon Mac answers it (only the flags make uses).
case "$1" in
  -m|-p) echo arm64 ;;
  -r) echo 23.6.0 ;;
  -a) echo "Darwin mac 23.6.0 Darwin Kernel Version 23.6.0 arm64" ;;
  *) echo Darwin ;;
esac
"""


def plan(os_name: str = "Darwin", arch: str = "arm64", extra_makefile: str | None = None) -> str:
    """The commands `make test` would run on os_name / arch, from a clean clone."""
    with tempfile.TemporaryDirectory() as tmp:
        uname = Path(tmp, "uname")
        uname.write_text(FAKE_UNAME)
        uname.chmod(uname.stat().st_mode | stat.S_IEXEC)
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEFILES")}
        if os_name == "Darwin":
            env["PATH"] = tmp + os.pathsep + env.get("PATH", "")
        cmd = ["make", "--no-print-directory", "-n", "-B"]
        if extra_makefile is not None:
            planted = Path(tmp, "planted.mk")
            planted.write_text(extra_makefile)
            cmd += ["-f", "Makefile", "-f", str(planted)]
        cmd += ["test-plan", f"UNAME={os_name}", f"ARCH={arch}"]
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"plan_check: `{' '.join(cmd)}` failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r.stdout


def logical_lines(text: str) -> list[str]:
    """Recipe lines with their backslash continuations joined."""
    out, cur = [], ""
    for line in text.splitlines():
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    if cur:
        out.append(cur)
    return out


def linux_only(lines: list[str]) -> list[str]:
    found = []
    for line in lines:
        for what, pat in LINUX_ONLY:
            if re.search(pat, line):
                found.append(f"{what}: {line.strip()[:200]}")
                break
    return found


def missing(lines: list[str]) -> list[str]:
    text = "\n".join(lines)
    return [what for what, pat in MUST_PLAN if not re.search(pat, text)]


def stray_os_reads() -> list[str]:
    """Fragments must test $(UNAME) / $(ARCH), not read the OS themselves."""
    found = []
    for mk in sorted(ROOT.glob("mk/*.mk")):
        for n, line in enumerate(mk.read_text().splitlines(), 1):
            if not line.lstrip().startswith("#") and RE_OS_READ.search(line):
                found.append(f"{mk.relative_to(ROOT)}:{n}: reads the OS itself: {line.strip()}")
    return found


def check(text: str, label: str) -> list[str]:
    lines = logical_lines(text)
    errors = linux_only(lines) + [f"not planned: {what}" for what in missing(lines)]
    print(f"plan_check: {label}: {len(lines)} planned line(s), {len(errors)} problem(s)")
    return errors


PLANTED_LINES = [
    "apt-get install -y -qq libc++-19-dev",
    "dpkg-query -W -f='${Status}' qemu-user",
    "sudo make install",
    "qemu-aarch64 -L /usr/aarch64-linux-gnu build-sim/x",
    "ldd build-sim/sim-conformance-libcxx | grep -q libc++.so",
    "readelf -d python/flashmetal/libflashmetal.dylib",
    '[ "$(od -An -tx2 -j18 -N2 x)" = " 00b7" ]',
    'file .build/h | grep -q "ARM aarch64"',
    "clang --target=aarch64-linux-gnu -o h h.c",
    "clang -fuse-ld=lld -o h h.c",
    "clang++ -isystem /usr/lib/llvm-19/include/c++/v1 x.cpp",
    "cat /proc/self/maps",
    "cp .build/release/libflashmetal.so python/flashmetal/",
    "LD_PRELOAD=/x/libclang_rt.asan.so python -c 1",
    "swift build -Xswiftc -static-stdlib",
]
# A fragment of the kind the check exists for: a Debian step that reaches a
# Mac's `make test`.
PLANTED_FRAGMENT = """EXTRA_TESTS += planted-debian-step
planted-debian-step:
\tapt-get install -y -qq libfoo-dev
"""


def self_test() -> int:
    failed = 0
    for line in PLANTED_LINES:
        caught = bool(linux_only([line]))
        print(f"plan_check self-test: {'caught' if caught else 'NOT CAUGHT'}: {line}")
        failed += not caught
    mac_ok = ["swift build -c release --product flashmetal", "cp .build/release/libflashmetal.dylib x",
              ".venv/bin/python -m pytest tests/python -q", ".venv/bin/python tests/summary.py --os Darwin --arch arm64",
              "xcrun -f clang++", "env -u FLASHMETAL_CPU_ISA .build/cpu-arm64/harness neon",
              'file .build/cpu-arm64/harness | grep -q "Mach-O 64-bit executable arm64" || { echo "not aarch64"; exit 1; }']
    false_hits = linux_only(mac_ok)
    print(f"plan_check self-test: Mac-only control lines {'flagged: ' + '; '.join(false_hits) if false_hits else 'pass'}")
    failed += bool(false_hits)
    planted = check(plan(extra_makefile=PLANTED_FRAGMENT), "Mac plan with a planted apt-get step")
    caught = any("apt-get install -y -qq libfoo-dev" in e for e in planted)
    print(f"plan_check self-test: planted apt-get step in make test {'caught' if caught else 'NOT CAUGHT'}")
    failed += not caught
    linux = check(plan("Linux", "x86_64"), "the Linux plan (must be caught: it installs Debian packages, runs qemu)")
    caught = any(e.startswith("Debian package tool") for e in linux) and any(e.startswith("qemu") for e in linux)
    print(f"plan_check self-test: the Linux plan {'caught' if caught else 'NOT CAUGHT'}")
    failed += not caught
    print(f"plan_check self-test: {'ok' if not failed else f'{failed} FAILED'}")
    return failed


def main(argv: list[str]) -> int:
    if argv not in ([], ["--self-test"]):
        print(__doc__)
        return 2
    if argv and self_test():
        return 1
    errors = check(plan(), "make test as an arm64 Mac plans it") + stray_os_reads()
    for e in errors:
        print("  " + e)
    print(f"plan_check: {'FAILED' if errors else 'the Mac plan runs nothing Linux-only'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
