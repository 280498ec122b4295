"""flashmetal.integrations.mlx against the float64 reference and against
``mx.fast.scaled_dot_product_attention`` (MLX's CPU build), on every backend:
MLX's own SDPA test cases (python/tests/test_fast_sdpa.py of ml-explore/mlx,
the ones that apply to a forward pass), bfloat16, sinks beside every kind of
mask, the errors, and mlx-lm generating the same greedy tokens with and
without ``patch()``."""
from __future__ import annotations

import math
import sys
from itertools import product

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="MLX is not installed (python/requirements-test.txt installs mlx[cpu])")

import flashmetal  # noqa: E402
from conftest import SIMULATED  # noqa: E402
from flashmetal import reference  # noqa: E402
from flashmetal.integrations import mlx as fmx  # noqa: E402

# (atol, rtol) against the float64 reference, per output dtype (as the other suites).
REF_TOL = {"float32": (1e-5, 1e-4), "float16": (1e-3, 5e-3), "bfloat16": (5e-3, 2e-2)}
# Against mx.fast, which rounds q*scale and the scores to the I/O dtype: MLX's own tolerances.
FAST_TOL = {"float32": (1e-4, 1e-4), "float16": (3e-3, 1e-2), "bfloat16": (3e-2, 3e-2)}


def _name(dt) -> str:
    return str(dt).rsplit(".", 1)[-1]


def f64(a) -> np.ndarray:
    return np.array(a.astype(mx.float32) if a.dtype != mx.bool_ else a).astype(
        np.float64 if a.dtype != mx.bool_ else np.bool_)


def ref_attention(q, k, v, scale, mask=None, sinks=None) -> np.ndarray:
    """float64 from the definition: flashmetal.reference, and for sinks one
    more logit per head in every row's softmax, without a value."""
    qn, kn, vn = f64(q), f64(k), f64(v)
    B, H, qL, D = qn.shape
    kL = kn.shape[2]
    causal = isinstance(mask, str)
    m = None if mask is None or causal else f64(mask)
    if sinks is None:
        return reference.attention(qn, kn, vn, scale=scale, mask=m, causal=causal, q_offset=kL - qL)
    g = H // kn.shape[1]
    s = scale * (qn @ np.repeat(kn, g, axis=1).swapaxes(-1, -2))
    vis = np.ones((qL, kL), bool)
    if causal:
        vis = reference.visible(qL, kL, causal=True, q_offset=kL - qL)
    if m is not None:
        s = s + (np.where(m, 0.0, -np.inf) if m.dtype == np.bool_ else m)
    s = np.where(vis, s, -np.inf)
    sink = f64(sinks.astype(q.dtype))[None, :, None, None] * np.ones((B, H, qL, 1))
    top = np.maximum(s.max(axis=-1, keepdims=True), sink)
    p = np.exp(s - top)
    den = p.sum(axis=-1, keepdims=True) + np.exp(sink - top)
    return (p / den) @ np.repeat(vn, g, axis=1)


def check(registry, q, k, v, scale, mask=None, sinks=None, fast=True):
    out = fmx.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks, registry=registry)
    final = mx.result_type(q, k, v)
    assert isinstance(out, mx.array) and out.dtype == final and out.shape == q.shape
    got = f64(out)
    exp = ref_attention(q, k, v, scale, mask, sinks)
    ok, ratio = reference.close(got, exp, *REF_TOL[_name(final)])
    assert ok, f"err/tol {ratio:.2f} against the float64 reference"
    if fast:
        want = f64(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks))
        atol, rtol = FAST_TOL[_name(final)]
        assert np.allclose(got, want, atol=atol, rtol=rtol), float(np.max(np.abs(got - want)))
    return out


def on_sim(registry) -> bool:
    """The simulator costs ~11 ns per multiply-add and more per tile: MLX's long
    cases run shorter there (the same code paths, fewer keys)."""
    return registry.backend in SIMULATED


def normal(shape, dtype=mx.float32, s=1.0):
    return (s * mx.random.normal(shape=shape)).astype(dtype)


# ---- MLX's test_fast_sdpa.py cases --------------------------------------------------------------------

