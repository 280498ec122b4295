# mk/cpu-arm64.mk — `make cpu-arm64-test`: the cpu kernels (C) built for
# aarch64, linked into tests/cpu_arm64/harness.c and run on the portable and
# the NEON path, each checked against a double-precision reference computed in
# the harness.
#   Linux         cross-built with clang --target=aarch64-linux-gnu and lld
#                 against Debian's arm64 cross libc, run under qemu-aarch64
#                 (numerics only: qemu cannot tell how fast the NEON path is)
#   Darwin arm64  built natively and run natively
#   elsewhere     not part of `make test`
ARM64_CC ?= $(shell command -v clang 2>/dev/null || echo /opt/swift/usr/bin/clang)
ARM64_OUT := .build/cpu-arm64
ARM64_KERNELS := $(filter-out %/pool.c %/sdpa.c,$(wildcard Sources/FlashMetalCPUKernels/*.c))
ARM64_COMMON := -std=c11 -O2 -ffp-contract=off -Wall -Werror \
	-ISources/FlashMetalCPUKernels/include -ISources/FlashMetalCPUKernels -ISources/CFlashMetal/include

ifeq ($(UNAME),Linux)
ARM64_CFLAGS := --target=aarch64-linux-gnu -fuse-ld=lld $(ARM64_COMMON)
ARM64_RUN := qemu-aarch64 -L /usr/aarch64-linux-gnu
# What `file` says of the binary it must be.
ARM64_FILE_SAYS := ARM aarch64
ARM64_DEPS := aarch64-deps
EXTRA_TESTS += cpu-arm64-test
else ifeq ($(UNAME)-$(ARCH),Darwin-arm64)
ARM64_CFLAGS := $(ARM64_COMMON)
ARM64_RUN :=
ARM64_FILE_SAYS := Mach-O 64-bit executable arm64
ARM64_DEPS :=
EXTRA_TESTS += cpu-arm64-test
endif
.PHONY: cpu-arm64-test

ifeq ($(ARM64_FILE_SAYS),)
cpu-arm64-test:
	@echo "cpu-arm64: runs on Linux (under qemu) or on an arm64 Mac, not on $(UNAME) $(ARCH)"; exit 1
else
$(ARM64_OUT)/harness: tests/cpu_arm64/harness.c tests/cpu_arm64/codes_case.h $(ARM64_KERNELS) $(wildcard Sources/FlashMetalCPUKernels/*.h) \
		Sources/FlashMetalCPUKernels/include/fm_cpu_kernels.h $(HEADER) | $(ARM64_DEPS)
	@mkdir -p $(ARM64_OUT)
	$(ARM64_CC) $(ARM64_CFLAGS) -o $@ tests/cpu_arm64/harness.c $(ARM64_KERNELS) -lm

cpu-arm64-test: $(ARM64_OUT)/harness
	@file $< | grep -q "$(ARM64_FILE_SAYS)" || { echo "cpu-arm64: $< is not an arm64 binary ($(ARM64_FILE_SAYS))"; exit 1; }
	FLASHMETAL_CPU_ISA=portable $(ARM64_RUN) $< portable
	env -u FLASHMETAL_CPU_ISA $(ARM64_RUN) $< neon
endif
