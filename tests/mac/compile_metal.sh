#!/usr/bin/env bash
# tests/mac/compile_metal.sh: compiles every embedded shader source (exactly
# what the library hands MTLDevice.makeLibrary(source:), see
# embedded_sources.sh) with Apple's offline Metal compiler at the language
# version the backend asks for (MSL 3.1) and safe math, warnings shown.
# macOS only (the macOS CI job); errors name the .metal/.h file and line
# through the embedder's #line directives.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$here/embedded_sources.sh" "$work"
xcrun -sdk macosx metal --version
status=0
for f in "$work"/*.metal; do
    if xcrun -sdk macosx metal -std=metal3.1 -fno-fast-math -c "$f" -o "${f%.metal}.air"; then
        echo "compile_metal: $(basename "$f") ok"
    else
        echo "compile_metal: $(basename "$f") FAILED"
        status=1
    fi
done
exit $status
