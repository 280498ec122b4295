"""One process-wide cpu worker pool, bounded by
FLASHMETAL_NUM_THREADS and started on first use, whatever the number of
registries (threads counted in /proc/self/task); and woken ahead of a call
(``fm_prepare_workers``, which every op's registry lookup calls on the cpu
backend): the calls after it give the reference's result and the bits of a
one-thread pool, whether the pool does not exist yet, its workers still spin,
or they sleep."""
from __future__ import annotations

import sys

import pytest

from subprocess_run import run_python

COUNT = """
tasks = lambda: len(os.listdir("/proc/self/task"))
base = tasks()
regs = [fm.Registry("cpu") for _ in range(100)]
assert tasks() == base, f"registries started threads before any work: {{tasks() - base}}"
for r in regs:
    check_decode(r, h=8, length=4096, d=128)
extra = tasks() - base
print(extra)
for r in regs:
    r.close()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
@pytest.mark.parametrize("n", [1, 3, 16])
def test_one_bounded_pool_for_all_registries(n):
    p = run_python(COUNT, env={"FLASHMETAL_NUM_THREADS": str(n)}, timeout=120)
    # The caller is one of the n threads: at most n - 1 workers, however many registries.
    assert int(p.stdout.strip()) == n - 1


PREPARED_CALLS = """
import hashlib
lib = fm._native.lib()
reg = fm.Registry("cpu")
q, k, v = decode_case(h=8, length=4096, d=128)
lib.fm_prepare_workers()  # before any pool: nothing to wake
outs = [fm.flash_attn_decode(q, k, v, 4096, registry=reg)]
for pause in (0.0, 0.002, 0.05, 0.0):  # workers spinning, just asleep, long asleep, woken and unused
    time.sleep(pause)
    lib.fm_prepare_workers()
    outs.append(fm.flash_attn_decode(q, k, v, 4096, registry=reg))
lib.fm_prepare_workers()
lib.fm_prepare_workers()  # twice in a row, then a call much later than the spin
time.sleep(0.01)
outs.append(fm.flash_attn_decode(q, k, v, 4096, registry=reg))
check_decode(reg, h=8, length=4096, d=128)
print(hashlib.sha256(b"".join(o.tobytes() for o in outs)).hexdigest(), len({o.tobytes() for o in outs}))
"""


@pytest.mark.parametrize("threads", ["2", "3"])
def test_prepared_calls_give_the_one_thread_bits(threads):
    one = run_python(PREPARED_CALLS, env={"FLASHMETAL_NUM_THREADS": "1"}).stdout.split()
    many = run_python(PREPARED_CALLS, env={"FLASHMETAL_NUM_THREADS": threads}).stdout.split()
    assert one[1] == "1", "a call's bits changed between calls"
    assert many == one
