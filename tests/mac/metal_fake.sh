#!/usr/bin/env bash
# tests/mac/metal_fake.sh: builds Sources/FlashMetalMetal (unchanged) on Linux
# against the Metal stand-in (tests/mac/stand-ins/Metal.swift with the
# protocols of Sources/MetalSim/Metal/Protocols.swift) and a Darwin
# that re-exports Glibc, links it with tests/mac/metal_fake/main.swift (a
# fake Metal device) and runs it. Needs a Linux `swift build` first (the
# generated EmbeddedShaders.swift).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
out=.build/mac-check/metal-fake
mkdir -p "$out"
embedded="$(ls .build/plugins/outputs/*/FlashMetalShaders/destination/EmbedShaders/EmbeddedShaders.swift | head -1)"
echo '@_exported import Glibc' > "$out/Darwin.swift"
printf 'module CFlashMetal {\n    umbrella "%s"\n    export *\n}\n' "$root/Sources/CFlashMetal/include" > "$out/CFlashMetal.modulemap"
common=(-I "$out" -L "$out" -Xcc "-fmodule-map-file=$out/CFlashMetal.modulemap" -swift-version 5 -Onone)
lib() { # module sources...
    local m="$1"; shift
    swiftc -parse-as-library -emit-library -static -emit-module -module-name "$m" \
        -emit-module-path "$out/$m.swiftmodule" -o "$out/lib$m.a" "${common[@]}" "$@"
}
lib Metal tests/mac/stand-ins/Metal.swift Sources/MetalSim/Metal/Protocols.swift
lib Darwin "$out/Darwin.swift"
lib FlashMetalCore Sources/FlashMetalCore/*.swift
lib FlashMetalShaders Sources/FlashMetalShaders/*.swift "$embedded"
lib FlashMetalMetal Sources/FlashMetalMetal/*.swift
swiftc "${common[@]}" -o "$out/metal-fake" tests/mac/metal_fake/main.swift \
    -lFlashMetalMetal -lFlashMetalShaders -lFlashMetalCore -lDarwin -lMetal
"$out/metal-fake"
