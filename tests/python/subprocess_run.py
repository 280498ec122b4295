"""Runs a snippet in a fresh interpreter, for the fork, signal, thread-count
and environment tests (test_fork, test_interrupt, test_env_vars, ...): each needs a process of its own."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from flashmetal import _loader

# Imported by every snippet: decode inputs and a check against the float64
# reference at the f16 tolerance decode is held to (numerics.TOLERANCE).
PRELUDE = """
import functools, os, signal, sys, threading, time
import numpy as np
import flashmetal as fm
from flashmetal import reference

@functools.cache
def decode_case(h=2, length=256, d=64, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((h, d)).astype(np.float32)
    k = rng.standard_normal((h, length, d)).astype(np.float32)
    v = rng.standard_normal((h, length, d)).astype(np.float32)
    return q, k, v

@functools.cache
def expected_decode(h, length, d, seed):
    q, k, v = decode_case(h, length, d, seed)
    return reference.decode(q, k, v, length)

def check_decode(reg, h=2, length=256, d=64, seed=0):
    q, k, v = decode_case(h, length, d, seed)
    out = fm.flash_attn_decode(q, k, v, length, registry=reg)
    ok, ratio = reference.close(out, expected_decode(h, length, d, seed), 1e-3, 5e-3)
    assert ok, f"{reg.backend}: decode off the reference by {ratio:.3g}x the tolerance"
"""


def run_python(*snippets: str, env: dict[str, str] | None = None, timeout: float = 120,
               check: bool = True) -> subprocess.CompletedProcess:
    """Runs PRELUDE + the snippets (each dedented); with `check`, a non-zero
    exit fails with the output."""
    code = "\n".join(textwrap.dedent(s) for s in snippets)
    full_env = dict(os.environ, FLASHMETAL_LIB=str(_loader.library_path()))
    full_env.update(env or {})
    p = subprocess.run([sys.executable, "-c", PRELUDE + code], capture_output=True, text=True,
                       env=full_env, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"subprocess exited {p.returncode}\nstdout:\n{p.stdout[-3000:]}\n"
                             f"stderr:\n{p.stderr[-3000:]}")
    return p