def vector_masks(Nq, L, causal=True):
    masks = [
        None,
        mx.array(True),
        mx.array([True] * (L - 10) + [False] * 10),
        mx.random.uniform(shape=(Nq, 1, L)) > 0.2,
        mx.random.uniform(shape=(L, 1, Nq)).T > 0.2,
        mx.random.uniform(shape=(Nq, 1, L)),
        mx.random.uniform(shape=(L, 1, Nq)).T,
        mx.log(mx.random.uniform(shape=(Nq, 1, L)) > 0.2),
        mx.log(mx.random.uniform(shape=(L, 1, Nq)).T > 0.2),
    ]
    return masks + (["causal"] if causal else [])


@pytest.mark.parametrize("L", [43, 4096])
def test_sdpa_vector(registry, L):
    L = min(L, 1024) if on_sim(registry) else L
    D, Nq, Nkv = 64, 4, 1
    mx.random.seed(0)
    q = normal((1, Nq, 1, D), s=0.5)
    k = normal((1, Nkv, L, D), s=0.5)
    v = normal((1, Nkv, L, D), s=0.5)
    with pytest.raises(ValueError, match="does not broadcast"):
        fmx.scaled_dot_product_attention(q, k, v, scale=1.0, mask=mx.full((Nq, 2, L), False), registry=registry)
    for m in vector_masks(Nq, L):
        check(registry, q, k, v, 1.0, m)


@pytest.mark.parametrize("L", [43, 4096])
def test_sdpa_vector_kv_transposed_head_seq(registry, L):
    L = min(L, 1024) if on_sim(registry) else L
    D, Nq, Nkv = 64, 4, 1
    mx.random.seed(0)
    q = normal((1, Nq, 1, D), s=0.5)
    k = normal((1, L, Nkv, D), s=0.5).swapaxes(1, 2)
    v = normal((1, L, Nkv, D), s=0.5).swapaxes(1, 2)
    for m in vector_masks(Nq, L, causal=False)[1:5]:
        check(registry, q, k, v, 1.0, m)


@pytest.mark.parametrize("L", [43, 4096])
def test_sdpa_few_query(registry, L):
    L = min(L, 300) if on_sim(registry) else L
    D, Lq, Nq, Nkv = 64, 8, 8, 1
    mx.random.seed(0)
    q = normal((1, Lq, Nq, D), s=0.5).swapaxes(1, 2)
    k = normal((1, Nkv, L, D), s=0.5)
    v = normal((1, Nkv, L, D), s=0.5)
    masks = [None, mx.array(True), mx.array([True] * (L - 10) + [False] * 10),
             mx.random.uniform(shape=(Nq, 1, L)) > 0.2, mx.random.uniform(shape=(L, 1, Nq)).T > 0.2, "causal"]
    for m in masks:
        check(registry, q, k, v, 1.0, m)


@pytest.mark.parametrize("Nq,Nkv,D,L", [(32, 4, 128, 8192), (64, 8, 64, 8201)])
def test_sdpa_vector_gqa_long(registry, Nq, Nkv, D, L):
    L = L - 6144 if on_sim(registry) else L  # 2048 and 2057 keys
    mx.random.seed(0)
    q = normal((1, Nq, 1, D), s=0.5)
    k = normal((1, Nkv, L + 32, D), s=0.5)[:, :, :L]
    v = normal((1, Nkv, L + 32, D), s=0.5)[:, :, :L]
    check(registry, q, k, v, 1.0)


def test_sdpa_fully_masked(registry):
    """MLX asks for no NaN; a row that sees no key is zeros here (MLX leaves it undefined)."""
    for Lq in (1, 8, 32):
        q, k, v = normal((1, 4, Lq, 128)), normal((1, 4, 8, 128)), normal((1, 4, 8, 128))
        out = np.array(fmx.scaled_dot_product_attention(q, k, v, mask=mx.array(False), scale=1, registry=registry))
        assert np.array_equal(out, np.zeros_like(out))


