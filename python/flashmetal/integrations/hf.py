"""A Hugging Face transformers attention backend.

    import flashmetal.integrations.hf as fm_hf
    fm_hf.register()                       # once per process
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="fm_attention")

The name is not "flashmetal": transformers treats any implementation whose
name contains "flash" as flash-attention (its masks and packed-sequence
paths) and one containing "sdpa" as torch's sdpa. Masks come from transformers'
sdpa mask builder (bool ``[B, 1, qL, kL]``, the sliding window and padding
included, or None for a plain causal block), so the window of Gemma-2's
local layers arrives in the mask; the logit softcap arrives as ``softcap``,
gpt-oss's attention sinks as ``s_aux`` (applied beside the mask). What the
backend cannot honour (dropout, a head mask) is an error, never dropped.
GQA heads are not repeated: the kernels read the shared K/V heads.

``QuantizedKVCache(model.config, k_bits, v_bits)`` (passed to ``generate``
as ``past_key_values``) keeps K and V as codes this backend attends over
directly (module ``hf_codes``).
"""
from __future__ import annotations

from typing import Any

import torch

from .._errors import InvalidValueError
from ..attention import scaled_dot_product_attention
from .torch_op import sdpa as _sdpa_op

NAME = "fm_attention"
_registered: set[str] = set()
# The attribute QuantizedKVCache's update() sets on the new keys it returns:
# the layer whose codes the attention appends them to and reads.
CODES_TAG = "_flashmetal_codes_layer"


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, softcap: float | None = None,
                      s_aux: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: q ``[B, H, qL, D]``, k/v
    ``[B, Hkv, kL, D]``; returns ``([B, qL, H, D], None)``. ``s_aux``: the
    per-head sink logits ``[H]`` (gpt-oss)."""
    if dropout:
        raise InvalidValueError(NAME, f"dropout ({dropout}) is not supported (call model.eval())")
    if kwargs.get("head_mask") is not None:
        raise InvalidValueError(NAME, "head_mask is not supported")
    q_len = query.shape[2]
    if hasattr(key, CODES_TAG):
        from .hf_codes import attend_codes, codes_layer

        layer = codes_layer(key)
        assert layer is not None
        return attend_codes(layer, query, key, value, attention_mask, scaling, float(softcap or 0.0), s_aux,
                            NAME, kwargs.get("sliding_window")), None
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    # As transformers' sdpa backend: a given mask carries the causal pattern; a
    # single query row (decode) sees every cached key.
    causal = bool(is_causal and attention_mask is None and q_len > 1)
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    # Compiled: one opaque op in the graph; eager: the function itself (the
    # custom op's dispatch costs ~90 us per call).
    sdpa = _sdpa_op if torch.compiler.is_compiling() else scaled_dot_product_attention
    out = sdpa(query, key, value, attention_mask, is_causal=causal, scale=scaling,
               enable_gqa=key.shape[1] != query.shape[1], softcap=float(softcap or 0.0), sinks=s_aux)
    return out.transpose(1, 2).contiguous(), None


def register(name: str = NAME) -> str:
    """Registers the backend (and its mask builder: transformers' sdpa one)
    under `name`; returns the name for ``attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    low = name.lower()
    if "flash" in low or "sdpa" in low:
        raise InvalidValueError("register", f"name {name!r} contains 'flash' or 'sdpa', which transformers "
                                "routes to its own kernels")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    _registered.add(name)
    return name


def registered_names() -> frozenset[str]:
    """The names register() has registered the backend under."""
    return frozenset(_registered)


def __getattr__(name: str) -> Any:
    if name == "QuantizedKVCache":  # imported on use: it needs transformers
        from .hf_codes import QuantizedKVCache

        return QuantizedKVCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
