"""The dynamic symbols a shared library exports, on Linux (ELF) and macOS (Mach-O)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def exported_symbols(path: Path | str) -> set[str]:
    """Names of the defined, exported symbols of `path`, as C spells them.
    ELF: the dynamic symbol table (nm -D). Mach-O has none: its external
    defined symbols (nm -gU) carry a leading underscore, removed here."""
    darwin = sys.platform == "darwin"
    cmd = ["nm", "-gU", str(path)] if darwin else ["nm", "-D", "--defined-only", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    names = {line.split()[-1] for line in out.splitlines() if line.strip() and not line.endswith(":")}
    return {n[1:] if darwin and n.startswith("_") else n for n in names}
