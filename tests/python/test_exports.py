"""The library exports its C ABI (fm_*) and no
internal symbol: not the fiber switch, not the pool or the SIGINT hook, not
the Swift modules' public symbols nor C++ template instances."""
from __future__ import annotations

import subprocess
import sys

import pytest

from flashmetal import _loader

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the ELF dynamic symbol table")


def global_dynamic_symbols() -> list[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(_loader.library_path())], capture_output=True,
                         text=True, check=True).stdout
    # Upper-case type letters are global (exported); lower-case ones are local.
    return [f[2] for f in (line.split() for line in out.splitlines()) if len(f) == 3 and f[1].isupper()]


def test_only_the_c_abi_is_exported():
    syms = global_dynamic_symbols()
    assert "fm_create_registry" in syms and "fm_dispatch_vec" in syms
    stray = [s for s in syms if not s.startswith("fm_")]
    assert not stray, f"exported beyond the C ABI: {stray[:10]}"
    internal = [s for s in syms if s.startswith(("fm_ctx_", "fm_pool_", "fm_interrupt_", "fm_env_"))]
    assert not internal, f"internal runtime symbols exported: {internal}"
