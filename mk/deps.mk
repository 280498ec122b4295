# mk/deps.mk — Debian packages that some Linux-only checks need, installed
# when missing (as the venv is). Each target is a stamp-free check: dpkg says
# whether the package is there, apt-get installs it otherwise (CI runs as
# root). On any other OS the targets fail: nothing there may depend on them.
#   libcxx-deps    libc++ 19: the simulator built against Apple's C++ library (mac-check)
#   aarch64-deps   qemu-user + arm64 cross libc/libstdc++/libgcc: the C/C++ parts
#                  cross-built for aarch64 and run under qemu-aarch64
#   simde-deps     SIMDe (header-only): the AVX-512 kernels built as portable code
#                  and run on any x86-64 machine (cpu-harness-test)
LIBCXX_PKGS := libc++-19-dev libc++abi-19-dev
SIMDE_PKGS := libsimde-dev
AARCH64_PKGS := qemu-user libc6-dev-arm64-cross libstdc++-12-dev-arm64-cross libgcc-12-dev-arm64-cross
APT_GET := $(if $(filter 0,$(shell id -u 2>/dev/null)),,sudo )apt-get

# $(call ensure-debs,packages...): install the ones dpkg does not report installed.
define ensure-debs
	@missing=""; for p in $(1); do \
		dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
		echo "deps: installing$$missing"; \
		$(APT_GET) update -qq && DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y -qq --no-install-recommends $$missing; \
	fi
endef

.PHONY: libcxx-deps aarch64-deps simde-deps
ifeq ($(UNAME),Linux)
libcxx-deps:
	$(call ensure-debs,$(LIBCXX_PKGS))

aarch64-deps:
	$(call ensure-debs,$(AARCH64_PKGS))

simde-deps:
	$(call ensure-debs,$(SIMDE_PKGS))
else
libcxx-deps aarch64-deps simde-deps:
	@echo "deps: $@ installs Debian packages for Linux-only checks; this is $(UNAME)"; exit 1
endif
