"""The new user's script: torch tensors in, torch tensors out, matching
torch.nn.functional.scaled_dot_product_attention (torch is installed into the
venv by mk/testdeps.mk). cpu runs the grid; sim a small subset."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import flashmetal as fm
from flashmetal import _interop, reference
from numerics import TOLERANCE, BF16, F16, F32

torch = pytest.importorskip("torch")
F = torch.nn.functional

NP = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}


def as_np(t):
    return _interop.to_numpy(t, "test", "t")


def check(out, q, k, v, expected_torch, *, mask=None, causal=False, q_offset=0, scale=None, what=""):
    """Against the float64 reference at the dtype's tolerance, and against
    torch's own output at twice it (both round once to the dtype)."""
    assert isinstance(out, torch.Tensor) and out.dtype == q.dtype and out.shape == q.shape, what
    dt = NP[q.dtype]
    atol, rtol = TOLERANCE[dt]
    m = None if mask is None else (as_np(mask) if mask.dtype == torch.bool else as_np(mask).astype(np.float64))
    hkv = k.shape[1]
    exp = reference.attention(as_np(q), as_np(k), as_np(v), mask=m, causal=causal, q_offset=q_offset,
                              scale=scale)
    got = out.float().numpy().astype(np.float64)
    ok, ratio = reference.close(got, exp, atol, rtol)
    assert ok, f"{what}: vs reference {ratio:.3g}x the tolerance (Hkv={hkv})"
    ok, ratio = reference.close(got, expected_torch.float().numpy().astype(np.float64), 2 * atol, 2 * rtol)
    assert ok, f"{what}: vs torch {ratio:.3g}x twice the tolerance"


