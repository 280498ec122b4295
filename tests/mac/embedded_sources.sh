#!/usr/bin/env bash
# tests/mac/embedded_sources.sh DIR [SHADER_DIR HEADER]: writes the shader
# sources exactly as the library embeds them (headers inlined, #line
# directives) to DIR/<file>.metal, using the embedder itself (ShaderEmbedder
# --sources). Defaults: Resources/shaders and the kernels' header, flashmetal_kernels.h.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
mkdir -p "$1"
out="$(cd "$1" && pwd)"
shaders="$(cd "${2:-$root/Resources/shaders}" && pwd)"
header="$(realpath "${3:-$root/Sources/CFlashMetal/include/flashmetal_kernels.h}")"
cd "$root"
swift build -c release --product ShaderEmbedder >/dev/null
"$(swift build -c release --show-bin-path)/ShaderEmbedder" --sources "$out" "$header" "$shaders"/*.metal "$shaders"/*.h
