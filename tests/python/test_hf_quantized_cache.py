"""QuantizedKVCache: generate() of a tiny random-weight Llama keeps K and V
as flashmetal codes and the attention reads them. Every step's logits equal
(float32 tolerance) a float64 reference model whose attention runs over the
reference codec's K̂, V̂ of the same rows; the greedy tokens' agreement with
the dense cache is reported (and bounded below for K8/V8)."""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flashmetal as fm  # noqa: E402
from flashmetal import quant_reference as qref  # noqa: E402
from flashmetal import reference  # noqa: E402
from flashmetal.integrations import hf  # noqa: E402
from flashmetal.integrations.hf_codes import QuantizedKVCache  # noqa: E402
from test_integrations import build, tiny_gemma2, tiny_llama  # noqa: E402

REF = "fm_codec_reference"
PROMPT, NEW = 12, 16


def _codec_reference(bits: tuple[int, int], seed: int):
    """transformers attention over K̂, V̂ of the reference codec, float64
    (the mask carries padding and sliding windows; the logit softcap as the
    model passes it)."""
    def forward(module, query, key, value, attention_mask, scaling=None, softcap=None, **kwargs):
        kb, vb = bits
        kd = qref.decode(*qref.encode(key.numpy(), kb, seed)[:2], kb, seed)
        vd = qref.decode(*qref.encode(value.numpy(), vb, seed + 1)[:2], vb, seed + 1)
        ql, kl = query.shape[2], key.shape[2]
        mask = None if attention_mask is None else attention_mask[..., :kl].numpy()
        o = reference.attention(query.numpy(), kd, vd, scale=scaling, causal=True, q_offset=kl - ql, mask=mask,
                                softcap=float(softcap or 0.0))
        return torch.from_numpy(o.astype(np.float32)).transpose(1, 2).contiguous(), None
    return forward


def _register_reference(bits, seed=0):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(REF, _codec_reference(bits, seed))
    AttentionMaskInterface.register(REF, sdpa_mask)


def _prompt(batch=2):
    return torch.randint(1, 96, (batch, PROMPT), generator=torch.Generator().manual_seed(1))


def _steps(model, ids, **kw):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=kw.pop("attention_mask", torch.ones_like(ids)), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences[:, PROMPT:], torch.stack(out.logits, 1)


@pytest.mark.slow
@pytest.mark.parametrize("bits", [(8, 8), (8, 4)])
def test_generate_over_codes(bits, monkeypatch):
    name = hf.register()
    model = build(tiny_llama, name, torch.float32)
    ids = _prompt()
    dense_tokens, _ = _steps(model, ids)

    def no_dense_copy(self, *a, **k):
        raise AssertionError("a cache row was dequantized")

    monkeypatch.setattr(fm.QuantizedKV, "dequantize", no_dense_copy)
    cache = QuantizedKVCache(model.config, *bits, chunk=16)
    tokens, logits = _steps(model, ids, cache=cache)
    monkeypatch.undo()

    # The cache holds codes only: uint8 rows and float32 norms, as many as the tokens seen.
    assert cache.get_seq_length() == PROMPT + NEW - 1
    for layer in cache.layers:
        assert layer.keys is None and layer.values is None
        for c, b in ((layer.k_codes, bits[0]), (layer.v_codes, bits[1])):
            assert isinstance(c, fm.QuantizedKV) and c.codec.bits == b
            assert c.codes.dtype == np.uint8 and c.shape == (2, 32, 2)  # 16 rows, grown once by 16
        dense = [v for v in vars(layer).values()
                 if isinstance(v, torch.Tensor) or isinstance(v, np.ndarray) and v.dtype.kind == "f"]
        assert not dense, dense

    # Each step's logits: float64 attention over the reference codec's K̂, V̂.
    _register_reference(bits)
    ref = build(tiny_llama, REF, torch.float32)
    ref_tokens, ref_logits = _steps(ref, ids)
    assert torch.equal(tokens, ref_tokens), (tokens, ref_tokens)
    np.testing.assert_allclose(logits.numpy(), ref_logits.numpy(), atol=2e-4, rtol=1e-3)

    agree = (tokens == dense_tokens).float().mean().item()
    print(f"K{bits[0]}/V{bits[1]}: {agree:.1%} of {tokens.numel()} greedy tokens equal the dense cache's")
    if bits == (8, 8):
        assert agree >= 0.9