def rand(shape, dtype, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [32, 64, 80, 96, 128, 256, 512])
@pytest.mark.parametrize("causal", [False, True])
def test_positional_and_keyword_match_torch(cpu, gen, dtype, d, causal):
    q = rand((2, 8, 24, d), dtype, gen)
    k, v = rand((2, 2, 40, d), dtype, gen), rand((2, 2, 40, d), dtype, gen)
    want = F.scaled_dot_product_attention(q, k, v, None, 0.0, causal, enable_gqa=True)
    pos = fm.scaled_dot_product_attention(q, k, v, None, 0.0, causal, enable_gqa=True, registry=cpu)
    kw = fm.scaled_dot_product_attention(query=q, key=k, value=v, attn_mask=None, dropout_p=0.0, is_causal=causal,
                                         scale=None, enable_gqa=True, registry=cpu)
    check(pos, q, k, v, want, causal=causal, what=f"{fm.last_route()} positional")
    assert torch.equal(pos, kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("ql,kl", [(512, 257), (33, 100)])
def test_cross_attention_lengths(cpu, gen, dtype, ql, kl):
    q, k, v = rand((1, 4, ql, 64), dtype, gen), rand((1, 4, kl, 64), dtype, gen), rand((1, 4, kl, 64), dtype, gen)
    for causal in (False, True):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out = fm.scaled_dot_product_attention(q, k, v, is_causal=causal, registry=cpu)
        check(out, q, k, v, want, causal=causal, what=f"{fm.last_route()} causal={causal}")


def hf_style_masks(b, h, ql, kl, dtype, gen):
    """The masks Hugging Face and users build: [B, 1, qL, kL] bool, expanded
    padding [B, 1, 1, kL] -> [B, H, qL, kL] (stride 0), additive float32."""
    keep = torch.rand((b, 1, ql, kl), generator=gen) < 0.7
    keep[..., 0] = True
    pad = torch.ones((b, 1, 1, kl), dtype=torch.bool)
    pad[0, ..., -3:] = False
    additive = torch.where(keep, torch.rand(keep.shape, generator=gen) - 0.5, torch.tensor(float("-inf")))
    return {"bool_b1": keep, "padding_expanded": pad.expand(b, h, ql, kl),
            "additive_same_dtype": additive.to(dtype), "additive_rank2": additive[0, 0].to(dtype)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", ["bool_b1", "padding_expanded", "additive_same_dtype", "additive_rank2"])
def test_broadcast_masks_match_torch(cpu, gen, dtype, name):
    b, h, ql, kl = 2, 4, 20, 36
    q, k, v = rand((b, h, ql, 80), dtype, gen), rand((b, h, kl, 80), dtype, gen), rand((b, h, kl, 80), dtype, gen)
    mask = hf_style_masks(b, h, ql, kl, dtype, gen)[name]
    want = F.scaled_dot_product_attention(q, k, v, mask)
    out = fm.scaled_dot_product_attention(q, k, v, mask, registry=cpu)
    check(out, q, k, v, want, mask=mask, what=f"{name} {fm.last_route()}")


def test_float32_mask_with_bf16_inputs(cpu, gen):
    """torch needs the mask in q's dtype; here any float dtype is converted once."""
    q, k, v = (rand((1, 2, 8, 64), torch.bfloat16, gen) for _ in range(3))
    m32 = torch.rand((8, 8), generator=gen) - 0.5
    want = F.scaled_dot_product_attention(q, k, v, m32.to(torch.bfloat16))
    out = fm.scaled_dot_product_attention(q, k, v, m32, registry=cpu)
    check(out, q, k, v, want, mask=m32.to(torch.bfloat16), what="f32 mask")


def test_scale_and_bottom_right(cpu, gen):
    """align='bottom_right' is torch's causal_lower_right (a KV cache)."""
    from torch.nn.attention.bias import causal_lower_right
    q, k, v = rand((1, 2, 5, 128), torch.float16, gen), rand((1, 2, 13, 128), torch.float16, gen), \
        rand((1, 2, 13, 128), torch.float16, gen)
    want = F.scaled_dot_product_attention(q, k, v, causal_lower_right(5, 13), scale=0.3)
    out = fm.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, align="bottom_right", registry=cpu)
    check(out, q, k, v, want, causal=True, q_offset=8, scale=0.3, what="bottom-right")


def test_sim_subset(gen):
    """The same comparisons on the simulator (the Metal kernels), small shapes."""
    sim = fm.Registry("sim")
    for dtype, d in ((torch.bfloat16, 64), (torch.float16, 96), (torch.float32, 80)):
        q, k, v = rand((1, 4, 9, d), dtype, gen), rand((1, 2, 17, d), dtype, gen), rand((1, 2, 17, d), dtype, gen)
        for causal in (False, True):
            want = F.scaled_dot_product_attention(q, k, v, None, 0.0, causal, enable_gqa=True)
            out = fm.scaled_dot_product_attention(q, k, v, None, 0.0, causal, enable_gqa=True, registry=sim)
            check(out, q, k, v, want, causal=causal, what=f"sim {fm.last_route()}")
    q, k, v = (rand((2, 2, 6, 64), torch.bfloat16, gen) for _ in range(3))
    mask = hf_style_masks(2, 2, 6, 6, torch.bfloat16, gen)["padding_expanded"]
    check(fm.scaled_dot_product_attention(q, k, v, mask, registry=sim), q, k, v,
          F.scaled_dot_product_attention(q, k, v, mask), mask=mask, what="sim mask")


def test_tensors_are_viewed_not_copied(cpu, gen):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        t = rand((1, 2, 4, 64), dtype, gen)
        a = as_np(t)
        assert a.__array_interface__["data"][0] == t.data_ptr() and a.dtype == NP[dtype]
    q = rand((1, 2, 4, 64), torch.bfloat16, gen)
    before = q.clone()
    out = fm.scaled_dot_product_attention(q, q, q, registry=cpu)
    assert torch.equal(q, before)
    # the result is the numpy result's memory, seen as a tensor (no copy out)
    out.view(torch.int16)[0, 0, 0, 0] = 0
    assert as_np(out)[0, 0, 0, 0] == 0


def test_numpy_in_numpy_out_and_errors(cpu, gen):
    q = rand((1, 2, 4, 64), torch.float32, gen)
    assert isinstance(fm.scaled_dot_product_attention(q.numpy(), q.numpy(), q.numpy(), registry=cpu), np.ndarray)
    with pytest.raises(TypeError, match="scale must be a float or None, got bool"):
        fm.scaled_dot_product_attention(q, q, q, scale=True, registry=cpu)
    with pytest.raises(ValueError, match="dropout_p must be 0.0"):
        fm.scaled_dot_product_attention(q, q, q, None, 0.5, registry=cpu)
    g = rand((1, 2, 4, 64), torch.float32, gen).requires_grad_()
    with pytest.raises(ValueError, match="query requires grad in grad mode"):  # no backward: never a silent cut
        fm.scaled_dot_product_attention(g, g, g, registry=cpu)
    with torch.no_grad():
        out = fm.scaled_dot_product_attention(g, g, g, registry=cpu)
    assert not out.requires_grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qs,ks,vs,gqa", [
    ((2, 4, 8, 64), (1, 4, 16, 64), (1, 4, 16, 32), False),   # one key/value batch row for every query's
    ((2, 4, 8, 64), (2, 1, 16, 64), (2, 1, 16, 64), False),   # one key/value head for every query head
    ((2, 1, 8, 64), (2, 4, 16, 64), (2, 4, 16, 64), False),   # one query head for every key head
    ((4, 8, 64), (2, 4, 16, 64), (2, 4, 16, 64), False),      # query of rank 3 beside rank 4
    ((8, 64), (16, 64), (16, 64), False),                     # rank 2: [L, E], no head axis
    ((1, 8, 1, 64), (3, 2, 16, 64), (3, 2, 16, 64), True),    # a broadcast batch with grouped-query heads
    ((3, 1, 4, 1, 64), (1, 2, 2, 16, 64), (3, 2, 2, 16, 64), True),  # rank 5, broadcast both ways
])
def test_broadcast_batch_axes_match_torch(cpu, gen, dtype, qs, ks, vs, gqa):
    """torch broadcasts the batch axes of query, key and value (all but the
    last two of a rank-2 or the last three otherwise; a head axis of 1 too):
    the drop-in gives torch's shape and values, with masks broadcast over the
    result's batch."""
    q, k, v = rand(qs, dtype, gen), rand(ks, dtype, gen), rand(vs, dtype, gen)
    atol, rtol = TOLERANCE[NP[dtype]]
    for mask, causal in ((None, False), (None, True), (torch.rand(qs[-2], ks[-2], generator=gen) > 0.3, False)):
        want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), mask, is_causal=causal,
                                              enable_gqa=gqa)
        out = fm.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, enable_gqa=gqa, registry=cpu)
        assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.shape == want.shape, (out.shape, want.shape)
        assert reference.close(out.double().numpy(), want.numpy(), 2 * atol, 2 * rtol)[0], (mask is None, causal)
    assert fm.explain(q, k, v, enable_gqa=gqa).kernel in fm.attention.ROUTES


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_more_batch_axes_match_torch(cpu, gen, dtype):
    """torch takes ``(N, ..., H, L, E)``: rank-5 query/key/value, with masks
    broadcast over the batch axes and GQA, match torch's float64 SDPA and the
    reference over the merged batch."""
    q, k, v = rand((2, 3, 4, 5, 64), dtype, gen), rand((2, 3, 2, 9, 64), dtype, gen), rand((2, 3, 2, 9, 32), dtype, gen)
    masks = [None, torch.rand(5, 9, generator=gen) > 0.3, torch.rand(2, 1, 1, 5, 9, generator=gen) > 0.3,
             rand((3, 4, 1, 9), torch.float32, gen), rand((2, 3, 4, 5, 9), dtype, gen)]
    atol, rtol = TOLERANCE[NP[dtype]]
    for mask in masks:
        for causal in ([False, True] if mask is None else [False]):
            want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), mask if mask is None or
                                                  mask.dtype == torch.bool else mask.double(), is_causal=causal,
                                                  enable_gqa=True)
            out = fm.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, enable_gqa=True, registry=cpu)
            assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.shape == want.shape
            m = None if mask is None else np.broadcast_to(as_np(mask), (2, 3, 4, 5, 9)).reshape(6, 4, 5, 9)
            m = m if m is None or m.dtype == np.bool_ else m.astype(np.float64)
            exp = reference.attention(as_np(q).reshape(6, 4, 5, 64), as_np(k).reshape(6, 2, 9, 64),
                                      as_np(v).reshape(6, 2, 9, 32), mask=m, causal=causal)
            got = out.double().numpy()
            assert reference.close(got.reshape(exp.shape), exp, atol, rtol)[0], (mask is None, causal)
            assert reference.close(got, want.numpy(), 2 * atol, 2 * rtol)[0], (mask is None, causal)
    with pytest.raises(fm.InvalidValueError, match="do not broadcast together"):
        fm.scaled_dot_product_attention(q, k[:, :2], v[:, :2], enable_gqa=True, registry=cpu)
    with pytest.raises(fm.InvalidValueError, match="does not broadcast to the batch axes") as e:
        fm.scaled_dot_product_attention(q, k, v, torch.ones(4, 4, 5, 9, dtype=torch.bool), enable_gqa=True,
                                        registry=cpu)
    assert e.value.argument == "attn_mask"


