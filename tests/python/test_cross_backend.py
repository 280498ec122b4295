"""The same inputs on the cpu backend and on the sim (the Metal kernels):
the two implementations must agree within the dtype's tolerance."""
from __future__ import annotations

import pytest

import flashmetal as fm
from conftest import BACKENDS
from numerics import BF16, F16, assert_close, randn

pytestmark = pytest.mark.skipif("sim" not in BACKENDS, reason="this build has no sim backend")


@pytest.fixture(scope="module")
def sim():
    r = fm.Registry("sim")
    yield r
    r.close()


@pytest.mark.parametrize("d,dtype,causal", [(64, BF16, True), (128, F16, False), (256, BF16, True),
                                            (512, F16, True)])
def test_prefill_sim_matches_cpu(cpu, sim, rng, d, dtype, causal):
    q = randn(rng, (2, 4, 37, d), dtype)
    k = randn(rng, (2, 2, 45, d), dtype)
    v = randn(rng, (2, 2, 45, d), dtype)
    mask = (rng.random((37, 45)) < 0.8)
    mask[:, 0] = True
    kw = dict(causal=causal, q_offset=8, mask=mask, softcap=20.0)
    a = fm.flash_attn_prefill(q, k, v, registry=cpu, **kw)
    b = fm.flash_attn_prefill(q, k, v, registry=sim, **kw)
    assert_close(b, a, dtype, f"sim vs cpu d={d}")