def test_prefill_logits_over_codes(registry):
    """One forward of the prompt through the cache (prefill over codes) and
    one decode step after it, on every backend."""
    name = hf.register()
    model = build(tiny_llama, name, torch.float32)
    _register_reference((8, 4))
    ref = build(tiny_llama, REF, torch.float32)
    ids = _prompt()
    cache = QuantizedKVCache(model.config, 8, 4, registry=registry)
    nxt = torch.tensor([[5], [7]])
    with torch.no_grad():
        got = [model(input_ids=ids, cache=cache).logits, model(input_ids=nxt, cache=cache).logits]
        want = ref(input_ids=torch.cat([ids, nxt], 1)).logits
    assert cache.get_seq_length() == PROMPT + 1
    np.testing.assert_allclose(torch.cat(got, 1).numpy(), want.numpy(), atol=2e-4, rtol=1e-3)


def _generate_against_reference(make, pads: list[int]) -> QuantizedKVCache:
    """generate() over a K8/V4 QuantizedKVCache with sequence b's first
    pads[b] tokens left padding: tokens and logits equal the reference
    model's (attention over the reference codec's K̂, V̂) with the same mask;
    returns the cache."""
    name = hf.register()
    model = build(make, name, torch.float32)
    _register_reference((8, 4))
    ref = build(make, REF, torch.float32)
    ids = _prompt(len(pads))
    mask = torch.ones_like(ids)
    for b, p in enumerate(pads):
        mask[b, :p] = 0
    ids = ids.masked_fill(mask == 0, 0)
    cache = QuantizedKVCache(model.config, 8, 4, chunk=8)
    tokens, logits = _steps(model, ids, attention_mask=mask, cache=cache)
    ref_tokens, ref_logits = _steps(ref, ids, attention_mask=mask)
    assert torch.equal(tokens, ref_tokens), (tokens, ref_tokens)
    np.testing.assert_allclose(logits.numpy(), ref_logits.numpy(), atol=2e-4, rtol=1e-3)
    assert cache.layers[0].pad.tolist() == pads
    return cache


@pytest.mark.slow
def test_left_padded_generate_over_codes():
    """Each sequence stores only its real tokens."""
    _generate_against_reference(tiny_llama, [0, 3, 7])


@pytest.mark.parametrize("pads", [[0, 0], [0, 4]])
def test_sliding_window_generate_over_codes(pads):
    """Gemma-2 (a sliding layer of window 5, then a full one; logit softcap):
    the sliding layer attends over the codes with its window, the prompt
    and every step longer than it."""
    _generate_against_reference(tiny_gemma2, pads)


def test_sliding_window_mask_other_than_the_window_refused():
    """A mask keeping keys outside the layer's window is refused by name,
    and the refused call stores nothing."""
    name = hf.register()
    model = build(tiny_llama, name, torch.float32)
    cache = QuantizedKVCache(model.config, 8, 4)
    layer = cache.layers[0]
    q = torch.randn(1, 4, 6, 64)
    k, v = layer.update(torch.randn(1, 2, 6, 64), torch.randn(1, 2, 6, 64))
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    with pytest.raises(fm.UnsupportedFeatureError, match="within a window of 3") as err:
        hf.attention_forward(model.model.layers[0].self_attn, q, k, v, causal, scaling=0.125, sliding_window=3)
    assert err.value.argument == "attention_mask"
    assert layer.length == 0
    windowed = causal & ~torch.ones(6, 6, dtype=torch.bool).tril(-3)[None, None]
    k, v = layer.update(torch.randn(1, 2, 6, 64), torch.randn(1, 2, 6, 64))
    out, _ = hf.attention_forward(model.model.layers[0].self_attn, q, k, v, windowed, scaling=0.125,
                                  sliding_window=3)
    want = reference.attention(q.numpy(), *(qref.decode(*qref.encode(x.numpy(), b, s)[:2], b, s)
                                            for x, b, s in ((k, 8, 0), (v, 4, 1))),
                               scale=0.125, causal=True, mask=windowed.numpy())
    np.testing.assert_allclose(out.numpy(), want.transpose(0, 2, 1, 3), atol=2e-4, rtol=1e-3)


def test_crop_drops_the_newest_rows():
    """After crop(-n), the next forward sees the first tokens only: its
    logits equal a fresh cache's over the same tokens."""
    name = hf.register()
    model = build(tiny_llama, name, torch.float32)
    ids = _prompt()
    cache, kept, fresh = (QuantizedKVCache(model.config, 8, 4) for _ in range(3))
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
        model(input_ids=ids, cache=kept)
        cache.crop(-4)
        cache.crop(0)
        assert cache.get_seq_length() == PROMPT - 4
        got = model(input_ids=ids[:, -4:], cache=cache).logits
        stale = model(input_ids=ids[:, -4:], cache=kept).logits  # the rows crop drops, still seen
        want = model(input_ids=ids, cache=fresh).logits[:, -4:]
    # The same to float32 rounding, not bit for bit: torch's matmul of 4 rows
    # need not round as the last 4 of 12 rows do (its blocking follows the row
    # count; on AVX-512 machines they differ in the last bit). Rows that crop
    # failed to drop move the logits by orders of magnitude more.
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    assert np.abs(stale.numpy() - want.numpy()).max() > 1e-3


