"""The ``flashmetal`` command (also ``python -m flashmetal``).

  flashmetal info      the backends this machine has, the device, the cpu
                       kernels' ISA path, threads, and the versions in use
  flashmetal bench     your shape on a backend, timed, beside torch's SDPA
                       when torch is installed
  flashmetal verify    your shape on every backend (or one) against the
                       float64 reference; exit status 1 when any is outside
                       the tolerance

A shape is batch, heads, kv heads, query length, kv length, head dim and
dtype; ``--decode`` is one query row over a kv_len cache, ``--causal`` is
bottom-right (the queries are the newest tokens, as a KV cache). Every run
goes through ``flashmetal.scaled_dot_product_attention``, which picks the
kernel; the route it took is printed.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import platform
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO
from collections.abc import Callable

import ml_dtypes
import numpy as np

from . import reference
from ._errors import Error
from .attention import last_route, scaled_dot_product_attention
from .demo import _TOLERANCE as TOLERANCE
from .registry import Registry, backend_names

_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
           "float32": np.dtype(np.float32)}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "half": "float16", "fp32": "float32",
                  "f32": "float32", "float": "float32"}
#: Runs longer than this (seconds, estimated from the warm-up) print a progress line.
PROGRESS_AFTER_S = 2.0
#: `verify` over all backends leaves the simulator out when it would take longer
#: than this (seconds): it costs ~11 ns per multiply-add.
SIM_BUDGET_S = 60.0
SIM_NS_PER_MAC = 11.0


def available_backends() -> list[str]:
    """The backends that open on this machine."""
    names = []
    for name in backend_names():
        try:
            Registry(name).close()
        except Error:
            continue
        names.append(name)
    return names


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: str
    causal: bool
    window: int | None

    def __str__(self) -> str:
        extra = (" causal" if self.causal else "") + (f" window={self.window}" if self.window else "")
        return (f"{self.dtype} B={self.batch} H={self.heads} Hkv={self.kv_heads} qL={self.q_len} "
                f"kvL={self.kv_len} D={self.head_dim}{extra}")

    def flops(self) -> float:
        """Multiply-adds of QK^T and PV, times 2 (the visible part for causal)."""
        t = np.arange(self.kv_len - self.q_len, self.kv_len)  # each row's position
        hi = np.minimum(t, self.kv_len - 1) if self.causal else np.full_like(t, self.kv_len - 1)
        lo = np.maximum(t - self.window + 1, 0) if self.window else np.zeros_like(t)
        seen = int(np.clip(hi - lo + 1, 0, None).sum())
        return 4.0 * self.batch * self.heads * seen * self.head_dim


def _dtype(text: str) -> str:
    name = _DTYPE_ALIASES.get(text.lower(), text.lower())
    if name not in _DTYPES:
        raise argparse.ArgumentTypeError(f"dtype must be one of {', '.join(_DTYPES)} (or bf16, fp16, fp32), "
                                         f"got {text!r}")
    return name


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def _add_shape_args(p: argparse.ArgumentParser, q_len: int, kv_len: int) -> None:
    g = p.add_argument_group("shape")
    g.add_argument("-b", "--batch", type=_positive, default=1)
    g.add_argument("--heads", type=_positive, default=16, help="query heads (default 16)")
    g.add_argument("--kv-heads", type=_positive, default=None, help="key/value heads (default: --heads)")
    g.add_argument("--q-len", type=_positive, default=q_len, help=f"query rows (default {q_len})")
    g.add_argument("--kv-len", type=_positive, default=kv_len, help=f"keys (default {kv_len})")
    g.add_argument("-d", "--head-dim", type=_positive, default=128)
    g.add_argument("--dtype", type=_dtype, default="bfloat16", help="bfloat16 (default), float16 or float32")
    g.add_argument("--causal", action="store_true", help="causal mask, bottom-right (queries are the newest)")
    g.add_argument("--window", type=_positive, default=None, help="sliding window (keys within W of the query)")
    g.add_argument("--decode", action="store_true", help="one query row over the kv cache (sets --q-len 1)")


def _shape(args: argparse.Namespace, ap: argparse.ArgumentParser) -> Shape:
    kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    if args.heads % kv_heads:
        ap.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({kv_heads})")
    return Shape(args.batch, args.heads, kv_heads, 1 if args.decode else args.q_len, args.kv_len, args.head_dim,
                 args.dtype, args.causal, args.window)


def make_inputs(s: Shape, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    dt = _DTYPES[s.dtype]
    q = rng.standard_normal((s.batch, s.heads, s.q_len, s.head_dim)).astype(dt)
    k = rng.standard_normal((s.batch, s.kv_heads, s.kv_len, s.head_dim)).astype(dt)
    v = rng.standard_normal((s.batch, s.kv_heads, s.kv_len, s.head_dim)).astype(dt)
    return q, k, v


def run_flashmetal(s: Shape, q: np.ndarray, k: np.ndarray, v: np.ndarray, reg: Registry) -> Any:
    return scaled_dot_product_attention(q, k, v, is_causal=s.causal, window=s.window, align="bottom_right",
                                        enable_gqa=True, registry=reg)


def _visible(s: Shape) -> np.ndarray:
    return reference.visible(s.q_len, s.kv_len, causal=s.causal, q_offset=s.kv_len - s.q_len, window=s.window)


def _torch_runner(s: Shape, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> Callable[[], Any] | None:
    """torch's SDPA on the same problem, or None without torch."""
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return None
    from ._interop import _numpy_to_torch

    tq, tk, tv = (_numpy_to_torch(np.ascontiguousarray(a)) for a in (q, k, v))
    mask = None
    if s.causal or s.window:
        vis = _visible(s)
        if not vis.all():
            mask = torch.from_numpy(vis)
    gqa = s.heads != s.kv_heads
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run() -> Any:
        with torch.inference_mode():
            return sdpa(tq, tk, tv, attn_mask=mask, enable_gqa=gqa)

    return run