def _shape_of(draw, rank: int, lead: tuple[int, ...], heads: int, rows: int, width: int) -> tuple[int, ...]:
    """A rank-`rank` shape whose batch axes are `lead`'s last ones, each
    possibly 1 (broadcast), its head axis `heads` or 1."""
    batch = tuple(draw(st.sampled_from([d, 1])) for d in lead[len(lead) - max(rank - 3, 0):]) if rank > 3 else ()
    head = (draw(st.sampled_from([heads, 1])),) if rank >= 3 else ()
    return batch + head + (rows, width)


@st.composite
def _broadcast_calls(draw):
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    heads, ql, kl = draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 6)), draw(st.integers(1, 9))
    ranks = [draw(st.integers(2, len(lead) + 3)) for _ in range(3)]
    qs = _shape_of(draw, ranks[0], lead, heads, ql, 32)
    ks = _shape_of(draw, ranks[1], lead, heads, kl, 32)
    vs = draw(st.sampled_from([ks[:-1] + (16,), _shape_of(draw, ranks[2], lead, heads, kl, 16)]))
    mask = draw(st.sampled_from([None, (ql, kl), (1, ql, kl), (heads, ql, kl), lead + (1, ql, kl), (2, 1, ql, kl)]))
    return qs, ks, vs, mask, draw(st.booleans()) and mask is None, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=150, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(call=_broadcast_calls())