def test_masks_with_holes_refused():
    name = hf.register()
    model = build(tiny_llama, name, torch.float32)
    ids = _prompt()
    mask = torch.ones_like(ids)
    mask[1, 5] = 0  # a hole, not left padding
    cache = QuantizedKVCache(model.config, 8, 4)
    with torch.no_grad(), pytest.raises(fm.UnsupportedFeatureError, match="^fm_attention: the attention mask "
                                        "keeps keys other than a causal block after left padding") as err:
        model(input_ids=ids, attention_mask=mask, cache=cache)
    assert err.value.argument == "attention_mask"
    assert cache.get_seq_length() == 0  # the refused call stored nothing


def test_bad_arguments():
    name = hf.register()
    model = build(tiny_llama, name, torch.float32)
    with pytest.raises(fm.InvalidValueError, match="QuantizedKVCache.*k_bits.*7"):
        QuantizedKVCache(model.config, 7, 4)
    for bad in (True, "4", 4.0):  # not an integer: a TypeError, as every flashmetal integer argument
        with pytest.raises(fm.InvalidTypeError, match="QuantizedKVCache: v_bits must be an integer") as e:
            QuantizedKVCache(model.config, 8, bad)
        assert e.value.argument == "v_bits"
    with pytest.raises(fm.InvalidValueError, match="QuantizedKVCache.*chunk"):
        QuantizedKVCache(model.config, 8, 4, chunk=0)
    with pytest.raises(fm.InvalidTypeError, match="QuantizedKVCache: chunk must be an integer"):
        QuantizedKVCache(model.config, 8, 4, chunk=1.5)
    # Checked when the cache is made, not by KVCodec in the middle of generate();
    # V's seed is seed + 1, so 2**64 - 1 is out of range too.
    for bad in (-1, 2**64 - 1):
        with pytest.raises(fm.InvalidValueError, match="QuantizedKVCache: seed") as e:
            QuantizedKVCache(model.config, 8, 4, seed=bad)
        assert e.value.argument == "seed"
    with pytest.raises(fm.InvalidTypeError, match="QuantizedKVCache: seed must be an integer"):
        QuantizedKVCache(model.config, 8, 4, seed="0")
    assert QuantizedKVCache(model.config, 8, 4, seed=2**64 - 2).seed == 2**64 - 2
    sdpa = build(tiny_llama, "sdpa", torch.float32)
    with pytest.raises(fm.InvalidValueError, match="QuantizedKVCache.*'sdpa'"):
        QuantizedKVCache(sdpa.config, 8, 4)


def test_bfloat16_model_over_codes():
    """A bfloat16 model: q, k and v reach the kernels in bfloat16 (the
    appended rows encoded from them, the output written in bfloat16 by the
    attention itself), prefill and a decode step; logits against the same
    model whose attention is float64 over the reference codec's K̂, V̂ of
    the same rows, within bfloat16 rounding of the layers around it."""
    name = hf.register()
    model = build(tiny_llama, name, torch.bfloat16)
    bits = (4, 4)
    ref_forward = _codec_reference(bits, 0)

    def bf16_reference(module, query, key, value, attention_mask, scaling=None, **kwargs):
        out, _ = ref_forward(module, query.float(), key.float(), value.float(),
                             None if attention_mask is None else attention_mask, scaling=scaling)
        return out.to(query.dtype), None

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(REF + "_bf16", bf16_reference)
    AttentionMaskInterface.register(REF + "_bf16", sdpa_mask)
    ref = build(tiny_llama, REF + "_bf16", torch.bfloat16)
    ids = _prompt()
    cache = QuantizedKVCache(model.config, *bits)
    with torch.no_grad():
        got = [model(input_ids=ids, cache=cache).logits]
        got.append(model(input_ids=ids[:, :1], cache=cache).logits)
        want = [ref(input_ids=ids).logits, ref(input_ids=torch.cat([ids, ids[:, :1]], 1)).logits[:, -1:]]
        dense = model(input_ids=ids).logits  # attention over the unquantized rows
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        np.testing.assert_allclose(g.float().numpy(), w.float().numpy(), atol=0.02, rtol=0.02)
    # The comparison tells codes from dense rows: the dense cache's logits differ.
    assert (dense.float() - want[0].float()).abs().max().item() > 0.05
