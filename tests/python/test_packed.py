"""flash-attn 2's packed entry points (flash_attn_qkvpacked_func,
flash_attn_kvpacked_func and their varlen forms) on every backend, against
the float64 serving reference run on the unpacked tensors: every feature,
GQA through kv, the LSE / S_dmask return, numpy and torch in, the caller's
tensor untouched, and errors that name the packed function."""
from __future__ import annotations

import inspect

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import BF16, F16, randn
from serving_cases import assert_out_lse, cu, with_sinks

FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(4, 2)),
    "causal_window_softcap": dict(causal=True, window_size=(6, -1), softcap=3.0),
    "scale_sinks": dict(softmax_scale=0.3, sinks=True),
}
D = 64


def ref(kw: dict) -> dict:
    """The reference's keywords for a call's (its scale is `scale`)."""
    kw = dict(kw)
    if "softmax_scale" in kw:
        kw["scale"] = kw.pop("softmax_scale")
    return kw


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("seqlen", [9, 1])  # 1: the decode route
def test_qkvpacked(registry, rng, feature, seqlen):
    b, h = 2, 2
    qkv = randn(rng, (b, seqlen, 3, h, D), BF16)
    before = qkv.copy()
    kw = with_sinks(rng, FEATURES[feature], h)
    out, lse, probs = fm.flash_attn_qkvpacked_func(qkv, return_attn_probs=True, registry=registry, **kw)
    assert out.shape == (b, seqlen, h, D) and out.dtype == BF16 and probs.shape == (0,)
    e_out, e_lse = reference.flash_attn(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], **ref(kw))
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} qkvpacked {feature} L={seqlen}")
    np.testing.assert_array_equal(qkv.view(np.uint16), before.view(np.uint16))
    plain = fm.flash_attn_qkvpacked_func(qkv, registry=registry, **kw)
    np.testing.assert_array_equal(plain.view(np.uint16), out.view(np.uint16))


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("h,hkv", [(2, 2), (4, 1), (6, 2)])
def test_kvpacked(registry, rng, feature, h, hkv):
    """GQA and MQA through kv's own head count; more keys than queries."""
    q = randn(rng, (1, 7, h, D), F16)
    kv = randn(rng, (1, 13, 2, hkv, D), F16)
    kw = with_sinks(rng, FEATURES[feature], h)
    out, lse, _ = fm.flash_attn_kvpacked_func(q, kv, return_attn_probs=True, registry=registry, **kw)
    e_out, e_lse = reference.flash_attn(q, kv[:, :, 0], kv[:, :, 1], **ref(kw))
    assert_out_lse(out, lse, e_out, e_lse, F16, f"{registry.backend} kvpacked {feature} H={h} Hkv={hkv}")


@pytest.mark.parametrize("feature", FEATURES)
def test_varlen_qkvpacked(registry, rng, feature):
    """Ragged sequences (one of length 1, one empty) of one packed tensor."""
    lengths = [5, 1, 0, 11]
    h = 2
    qkv = randn(rng, (sum(lengths), 3, h, D), BF16)
    cs = cu(lengths)
    kw = with_sinks(rng, FEATURES[feature], h)
    out, lse, probs = fm.flash_attn_varlen_qkvpacked_func(qkv, cs, max(lengths), return_attn_probs=True,
                                                          registry=registry, **kw)
    assert out.shape == (sum(lengths), h, D) and probs.shape == (0,)
    e_out, e_lse = reference.flash_attn_varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cs, cs, **ref(kw))
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} varlen qkvpacked {feature}")


@pytest.mark.parametrize("feature", FEATURES)
def test_varlen_kvpacked(registry, rng, feature):
    """Different q and k lengths per sequence (fewer keys than queries once),
    GQA 4:2."""
    ql, kl = [3, 8, 1], [10, 4, 6]
    h, hkv = 4, 2
    q = randn(rng, (sum(ql), h, D), F16)
    kv = randn(rng, (sum(kl), 2, hkv, D), F16)
    cq, ck = cu(ql), cu(kl)
    kw = with_sinks(rng, FEATURES[feature], h)
    out, lse, _ = fm.flash_attn_varlen_kvpacked_func(q, kv, cq, ck, max(ql), max(kl), return_attn_probs=True,
                                                     registry=registry, **kw)
    e_out, e_lse = reference.flash_attn_varlen(q, kv[:, 0], kv[:, 1], cq, ck, **ref(kw))
    assert_out_lse(out, lse, e_out, e_lse, F16, f"{registry.backend} varlen kvpacked {feature}")