class _Progress:
    """A progress line on stderr for runs estimated to take longer than PROGRESS_AFTER_S."""

    def __init__(self, what: str, total: int, estimate_s: float, stream: TextIO, force: bool) -> None:
        self.what, self.total, self.stream = what, total, stream
        self.on = force or estimate_s > PROGRESS_AFTER_S
        self.t0 = time.perf_counter()
        self.tty = stream.isatty()

    def step(self, i: int) -> None:
        if not self.on:
            return
        line = f"  {self.what}: run {i}/{self.total}, {time.perf_counter() - self.t0:.1f} s"
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.on and self.tty:
            self.stream.write("\n")


def time_ms(fn: Callable[[], Any], runs: int, what: str, force_progress: bool = False) -> float:
    """Median wall time of `runs` calls after one warm-up call."""
    t0 = time.perf_counter()
    fn()
    warm = time.perf_counter() - t0
    progress = _Progress(what, runs, warm * runs, sys.stderr, force_progress)
    times = []
    for i in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        progress.step(i + 1)
    progress.done()
    return float(np.median(times))


# ---- info -------------------------------------------------------------------------------------------------

def _version(module: str) -> str | None:
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return None


def cmd_info(args: argparse.Namespace) -> int:
    from . import __version__
    from ._info import info

    backends = available_backends()
    reg = Registry(args.backend)
    about = info(reg)
    reg.close()
    report: dict[str, Any] = {"flashmetal": __version__, "backends_available": backends, **about,
                              "python": platform.python_version(), "numpy": np.__version__}
    for extra in ("ml_dtypes", "cffi", "torch", "transformers", "mlx", "mlx-lm"):
        report[extra] = _version(extra)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"flashmetal {__version__}")
    for key, value in report.items():
        if key != "flashmetal":
            print(f"  {key:18} {', '.join(value) if isinstance(value, list) else value}")
    if about["backend"] == "cpu" and about["cpu_isa_portable"]:
        print("  note: the cpu kernels run their portable C path on this CPU: expect several times lower speed")
    return 0


# ---- bench ------------------------------------------------------------------------------------------------

def _rate(s: Shape, ms: float) -> str:
    """GFLOP/s; for decode (one query row, bound by reading the cache) also GB/s of K and V."""
    text = f"{s.flops() / ms / 1e6:8.1f} GFLOP/s"
    if s.q_len == 1:
        kv_bytes = 2 * s.batch * s.kv_heads * s.kv_len * s.head_dim * _DTYPES[s.dtype].itemsize
        text += f" {kv_bytes / ms / 1e6:7.1f} GB/s of K/V"
    return text


