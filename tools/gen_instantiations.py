#!/usr/bin/env python3
"""Writes the shaders' INSTANTIATE_KERNEL lines from the capability tables.

Which kernels exist is decided once, in Swift: the capability tables of
Sources/FlashMetalCore/Capabilities.swift (head dims, dtypes, tile geometry
per head dim) enumerate every kernel (KernelSpec.all), and KernelSpec names
each one and derives its template function and arguments
(KernelSpec.instantiation). The built library reports that list through
fm_kernel_instantiations(); this script writes it into Resources/shaders,
between marker lines:

    // BEGIN GENERATED INSTANTIATIONS: flash_attn_vec flash_attn_vec_reduce
    // (written by tools/gen_instantiations.py from the capability tables; do not edit)
    INSTANTIATE_KERNEL("flash_attn_vec_dk64", flash_attn_vec, float, 64)
    ...
    // END GENERATED INSTANTIATIONS

A block holds every kernel whose template function its BEGIN line names, in
the tables' order; each function belongs to one block. Kernels of functions no
block names stay hand-written in their shader, and `--check` (and
tests/python/test_kernel_instantiations.py) fails when one of those lines
disagrees with the tables.

Usage: gen_instantiations.py [--check] [--lib LIBRARY] [SHADER_DIR]
    LIBRARY: the built libflashmetal (default $FLASHMETAL_LIB, else
    python/flashmetal's copy, which `make python` refreshes); SHADER_DIR:
    Resources/shaders. `make kernel-instantiations` builds the library and
    runs this.

Adding a head dim that runs on existing kernel bodies:
  1. one row in each capability table that should have it, in
     Sources/FlashMetalCore/Capabilities.swift (PrefillCapability.geometry,
     and f32Geometry or f32SplitGeometry for float32 I/O; VecCapability.headDims);
  2. `make kernel-instantiations`.
No kernel name or instantiation is hand-written: the kernel names, the
shaders' instantiations, fm_supported_head_dims (and so the Python package's
routing and the tests' head-dim lists) all follow the tables; only the tests
that pin the tables' contents on purpose change with them (docs/ARCHITECTURE.md,
"A head dim", lists them). A head dim at 160 on the two-byte, float32 and
decode tables is three rows, from which this writes ten lines. A head dim that
needs a new kernel body or template argument also changes
KernelSpec.instantiation and the shader.

Standard library only (ctypes), so it runs from any python3 >= 3.10.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
from collections import Counter
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
SHADERS = ROOT / "Resources" / "shaders"
BEGIN = "// BEGIN GENERATED INSTANTIATIONS:"
END = "// END GENERATED INSTANTIATIONS"
NOTE = "// (written by tools/gen_instantiations.py from the capability tables; do not edit)"
# Instantiated by the simulator's self-test only: no op requests it, so no table lists it.
UNLISTED = frozenset({"fm_selftest_reduce"})


class Kernel(NamedTuple):
    """One kernel as the tables define it: host name, template function, template arguments."""

    name: str
    function: str
    args: tuple[str, ...]

    @property
    def line(self) -> str:
        """Its INSTANTIATE_KERNEL line."""
        return f'INSTANTIATE_KERNEL("{self.name}", {", ".join((self.function, *self.args))})'


def default_library() -> Path:
    """$FLASHMETAL_LIB, else the Python package's copy of the library."""
    env = os.environ.get("FLASHMETAL_LIB")
    if env:
        return Path(env)
    name = "libflashmetal.dylib" if sys.platform == "darwin" else "libflashmetal.so"
    return ROOT / "python" / "flashmetal" / name


def parse(text: str) -> list[Kernel]:
    """Kernels from fm_kernel_instantiations' text ("name function arg ..." a line)."""
    kernels = []
    for row in text.splitlines():
        fields = row.split()
        if len(fields) < 2:
            raise ValueError(f"fm_kernel_instantiations: malformed line {row!r}")
        kernels.append(Kernel(fields[0], fields[1], tuple(fields[2:])))
    return kernels


def library_kernels(library: Path) -> list[Kernel]:
    """Every kernel the built library's capability tables define, in their order."""
    if not library.is_file():
        raise FileNotFoundError(f"{library}: no built library (run `make python` or pass --lib)")
    lib = ctypes.CDLL(str(library))
    lib.fm_kernel_instantiations.restype = ctypes.c_char_p
    return parse(lib.fm_kernel_instantiations().decode())


