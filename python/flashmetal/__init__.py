"""flashmetal: flash-attention kernels for Apple-silicon GPUs, from numpy.

Backends: "metal" (macOS), "sim" (the Metal kernels run by a simulator) and
"cpu" (native). ``Registry("auto")`` picks metal on macOS, else cpu.
"""
from ._errors import BackendError
from .prefill import flash_attn_prefill
from .registry import Registry, default_registry

__all__ = ["BackendError", "Registry", "default_registry", "flash_attn_prefill"]
__version__ = "0.1.0"
