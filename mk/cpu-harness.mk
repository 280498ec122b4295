# mk/cpu-harness.mk — `make cpu-harness-test`: the cpu kernels' C harness
# (tests/cpu_arm64/harness.c, the one `cpu-arm64-test` runs under qemu) built
# natively on x86-64 and run once per ISA path (FLASHMETAL_CPU_ISA caps it;
# a path the machine lacks runs as the best one it has). It checks the
# kernels without the Swift dispatch, against its own double reference:
# prefill (plain mode and the serving extension: varlen, paged, kv lens,
# window, softcap, sinks, LSE, head dims 64-256 incl. 80/96/192, 512, MLA's
# 576 over v 512), decode, the decode and tiled prefill over quantized KV
# codes (every width, dense sides), blk and the mask builder. Reuses
# ARM64_CC and ARM64_KERNELS of mk/cpu-arm64.mk (included first: fragments
# load in name order).
# On Linux a second build, harness-emulated, compiles the AVX-512,
# AVX512-VBMI and AVX512-BF16 instances (and the ISA detection; the other objects are the
# native build's) without their target attribute and their intrinsics
# from SIMDe (FM_ISA_EMULATED: Sources/FlashMetalCPUKernels/x86_intrin.h,
# tests/cpu_arm64/isa_emulated.h), and its dispatch reports every x86 ISA: it
# runs those paths on any x86-64 machine (about 10 s each on a loaded 2-core
# machine), and fails unless the path it asked for is the one that ran.
HARNESS_OUT := .build/cpu-harness
HARNESS_CFLAGS := -std=c11 -O2 -ffp-contract=off -Wall -Werror \
	-ISources/FlashMetalCPUKernels/include -ISources/FlashMetalCPUKernels -ISources/CFlashMetal/include
HARNESS_SRCS := tests/cpu_arm64/harness.c $(ARM64_KERNELS)
HARNESS_HEADERS := tests/cpu_arm64/codes_case.h $(wildcard Sources/FlashMetalCPUKernels/*.h) \
	Sources/FlashMetalCPUKernels/include/fm_cpu_kernels.h $(HEADER)
# The sources FM_ISA_EMULATED changes; the emulated build shares the others' objects.
HARNESS_EMULATED_SRCS := $(addprefix Sources/FlashMetalCPUKernels/,cpu_features.c kernels_avx512.c kernels_avx512vbmi.c \
	kernels_avx512bf16.c)
HARNESS_OBJS := $(patsubst %.c,$(HARNESS_OUT)/native/%.o,$(HARNESS_SRCS))
HARNESS_EMULATED_OBJS := $(patsubst %.c,$(HARNESS_OUT)/native/%.o,$(filter-out $(HARNESS_EMULATED_SRCS),$(HARNESS_SRCS))) \
	$(patsubst %.c,$(HARNESS_OUT)/emulated/%.o,$(HARNESS_EMULATED_SRCS))

ifeq ($(ARCH),x86_64)
EXTRA_TESTS += cpu-harness-test
endif
.PHONY: cpu-harness-test

$(HARNESS_OUT)/native/%.o: %.c $(HARNESS_HEADERS)
	@mkdir -p $(@D)
	$(ARM64_CC) $(HARNESS_CFLAGS) -c -o $@ $<

$(HARNESS_OUT)/harness: $(HARNESS_OBJS)
	$(ARM64_CC) -o $@ $^ -lm

cpu-harness-test: $(HARNESS_OUT)/harness
	for isa in portable avx2 avx512 avx512vbmi avx512bf16; do FLASHMETAL_CPU_ISA=$$isa $< || exit 1; done

ifeq ($(UNAME)-$(ARCH),Linux-x86_64)
$(HARNESS_OUT)/emulated/%.o: %.c $(HARNESS_HEADERS) tests/cpu_arm64/isa_emulated.h | simde-deps
	@mkdir -p $(@D)
	$(ARM64_CC) $(HARNESS_CFLAGS) -Wno-psabi -DFM_ISA_EMULATED -Itests/cpu_arm64 -c -o $@ $<

$(HARNESS_OUT)/harness-emulated: $(HARNESS_EMULATED_OBJS)
	$(ARM64_CC) -o $@ $^ -lm

cpu-harness-test: cpu-harness-emulated-test
.PHONY: cpu-harness-emulated-test
cpu-harness-emulated-test: $(HARNESS_OUT)/harness-emulated
	for isa in avx512 avx512vbmi avx512bf16; do FLASHMETAL_CPU_ISA=$$isa $< $$isa || exit 1; done
endif
