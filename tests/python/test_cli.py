"""The flashmetal command (python -m flashmetal, flashmetal.cli): info, bench
and verify on small shapes, run as a user runs them (a subprocess), their
output and exit codes; verify fails when the result is wrong."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import flashmetal
from flashmetal import cli

from conftest import BACKENDS


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashmetal", *args], capture_output=True, text=True, timeout=300)


def test_info_lists_backends_device_isa_threads_versions():
    r = run("info", "--json")
    assert r.returncode == 0, r.stderr
    about = json.loads(r.stdout)
    assert about["backends_available"] == BACKENDS
    assert about["flashmetal"] == flashmetal.__version__
    assert about["abi_version"] == flashmetal.abi_version()
    assert about["cpu_isa"] == flashmetal.info()["cpu_isa"] and about["threads"] >= 1
    assert about["numpy"] == np.__version__ and about["backend"] in BACKENDS
    text = run("info")
    assert text.returncode == 0 and f"flashmetal {flashmetal.__version__}" in text.stdout
    assert "backends_available " + ", ".join(BACKENDS) in text.stdout and "cpu_isa" in text.stdout


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_passes_on_small_shapes(backend):
    for shape in (["--q-len", "9", "--kv-len", "40", "--causal", "--heads", "4", "--kv-heads", "2", "-d", "64"],
                  ["--decode", "--kv-len", "50", "--dtype", "fp32", "--window", "7", "--heads", "2", "-d", "80"],
                  ["--q-len", "5", "--kv-len", "5", "--dtype", "float16", "--heads", "2", "-d", "48"]):
        r = run("verify", "--backend", backend, *shape)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"  {backend:6} PASS" in r.stdout and r.stdout.rstrip().endswith("all PASS")


def test_verify_all_backends_by_default():
    r = run("verify", "--q-len", "3", "--kv-len", "17", "--heads", "2", "-d", "64")
    assert r.returncode == 0, r.stderr
    assert [line.split()[0] for line in r.stdout.splitlines()[1:-1]] == BACKENDS


@pytest.mark.skipif("sim" not in BACKENDS, reason="the simulator backend is not built here")
def test_verify_all_leaves_out_a_long_simulation(monkeypatch, capsys):
    monkeypatch.setattr(cli, "SIM_BUDGET_S", 0.0)
    assert cli.main(["verify", "--q-len", "3", "--kv-len", "17", "--heads", "2", "-d", "64"]) == 0
    out = capsys.readouterr().out
    assert "  sim    not run: ~0 s on the simulator (--backend sim runs it)" in out and "  cpu    PASS" in out
    assert cli.main(["verify", "--backend", "sim", "--q-len", "3", "--kv-len", "17", "--heads", "2", "-d", "64"]) == 0
    assert "  sim    PASS" in capsys.readouterr().out


def test_verify_fails_outside_a_tolerance_it_cannot_meet():
    r = run("verify", "--backend", "cpu", "--q-len", "8", "--kv-len", "16", "--heads", "2", "-d", "64",
            "--atol", "0", "--rtol", "0")  # bfloat16 output never equals the float64 reference everywhere
    assert r.returncode == 1, r.stdout
    assert "  cpu    FAIL" in r.stdout and "FAIL: 1 of 1 backend(s) outside the tolerance" in r.stdout


def test_verify_fails_on_a_wrong_result(monkeypatch, capsys):
    real = cli.scaled_dot_product_attention

    def off_by_a_little(*args, **kwargs):
        return np.asarray(real(*args, **kwargs)).astype(np.float32) + np.float32(0.05)

    monkeypatch.setattr(cli, "scaled_dot_product_attention", off_by_a_little)
    assert cli.main(["verify", "--backend", "cpu", "--q-len", "4", "--kv-len", "9", "--heads", "2",
                     "-d", "64"]) == 1
    assert "  cpu    FAIL" in capsys.readouterr().out
    monkeypatch.setattr(cli, "scaled_dot_product_attention", real)
    assert cli.main(["verify", "--backend", "cpu", "--q-len", "4", "--kv-len", "9", "--heads", "2",
                     "-d", "64"]) == 0


def test_bench_prints_timing_route_and_torch_or_its_absence():
    r = run("bench", "--backend", "cpu", "--q-len", "16", "--kv-len", "64", "--heads", "4", "--kv-heads", "2",
            "-d", "64", "--causal", "--runs", "2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("flashmetal bench on backend 'cpu': bfloat16 B=1 H=4 Hkv=2 qL=16 kvL=64 D=64 causal")
    assert " ms " in lines[1] and "GFLOP/s" in lines[1] and "(flash_attn_prefill: tiled flash attention)" in lines[1]
    try:
        import torch  # noqa: F401
        assert lines[2].startswith("  torch sdpa") and "ms" in lines[2] and lines[3].startswith("  speedup")
    except ImportError:
        assert lines[2] == "  torch sdpa   not installed (pip install torch to compare)"


def test_bench_decode_progress_line_and_no_torch():
    r = run("bench", "--backend", "cpu", "--decode", "--kv-len", "300", "--dtype", "float32", "--heads", "8",
            "-d", "128", "--runs", "3", "--no-torch", "--progress")
    assert r.returncode == 0, r.stderr
    assert "qL=1 kvL=300" in r.stdout and "flash_attn_decode" in r.stdout and "torch" not in r.stdout
    assert "GB/s of K/V" in r.stdout
    assert [line.strip() for line in r.stderr.splitlines()][-1].startswith("flashmetal: run 3/3,")


def test_shape_flops_count_only_visible_keys():
    s = cli.Shape(1, 1, 1, 4, 6, 8, "float32", causal=True, window=None)
    assert s.flops() == 4.0 * 8 * (3 + 4 + 5 + 6)
    w = cli.Shape(1, 1, 1, 4, 6, 8, "float32", causal=True, window=2)
    assert w.flops() == 4.0 * 8 * 2 * 4


@pytest.mark.parametrize("argv,message", [
    (["verify", "--heads", "3", "--kv-heads", "2"], "--heads (3) must be a multiple of --kv-heads (2)"),
    (["bench", "--dtype", "float64"], "dtype must be one of bfloat16, float16, float32"),
    (["verify", "--q-len", "0"], "expected a positive integer, got 0"),
])
def test_bad_arguments_exit_2_naming_them(argv, message):
    r = run(*argv)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert f"usage: flashmetal {argv[0]}" in r.stderr


def test_library_errors_exit_2_with_the_message():
    r = run("verify", "--backend", "nonesuch")
    assert r.returncode == 2 and "flashmetal verify:" in r.stderr and "nonesuch" in r.stderr, r.stderr


def test_console_script_is_declared():
    from importlib.metadata import entry_points

    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts.get("flashmetal") == "flashmetal.cli:main"
