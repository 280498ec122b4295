import CFlashMetal
import FlashMetalCore

/// fm_dispatch_sdpa of flashmetal.h: the simple fused SDPA.
@_cdecl("fm_dispatch_sdpa")
public func fm_dispatch_sdpa(
    _ registry: OpaquePointer?, _ q: UnsafePointer<FMTensor>?, _ k: UnsafePointer<FMTensor>?,
    _ v: UnsafePointer<FMTensor>?, _ mask: UnsafePointer<FMTensor>?, _ out: UnsafePointer<FMTensor>?,
    _ options: UnsafePointer<FMSdpaOptions>?,
    _ err: UnsafeMutablePointer<FMError>?
) -> Int32 {
    guarded(err) {
        let op = SdpaDispatcher.op
        let reg = try Handles.registry(registry, op: op)
        guard let options = options else { throw FlashMetalError.value(op, "options is null", arg: "options") }
        try reg.run([SdpaDispatcher.makeDispatch(
            q: try TensorRef(q, op: op, name: "q"), k: try TensorRef(k, op: op, name: "k"),
            v: try TensorRef(v, op: op, name: "v"), mask: try optionalTensor(mask, op: op, name: "mask"),
            out: try TensorRef(out, op: op, name: "out"),
            try SdpaOptions(options.pointee))], op: op)
    }
}
