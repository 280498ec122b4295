# mk/cpu-harness.mk — `make cpu-harness-test`: the cpu kernels' C harness
# (tests/cpu_arm64/harness.c, the one `cpu-arm64-test` runs under qemu) built
# natively on x86-64 and run once per ISA path (FLASHMETAL_CPU_ISA caps it;
# a path the machine lacks runs as the best one it has). It checks the
# kernels without the Swift dispatch, against its own double reference:
# prefill (plain mode and the serving extension: varlen, paged, kv lens,
# window, softcap, sinks, LSE, head dims 64-256 incl. 80/96/192, 512, MLA's
# 576 over v 512), decode, blk and the mask builder. A few seconds. Reuses
# ARM64_CC and ARM64_KERNELS of mk/cpu-arm64.mk (included first: fragments
# load in name order).
HARNESS_OUT := .build/cpu-harness
HARNESS_CFLAGS := -std=c11 -O2 -ffp-contract=off -Wall -Werror \
	-ISources/FlashMetalCPUKernels/include -ISources/FlashMetalCPUKernels -ISources/CFlashMetal/include

ifeq ($(ARCH),x86_64)
EXTRA_TESTS += cpu-harness-test
endif
.PHONY: cpu-harness-test

$(HARNESS_OUT)/harness: tests/cpu_arm64/harness.c tests/cpu_arm64/codes_case.h $(ARM64_KERNELS) $(wildcard Sources/FlashMetalCPUKernels/*.h) \
		Sources/FlashMetalCPUKernels/include/fm_cpu_kernels.h $(HEADER)
	@mkdir -p $(HARNESS_OUT)
	$(ARM64_CC) $(HARNESS_CFLAGS) -o $@ tests/cpu_arm64/harness.c $(ARM64_KERNELS) -lm

cpu-harness-test: $(HARNESS_OUT)/harness
	for isa in portable avx2 avx512 avx512bf16; do FLASHMETAL_CPU_ISA=$$isa $< || exit 1; done
