# mk/cpu-arm64.mk — `make cpu-arm64-test`: the cpu kernels (C) cross-built for
# aarch64 with clang --target=aarch64-linux-gnu and lld against Debian's arm64
# cross libc, linked into tests/cpu_arm64/harness.c and run under qemu-aarch64
# on the portable and the NEON path, each checked against a double-precision
# reference computed in the harness. Numerics only: qemu cannot tell how fast
# the NEON path is.
ARM64_CC ?= $(shell command -v clang 2>/dev/null || echo /opt/swift/usr/bin/clang)
ARM64_OUT := .build/cpu-arm64
ARM64_KERNELS := $(filter-out %/pool.c %/sdpa.c,$(wildcard Sources/FlashMetalCPUKernels/*.c))
ARM64_CFLAGS := --target=aarch64-linux-gnu -fuse-ld=lld -std=c11 -O2 -ffp-contract=off -Wall -Werror \
	-ISources/FlashMetalCPUKernels/include -ISources/FlashMetalCPUKernels -ISources/CFlashMetal/include
QEMU_ARM64 := qemu-aarch64 -L /usr/aarch64-linux-gnu

EXTRA_TESTS += cpu-arm64-test
.PHONY: cpu-arm64-test

$(ARM64_OUT)/harness: tests/cpu_arm64/harness.c $(ARM64_KERNELS) $(wildcard Sources/FlashMetalCPUKernels/*.h) \
		Sources/FlashMetalCPUKernels/include/fm_cpu_kernels.h $(HEADER) | aarch64-deps
	@mkdir -p $(ARM64_OUT)
	$(ARM64_CC) $(ARM64_CFLAGS) -o $@ tests/cpu_arm64/harness.c $(ARM64_KERNELS) -lm

cpu-arm64-test: $(ARM64_OUT)/harness
	@file $< | grep -q "ARM aarch64" || { echo "cpu-arm64: $< is not an aarch64 binary"; exit 1; }
	FLASHMETAL_CPU_ISA=portable $(QEMU_ARM64) $< portable
	env -u FLASHMETAL_CPU_ISA $(QEMU_ARM64) $< neon