def test_sdpa_inf_score(registry):
    for D, Lq in product((4, 128), (1, 8)):
        q, k = mx.ones((1, 4, Lq, D)), mx.ones((1, 4, 8, D))
        v = normal((1, 4, 8, D))
        k[..., 0, :] = -float("inf")
        check(registry, q, k, v, 1.0)


def test_sdpa_vector_batched(registry):
    D = 64
    q, k, v = normal((2, 1, 3, D)), normal((2, 1, 3, D)), normal((2, 1, 3, D))
    check(registry, q, k, v, 1.0)
    q = normal((2, 4, 3, D))
    check(registry, q, k, v, 1.0)
    q = normal((2, 3, 4, D)).swapaxes(1, 2)
    check(registry, q, k, v, 1.0)
    k = normal((2, 3, 1, D)).swapaxes(1, 2)
    check(registry, q, k, v, 1.0)
    q, k, v = normal((2, 4, 3, D)), normal((2, 3, 2, D)).swapaxes(1, 2), normal((2, 2, 3, D))
    check(registry, q, k, v, 1.0)
    q, k, v = normal((2, 4, 3, D)), normal((2, 1, 3, D)), normal((2, 1, 3, D))
    check(registry, q, k, v, 1.0, 10 * normal((1, 2, 3, 3)).swapaxes(0, 1))


def test_sdpa_broadcast_and_promoted_masks(registry):
    D, Nq, Nkv, L = 64, 4, 1, 256
    mx.random.seed(0)
    q, k, v = normal((1, Nq, L, D), s=0.5), normal((1, Nkv, L, D), s=0.5), normal((1, Nkv, L, D), s=0.5)
    check(registry, q, k, v, 1.0, mx.array(True))
    check(registry, q, k, v, 1.0, mx.array(2.0, mx.bfloat16))  # a bfloat16 mask promotes to float32


def test_sdpa_noncontiguous_inputs(registry):
    mask = mx.ones(shape=(4, 1, 7, 7), dtype=mx.bool_)
    mx.random.seed(0)
    q = normal((4, 7, 32, 64)).swapaxes(1, 2)
    k = normal((4, 7, 8, 64)).swapaxes(1, 2)
    v = normal((4, 7, 8, 64)).swapaxes(1, 2)
    check(registry, q, k, v, 1.0, mask)


def test_sdpa_nan_bug(registry):
    N = 128
    q, k, v = (mx.random.uniform(shape=(1, 1, N, 128)) for _ in range(3))
    lin, rin = mx.arange(N)[:, None], mx.arange(N)[None]
    mask = (lin >= rin) & (lin <= rin + 111)
    check(registry, q, k, v, 1.0, mask)
    check(registry, q, k, v, 1.0, mx.log(mask))


@pytest.mark.parametrize("D", [72, 96])
def test_sdpa_head_dims_72_96(registry, D):
    B, qH, kH = 1, 8, 2
    lengths = ((17, 41),) if on_sim(registry) else ((64, 128), (65, 127))  # partial tiles either way
    for (qL, kL), dtype, mask in product(lengths, (mx.float16, mx.bfloat16, mx.float32),
                                         (None, "additive", "bool", "causal")):
        mx.random.seed(0)
        scale = 1.0 / math.sqrt(D)
        q = mx.random.uniform(0.0, 0.5, (B, qH, qL, D), dtype)
        k = mx.random.uniform(0.0, 0.5, (B, kH, kL, D), dtype)
        v = mx.random.uniform(0.0, scale, (B, kH, kL, D), dtype)
        m = {"additive": mx.random.uniform(0.0, 0.5, (B, qH, qL, kL), dtype),
             "bool": mx.random.uniform(0.0, 1.0, (B, qH, qL, kL)) < 0.5}.get(mask, mask)
        check(registry, q, k, v, scale, m)


