"""Attention sinks through the front door: ``sinks=`` beside a mask on the
drop-in (every route it can take; a call only a kernel without sinks could
run is refused, never run without them), flash_attn_prefill, the torch
custom op, and the Hugging Face backend's ``s_aux`` (gpt-oss). Before, the
drop-in had no sinks and the HF backend swallowed ``s_aux`` in **kwargs."""
from __future__ import annotations

import math

import numpy as np
import pytest

import flashmetal as fm
from numerics import BF16, F16, F32, assert_close, randn


def _reference(q, k, v, sinks, *, vis):
    """float64 attention with a per-head sink in the denominator: q [B, H,
    qL, D], k/v [B, Hkv, kL, D], vis bool broadcast to [B, H, qL, kL]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = (q @ np.swapaxes(k, -1, -2)) / math.sqrt(q.shape[-1])
    s = np.where(vis, s, -np.inf)
    sink = np.asarray(sinks, np.float64).reshape(1, -1, 1, 1)
    m = np.maximum(s.max(axis=-1, keepdims=True), sink)
    p = np.exp(s - m)
    return (p @ v) / (p.sum(axis=-1, keepdims=True) + np.exp(sink - m))


@pytest.mark.parametrize("ql,kl", [(7, 7), (1, 9), (5, 12)])
def test_dropin_sinks_beside_a_mask(registry, rng, ql, kl):
    q, k, v = randn(rng, (2, 4, ql, 64), BF16), randn(rng, (2, 2, kl, 64), BF16), randn(rng, (2, 2, kl, 64), BF16)
    sinks = (rng.standard_normal(4) * 2).astype(np.float32)
    pad = np.ones((2, 1, ql, kl), bool)
    pad[1, :, :, :2] = False  # sequence 1 is left-padded by two keys
    for causal in (False, True):
        t = np.arange(ql)[:, None] + (kl - ql)
        vis = pad & (np.arange(kl)[None, :] <= t if causal else True)
        got = fm.scaled_dot_product_attention(q, k, v, pad, is_causal=causal, enable_gqa=True, sinks=sinks,
                                              align="bottom_right", registry=registry)
        assert fm.last_route().kernel == "flash_attn_prefill"
        assert_close(got, _reference(q, k, v, sinks, vis=vis), BF16, f"sinks, causal={causal}")
    got = fm.flash_attn_prefill(q, k, v, mask=pad[:, :, :, :], sinks=sinks, registry=registry)
    assert_close(got, _reference(q, k, v, sinks, vis=pad), BF16, "flash_attn_prefill sinks")


def test_sinks_a_route_cannot_apply_are_refused(registry, rng):
    q = randn(rng, (1, 2, 4, 600), F32)  # D = 600: no prefill tile runs it, the general kernel
    with pytest.raises(fm.UnsupportedFeatureError, match=r"^scaled_dot_product_attention: sinks are applied by the "
                                                         r"prefill kernel only"):
        fm.scaled_dot_product_attention(q, q, q, sinks=np.zeros(2, np.float32), registry=registry)
    h = randn(rng, (1, 2, 4, 64), F16)
    with pytest.raises(fm.InvalidValueError, match=r"^scaled_dot_product_attention: sinks must have shape \[2\]"):
        fm.scaled_dot_product_attention(h, h, h, sinks=np.zeros(3, np.float32), registry=registry)


def test_custom_op_takes_sinks(registry):
    torch = pytest.importorskip("torch")
    from flashmetal.integrations import torch_op  # noqa: F401
    g = torch.Generator().manual_seed(0)
    q = torch.randn((1, 4, 6, 64), generator=g).to(torch.bfloat16)
    k = torch.randn((1, 2, 6, 64), generator=g).to(torch.bfloat16)
    sinks = torch.randn(4, generator=g)
    with torch.no_grad():
        out = torch.ops.flashmetal.sdpa(q, k, k, None, True, None, True, 0.0, None, False, sinks)
    vis = np.tril(np.ones((6, 6), bool))
    want = _reference(q.float().numpy(), k.float().numpy(), k.float().numpy(), sinks.numpy(), vis=vis)
    assert_close(out.float().numpy(), want, BF16, "torch.ops.flashmetal.sdpa sinks")


def test_hf_gpt_oss_keeps_its_sinks():
    """A tiny random-weight GptOssForCausalLM (sinks on every layer, sliding
    and full layers): the fm_attention backend's logits match eager's and the
    greedy tokens are the same (before: sinks dropped, logits ~6 off)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GptOssForCausalLM"):
        pytest.skip("transformers without gpt-oss")
    from flashmetal.integrations import hf
    hf.register()
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(vocab_size=128, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                    num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                    max_position_embeddings=256, layer_types=["sliding_attention", "full_attention"])
    model = transformers.GptOssForCausalLM(cfg).to(torch.bfloat16).eval()
    for layer in model.model.layers:  # random, clearly nonzero sinks
        layer.self_attn.sinks.data = torch.randn(4).to(torch.bfloat16) * 3
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.config._attn_implementation = "eager"
        eager = model(ids).logits.float()
        model.config._attn_implementation = hf.NAME
        ours = model(ids).logits.float()
    err = (ours - eager).abs().max().item()
    assert err < 0.1 * eager.abs().max().item(), f"logits {err:.3g} off eager"
    with torch.no_grad():
        model.config._attn_implementation = "eager"
        want = model.generate(ids[:1], max_new_tokens=8, do_sample=False)
        model.config._attn_implementation = hf.NAME
        got = model.generate(ids[:1], max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want), (got, want)