def test_results_match_the_unpacked_functions_bit_for_bit(registry, rng):
    """A packed call is the unpacked call on the same tensors."""
    qkv = randn(rng, (1, 9, 3, 2, D), BF16)
    q, k, v = (np.ascontiguousarray(qkv[:, :, i]) for i in range(3))
    a = fm.flash_attn_qkvpacked_func(qkv, causal=True, registry=registry)
    b = fm.flash_attn_func(q, k, v, causal=True, registry=registry)
    np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    kv = np.ascontiguousarray(qkv[:, :, 1:])
    c = fm.flash_attn_kvpacked_func(q, kv, causal=True, registry=registry)
    np.testing.assert_array_equal(c.view(np.uint16), b.view(np.uint16))
    cs = cu([4, 5])
    flat = qkv[0]
    d = fm.flash_attn_varlen_qkvpacked_func(flat, cs, 5, causal=True, registry=registry)
    e = fm.flash_attn_varlen_func(*(np.ascontiguousarray(flat[:, i]) for i in range(3)), cs, cs, 5, 5,
                                  causal=True, registry=registry)
    np.testing.assert_array_equal(d.view(np.uint16), e.view(np.uint16))


def test_return_values_without_probs(registry, rng):
    """return_attn_probs=False: the output alone (flash-attn's)."""
    qkv = randn(rng, (1, 4, 3, 2, D), F16)
    out = fm.flash_attn_qkvpacked_func(qkv, registry=registry)
    assert isinstance(out, np.ndarray) and out.shape == (1, 4, 2, D)
    out = fm.flash_attn_varlen_kvpacked_func(qkv[0, :, 0], qkv[0, :, 1:], cu([4]), cu([4]), 4, 4, registry=registry)
    assert isinstance(out, np.ndarray) and out.shape == (4, 2, D)


def test_torch_in_torch_out(registry, rng):
    torch = pytest.importorskip("torch")
    qkv_np = randn(rng, (1, 6, 3, 2, D), BF16)
    qkv = torch.from_numpy(qkv_np.view(np.int16)).view(torch.bfloat16)
    out, lse, probs = fm.flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True, registry=registry)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and isinstance(lse, torch.Tensor)
    assert isinstance(probs, torch.Tensor)
    e_out, e_lse = reference.flash_attn(qkv_np[:, :, 0], qkv_np[:, :, 1], qkv_np[:, :, 2], causal=True)
    assert_out_lse(out.view(torch.int16).numpy().view(BF16), lse.numpy(), e_out, e_lse, BF16,
                   f"{registry.backend} torch qkvpacked")
    flat = qkv[0]
    cs = torch.tensor([0, 2, 6], dtype=torch.int32)
    out = fm.flash_attn_varlen_qkvpacked_func(flat, cs, 4, registry=registry)
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (6, 2, D)
    q = flat[:, 0]
    out = fm.flash_attn_varlen_kvpacked_func(q, flat[:, 1:], cs, cs, 4, 4, registry=registry)
    assert isinstance(out, torch.Tensor)
    out = fm.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], registry=registry)
    assert isinstance(out, torch.Tensor)
    e_out, _ = reference.flash_attn(qkv_np[:, :, 0], qkv_np[:, :, 1], qkv_np[:, :, 2])
    assert_out_lse(out.view(torch.int16).numpy().view(BF16), None, e_out, None, BF16, "torch kvpacked")


