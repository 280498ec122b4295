import FlashMetalCPU
import FlashMetalCore
#if canImport(Metal)
import FlashMetalMetal
#endif
#if canImport(FlashMetalSimBackend)
import FlashMetalSimBackend
#endif
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// Names a backend: "auto" is metal on macOS, else cpu; FLASHMETAL_BACKEND
/// overrides "auto". On Linux the Metal backend runs on the metal-sim
/// runtime as "metal-sim" (never chosen by "auto").
enum BackendFactory {
    static var available: [String] {
        var names = ["cpu"]
        #if canImport(Metal) && os(Linux)
        names.append("metal-sim")
        #elseif canImport(Metal)
        names.append("metal")
        #endif
        #if canImport(FlashMetalSimBackend)
        names.append("sim")
        #endif
        return names
    }

    static func resolve(_ requested: String) -> String {
        guard requested == "auto" else { return requested }
        // FLASHMETAL_BACKEND=auto is the same as not setting it.
        if let env = getenv("FLASHMETAL_BACKEND"), !String(cString: env).isEmpty, String(cString: env) != "auto" {
            return String(cString: env)
        }
        #if canImport(Metal) && !os(Linux)
        return "metal"
        #else
        return "cpu"
        #endif
    }

    static func make(_ requested: String) throws -> Backend {
        let name = resolve(requested)
        switch name {
        case "cpu":
            return CPUBackend()
        #if canImport(Metal) && os(Linux)
        case "metal-sim":
            return try MetalBackend()
        #elseif canImport(Metal)
        case "metal":
            return try MetalBackend()
        #endif
        #if canImport(FlashMetalSimBackend)
        case "sim":
            return SimBackend()
        #endif
        default:
            let via = name == requested ? "" : " (from FLASHMETAL_BACKEND for 'auto')"
            throw FlashMetalError.value(
                "create_registry", "unknown or unavailable backend '\(name)'\(via); available: auto, "
                    + available.joined(separator: ", "), arg: "backend")
        }
    }
}
