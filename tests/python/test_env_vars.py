"""Every FLASHMETAL_* integer variable is range-checked.
A hostile value is ignored with one warning on stderr naming the variable,
the value and the accepted range; the process computes correctly with the
default (never an overflow, a crash or a hang)."""
from __future__ import annotations

import pytest

from subprocess_run import run_python

VARS = ["FLASHMETAL_NUM_THREADS", "FLASHMETAL_SIM_WORKERS", "FLASHMETAL_SIM_STACK_KB", "FLASHMETAL_SIM_SCRAMBLE"]

# Both backends, twice each (a per-call reader must warn only once).
COMPUTE = """
for backend in ("cpu", "sim"):
    reg = fm.Registry(backend)
    for seed in range(2):
        check_decode(reg, h=2, length=256, d=64, seed=seed)
print("ok")
"""

HOSTILE = {
    "overflow": ["99999999999999999999", "9223372036854775808", "9007199254740993", "18446744073709551616"],
    "negative": ["-1", "-1", "-1", "-1"],
    "text": ["abc", "4 threads", "0x10", "1e3"],
    "zero_or_blank": ["0", "0", "0", " "],
    "huge_in_int64": ["1025", "1025", "16385", "-9223372036854775808"],
}


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_hostile_values_warn_once_and_default(kind):
    env = dict(zip(VARS, HOSTILE[kind]))
    if kind == "zero_or_blank":
        env.pop("FLASHMETAL_SIM_SCRAMBLE")  # 0 is a valid scramble value (off)
    p = run_python(COMPUTE, env=env, timeout=120)
    assert p.stdout.strip() == "ok"
    for var, value in env.items():
        if not value.strip():
            continue  # blank means unset
        line = f'flashmetal: ignoring {var}="{value}": expected an integer in '
        assert p.stderr.count(line) == 1, f"{var}={value!r}: stderr was\n{p.stderr}"


def test_boundary_values_are_accepted():
    p = run_python(COMPUTE, env={"FLASHMETAL_NUM_THREADS": "1024", "FLASHMETAL_SIM_WORKERS": "1024",
                                 "FLASHMETAL_SIM_STACK_KB": "16384",
                                 "FLASHMETAL_SIM_SCRAMBLE": "9223372036854775807"}, timeout=120)
    assert p.stdout.strip() == "ok"
    assert "flashmetal: ignoring" not in p.stderr, p.stderr


def test_small_stack_is_accepted():
    p = run_python(COMPUTE, env={"FLASHMETAL_SIM_STACK_KB": "64", "FLASHMETAL_NUM_THREADS": "1"}, timeout=120)
    assert p.stdout.strip() == "ok" and "ignoring" not in p.stderr
