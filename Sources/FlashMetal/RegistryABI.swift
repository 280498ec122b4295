import CFlashMetal
import FlashMetalCore

/// The release (FM_VERSION of flashmetal.h), as a static C string.
@_cdecl("fm_version")
public func fm_version() -> UnsafePointer<CChar> {
    return versionString
}

/// The C ABI version this library implements (FM_ABI_VERSION).
@_cdecl("fm_abi_version")
public func fm_abi_version() -> Int32 {
    Int32(FM_ABI_VERSION)
}

/// A static name for a status code.
@_cdecl("fm_status_string")
public func fm_status_string(_ status: Int32) -> UnsafePointer<CChar> {
    statusStrings[status] ?? unknownStatus
}

/// A static C string that lives for the process.
func staticCString(_ s: String) -> UnsafePointer<CChar> {
    let p = UnsafeMutablePointer<CChar>.allocate(capacity: s.utf8.count + 1)
    for (i, b) in s.utf8.enumerated() { p[i] = CChar(bitPattern: b) }
    p[s.utf8.count] = 0
    return UnsafePointer(p)
}

private let versionString = staticCString(FM_VERSION)
private let unknownStatus = staticCString("unknown status")
private let statusStrings: [Int32: UnsafePointer<CChar>] = Dictionary(uniqueKeysWithValues: [
    (FM_OK, "FM_OK"), (FM_ERROR_VALUE, "FM_ERROR_VALUE"), (FM_ERROR_TYPE, "FM_ERROR_TYPE"),
    (FM_ERROR_BACKEND, "FM_ERROR_BACKEND"), (FM_ERROR_INTERNAL, "FM_ERROR_INTERNAL"),
    (FM_ERROR_INTERRUPTED, "FM_ERROR_INTERRUPTED"), (FM_ERROR_UNSUPPORTED, "FM_ERROR_UNSUPPORTED"),
].map { (Int32($0.0.rawValue), staticCString($0.1)) })

/// fm_create_registry of flashmetal.h: a registry on a named backend, as a never-reused handle.
@_cdecl("fm_create_registry")
public func fm_create_registry(_ backend: UnsafePointer<CChar>?, _ out: UnsafeMutablePointer<OpaquePointer?>?,
                               _ err: UnsafeMutablePointer<FMError>?) -> Int32 {
    guarded(err) {
        guard let out = out else { throw FlashMetalError.value("create_registry", "out is null", arg: "out") }
        out.pointee = nil
        let name = backend.map { String(cString: $0) } ?? "auto"
        out.pointee = Handles.register(Registry(backend: try BackendFactory.make(name)))
    }
}

/// fm_destroy_registry of flashmetal.h: ends open batches, then frees the registry.
@_cdecl("fm_destroy_registry")
public func fm_destroy_registry(_ registry: OpaquePointer?) -> Int32 {
    guarded(nil) {
        if let r = registry { try Handles.destroy(r) }
    }
}

/// fm_registry_backend of flashmetal.h: the backend name ("cpu", "sim", "metal").
@_cdecl("fm_registry_backend")
public func fm_registry_backend(_ registry: OpaquePointer?, _ name: UnsafeMutablePointer<CChar>?, _ len: Int) -> Int32 {
    // No error buffer: on failure the name is "" (never a message that could
    // be read as a backend name); fm_status_string describes the status.
    var backend = ""
    let status = guarded(nil) { backend = try Handles.registry(registry, op: "registry_backend").backend.name }
    writeMessage(backend, name, len)
    return status
}

/// fm_backend_names of flashmetal.h: the backends this build can create,
/// comma-separated ("auto" aside).
@_cdecl("fm_backend_names")
public func fm_backend_names(_ names: UnsafeMutablePointer<CChar>?, _ len: Int) {
    writeMessage(BackendFactory.available.joined(separator: ","), names, len)
}

/// fm_registry_defers_work of flashmetal.h: whether the registry's backend
/// runs the work of a batch scope only when the scope ends.
@_cdecl("fm_registry_defers_work")
public func fm_registry_defers_work(_ registry: OpaquePointer?, _ out: UnsafeMutablePointer<Int32>?,
                                    _ err: UnsafeMutablePointer<FMError>?) -> Int32 {
    guarded(err) {
        guard let out = out else { throw FlashMetalError.value("registry_defers_work", "out is null", arg: "out") }
        out.pointee = try Handles.registry(registry, op: "registry_defers_work").backend.defersWork ? 1 : 0
    }
}

/// fm_begin_batch of flashmetal.h: opens a (nestable) batch scope.
@_cdecl("fm_begin_batch")
public func fm_begin_batch(_ registry: OpaquePointer?, _ err: UnsafeMutablePointer<FMError>?) -> Int32 {
    guarded(err) { try Handles.registry(registry, op: "begin_batch").beginBatch() }
}

/// fm_end_batch of flashmetal.h: closes a batch scope; the outermost flushes.
@_cdecl("fm_end_batch")
public func fm_end_batch(_ registry: OpaquePointer?, _ err: UnsafeMutablePointer<FMError>?) -> Int32 {
    guarded(err) { try Handles.registry(registry, op: "end_batch").endBatch() }
}
