import CFlashMetal
import FlashMetalCore
#if canImport(Metal)
import FlashMetalMetal
#endif

/// fm_alloc_host of flashmetal.h: zeroed, 16 KiB-aligned host memory for a
/// long-lived tensor, which the metal backend wraps once for its lifetime.
@_cdecl("fm_alloc_host")
public func fm_alloc_host(_ bytes: Int, _ out: UnsafeMutablePointer<UnsafeMutableRawPointer?>?,
                          _ err: UnsafeMutablePointer<FMError>?) -> Int32 {
    guarded(err) {
        guard let out else { throw FlashMetalError.value("alloc_host", "out is null") }
        out.pointee = nil
        out.pointee = try HostAllocations.allocate(bytes: bytes, op: "alloc_host").base
    }
}

/// fm_free_host of flashmetal.h: frees memory from fm_alloc_host.
@_cdecl("fm_free_host")
public func fm_free_host(_ p: UnsafeMutableRawPointer?, _ err: UnsafeMutablePointer<FMError>?) -> Int32 {
    guarded(err) { try HostAllocations.free(p, op: "free_host") }
}

/// fm_registry_device of flashmetal.h: the GPU a metal or metal-sim registry
/// runs on ("" for the other backends).
@_cdecl("fm_registry_device")
public func fm_registry_device(_ registry: OpaquePointer?, _ name: UnsafeMutablePointer<CChar>?,
                               _ len: Int) -> Int32 {
    var device = ""
    let status = guarded(nil) {
        let backend = try Handles.registry(registry, op: "registry_device").backend
        #if canImport(Metal)
        if let m = backend as? MetalBackend { device = m.deviceName }
        #endif
    }
    writeMessage(device, name, len)
    return status
}
