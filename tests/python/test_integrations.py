"""flashmetal.integrations: the torch custom op (one op under torch.compile)
and the Hugging Face attention backend on tiny random-weight Llama and
Gemma-2 models built from configs (no download), against transformers' own
"sdpa" / "eager" attention: the same greedy tokens, logits within tolerance.
torch and transformers are installed into the venv by mk/testdeps.mk."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flashmetal as fm  # noqa: E402
from flashmetal.integrations import hf, torch_op  # noqa: E402,F401


def test_custom_op_matches_the_front_door():
    g = torch.Generator().manual_seed(0)
    q = torch.randn((1, 4, 7, 80), generator=g).to(torch.bfloat16)
    k = torch.randn((1, 2, 11, 80), generator=g).to(torch.bfloat16)
    out = torch.ops.flashmetal.sdpa(q, k, k, None, True, 0.2, True, 5.0, 3, True)
    direct = fm.scaled_dot_product_attention(q, k, k, is_causal=True, scale=0.2, enable_gqa=True, softcap=5.0,
                                             window=3, align="bottom_right")
    assert out.dtype == torch.bfloat16 and torch.equal(out, direct)


def test_torch_compile_sees_one_op():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(q, k, v):
        return torch.ops.flashmetal.sdpa(q, k, v, is_causal=True) * 2.0

    q = torch.randn((1, 2, 9, 64))
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    out = compiled(q, q, q)
    assert torch.allclose(out, 2.0 * torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True),
                          atol=1e-5, rtol=1e-4)
    assert len(graphs) == 1
    ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum(op in (torch.ops.flashmetal.sdpa, torch.ops.flashmetal.sdpa.default) for op in ops) == 1, ops


def test_hf_backend_is_one_op_compiled_and_the_function_eager(monkeypatch):
    """Compiled, transformers' attention call through the backend is the one
    custom op (no graph break); eager it calls the function directly (the
    op's dispatch would cost more than a decode step's kernel): same values."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    class Attn(torch.nn.Module):
        is_causal = True

    module = Attn()
    g = torch.Generator().manual_seed(1)
    q = torch.randn((1, 4, 1, 64), generator=g).to(torch.bfloat16)
    k = torch.randn((1, 2, 37, 64), generator=g).to(torch.bfloat16)
    v = torch.randn((1, 2, 37, 64), generator=g).to(torch.bfloat16)

    def f(q, k, v):
        return hf.attention_forward(module, q, k, v, None, scaling=0.125)[0]

    compiled = torch.compile(f, backend=backend, fullgraph=True)(q, k, v)
    assert len(graphs) == 1
    ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum(op in (torch.ops.flashmetal.sdpa, torch.ops.flashmetal.sdpa.default) for op in ops) == 1, ops

    def no_op(*args, **kwargs):
        raise AssertionError("the eager call went through the custom op")

    monkeypatch.setattr(hf, "_sdpa_op", no_op)
    eager = f(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=0.125,
                                                           enable_gqa=True).transpose(1, 2)
    assert torch.equal(eager, compiled)
    assert torch.allclose(eager.double(), ref, atol=2e-2, rtol=2e-2)


def test_register_refuses_names_transformers_reroutes():
    with pytest.raises(ValueError, match="contains 'flash' or 'sdpa'"):
        hf.register("flashmetal")
    assert hf.register() == "fm_attention"


def tiny_llama(attn):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=128)
    return cfg, transformers.LlamaForCausalLM


def tiny_gemma2(attn):
    cfg = transformers.Gemma2Config(vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                    max_position_embeddings=128, sliding_window=5, attn_logit_softcapping=20.0,
                                    final_logit_softcapping=15.0, query_pre_attn_scalar=64,
                                    layer_types=["sliding_attention", "full_attention"])
    return cfg, transformers.Gemma2ForCausalLM


def build(make, attn, dtype):
    torch.manual_seed(0)
    cfg, cls = make(attn)
    model = cls._from_config(cfg, attn_implementation=attn, dtype=dtype)
    return model.eval()


@pytest.mark.parametrize("make,reference_attn", [(tiny_llama, "sdpa"), (tiny_gemma2, "eager")])
def test_hf_models_match(make, reference_attn):
    name = hf.register()
    flash, ref = build(make, name, torch.float32), build(make, reference_attn, torch.float32)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding on the second sequence
    with torch.no_grad():
        lo = flash(input_ids=ids, attention_mask=mask).logits
        lr = ref(input_ids=ids, attention_mask=mask).logits
        keep = mask.bool()
        np.testing.assert_allclose(lo[keep].numpy(), lr[keep].numpy(), atol=2e-4, rtol=1e-3)
        kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
        go = flash.generate(input_ids=ids, attention_mask=mask, **kw)
        gr = ref.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(go, gr), (go, gr)
    assert fm.last_route() is not None


@pytest.mark.parametrize("make,reference_attn", [(tiny_llama, "sdpa"), (tiny_gemma2, "eager")])
def test_hf_models_bf16_take_the_prefill_kernel(make, reference_attn):
    name = hf.register()
    flash, ref = build(make, name, torch.bfloat16), build(make, reference_attn, torch.bfloat16)
    ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        lo = flash(input_ids=ids).logits.float()
        lr = ref(input_ids=ids).logits.float()
    assert fm.last_route().kernel == "flash_attn_prefill"
    scale = float(lr.abs().max())
    assert float((lo - lr).abs().max()) <= 0.05 * scale


@pytest.mark.parametrize("make,reference_attn", [(tiny_llama, "sdpa"), (tiny_gemma2, "eager")])
def test_hf_models_float32_take_the_prefill_kernel(make, reference_attn):
    """A float32 model's prefill runs on the tiled kernel, not the general one."""
    name = hf.register()
    flash, ref = build(make, name, torch.float32), build(make, reference_attn, torch.float32)
    ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        lo = flash(input_ids=ids).logits
        lr = ref(input_ids=ids).logits
    assert fm.last_route().kernel == "flash_attn_prefill"
    np.testing.assert_allclose(lo.numpy(), lr.numpy(), atol=2e-4, rtol=1e-3)


def test_hf_gemma2_on_the_simulator():
    """The same model through the Metal kernels (run by the simulator): same greedy tokens as eager."""
    code = (
        "import torch, flashmetal as fm, test_integrations as t\n"
        "from flashmetal.integrations import hf\n"
        "ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(3))\n"
        "kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)\n"
        "with torch.no_grad():\n"
        "    flash = t.build(t.tiny_gemma2, hf.register(), torch.float32).generate(input_ids=ids, **kw)\n"
        "    ref = t.build(t.tiny_gemma2, 'eager', torch.float32).generate(input_ids=ids, **kw)\n"
        "assert fm.info()['backend'] == 'sim' and fm.last_route() is not None\n"
        "assert torch.equal(flash, ref), (flash, ref)\n")
    env = dict(os.environ, FLASHMETAL_BACKEND="sim", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