@pytest.mark.parametrize("transpose", [False, True])
def test_sdpa_shapes(registry, transpose):
    """test_sdpa's shapes (MLX runs them on its GPU only), float16, every mask kind."""
    shapes = [(1, 20, 20, 64, 3, 3), (1, 64, 128, 64, 8, 8), (1, 65, 128, 64, 8, 2), (1, 65, 127, 128, 8, 2),
              (1, 127, 65, 128, 8, 2), (1, 1, 67, 128, 8, 8), (1, 1, 129, 128, 8, 2)]
    if on_sim(registry):
        shapes = [(1, 20, 20, 64, 3, 3), (1, 33, 65, 128, 4, 2), (1, 65, 33, 128, 4, 2), (1, 1, 129, 128, 8, 2)]
    for (B, qL, kL, D, qH, kH), mask in product(shapes, (None, "additive", "bool", "causal")):
        mx.random.seed(0)
        scale = 1.0 / math.sqrt(D)
        sq, skv = ((B, qL, qH, D), (B, kL, kH, D)) if transpose else ((B, qH, qL, D), (B, kH, kL, D))
        q = mx.random.uniform(0.0, 0.5, sq, mx.float16)
        k = mx.random.uniform(0.0, 0.5, skv, mx.float16)
        v = mx.random.uniform(0.0, scale, skv, mx.float16)
        if transpose:
            q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
        m = {"additive": mx.random.uniform(0.0, 0.5, (B, qH, qL, kL), mx.float16),
             "bool": mx.random.uniform(0.0, 1.0, (B, qH, qL, kL)) < 0.5}.get(mask, mask)
        # Causal rows before key 0 (qL > kL) are undefined in MLX: checked against the reference only.
        check(registry, q, k, v, scale, m, fast=not (mask == "causal" and qL > kL))


def test_sdpa_attention_sinks(registry):
    B, N_q, D = 2, 8, 64
    scale = D ** -0.5
    q = normal((B, N_q, 128, D))
    k = v = normal((B, N_q, 128, D))
    with pytest.raises(flashmetal.InvalidTypeError, match="sinks dtype float32 must promote"):
        fmx.scaled_dot_product_attention(q.astype(mx.float16), k.astype(mx.float16), v.astype(mx.float16),
                                         scale=scale, sinks=normal((N_q,)), registry=registry)
    for shape in ((N_q + 1,), ()):
        with pytest.raises(flashmetal.InvalidValueError, match="sinks has shape"):
            fmx.scaled_dot_product_attention(q, k, v, scale=scale, sinks=normal(shape), registry=registry)
    T_qs, T_kvs = ((1, 24), (40, 200)) if on_sim(registry) else ((1, 128), (128, 1024))
    for T_q, T_kv, N_kv, dtype in product(T_qs, T_kvs, (2, 8), (mx.float16, mx.float32)):
        q = normal((B, N_q, T_q, D), dtype)
        k = normal((B, N_kv, T_kv, D), dtype)
        v = normal((B, N_kv, T_kv, D), dtype)
        check(registry, q, k, v, scale, sinks=10 * normal((N_q,), dtype))


@pytest.mark.parametrize("B,T_q,offset,mask", list(product((1, 3), (1, 8), (8, 9, 79), (None, "causal"))))
def test_sdpa_sliced(registry, B, T_q, offset, mask):
    N, D = 8, 64
    q = normal((B, N, T_q, D), mx.float16)
    k = normal((B, N, 256, D), mx.float16)[..., :offset, :]
    v = normal((B, N, 256, D), mx.float16)[..., :offset, :]
    for _ in range(2):
        check(registry, q, k, v, D ** -0.5, mask)


# ---- beyond MLX's suite ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("mask", [None, "causal", "bool", "additive", "window"])
@pytest.mark.parametrize("qL,kL", [(1, 37), (5, 37), (37, 37)])
def test_sinks_beside_every_mask(registry, dtype, mask, qL, kL):
    B, H, Hkv, D = 2, 4, 2, 64
    mx.random.seed(qL + kL)
    q, k, v = normal((B, H, qL, D), dtype), normal((B, Hkv, kL, D), dtype), normal((B, Hkv, kL, D), dtype)
    rows, cols = mx.arange(kL - qL, kL)[:, None], mx.arange(kL)[None]
    m = {"bool": mx.random.uniform(shape=(B, 1, qL, kL)) > 0.3,
         "additive": normal((1, H, 1, kL), dtype),
         "window": (rows >= cols) & (rows < cols + 6)}.get(mask, mask)
    check(registry, q, k, v, D ** -0.5, m, sinks=3 * normal((H,), dtype))


