// Build-time tool (not part of the library): writes EmbeddedShaders.swift.
//
// usage: ShaderEmbedder OUTPUT HEADER FILE...
//        ShaderEmbedder --sources DIR HEADER FILE...
//   (the second form writes each embedded source to DIR/<file>.metal, so the
//   macOS CI job can compile exactly what the library embeds)
// Each .metal file becomes one source string in which `#include "x"` lines
// naming HEADER (flashmetal_kernels.h) or a sibling .h file are replaced by that file's text
// (the Metal compiler cannot resolve quoted includes of a source-compiled
// library). `#line` directives around every inlined file make a Metal compile
// error name the real file and line. Kernel host names are read from
// INSTANTIATE_KERNEL("name", ...).
// Plain libc I/O: the project keeps Foundation out of everything but the
// macOS Metal backend. Only standard-library API that exists on every macOS
// the package supports: firstRange(of:) and String.contains(String) are
// macOS 13+ without Foundation, so substring search is done on UTF-8 bytes.
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

func fail(_ message: String) -> Never {
    fputs("ShaderEmbedder: \(message)\n", stderr)
    exit(1)
}

func read(_ path: String) -> String {
    guard let f = fopen(path, "rb") else { fail("cannot read \(path)") }
    defer { fclose(f) }
    var bytes: [UInt8] = []
    var chunk = [UInt8](repeating: 0, count: 65536)
    while true {
        let n = fread(&chunk, 1, chunk.count, f)
        if n > 0 { bytes += chunk[0..<n] }
        if n < chunk.count { break }
    }
    return String(decoding: bytes, as: UTF8.self)
}

func write(_ text: String, to path: String) {
    guard let f = fopen(path, "wb") else { fail("cannot write \(path)") }
    defer { fclose(f) }
    let bytes = Array(text.utf8)
    if fwrite(bytes, 1, bytes.count, f) != bytes.count { fail("short write to \(path)") }
}

func fileName(_ path: String) -> String { String(path.split(separator: "/").last ?? Substring(path)) }

let sourcesOnly = CommandLine.arguments.dropFirst().first == "--sources"
let args = Array(CommandLine.arguments.dropFirst(sourcesOnly ? 2 : 1))
guard args.count >= 2 else { fail("usage: ShaderEmbedder [--sources] OUTPUT HEADER FILE...") }
let output = args[0]
let files = Array(args.dropFirst(2))

var includable: [String: String] = [fileName(args[1]): args[1]]
for f in files where f.hasSuffix(".h") { includable[fileName(f)] = f }

/// Where `needle` first occurs in `hay`, by UTF-8 bytes.
func firstOffset(of needle: String, in hay: Substring) -> Int? {
    let n = Array(needle.utf8), h = Array(hay.utf8)
    guard !n.isEmpty, h.count >= n.count else { return n.isEmpty ? 0 : nil }
    return (0...(h.count - n.count)).first { i in h[i..<(i + n.count)].elementsEqual(n) }
}

/// Inlines quoted includes, each file once (as an include guard would).
/// `#line` before each file's first line and after each inlined file keeps
/// compiler diagnostics pointing at the original file and line.
func inline(_ path: String, seen: inout Set<String>) -> String {
    let name = fileName(path)
    var out: [String] = ["#line 1 \"\(name)\""]
    for (number, line) in read(path).split(separator: "\n", omittingEmptySubsequences: false).enumerated() {
        let t = line.drop { $0 == " " || $0 == "\t" }
        if t.hasPrefix("#include \""), let target = t.split(separator: "\"").dropFirst().first.map(String.init),
           let targetPath = includable[target] {
            if seen.insert(target).inserted {
                out.append("// ---- begin \(target) (inlined) ----")
                out.append(inline(targetPath, seen: &seen))
                out.append("// ---- end \(target) ----")
            }
            out.append("#line \(number + 2) \"\(name)\"")
            continue
        }
        out.append(String(line))
    }
    return out.joined(separator: "\n")
}

func kernelNames(_ source: String) -> [String] {
    let marker = "INSTANTIATE_KERNEL(\""
    return source.split(separator: "\n").compactMap { line -> String? in
        guard let at = firstOffset(of: marker, in: line) else { return nil }
        let after = line.utf8.dropFirst(at + marker.utf8.count)
        return after.firstIndex(of: UInt8(ascii: "\"")).map { String(decoding: after[..<$0], as: UTF8.self) }
    }
}

/// A raw-string delimiter that does not occur in the text.
func literal(_ text: String) -> String {
    var hashes = "#"
    let whole = Substring(text)
    while firstOffset(of: "\"\(hashes)", in: whole) != nil || firstOffset(of: "\(hashes)\"", in: whole) != nil {
        hashes += "#"
    }
    return "\(hashes)\"\"\"\n\(text)\n\"\"\"\(hashes)"
}

var sources: [(String, String)] = []
var kernels: [(String, String)] = []
for f in files where f.hasSuffix(".metal") {
    var seen = Set<String>()
    let name = fileName(f)
    sources.append((name, inline(f, seen: &seen)))
    for k in kernelNames(read(f)) { kernels.append((k, name)) }
}

if sourcesOnly {
    for (name, text) in sources { write(text + "\n", to: "\(output)/\(name)") }
    exit(0)
}

var swift = "// Generated by ShaderEmbedder from Resources/shaders. Do not edit.\n"
swift += "public enum EmbeddedShaders {\n"
swift += "    /// Metal source per shader file, shared header inlined.\n"
swift += "    public static let sources: [String: String] = [\n"
for (name, text) in sources { swift += "        \"\(name)\": \(literal(text)),\n" }
swift += sources.isEmpty ? "        :\n" : ""
swift += "    ]\n\n"
swift += "    /// Shader file of each kernel host name.\n"
swift += "    public static let kernelFiles: [String: String] = [\n"
for (k, f) in kernels { swift += "        \"\(k)\": \"\(f)\",\n" }
swift += kernels.isEmpty ? "        :\n" : ""
swift += "    ]\n}\n"
write(swift, to: output)
