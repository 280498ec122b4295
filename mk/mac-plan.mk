# mk/mac-plan.mk — `make mac-plan-dry-run`, part of `make mac-check`: `make
# test` planned as an Apple-silicon Mac plans it (make -n -B with UNAME=Darwin
# ARCH=arm64 and a `uname` answering so), failing on any Debian, qemu,
# ELF-only or Linux-path command in the plan (tests/mac/plan_check.py), after
# its self-test: planted Linux-only lines, a planted apt-get step and the
# Linux plan itself must each be caught. A few seconds.
.PHONY: mac-plan-dry-run
mac-plan-dry-run:
	@$(MAC_TIME) $(PYTHON) tests/mac/plan_check.py --self-test

MAC_CHECKS += mac-plan-dry-run
