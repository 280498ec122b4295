"""flashmetal.info(): what runs here — backend, device, the cpu kernels' ISA
path, threads, library and ABI versions — read from the loaded library."""
from __future__ import annotations

import platform
import threading
from typing import Any

from . import _loader, _native
from .registry import RegistryLike, resolve

# The cpu kernels' ISA query: exported by the library, outside the public C
# ABI header, so declared here and resolved in the library already loaded.
_ISA_CDEF = "int fm_cpu_isa(void); const char *fm_cpu_isa_name(int isa); int fm_cpu_vbmi(void);"
_PORTABLE = "portable"


_declare_lock = threading.Lock()


def _isa_lib() -> Any:
    """The loaded library with the ISA queries declared."""
    ffi, lib = _native.ffi(), _native.lib()
    with _declare_lock:  # declare once, even when threads race here
        if getattr(lib, "fm_cpu_isa", None) is None:
            ffi.cdef(_ISA_CDEF)
    return lib


def cpu_isa() -> str:
    """The ISA path the cpu kernels run: "portable" (plain C), "avx2",
    "avx512", "avx512vbmi", "avx512bf16" or "neon" (FLASHMETAL_CPU_ISA may cap it)."""
    lib = _isa_lib()
    name: str = _native.ffi().string(lib.fm_cpu_isa_name(lib.fm_cpu_isa())).decode()
    return name


def cpu_vbmi() -> bool:
    """Whether the cpu path uses AVX512-VBMI (the decode over 8-bit quantized
    caches): the CPU has it and the path is avx512vbmi or above (AVX512-BF16
    does not imply it)."""
    return bool(_isa_lib().fm_cpu_vbmi())


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def info(registry: RegistryLike = None) -> dict[str, Any]:
    """Backend, device, cpu ISA path, threads, library and ABI versions.

    ``registry``: the backend to describe (a Registry or a name); default ``Registry("auto")``.
    """
    reg = resolve(registry, "info")
    ffi, lib = _native.ffi(), _native.lib()
    devices = {"cpu": _cpu_model(), "sim": f"simulated Apple GPU on {_cpu_model()}", "metal": "Apple GPU (Metal)"}
    name = ffi.new("char[]", 256)
    if lib.fm_registry_device(reg._live_handle("info"), name, 256) == lib.FM_OK and ffi.string(name):
        # metal: the GPU's name; metal-sim: the emulated device, run on the simulator.
        devices[reg.backend] = ffi.string(name).decode()
        if reg.backend == "metal-sim":
            devices[reg.backend] += f" on {_cpu_model()}"
    isa = cpu_isa()
    return {
        "backend": reg.backend,
        "device": devices.get(reg.backend, reg.backend),
        "cpu_isa": isa,
        "cpu_isa_portable": isa == _PORTABLE,
        "cpu_vbmi": cpu_vbmi(),
        "threads": int(lib.fm_num_threads()),
        "library": str(_loader.library_path()),
        "library_version": ffi.string(lib.fm_version()).decode(),
        "abi_version": _native.abi_version(),
        "machine": platform.machine(),
    }