def test_signatures_are_flash_attns():
    """Positional order and defaults of flash-attn 2's interface, then our
    keyword-only extras."""
    common = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
              ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
    required = {
        fm.flash_attn_qkvpacked_func: ["qkv"],
        fm.flash_attn_kvpacked_func: ["q", "kv"],
        fm.flash_attn_varlen_qkvpacked_func: ["qkv", "cu_seqlens", "max_seqlen"],
        fm.flash_attn_varlen_kvpacked_func: ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                             "max_seqlen_k"],
    }
    for fn, names in required.items():
        params = list(inspect.signature(fn).parameters.values())
        positional = [p for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert [p.name for p in positional] == names + [n for n, _ in common], fn.__name__
        assert [p.default for p in positional[len(names):]] == [d for _, d in common], fn.__name__
        assert all(p.default is inspect.Parameter.empty for p in positional[:len(names)]), fn.__name__
        assert [p.name for p in params if p.kind is p.KEYWORD_ONLY] == ["sinks", "attention_chunk", "registry"], fn.__name__
        assert fn.__name__ in fm.__all__


ERRORS = [
    # (function, args, exception, words the message must hold)
    ("flash_attn_qkvpacked_func", lambda a: (a["qkv"][:, :, :2],), ValueError, ["qkv", "dim 2", "3", "got 2"]),
    ("flash_attn_qkvpacked_func", lambda a: (a["qkv"][0],), ValueError, ["qkv", "rank 5", "(4, 3, 2, 64)"]),
    ("flash_attn_kvpacked_func", lambda a: (a["q"], a["qkv"]), ValueError, ["kv", "dim 2", "got 3"]),
    ("flash_attn_varlen_qkvpacked_func", lambda a: (a["qkv"][0, :, :2], cu([4]), 4), ValueError,
     ["qkv", "dim 1", "got 2"]),
    ("flash_attn_varlen_kvpacked_func", lambda a: (a["q"][0], a["qkv"][0], cu([4]), cu([4]), 4, 4), ValueError,
     ["kv", "dim 1", "got 3"]),
    # errors of the unpacked function, in its words, with what its argument is here
    ("flash_attn_kvpacked_func", lambda a: (a["q"], a["kv"].astype(F16)), TypeError, ["kv[:, :, 0]", "float16"]),
    ("flash_attn_qkvpacked_func", lambda a: (a["qkv"].astype(np.int32),), TypeError, ["qkv[:, :, 0]", "int32"]),
    ("flash_attn_kvpacked_func", lambda a: (a["q"], a["kv"][:, :, :, :1].repeat(3, axis=3)), ValueError,
     ["k heads (3)"]),
    ("flash_attn_varlen_qkvpacked_func", lambda a: (a["qkv"][0], np.array([0, 9], np.int32), 9), ValueError,
     ["cu_seqlens_q[1] = 9", "(cu_seqlens_q is cu_seqlens)"]),
    ("flash_attn_varlen_kvpacked_func", lambda a: (a["q"][0], a["kv"][0], cu([4]), cu([4]), 4, -1), ValueError,
     ["max_seqlen_k"]),
]


@pytest.mark.parametrize("case", range(len(ERRORS)))
def test_errors_name_the_packed_function(case, rng):
    name, args, exc, words = ERRORS[case]
    arrays = {"qkv": randn(rng, (1, 4, 3, 2, D), BF16), "q": randn(rng, (1, 4, 2, D), BF16),
              "kv": randn(rng, (1, 4, 2, 2, D), BF16)}
    with pytest.raises(exc) as info:
        getattr(fm, name)(*args(arrays), registry="cpu")
    assert isinstance(info.value, fm.Error) and info.value.op == name, info.value
    text = str(info.value)
    assert text.startswith(f"{name}: "), text
    for w in words:
        assert w in text, (w, text)
    assert "flash_attn_func" not in text and "flash_attn_varlen_func" not in text, text


def test_unsupported_features_name_the_packed_function(rng):
    qkv = randn(rng, (1, 4, 3, 2, D), BF16)
    with pytest.raises(TypeError, match=r"^flash_attn_qkvpacked_func: alibi_slopes must be float32"):
        fm.flash_attn_qkvpacked_func(qkv, alibi_slopes=np.ones(2, np.float64), registry="cpu")
    with pytest.raises(ValueError, match=r"^flash_attn_varlen_kvpacked_func: dropout_p"):
        fm.flash_attn_varlen_kvpacked_func(qkv[0, :, 0], qkv[0, :, 1:], cu([4]), cu([4]), 4, 4, 0.1,
                                           registry="cpu")


@pytest.mark.parametrize("name,args,argument", [
    ("flash_attn_kvpacked_func", lambda a: (a["q"], a["kv"].astype(F16)), "kv[:, :, 0]"),
    ("flash_attn_qkvpacked_func", lambda a: (a["qkv"].astype(np.int32),), "qkv[:, :, 0]"),
    ("flash_attn_varlen_qkvpacked_func", lambda a: (a["qkv"][0], np.array([0, 9], np.int32), 9), "cu_seqlens"),
    ("flash_attn_varlen_kvpacked_func", lambda a: (a["q"][0], a["kv"][0], cu([4]), cu([4]), 4, -1), "max_seqlen_k"),
])
def test_error_argument_names_the_packed_argument(rng, name, args, argument):
    """The error's argument field is the packed function's own argument."""
    arrays = {"qkv": randn(rng, (1, 4, 3, 2, D), BF16), "q": randn(rng, (1, 4, 2, D), BF16),
              "kv": randn(rng, (1, 4, 2, 2, D), BF16)}
    with pytest.raises(fm.Error) as info:
        getattr(fm, name)(*args(arrays), registry="cpu")
    assert info.value.op == name and info.value.argument == argument, (info.value, info.value.argument)
