# mk/kernels.mk — the shaders' INSTANTIATE_KERNEL lines, generated from the
# capability tables (Sources/FlashMetalCore/Capabilities.swift) through the
# built library by tools/gen_instantiations.py, then built into the library.
# tests/python/test_kernel_instantiations.py fails when a checked-in block
# differs from the generator's output.
.PHONY: kernel-instantiations

kernel-instantiations: python
	$(PY) tools/gen_instantiations.py --lib $(PKG)/$(LIBNAME)
	$(MAKE) python
