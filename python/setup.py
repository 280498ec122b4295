"""Builds libflashmetal through SwiftPM into the wheel.

`pip install ./python`, `python -m build ./python` and `python -m build
--wheel ./python` all run `swift build -c release` here, with the Swift
runtime linked statically on Linux (`-static-stdlib`: the wheel then needs no
Swift toolchain; on macOS the runtime is part of the OS), and put the
library and its header into the package. A missing toolchain or a failed
build fails the build, never the first call. The wheel is tagged for this
platform (py3-none-<platform>: the library is loaded through cffi's ABI mode,
so any CPython 3 can use it); on macOS for the machine's architecture and the
macOS floor of Package.swift (macosx_14_0_arm64 on Apple silicon).

The Swift package is found next to python/ (a checkout) or in swift-src/ (an
sdist, which carries a copy of it). The version is FM_VERSION of flashmetal.h.

Environment: FLASHMETAL_SWIFT (the swift executable), FLASHMETAL_SWIFT_SCRATCH
(SwiftPM's build directory; default <package>/.build/wheel, reused between builds).
"""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
LIBNAME = "libflashmetal.dylib" if sys.platform == "darwin" else "libflashmetal.so"
HEADER = Path("Sources/CFlashMetal/include/flashmetal.h")
# `swift build`'s arguments for the library, and the flags added on Linux: the
# Swift runtime linked into the library, so the wheel needs no toolchain (on
# macOS the runtime is part of the OS). The Makefile's `make build` reads these
# two lines, so `make wheel`, which builds in the same SwiftPM directory
# (FLASHMETAL_SWIFT_SCRATCH), finds everything built with the same flags.
SWIFT_BUILD_ARGS = "build -c release --product flashmetal"
SWIFT_LINUX_FLAGS = "-Xswiftc -static-stdlib"
# What SwiftPM needs to load the manifest and build the library.
SWIFT_PACKAGE_PARTS = ["Package.swift", "Sources", "Resources", "Plugins", "tests/swift"]


def swift_package_root() -> Path:
    for root in (HERE / "swift-src", HERE.parent):
        if (root / "Package.swift").is_file():
            return root
    raise SystemExit(f"flashmetal: no Swift package (Package.swift) in {HERE / 'swift-src'} or {HERE.parent}: "
                     "build from a flashmetal checkout or its sdist")


def version() -> str:
    text = (swift_package_root() / HEADER).read_text()
    m = re.search(r'#define\s+FM_VERSION\s+"([^"]+)"', text)
    if not m:
        raise SystemExit(f"flashmetal: no FM_VERSION in {HEADER}")
    return m.group(1)


def swift_executable() -> str:
    for cand in (os.environ.get("FLASHMETAL_SWIFT"), shutil.which("swift"), "/opt/swift/usr/bin/swift"):
        if cand and Path(cand).is_file():
            return cand
    raise SystemExit("flashmetal: the Swift toolchain (6.0+) is needed to build the library: put `swift` on PATH "
                     "or set FLASHMETAL_SWIFT")


def build_library() -> Path:
    """Runs SwiftPM; returns the built library. Any failure is a build error."""
    root = swift_package_root()
    scratch = Path(os.environ.get("FLASHMETAL_SWIFT_SCRATCH", root / ".build" / "wheel"))
    cmd = [swift_executable(), *SWIFT_BUILD_ARGS.split(), "--package-path", str(root), "--scratch-path", str(scratch)]
    if sys.platform != "darwin":
        cmd += SWIFT_LINUX_FLAGS.split()
    print("flashmetal: " + " ".join(cmd), flush=True)
    result = subprocess.run(cmd)
    if result.returncode != 0:
        raise SystemExit(f"flashmetal: `swift build` failed (exit {result.returncode})")
    lib = scratch / "release" / LIBNAME
    if not lib.is_file():
        raise SystemExit(f"flashmetal: `swift build` succeeded but {lib} is missing")
    return lib


class BuildPyWithLibrary(build_py):
    """build_py, plus the Swift library and its header in the package."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return  # `make` copies the library into the source tree for editable installs
        dest = Path(self.build_lib) / "flashmetal"
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build_library(), dest / LIBNAME)
        shutil.copy2(swift_package_root() / HEADER, dest / "flashmetal.h")


class BinaryDistribution(Distribution):
    """Not pure: the package carries a native library (installed to platlib)."""

    def has_ext_modules(self) -> bool:
        return True


def macos_deployment_target() -> str:
    """The macOS floor Package.swift declares (`.macOS(.v14)` -> "14.0"): the built dylib's minimum."""
    text = (swift_package_root() / "Package.swift").read_text()
    m = re.search(r"\.macOS\(\s*\.v(\d+)(?:_(\d+))?\s*\)", text)
    if not m:
        raise SystemExit("flashmetal: no .macOS(.vN) platform in Package.swift")
    return f"{m.group(1)}.{m.group(2) or 0}"


def platform_tag() -> str:
    """This platform's wheel tag. On macOS the library's own: this machine's architecture (SwiftPM builds
    for it alone) and the deployment target, not the Python build's (often universal2 and older)."""
    if sys.platform == "darwin":
        return "macosx_%s_%s" % (macos_deployment_target().replace(".", "_"), platform.machine())
    return sysconfig.get_platform().replace("-", "_").replace(".", "_")


class PlatformWheel(bdist_wheel):
    """Tagged py3-none-<platform>: it carries a native library but no CPython extension."""

    def get_tag(self) -> tuple[str, str, str]:
        return "py3", "none", platform_tag()


class SdistWithSwiftPackage(sdist):
    """An sdist that carries the Swift package (in swift-src/), so a wheel builds from it alone."""

    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        root = swift_package_root()
        for part in SWIFT_PACKAGE_PARTS:
            src, dst = root / part, Path(base_dir) / "swift-src" / part
            if src.is_dir():
                shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".build", "*.o"))
            elif src.is_file():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)


setup(version=version(), distclass=BinaryDistribution,
      cmdclass={"build_py": BuildPyWithLibrary, "bdist_wheel": PlatformWheel, "sdist": SdistWithSwiftPackage})