def cmd_bench(args: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    s = _shape(args, ap)
    reg = Registry(args.backend)
    q, k, v = make_inputs(s)
    print(f"flashmetal bench on backend '{reg.backend}': {s}, median of {args.runs} runs")
    ms = time_ms(lambda: run_flashmetal(s, q, k, v, reg), args.runs, "flashmetal", args.progress)
    route = last_route()
    print(f"  flashmetal   {ms:10.3f} ms  {_rate(s, ms)}  ({route})")
    runner = None if args.no_torch else _torch_runner(s, q, k, v)
    if runner is not None:
        torch = importlib.import_module("torch")
        tms = time_ms(runner, args.runs, "torch", args.progress)
        print(f"  torch sdpa   {tms:10.3f} ms  {_rate(s, tms)}  "
              f"(torch {torch.__version__}, {torch.get_num_threads()} threads)")
        print(f"  speedup      {tms / ms:10.2f}x (torch time / flashmetal time)")
    elif not args.no_torch:
        print("  torch sdpa   not installed (pip install torch to compare)")
    reg.close()
    return 0


# ---- verify -----------------------------------------------------------------------------------------------

def cmd_verify(args: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    s = _shape(args, ap)
    backends = available_backends() if args.backend == "all" else [args.backend]
    atol, rtol = TOLERANCE[s.dtype]
    atol = atol if args.atol is None else args.atol
    rtol = rtol if args.rtol is None else args.rtol
    q, k, v = make_inputs(s, args.seed)
    mask = None
    if s.causal or s.window:
        mask = np.where(_visible(s), 0.0, -np.inf)
    expected = reference.attention(q, k, v, mask=mask)
    print(f"flashmetal verify: {s} against the float64 reference, tolerance |err| <= {atol:g} + {rtol:g}*|ref|")
    failed = 0
    for name in backends:
        sim_s = s.flops() / 2 * SIM_NS_PER_MAC * 1e-9
        if name == "sim" and args.backend == "all" and sim_s > SIM_BUDGET_S:
            print(f"  sim    not run: ~{sim_s:.0f} s on the simulator (--backend sim runs it)")
            continue
        with Registry(name) as reg:
            out = np.asarray(run_flashmetal(s, q, k, v, reg))
            route = last_route()
        ok, ratio = reference.close(out, expected, atol, rtol)
        err = float(np.max(np.abs(out.astype(np.float64) - expected))) if out.size else 0.0
        failed += not ok
        print(f"  {name:6} {'PASS' if ok else 'FAIL'}  max|err| {err:.3e}  err/tol {ratio:.3f}  "
              f"({route.kernel if route else '?'})")
    print("all PASS" if not failed else f"FAIL: {failed} of {len(backends)} backend(s) outside the tolerance")
    return 1 if failed else 0


# ---- entry ------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="flashmetal", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="{info,bench,verify}")
    p = sub.add_parser("info", help="backends, device, ISA path, threads, versions")
    p.set_defaults(parser=p)
    p.add_argument("--backend", default="auto", help="the backend to describe (default auto)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = sub.add_parser("bench", help="time your shape, beside torch's SDPA when installed")
    p.set_defaults(parser=p)
    _add_shape_args(p, q_len=1024, kv_len=1024)
    p.add_argument("--backend", default="auto", help="cpu, sim, metal or auto (default)")
    p.add_argument("--runs", type=_positive, default=10, help="timed runs after one warm-up (default 10)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch comparison")
    p.add_argument("--progress", action="store_true",
                   help=f"always print the progress line (default: runs estimated over {PROGRESS_AFTER_S:g} s)")
    p = sub.add_parser("verify", help="check your shape against the float64 reference")
    p.set_defaults(parser=p)
    _add_shape_args(p, q_len=128, kv_len=128)
    p.add_argument("--backend", default="all", help="a backend, or all (default) that open here")
    p.add_argument("--atol", type=float, default=None, help="absolute tolerance (default: the dtype's)")
    p.add_argument("--rtol", type=float, default=None, help="relative tolerance (default: the dtype's)")
    p.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        if args.command == "info":
            return cmd_info(args)
        if args.command == "bench":
            return cmd_bench(args, args.parser)
        return cmd_verify(args, args.parser)
    except Error as e:
        print(f"flashmetal {args.command}: {e}", file=sys.stderr)
        return 2
