"""torch inputs that must not silently mislead: a CausalBias mask means the
causal alignment it names (its storage holds nothing), other tensor
subclasses whose storage is not their value are refused, and since there is
no backward, an input requiring grad in grad mode is an error on every entry
point, and a tensor requiring grad is never written in place."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import BF16, F32, assert_close

torch = pytest.importorskip("torch")
import torch.nn.attention.bias as tbias  # noqa: E402

from flashmetal.integrations import torch_op  # noqa: E402,F401


def _rand(shape, dtype=torch.float32, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant,offset", [("upper_left", 0), ("lower_right", 5)])
def test_causal_bias_means_its_alignment(registry, dtype, variant, offset):
    q, k, v = _rand((1, 2, 4, 64), dtype, 1), _rand((1, 2, 9, 64), dtype, 2), _rand((1, 2, 9, 64), dtype, 3)
    bias = getattr(tbias, f"causal_{variant}")(4, 9)
    out = fm.scaled_dot_product_attention(q, k, v, bias, registry=registry)
    as64 = lambda t: t.float().numpy()
    want = reference.attention(as64(q), as64(k), as64(v), causal=True, q_offset=offset)
    assert_close(out.float().numpy(), want, BF16 if dtype == torch.bfloat16 else F32, f"CausalBias {variant}")
    with pytest.raises(fm.InvalidValueError, match=r"^scaled_dot_product_attention: attn_mask is a CausalBias for "
                       r"\(3 queries, 9 keys\), not this call's \(4, 9\)") as e:
        fm.scaled_dot_product_attention(q, k, v, getattr(tbias, f"causal_{variant}")(3, 9), registry=registry)
    assert e.value.argument == "attn_mask"


def test_other_tensor_subclasses_are_refused(registry):
    class Lazy(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return super().__torch_function__(func, types, args, kwargs or {})

    q = _rand((1, 2, 4, 64))
    lazy = q.as_subclass(Lazy)
    with pytest.raises(fm.InvalidTypeError, match=r"^scaled_dot_product_attention: query is a Lazy, a tensor subclass"):
        fm.scaled_dot_product_attention(lazy, q, q, registry=registry)
    with pytest.raises(fm.InvalidTypeError, match=r"^sdpa: mask is a Lazy"):
        fm.sdpa(q, q, q, mask=torch.zeros(4, 4).as_subclass(Lazy), registry=registry)
    p = torch.nn.Parameter(q.clone(), requires_grad=False)  # a Parameter's storage is its value
    with torch.no_grad():
        fm.scaled_dot_product_attention(p, q, q, registry=registry)


def test_grad_mode_inputs_are_refused_on_every_entry_point(registry):
    h = lambda *s: _rand(s, torch.bfloat16)
    calls = {
        "scaled_dot_product_attention": lambda g: fm.scaled_dot_product_attention(g, h(1, 2, 4, 64), h(1, 2, 4, 64),
                                                                                  registry=registry),
        "flash_attn_prefill": lambda g: fm.flash_attn_prefill(g, h(1, 2, 4, 64), h(1, 2, 4, 64), registry=registry),
        "sdpa": lambda g: fm.sdpa(g, h(1, 2, 4, 64), h(1, 2, 4, 64), registry=registry),
        "flash_attn_func": lambda g: fm.flash_attn_func(g, h(1, 4, 2, 64), h(1, 4, 2, 64), registry=registry),
        "flash_attn_with_kvcache": lambda g: fm.flash_attn_with_kvcache(g, h(1, 4, 2, 64), h(1, 4, 2, 64),
                                                                        registry=registry),
        "flash_attn_decode": lambda g: fm.flash_attn_decode(g.float()[0, :, 0], _rand((2, 8, 64)),
                                                            _rand((2, 8, 64)), 8, registry=registry),
    }
    for op, call in calls.items():
        g = h(1, 2, 4, 64).requires_grad_()
        if op in ("flash_attn_func", "flash_attn_with_kvcache"):
            g = h(1, 4, 2, 64).requires_grad_()
        with pytest.raises(fm.InvalidValueError, match=rf"^{op}: .* requires grad in grad mode"):
            call(g)
        with torch.no_grad():
            call(g)
    g = h(1, 2, 4, 64).requires_grad_()
    with pytest.raises(fm.InvalidValueError, match="requires grad in grad mode"):
        torch.ops.flashmetal.sdpa(g, g.detach(), g.detach())


def test_grad_requiring_out_and_cache_are_not_written(registry):
    q, k = _rand((1, 2, 4, 64), torch.bfloat16), _rand((1, 2, 8, 64), torch.bfloat16)
    out = torch.zeros(1, 2, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad(), pytest.raises(fm.InvalidValueError, match=r"^flash_attn_prefill: out requires grad"):
        fm.flash_attn_prefill(q, k, k, out=out, registry=registry)
    assert not out.detach().any(), "out was written"
    kc = torch.zeros(1, 16, 1, 64, dtype=torch.bfloat16, requires_grad=True)
    new = _rand((1, 1, 1, 64), torch.bfloat16)
    with torch.no_grad(), pytest.raises(fm.InvalidValueError, match=r"^flash_attn_with_kvcache: k_cache requires grad"):
        fm.flash_attn_with_kvcache(_rand((1, 1, 2, 64), torch.bfloat16), kc, kc.detach().clone(), new, new,
                                   cache_seqlens=3, registry=registry)
    assert not kc.detach().any(), "k_cache was written"


def test_unreadable_torch_and_dlpack_inputs_are_flashmetal_errors(registry):
    """float8, sparse, lazily negated tensors and a __dlpack__ that returns no
    capsule: an InvalidTypeError naming the public function and the argument
    (before: bare TypeError / RuntimeError / ValueError from torch or numpy)."""
    class NotACapsule:
        def __dlpack__(self, **kw):
            return 42

        def __dlpack_device__(self):
            return (1, 0)

    ok = np.zeros((1, 2, 4, 64), np.float32)
    bad = {"float8": torch.zeros(1, 2, 4, 64).to(torch.float8_e4m3fn), "sparse": torch.zeros(1, 2, 4, 64).to_sparse(),
           "negative bit": torch.zeros(1, 2, 4, 64)._neg_view(), "dlpack": NotACapsule()}
    for _what, x in bad.items():
        with pytest.raises(fm.InvalidTypeError, match=r"^sdpa: q "):
            fm.sdpa(x, ok, ok, registry=registry)
        with pytest.raises(fm.InvalidTypeError, match=r"^scaled_dot_product_attention: key "):
            fm.scaled_dot_product_attention(ok, x, ok, registry=registry)
