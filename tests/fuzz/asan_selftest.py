"""Proves the ASan run is real before `make fuzz-asan` trusts it: the loaded
library must be the instrumented one, and a caller that lies about a buffer
(nbytes larger than its allocation) must be caught by ASan inside the C
kernel. Run under the ASan environment of mk/fuzz.mk."""
import os
import subprocess
import sys

from flashmetal import _loader

path = str(_loader.library_path())
assert "asan" in path, f"not the ASan build: {path}"
assert "asan" in os.environ.get("LD_PRELOAD", ""), "ASan runtime not preloaded"
code = r"""
import numpy as np
from flashmetal import _loader
ffi, lib = _loader.load()
h = ffi.new("FMRegistry **"); err = ffi.new("FMError *")
lib.fm_create_registry(b"cpu", h, err)
small = np.zeros(16, np.uint16)               # 32 real bytes...
big = np.zeros((1, 1, 64, 64), np.uint16)
def T(a, shape, nbytes):
    t = ffi.new("FMTensor *"); t.data = ffi.cast("void *", a.ctypes.data); t.nbytes = nbytes
    t.dtype = 2; t.ndim = 4
    for i, d in enumerate(shape): t.shape[i] = d
    return t
o = ffi.new("FMPrefillOptions *"); o.scale = 0.1
q = T(small, [1, 1, 64, 64], 8192)            # ...claimed as 8 KiB: a caller's lie
s = lib.fm_dispatch_prefill(h[0], q, T(big, [1, 1, 64, 64], 8192), T(big, [1, 1, 64, 64], 8192),
                            ffi.NULL, ffi.NULL, T(np.zeros_like(big), [1, 1, 64, 64], 8192), o, err)
print("NOT CAUGHT", s)
"""
p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
assert "ERROR: AddressSanitizer: heap-buffer-overflow" in p.stderr, (p.returncode, p.stdout, p.stderr[-2000:])
print(f"asan selftest: the instrumented library at {path} reports a heap-buffer-overflow "
      "for an overstated nbytes")