def test_broadcast_shapes_as_torch(cpu, call):
    """Random ranks and broadcast batch, head and mask axes: where torch's
    SDPA (float64) computes a result, the drop-in gives its shape and values;
    where torch refuses, the drop-in raises a ValueError naming itself."""
    qs, ks, vs, ms, causal, seed = call
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, generator=gen) for s in (qs, ks, vs))
    mask = None if ms is None else torch.rand(ms, generator=gen) > 0.3
    try:
        want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), mask, is_causal=causal)
    except RuntimeError:
        want = None
        # torch adds the mask into q k^T in place, so it also refuses a mask that broadcasts with q k^T into a
        # larger shape (more axes, or an axis v broadcasts), which the drop-in reads as broadcasting
        if mask is not None:
            try:
                scores = np.broadcast_shapes(qs[:-2], ks[:-2]) + (qs[-2], ks[-2])
                assume(np.broadcast_shapes(tuple(mask.shape), scores) == scores)
            except ValueError:
                pass
    if want is None:
        with pytest.raises(ValueError, match="^scaled_dot_product_attention: "):
            fm.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, registry=cpu)
        return
    out = fm.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, registry=cpu)
    assert out.shape == want.shape, (out.shape, want.shape)
    atol, rtol = TOLERANCE[np.dtype(np.float32)]
    assert reference.close(out.double().numpy(), want.numpy(), atol, rtol)[0]
