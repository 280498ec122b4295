"""The C, C++ and MSL format check of `make check`.

clang-format (configured by .clang-format) formats each file; the check
compares its output with the file after collapsing every run of whitespace
(line breaks included) to one space. So it enforces what clang-format puts
between tokens on a line: spaces around binary operators, after keywords
and commas, none inside parentheses, `T *p` pointer alignment, one space
before a `//` comment; it leaves line breaks, continuation indents and
alignment to the author. Trailing whitespace and tabs are checked directly.
Usage: clang_format_check.py CLANG_FORMAT FILE...; exit 1 on any finding.
"""
from __future__ import annotations

import re
import subprocess
import sys

_BREAK = re.compile(r"[ \t]*(?:\\?\n[ \t]*)+")  # a line break (also a macro's backslash-newline) and its indents
_SPACES = re.compile(r"[ \t]+")
BREAK = "\n"


def _normal(text: str) -> str:
    """The text with every line break as one BREAK and every run of spaces as one space."""
    return _SPACES.sub(" ", _BREAK.sub(BREAK, text)).strip()


def first_difference(a: str, b: str) -> int | None:
    """Where normalised texts `a` and `b` differ other than by line breaks
    (a break matches one space or none on the other side), or None."""
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] == b[j]:
            i, j = i + 1, j + 1
        elif a[i] == BREAK:
            i, j = i + 1, j + (b[j] == " ")
        elif b[j] == BREAK:
            i, j = i + (a[i] == " "), j + 1
        else:
            return i
    rest = a[i:].replace(BREAK, "") + b[j:].replace(BREAK, "")
    return None if not rest.strip() else i


def check(clang_format: str, path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    problems = []
    for n, line in enumerate(text.split("\n"), 1):
        if line != line.rstrip():
            problems.append(f"{path}:{n}: trailing whitespace")
        if "\t" in line:
            problems.append(f"{path}:{n}: tab character")
    formatted = subprocess.run([clang_format, "--assume-filename=" + path.replace(".metal", ".cpp")],
                               input=text, capture_output=True, text=True, check=True).stdout
    a, b = _normal(text), _normal(formatted)
    at = first_difference(a, b)
    if at is not None:
        line = a[:at].count(BREAK) + 1
        near = a[max(at - 40, 0):at + 40].replace(BREAK, " ")
        problems.append(f"{path}:{line}: clang-format spaces this differently: `{near}`")
    return problems


def main(argv: list[str]) -> int:
    clang_format, files = argv[1], argv[2:]
    problems = [p for f in files for p in check(clang_format, f)]
    for p in problems:
        print(p)
    print(f"clang-format check: {len(files)} files, {len(problems)} findings")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
