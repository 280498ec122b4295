"""``torch.ops.flashmetal.sdpa``: the front door as a torch.library custom op.

torch.compile treats it as one opaque op (a fake implementation gives its
output shape), so graphs that call it compile without a break. Importing
this module registers the op; it needs torch.
"""
from __future__ import annotations

from typing import Any


import torch

from .._errors import InvalidValueError
from ..attention import scaled_dot_product_attention

OP_NAME = "flashmetal::sdpa"


@torch.library.custom_op(OP_NAME, mutates_args=())  # type: ignore[untyped-decorator]
def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
         is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False, softcap: float = 0.0,
         window: int | None = None, bottom_right: bool = False,
         sinks: torch.Tensor | None = None) -> torch.Tensor:
    """flashmetal.scaled_dot_product_attention on CPU tensors (no dropout);
    ``bottom_right`` selects the KV-cache causal alignment; ``sinks`` [H]
    per-head sink logits."""
    return scaled_dot_product_attention(query, key, value, attn_mask, 0.0, is_causal, scale=scale,
                                        enable_gqa=enable_gqa, softcap=softcap, window=window,
                                        align="bottom_right" if bottom_right else "top_left", sinks=sinks)


@sdpa.register_fake  # type: ignore[untyped-decorator]
def _sdpa_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False, softcap: float = 0.0,
               window: int | None = None, bottom_right: bool = False,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def _refuse_grad(ctx: Any, inputs: Any, output: Any) -> None:
    # torch calls this only when an input requires grad in grad mode: there
    # is no backward, so the call is refused rather than cut from the graph.
    raise InvalidValueError(OP_NAME, "an input requires grad in grad mode, but flashmetal has no backward pass: "
                            "call it under torch.no_grad() or torch.inference_mode()")


def _no_backward(ctx: Any, grad: Any) -> Any:  # never reached: _refuse_grad refuses first
    raise InvalidValueError(OP_NAME, "flashmetal has no backward pass")


sdpa.register_autograd(_no_backward, setup_context=_refuse_grad)
