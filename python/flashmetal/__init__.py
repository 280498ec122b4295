"""flashmetal: flash-attention kernels for Apple-silicon GPUs, from numpy.

Backends: "metal" (macOS), "sim" (the Metal kernels run by a simulator) and
"cpu" (native). ``Registry("auto")`` picks metal on macOS, else cpu.
"""
from ._errors import BackendError
from ._info import info
from .prefill import flash_attn_prefill
from .attention import Route, explain, last_route, scaled_dot_product_attention
from .blk import blk_byte_len, build_blk
from .decode import flash_attn_decode
from .mask import build_mask
from .sdpa import sdpa
from .registry import Registry, default_registry

__all__ = ["BackendError", "info", "Registry", "default_registry", "flash_attn_prefill",
           "scaled_dot_product_attention", "Route", "explain", "last_route", "blk_byte_len", "build_blk", "flash_attn_decode",
           "build_mask", "sdpa"]
__version__ = "0.1.0"