def test_bfloat16_in_and_out_and_inputs_untouched(registry):
    """MLX's DLPack refuses bfloat16; the integration reads its bits and returns bfloat16."""
    q, k, v = normal((1, 4, 9, 128), mx.bfloat16), normal((1, 2, 30, 128), mx.bfloat16), \
        normal((1, 2, 30, 128), mx.bfloat16)
    before = [np.array(x.view(mx.uint16)) for x in (q, k, v)]
    out = check(registry, q, k, v, 128 ** -0.5, "causal", sinks=normal((4,), mx.bfloat16))
    assert out.dtype == mx.bfloat16
    for x, b in zip((q, k, v), before):
        assert np.array_equal(np.array(x.view(mx.uint16)), b)


def test_mixed_dtypes_promote_as_mlx(registry):
    q = normal((1, 2, 4, 64), mx.bfloat16)
    k, v = normal((1, 2, 6, 64), mx.float16), normal((1, 2, 6, 64), mx.float16)
    out = check(registry, q, k, v, 0.125)
    assert out.dtype == mx.float32 == mx.result_type(q, k, v)


def test_causal_is_bottom_right(registry):
    """qL < kL: MLX's "causal" puts the queries at the newest positions (torch's is_causal does not)."""
    q, k, v = normal((1, 2, 3, 64)), normal((1, 2, 10, 64)), normal((1, 2, 10, 64))
    out = f64(check(registry, q, k, v, 0.125, "causal"))
    top_left = reference.attention(f64(q), f64(k), f64(v), scale=0.125, causal=True, q_offset=0)
    assert not reference.close(out, top_left, *REF_TOL["float32"])[0]


def test_errors_name_the_function_and_argument(registry):
    q, k, v = normal((1, 4, 3, 64)), normal((1, 2, 5, 64)), normal((1, 2, 5, 64))
    call = fmx.scaled_dot_product_attention
    with pytest.raises(flashmetal.InvalidValueError, match=r"mlx.scaled_dot_product_attention: q has shape \(4, 3, 64\)"):
        call(q[0], k, v, scale=1.0, registry=registry)
    with pytest.raises(flashmetal.InvalidValueError, match=r"N_q \(4\) must be a multiple of N_kv \(3\)"):
        call(q, normal((1, 3, 5, 64)), normal((1, 3, 5, 64)), scale=1.0, registry=registry)
    with pytest.raises(flashmetal.InvalidValueError, match="head dim 64 must equal k's \\(32\\)"):
        call(q, normal((1, 2, 5, 32)), normal((1, 2, 5, 32)), scale=1.0, registry=registry)
    with pytest.raises(flashmetal.InvalidValueError, match="mask must be None, 'causal' or an array, got 'upper'"):
        call(q, k, v, scale=1.0, mask="upper", registry=registry)
    with pytest.raises(flashmetal.InvalidValueError, match="rank <= 4"):
        call(q, k, v, scale=1.0, mask=mx.ones((1, 1, 1, 3, 5), mx.bool_), registry=registry)
    with pytest.raises(flashmetal.InvalidTypeError, match="mask dtype float32 must be bool or promote"):
        call(q.astype(mx.float16), k.astype(mx.float16), v.astype(mx.float16), scale=1.0,
             mask=mx.zeros((3, 5)), registry=registry)
    with pytest.raises(flashmetal.InvalidTypeError, match="promote to float64; flashmetal takes float32"):
        call(q.astype(mx.float64), k, v, scale=1.0, registry=registry)
    with pytest.raises(flashmetal.InvalidTypeError, match="k must be an mlx.core.array, got ndarray"):
        call(q, np.zeros((1, 2, 5, 64), np.float32), v, scale=1.0, registry=registry)
    with pytest.raises(flashmetal.InvalidTypeError, match="scale must be a float, got NoneType"):
        call(q, k, v, scale=None, registry=registry)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(flashmetal.InvalidValueError, match="scale must be finite") as e:
            call(q, k, v, scale=bad, registry=registry)
        assert e.value.op == "mlx.scaled_dot_product_attention" and e.value.argument == "scale"


