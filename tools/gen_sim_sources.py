#!/usr/bin/env python3
"""Writes the simulator's sources of the shaders: for every
Resources/shaders/<name>.metal, Sources/FlashMetalSim/kernels/<name>.cpp
(the shader compiled as C++ for the sim) and
Sources/FlashMetalSimCounted/<name>.cpp (its counted copy: the same text in
namespace fmsim_counted after counted_prelude.h, so metal-sim can check every
load and store against the bound buffers). Both are the shader's name and
nothing else, so adding a shader adds no hand-written simulator file.

A shader header that includes a system header (kv_codec.h: <stdint.h>)
cannot sit inside a namespace: the counted copy includes it first, outside
(its include guard then keeps the shader's own include empty).

Usage: gen_sim_sources.py [--check]
    --check: change nothing; exit 1 when a source is missing, differs or
    belongs to no shader. `make kernel-instantiations` runs this.

Standard library only.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHADERS = ROOT / "Resources" / "shaders"
PLAIN = ROOT / "Sources" / "FlashMetalSim" / "kernels"
COUNTED = ROOT / "Sources" / "FlashMetalSimCounted"
NOTE = "(written by tools/gen_sim_sources.py; do not edit)"
_LOCAL_INCLUDE = re.compile(r'^#include "([^"]+)"', re.MULTILINE)


def outside_headers(shader: str) -> list[str]:
    """The local headers the shader includes that include a system header,
    in the shader's order."""
    out = []
    for name in _LOCAL_INCLUDE.findall(shader):
        header = SHADERS / name
        if header.exists() and "#include <" in header.read_text():
            out.append(name)
    return [n for n in out if n != "dialect.h"]  # counted_prelude.h includes the dialect itself


def plain_source(name: str) -> str:
    return (f"// The {name} shader compiled for the simulator {NOTE}.\n"
            f'#include "../../../Resources/shaders/{name}.metal"\n')


def counted_source(name: str, shader: str) -> str:
    first = "".join(f'#include "../../Resources/shaders/{h}"\n' for h in outside_headers(shader))
    return (f"// The counted copy of {name}.metal (traced loads and stores; see FlashMetalSim/counters.h)\n"
            f"// {NOTE}.\n"
            '#include "counted_prelude.h"\n'
            f"{first}"
            "namespace fmsim_counted {\n"
            f'#include "../../Resources/shaders/{name}.metal"\n'
            "} // namespace fmsim_counted\n")


def expected() -> dict[Path, str]:
    """Every simulator source the shaders call for, and its text."""
    files: dict[Path, str] = {}
    for shader in sorted(SHADERS.glob("*.metal")):
        files[PLAIN / f"{shader.stem}.cpp"] = plain_source(shader.stem)
        files[COUNTED / f"{shader.stem}.cpp"] = counted_source(shader.stem, shader.read_text())
    return files


def problems() -> list[str]:
    """What differs from the generator's output (empty when current)."""
    want = expected()
    out = [f"{p.relative_to(ROOT)}: {'differs' if p.exists() else 'missing'}"
           for p, text in want.items() if not p.exists() or p.read_text() != text]
    out += [f"{p.relative_to(ROOT)}: belongs to no shader" for d in (PLAIN, COUNTED) for p in sorted(d.glob("*.cpp"))
            if p not in want]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a source is out of date")
    args = parser.parse_args(argv)
    if args.check:
        found = problems()
        for line in found:
            print(line, file=sys.stderr)
        return 1 if found else 0
    want = expected()
    for path, text in want.items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    for d in (PLAIN, COUNTED):
        for p in sorted(d.glob("*.cpp")):
            if p not in want:
                p.unlink()
                print(f"removed {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
