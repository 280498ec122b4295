/// The function constants of a library's source, as Metal's compiler knows
/// them: each declaration (`FUNCTION_CONSTANT(type, name, index)`) and, per
/// kernel, the ones it reads. A kernel reads a constant when its function
/// (parameters included), a function it calls, or a constant expression it
/// reads names it outside `is_function_constant_defined(...)`. makeFunction fails when one of
/// those is unset or set with another type.
/// https://developer.apple.com/documentation/metal/mtllibrary/makefunction(name:constantvalues:completionhandler:)
/// https://developer.apple.com/documentation/metal/mtlfunctionconstantvalues/setconstantvalue(_:type:index:)
struct FunctionConstantTable {
    struct Declaration {
        let name: String
        let type: String
        let index: Int
    }
    private(set) var declared: [String: Declaration] = [:]
    /// FUNCTION_CONSTANT_EXPR names → the identifiers of their expressions.
    private var expressions: [String: Set<String>] = [:]
    /// Top-level function names → the identifiers of their bodies.
    private var functions: [String: Set<String>] = [:]
    /// Kernel host names → their template function (INSTANTIATE_KERNEL).
    private var kernels: [String: String] = [:]

    init(source: String) {
        let text = Self.withoutComments(source)
        for line in text.split(separator: "\n") {
            let l = line.drop(while: { $0 == " " })
            if let args = Self.arguments(l, of: "FUNCTION_CONSTANT"), args.count == 3, let i = Int(args[2]) {
                declared[args[1]] = Declaration(name: args[1], type: args[0], index: i)
            } else if let args = Self.arguments(l, of: "FUNCTION_CONSTANT_EXPR"), args.count >= 3 {
                expressions[args[1]] = Self.identifiers(args[2...].joined(separator: ","))
            } else if let args = Self.arguments(l, of: "INSTANTIATE_KERNEL"), args.count >= 2 {
                kernels[String(args[0].filter { $0 != "\"" })] = args[1]
            }
        }
        functions = Self.topLevelFunctions(text)
    }

    /// The constants kernel `host` reads, by index.
    func required(byKernel host: String) -> [Declaration] {
        guard let root = kernels[host] else { return [] }
        var seen: Set<String> = [], stack = [root], out: [Int: Declaration] = [:]
        while let name = stack.popLast() {
            guard seen.insert(name).inserted else { continue }
            if let d = declared[name] { out[d.index] = d }
            stack.append(contentsOf: functions[name] ?? expressions[name] ?? [])
        }
        return out.values.sorted { $0.index < $1.index }
    }

    /// The MTLDataType a declared type is set with.
    static func dataType(_ type: String) -> MTLDataType? {
        switch type {
        case "bool": return .bool
        case "int": return .int
        case "uint": return .uint
        case "float": return .float
        default: return nil
        }
    }

    private static func withoutComments(_ s: String) -> String {
        var out = "", i = s.startIndex
        while i < s.endIndex {
            let rest = s[i...]
            if rest.hasPrefix("//") {
                i = rest.firstIndex(of: "\n") ?? s.endIndex
            } else if rest.hasPrefix("/*") {
                var j = s.index(i, offsetBy: 2)
                while j < s.endIndex && !s[j...].hasPrefix("*/") { j = s.index(after: j) }
                i = j < s.endIndex ? s.index(j, offsetBy: 2) : s.endIndex
                out += " "
            } else {
                out.append(s[i])
                i = s.index(after: i)
            }
        }
        return out
    }

    /// The comma-separated arguments of `name(...)` starting the line.
    private static func arguments(_ line: Substring, of name: String) -> [String]? {
        guard line.hasPrefix(name + "("), let close = line.lastIndex(of: ")") else { return nil }
        let inner = line[line.index(line.startIndex, offsetBy: name.count + 1)..<close]
        return inner.split(separator: ",").map { String($0).trimmingSpaces }
    }

    private static func isIdentifier(_ c: Character) -> Bool { c == "_" || c.isLetter || c.isNumber }

    /// Identifiers of `s`, leaving out those inside is_function_constant_defined(...).
    static func identifiers(_ s: String) -> Set<String> {
        var out: Set<String> = [], cur = "", skipNext = false
        for c in s + " " {
            if isIdentifier(c) {
                cur.append(c)
                continue
            }
            if !cur.isEmpty {
                if cur == "is_function_constant_defined" { skipNext = true }
                else if skipNext { skipNext = false }
                else { out.insert(cur) }
                cur = ""
            }
        }
        return out
    }

    /// Every `name(...) ... { body }` at brace depth 0, by name (overloads
    /// and specialisations merged).
    private static func topLevelFunctions(_ text: String) -> [String: Set<String>] {
        var out: [String: Set<String>] = [:]
        let chars = Array(text)
        var depth = 0, headerStart = 0, bodyStart = 0, name: String?
        for (i, c) in chars.enumerated() {
            switch c {
            case "{":
                if depth == 0 {
                    // The name before the header's last top-level '(' (the
                    // parameter list; macro lines may come before it).
                    var parens = 0, open: Int?
                    for j in headerStart..<i {
                        if chars[j] == "(" {
                            if parens == 0 { open = j }
                            parens += 1
                        } else if chars[j] == ")" {
                            parens -= 1
                        }
                    }
                    name = open.map { o in
                        String(chars[headerStart..<o].reversed().drop(while: { $0 == " " || $0 == "\n" })
                            .prefix(while: isIdentifier).reversed())
                    }
                    // The parameters count as the body: an argument under
                    // [[function_constant(c)]] reads c.
                    bodyStart = open ?? i + 1
                }
                depth += 1
            case "}":
                depth -= 1
                if depth == 0 {
                    if let n = name, !n.isEmpty {
                        out[n, default: []].formUnion(identifiers(String(chars[bodyStart..<i])))
                    }
                    name = nil
                    headerStart = i + 1
                }
            default:
                // A declaration or a directive line ends a header.
                if depth == 0 && (c == ";" || (c == "\n" && i + 1 < chars.count && chars[i + 1] == "#")) {
                    headerStart = i + 1
                }
            }
        }
        return out
    }
}