# ---- mlx-lm ---------------------------------------------------------------------------------------------

needs_mlx_lm = pytest.mark.skipif(sys.version_info < (3, 11), reason="mlx-lm needs Python >= 3.11")

# The sliding-window layer first: the last layer's attention over the prompt feeds
# nothing the next tokens read (only its last row and its K/V inputs do), so a
# mask error there would pass unseen. Checked: dropping the masks, or scaling
# the scores by 1.2, changes these models' tokens or log-probs beyond the bounds.
LLAMA = dict(model_type="llama", hidden_size=256, num_hidden_layers=2, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97, tie_word_embeddings=False,
             layer_types=["sliding_attention", "full_attention"], sliding_window=6)
GPT_OSS = dict(model_type="gpt_oss", num_hidden_layers=2, num_local_experts=2, num_experts_per_tok=1, vocab_size=97,
               hidden_size=128, intermediate_size=128, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
               sliding_window=6, layer_types=["sliding_attention", "full_attention"])


def tiny_model(config: dict, dtype):
    """A random-weight mlx-lm model built from a config dict (offline)."""
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(7)
    model = module.Model(module.ModelArgs.from_dict(config))
    for layer in model.layers:  # gpt-oss: non-zero sinks, so they matter
        attn = getattr(layer, "self_attn", None)
        if attn is not None and hasattr(attn, "sinks"):
            attn.sinks = 2 * mx.random.normal(attn.sinks.shape)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def greedy(model, prompt, n):
    """The greedy tokens and each step's log-probabilities (float32 numpy)."""
    from mlx_lm.generate import generate_step

    steps = [(int(t), np.array(lp.astype(mx.float32))) for t, lp in generate_step(mx.array(prompt), model,
                                                                                 max_tokens=n)]
    return [t for t, _ in steps], np.stack([lp for _, lp in steps])


@needs_mlx_lm
# gpt-oss in float32: MLX's CPU build runs its experts' GatherMM in float32 only.
@pytest.mark.parametrize("config,dtype", [(LLAMA, mx.bfloat16), (GPT_OSS, mx.float32)], ids=["llama", "gpt_oss"])
def test_mlx_lm_same_greedy_tokens_with_patch(registry, config, dtype, monkeypatch):
    import mlx_lm.models.base as base

    model = tiny_model(config, dtype)
    prompt = [int(x) for x in np.random.default_rng(3).integers(0, config["vocab_size"], 11)]
    want, want_logprobs = greedy(model, prompt, 10)
    assert len(set(want)) >= 3, want  # a model that repeats one token would hide attention errors
    calls = []
    real = fmx.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(kwargs.get("mask") if not isinstance(kwargs.get("mask"), mx.array) else "array")
        return real(*args, **kwargs)

    monkeypatch.setattr(fmx, "scaled_dot_product_attention", counting)
    original = base.scaled_dot_product_attention
    fmx.patch(registry=registry)
    try:
        assert fmx.is_patched() and base.scaled_dot_product_attention is not original
        got, got_logprobs = greedy(model, prompt, 10)
    finally:
        fmx.unpatch()
    assert base.scaled_dot_product_attention is original and not fmx.is_patched()
    layers = config["num_hidden_layers"]
    assert len(calls) >= layers * 10 and len(calls) % layers == 0, calls  # the prompt, then each step, every layer
    assert "causal" in calls and "array" in calls and None in calls  # full, sliding-window and decode masks
    assert got == want
    # bfloat16: the attention output's rounding moves log-probs by a few 1e-2 (measured 0.03); float32 1e-6.
    atol = 0.1 if dtype == mx.bfloat16 else 1e-4
    assert np.max(np.abs(got_logprobs - want_logprobs)) <= atol


