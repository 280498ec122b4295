"""flashmetal: flash-attention kernels for Apple-silicon GPUs, from numpy.

Backends: "metal" (macOS), "sim" (the Metal kernels run by a simulator) and
"cpu" (native). ``Registry("auto")`` picks metal on macOS, else cpu.

Every op uses one causal convention: query row i sits at ``q_offset + i``
with ``q_offset = kv_len - qL`` by default (bottom-right, the queries are the
newest tokens), and sees keys at positions ``<= q_offset + i``.

Errors derive from :class:`Error` and carry ``.op`` (the public function),
``.argument`` (the parameter at fault, or None) and ``.status``; each is also
a ValueError, TypeError or RuntimeError.
"""
from ._errors import BackendError, Error, InternalError, InvalidTypeError, InvalidValueError, UnsupportedFeatureError
from ._info import info
from ._loader import header_version
from .prefill import flash_attn_prefill
from ._route import Route
from .attention import explain, last_route, scaled_dot_product_attention
from .blk import blk_byte_len, build_blk
from .decode import flash_attn_decode
from .mask import build_mask
from .sdpa import sdpa
from .serving import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from .combine import flash_attn_combine
from .packed import (flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_kvpacked_func,
                     flash_attn_varlen_qkvpacked_func)
from .registry import Registry, default_registry
from .kv_codec import KVCodec, QuantizedKV
from ._native import abi_version, set_interrupt, head_dims as supported_head_dims

__all__ = ["Error", "InvalidValueError", "InvalidTypeError", "BackendError", "InternalError", "Registry",
           "default_registry", "flash_attn_prefill", "scaled_dot_product_attention", "Route", "explain",
           "last_route", "info", "blk_byte_len", "build_blk", "flash_attn_decode", "build_mask", "sdpa",
           "supported_head_dims", "abi_version", "UnsupportedFeatureError", "flash_attn_func",
           "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "KVCodec", "QuantizedKV",
           "set_interrupt", "flash_attn_combine"]


def __getattr__(name: str) -> str:
    # The version is FM_VERSION of the shipped header: one source for the
    # library and the package, read without loading the library.
    if name == "__version__":
        return header_version()
    raise AttributeError(f"module 'flashmetal' has no attribute {name!r}")
