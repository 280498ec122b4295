# mk/fuzz.mk — fuzzing beyond the bounded run inside `make test`.
#   make fuzz        FUZZ_SCALE x the make-test fuzz counts (random seeds) on the
#                    release library, then the fuzz + thread tests again on an
#                    AddressSanitizer build of libflashmetal (C kernels, simulator
#                    C++ and Swift all instrumented) loaded into python with the
#                    ASan runtime preloaded.
#   make fuzz-asan   only the ASan part.
# The bounded fuzz run of `make test` is tests/python/test_fuzz.py (~30 s).
FUZZ_SCALE ?= 5
ASAN_SCRATCH := .build/asan
ASAN_LIB := $(ASAN_SCRATCH)/release/$(LIBNAME)
ASAN_CLANG := $(dir $(realpath $(SWIFT)))clang
# The ASan runtime of this machine's OS and architecture, injected into
# python: LD_PRELOAD on Linux (libclang_rt.asan-<arch>.so, or the per-target
# layout's libclang_rt.asan.so), DYLD_INSERT_LIBRARIES on macOS (use a python
# outside /usr/bin there: SIP strips DYLD_* variables for system binaries).
ifeq ($(UNAME),Darwin)
ASAN_RT_NAMES := libclang_rt.asan_osx_dynamic.dylib lib/darwin/libclang_rt.asan_osx_dynamic.dylib
ASAN_PRELOAD := DYLD_INSERT_LIBRARIES
else
ASAN_RT_NAMES := libclang_rt.asan-$(ARCH).so libclang_rt.asan.so
ASAN_PRELOAD := LD_PRELOAD
endif
# -print-file-name answers with the bare name when it finds nothing.
ASAN_RT = $(or $(firstword $(foreach n,$(ASAN_RT_NAMES),$(filter /%,$(shell $(ASAN_CLANG) -print-file-name=$(n))))),\
	$(error no ASan runtime ($(ASAN_RT_NAMES)) found by $(ASAN_CLANG)))
# Python itself leaks by design (no LeakSanitizer); with allocator_may_return_null a
# huge allocation returns NULL (as glibc does) instead of aborting. test_leaks is
# left out: ASan's quarantine holds freed memory, so RSS is not flat under it.
ASAN_ENV = $(ASAN_PRELOAD)=$(ASAN_RT) ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:halt_on_error=1 \
	FLASHMETAL_LIB=$(CURDIR)/$(ASAN_LIB) FLASHMETAL_HEADER=$(CURDIR)/$(HEADER)

.PHONY: fuzz fuzz-asan asan-lib

asan-lib:
	$(SWIFT) build -c release --product flashmetal --scratch-path $(ASAN_SCRATCH) --sanitize=address

fuzz: python venv
	FLASHMETAL_FUZZ_SCALE=$(FUZZ_SCALE) FLASHMETAL_FUZZ_RANDOM=1 FLASHMETAL_FUZZ_SEED=$$RANDOM$$RANDOM \
		$(PY) -m pytest tests/python/test_fuzz.py -q $(PYTEST_ARGS)
	$(MAKE) fuzz-asan

fuzz-asan: asan-lib venv
	$(ASAN_ENV) $(PY) tests/fuzz/asan_selftest.py
	$(ASAN_ENV) FLASHMETAL_FUZZ_SCALE=$(FUZZ_SCALE) FLASHMETAL_FUZZ_SEED=$$RANDOM$$RANDOM \
		$(PY) -m pytest tests/python/test_fuzz.py tests/python/test_threads.py -q -p no:cacheprovider $(PYTEST_ARGS)
