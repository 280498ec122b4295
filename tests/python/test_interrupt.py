"""SIGINT cancels a long cpu or sim call within ~1 s with
KeyboardInterrupt, and the registry keeps working (the interrupted call's
output is unspecified)."""
from __future__ import annotations

import sys

import pytest

from subprocess_run import run_python

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

# A prefill that runs ~10 s uninterrupted on either backend here (sim: 4
# heads x 1024 rows; cpu: 16 heads x 8192 rows), then SIGINT from a timer.
LONG_CALL = """
import ml_dtypes
backend = "{backend}"
reg = fm.Registry(backend)
shape = (1, 4, 1024, 128) if backend == "sim" else (1, 16, 8192, 128)
x = np.random.default_rng(0).standard_normal(shape).astype(ml_dtypes.bfloat16)
call = lambda: fm.flash_attn_prefill(x, x, x, registry=reg)
# A process started as a background job of a non-interactive shell inherits
# SIGINT ignored (and Python then leaves it so): start from Python's handler.
signal.signal(signal.SIGINT, signal.default_int_handler)
{setup}
threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
t0 = time.monotonic()
try:
    call()
    raise SystemExit(f"not interrupted: the call ran {{time.monotonic() - t0:.1f}} s to completion")
except KeyboardInterrupt as e:
    waited = time.monotonic() - t0
    print(f"{{waited:.3f}} {{e}}")
assert waited < 1.5, f"KeyboardInterrupt came {{waited:.2f}} s after the call started (SIGINT at 0.5 s)"
check_decode(reg)  # the registry still computes correctly
"""


@pytest.mark.parametrize("backend", ["cpu", "sim"])
def test_sigint_interrupts_a_long_call(backend):
    p = run_python(LONG_CALL.format(backend=backend, setup=""), timeout=120)
    assert float(p.stdout.split()[0]) < 1.5


# A ~1 s sim prefill with out=, checked against the float64 reference, while
# a SIGINT arrives 0.2 s in: {setup} runs first, {call} makes the call.
RUNS_THROUGH = """
import ml_dtypes
from flashmetal import reference
signal.signal(signal.SIGINT, signal.default_int_handler)
reg = fm.Registry("sim")
x = np.random.default_rng(0).standard_normal((1, 2, 1024, 64)).astype(ml_dtypes.bfloat16)
out = np.full(x.shape, np.nan, x.dtype)
def call():
    fm.flash_attn_prefill(x, x, x, out=out, registry=reg)
{setup}
threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
t0 = time.monotonic()
{call}
waited = time.monotonic() - t0
assert waited > 0.3, f"the call ended {{waited:.2f}} s in: the SIGINT came after it"
want = reference.attention(x, x, x)
ok, ratio = reference.close(out.astype(np.float32), want, 5e-3, 2e-2)
assert ok, f"the output is not the complete result ({{ratio:.3g}}x over tolerance)"
print("completed", f"{{waited:.2f}}")
"""


def test_sigint_with_a_python_handler_that_does_not_raise():
    """The application's handler runs and does not raise (a server draining
    on SIGINT): the main thread's call is not lost, it completes with the
    right result and raises nothing."""
    setup = """
seen = []
signal.signal(signal.SIGINT, lambda *a: seen.append(1))
time.sleep(0.15)  # the library re-checks its handler at most every 100 ms
"""
    p = run_python(RUNS_THROUGH.format(setup=setup, call="call()") + "assert seen == [1], seen\n", timeout=120)
    assert p.stdout.startswith("completed"), p.stdout


def test_sigint_does_not_cut_short_a_worker_threads_call():
    """Python raises KeyboardInterrupt only in the main thread: a call another
    thread makes runs to completion (before, it was cut short and raised
    KeyboardInterrupt in the worker)."""
    call = """
failure, done, main_got = [], threading.Event(), []
def work():
    try:
        call()
    except BaseException as e:
        failure.append(e)
    done.set()
threading.Thread(target=work).start()
while not done.is_set():
    try:
        done.wait(0.05)
    except KeyboardInterrupt:  # the main thread gets it; the worker's call goes on
        main_got.append(1)
assert not failure, failure
assert main_got == [1], "the main thread did not get its KeyboardInterrupt"
"""
    p = run_python(RUNS_THROUGH.format(setup="", call=call), timeout=120)
    assert p.stdout.startswith("completed"), p.stdout


@pytest.mark.parametrize("switch", ["env", "setter"])
def test_interruption_can_be_turned_off(switch):
    """FLASHMETAL_INTERRUPT=0, or fm.set_interrupt(False): the main thread's
    call completes; Python raises its KeyboardInterrupt once it returns."""
    setup = "assert fm.set_interrupt(False) is True" if switch == "setter" else ""
    call = """
try:
    call()
except KeyboardInterrupt:
    pass
"""
    env = {"FLASHMETAL_INTERRUPT": "0"} if switch == "env" else None
    p = run_python(RUNS_THROUGH.format(setup=setup, call=call), env=env, timeout=120)
    assert p.stdout.startswith("completed"), p.stdout


def test_ignored_sigint_stays_ignored():
    """Under SIG_IGN the library installs nothing: the call completes."""
    p = run_python("""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import ml_dtypes
    reg = fm.Registry("sim")
    # ~1 s on the sim (a 16k-key decode took only 30-40 ms: the SIGINT could
    # land after the call).
    x = np.random.default_rng(0).standard_normal((1, 2, 1024, 64)).astype(ml_dtypes.bfloat16)
    sent = []
    def interrupt():
        os.kill(os.getpid(), signal.SIGINT)
        sent.append(time.monotonic())
    threading.Timer(0.05, interrupt).start()
    fm.flash_attn_prefill(x, x, x, registry=reg)
    done = time.monotonic()
    assert sent and sent[0] < done, "the SIGINT was not sent during the call"
    check_decode(reg)
    print("completed")
    """, timeout=120)
    assert p.stdout.strip() == "completed"