@needs_mlx_lm
def test_kv_cache_buffers_read_in_place(registry, monkeypatch):
    """k and v from mlx-lm's KVCache are strided prefixes of its buffers: with
    cache= the buffers themselves are read (kv_len = the prefix), not a copy."""
    from mlx_lm.models.cache import KVCache

    passed = []
    real = fmx._front_door

    def spy(q, k, v, **kwargs):
        passed.append((k, v, kwargs["kv_len"]))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(fmx, "_front_door", spy)
    cache = KVCache()
    for step, mask in ((9, "causal"), (1, None), (1, None), (3, "causal")):
        keys, values = cache.update_and_fetch(normal((1, 2, step, 64), mx.bfloat16),
                                              normal((1, 2, step, 64), mx.bfloat16))
        q = normal((1, 4, step, 64), mx.bfloat16)
        out = fmx.scaled_dot_product_attention(q, keys, values, scale=0.125, mask=mask, cache=cache,
                                               registry=registry)
        ok, ratio = reference.close(f64(out), ref_attention(q, keys, values, 0.125, mask), *REF_TOL["bfloat16"])
        assert ok, ratio
        k_in, v_in, kv_len = passed[-1]
        assert kv_len == keys.shape[2] and k_in.shape == tuple(cache.keys.shape) and k_in.shape[2] > kv_len
        assert np.shares_memory(k_in, np.asarray(cache.keys.view(mx.uint16)))
        assert np.shares_memory(v_in, np.asarray(cache.values.view(mx.uint16)))
    other = KVCache()  # k and v not from this cache: read as given
    fmx.scaled_dot_product_attention(q, keys, values, scale=0.125, cache=other, registry=registry)
    assert passed[-1][2] is None


@needs_mlx_lm
def test_patch_reaches_modules_imported_before_and_after():
    import importlib

    import mlx_lm.models.base as base
    import mlx_lm.models.llama as llama

    original = base.scaled_dot_product_attention
    fmx.patch()
    try:
        assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention is not original
        qwen2 = importlib.import_module("mlx_lm.models.qwen2")
        assert qwen2.scaled_dot_product_attention is base.scaled_dot_product_attention
        fmx.patch()  # again: still one patch, unpatch restores mlx-lm's
    finally:
        fmx.unpatch()
    assert llama.scaled_dot_product_attention is original and qwen2.scaled_dot_product_attention is original


def test_dtype_errors_are_the_value_errors_mlx_raises(registry):
    """mx.fast raises ValueError for a mask or sinks dtype that does not promote
    to the output's and for q/k/v of an unsupported type; so does this
    function (still a TypeError too, as flashmetal's dtype errors are)."""
    q, k, v = (normal((1, 2, 3, 64), mx.float16) for _ in range(3))
    cases = [("mask", dict(mask=mx.zeros((3, 3), mx.float32))), ("sinks", dict(sinks=mx.zeros((2,), mx.float32)))]
    for argument, kw in cases:
        with pytest.raises(ValueError):
            mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, **kw)
        with pytest.raises(ValueError, match=f"{argument} dtype float32 must") as e:
            fmx.scaled_dot_product_attention(q, k, v, scale=1.0, registry=registry, **kw)
        assert isinstance(e.value, TypeError) and e.value.argument == argument
    ints = mx.zeros((1, 2, 3, 64), mx.int32)
    with pytest.raises(ValueError):
        mx.fast.scaled_dot_product_attention(ints, ints, ints, scale=1.0)
    with pytest.raises(ValueError, match="promote to int32") as e:
        fmx.scaled_dot_product_attention(ints, ints, ints, scale=1.0, registry=registry)
    assert e.value.argument == "q"


def test_no_keys_gives_zeros_as_mx_fast(registry):
    """T_kv = 0: mx.fast returns zeros; so does this function, with sinks too."""
    q, kv = normal((1, 4, 3, 64)), normal((1, 2, 0, 64))
    want = mx.fast.scaled_dot_product_attention(q, kv, kv, scale=0.125)
    for kw in ({}, {"sinks": normal((4,))}):
        out = fmx.scaled_dot_product_attention(q, kv, kv, scale=0.125, registry=registry, **kw)
        assert out.dtype == want.dtype and out.shape == want.shape and np.array_equal(np.array(out), np.array(want))
