import CFlashMetal
import FlashMetalCore

/// fm_build_mask of flashmetal.h: fills a [qL, kL] causal/window mask.
@_cdecl("fm_build_mask")
public func fm_build_mask(_ registry: OpaquePointer?, _ out: UnsafePointer<FMTensor>?,
                          _ options: UnsafePointer<FMMaskOptions>?,
                          _ err: UnsafeMutablePointer<FMError>?) -> Int32 {
    guarded(err) {
        let op = MaskDispatcher.op
        let reg = try Handles.registry(registry, op: op)
        guard let options = options else { throw FlashMetalError.value(op, "options is null", arg: "options") }
        let o = try TensorRef(out, op: op, name: "out")
        try reg.run([MaskDispatcher.makeDispatch(out: o, try MaskOptions(options.pointee))], op: op)
    }
}