class Block(NamedTuple):
    """One generated block: the line indices of its BEGIN and END lines and the
    template functions its BEGIN line names."""

    begin: int
    end: int
    functions: tuple[str, ...]


def blocks(text: str, where: str = "shader") -> list[Block]:
    """The generated blocks of `text`, in order. A ValueError names `where`
    for a BEGIN without its END, an END without a BEGIN, a BEGIN line that
    names no function, or a function that two blocks name."""
    lines = text.split("\n")
    found: list[Block] = []
    claimed: set[str] = set()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(END):
            raise ValueError(f"{where}:{i + 1}: {END!r} without a BEGIN line")
        if not line.startswith(BEGIN):
            i += 1
            continue
        functions = tuple(line[len(BEGIN):].split())
        if not functions:
            raise ValueError(f"{where}:{i + 1}: the BEGIN line names no template function")
        for f in functions:
            if f in claimed:
                raise ValueError(f"{where}:{i + 1}: {f} is named by two generated blocks")
            claimed.add(f)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith((BEGIN, END))), None)
        if end is None or not lines[end].startswith(END):
            raise ValueError(f"{where}:{i + 1}: generated block without its {END!r} line")
        found.append(Block(i, end, functions))
        i = end + 1
    return found


def generated_lines(text: str, where: str = "shader") -> list[str]:
    """The lines inside the generated blocks of `text` (between each BEGIN
    and its END line)."""
    lines = text.split("\n")
    return [line for b in blocks(text, where) for line in lines[b.begin + 1:b.end]]


def render(text: str, kernels: list[Kernel], where: str = "shader") -> str:
    """`text` with each generated block rewritten from `kernels`. A ValueError
    names `where` for a malformed block (see `blocks`) or a function that no
    kernel has."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    for b in blocks(text, where):
        for f in b.functions:
            if not any(k.function == f for k in kernels):
                raise ValueError(f"{where}:{b.begin + 1}: no kernel of the capability tables uses {f}")
        out.extend(lines[i:b.begin + 1])
        out.append(NOTE)
        out.extend(k.line for k in kernels if k.function in b.functions)
        out.append(lines[b.end])
        i = b.end + 1
    out.extend(lines[i:])
    return "\n".join(out)


def shader_files(shader_dir: Path) -> list[Path]:
    """The .metal files of `shader_dir`, sorted."""
    return sorted(shader_dir.glob("*.metal"))


def instantiated(texts: list[str]) -> list[str]:
    """Every INSTANTIATE_KERNEL line of the given shader sources."""
    return [line for t in texts for line in t.split("\n") if line.startswith('INSTANTIATE_KERNEL("')]


def disagreements(texts: list[str], kernels: list[Kernel]) -> list[str]:
    """What the shader sources (as generated) instantiate that the tables do
    not define, or define otherwise, and what the tables define that no
    shader instantiates: one message each, empty when they agree."""
    lines = instantiated(texts)
    have = set(lines)
    names = {k.name for k in kernels}
    problems = [f"not instantiated (or with other template arguments): {k.line}"
                for k in kernels if k.line not in have]
    for line in lines:
        name = line.split('"')[1]
        if name not in names and name not in UNLISTED:
            problems.append(f"instantiated but in no capability table: {line}")
    counts = Counter(line.split('"')[1] for line in lines)
    problems += [f"instantiated more than once: {n}" for n, c in sorted(counts.items()) if c > 1]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file is out of date")
    parser.add_argument("--lib", type=Path, default=None, help="the built libflashmetal")
    parser.add_argument("shader_dir", nargs="?", type=Path, default=SHADERS)
    args = parser.parse_args(argv)
    kernels = library_kernels(args.lib or default_library())
    stale: list[Path] = []
    texts: list[str] = []
    for path in shader_files(args.shader_dir):
        old = path.read_text()
        new = render(old, kernels, where=str(path))
        texts.append(new)
        if new != old:
            stale.append(path)
            if not args.check:
                tmp = path.with_name(f".{path.name}.tmp")
                tmp.write_text(new)
                tmp.replace(path)
    verb = "out of date" if args.check else "rewritten"
    for path in stale:
        print(f"{path}: {verb}", file=sys.stderr if args.check else sys.stdout)
    problems = disagreements(texts, kernels)
    for p in problems:
        print(f"gen_instantiations: {p}", file=sys.stderr)
    return 1 if problems or (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
