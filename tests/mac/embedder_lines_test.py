#!/usr/bin/env python3
"""The embedded shader sources carry #line directives: a compile error in any
file inlined into them (the .metal file, dialect.h, flashmetal_kernels.h) names that
file and its line. Plants an #error at a known line of each, embeds the copies
with the embedder itself, preprocesses the result and checks the locations."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# (file, 1-based line the planted #error will occupy)
PLANTS = [("sdpa.metal", 30), ("dialect.h", 3), ("flashmetal_kernels.h", 40)]


def main(cxx: str) -> int:
    with tempfile.TemporaryDirectory(prefix="embed-lines-") as tmp:
        shaders, out = Path(tmp) / "shaders", Path(tmp) / "out"
        shutil.copytree(ROOT / "Resources" / "shaders", shaders)
        header = Path(tmp) / "flashmetal_kernels.h"
        shutil.copy(ROOT / "Sources" / "CFlashMetal" / "include" / "flashmetal_kernels.h", header)
        for name, line in PLANTS:
            f = header if name == "flashmetal_kernels.h" else shaders / name
            lines = f.read_text().split("\n")
            lines.insert(line - 1, f"#error planted in {name}")
            f.write_text("\n".join(lines))
        subprocess.run([str(ROOT / "tests" / "mac" / "embedded_sources.sh"), str(out), str(shaders), str(header)],
                       check=True)
        # dialect.h's host branch includes the shim by a path relative to Resources/shaders.
        p = subprocess.run([cxx, "-E", "-x", "c++", "-std=c++20", "-I", str(ROOT / "Resources" / "shaders"),
                            str(out / "sdpa.metal"), "-o", "/dev/null"], capture_output=True, text=True)
    missing = [f"{name}:{line}" for name, line in PLANTS
               if f"{name}:{line}:2: error: planted in {name}" not in p.stderr]
    if missing:
        print(f"embedder_lines_test: no error located at {missing}; compiler said:\n{p.stderr[-3000:]}")
        return 1
    print(f"embedder_lines_test: errors located at {[f'{n}:{l}' for n, l in PLANTS]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "clang++"))
