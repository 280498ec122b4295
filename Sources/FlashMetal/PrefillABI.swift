import CFlashMetal
import FlashMetalCore

/// fm_dispatch_prefill of flashmetal.h: one tiled flash-attention prefill.
@_cdecl("fm_dispatch_prefill")
public func fm_dispatch_prefill(
    _ registry: OpaquePointer?, _ q: UnsafePointer<FMTensor>?, _ k: UnsafePointer<FMTensor>?,
    _ v: UnsafePointer<FMTensor>?, _ mask: UnsafePointer<FMTensor>?, _ blk: UnsafePointer<FMTensor>?,
    _ out: UnsafePointer<FMTensor>?, _ options: UnsafePointer<FMPrefillOptions>?,
    _ err: UnsafeMutablePointer<FMError>?
) -> Int32 {
    guarded(err) { try runPrefill(registry, q, k, v, mask, blk, nil, out, options) }
}

/// fm_dispatch_prefill_sinks of flashmetal.h: fm_dispatch_prefill with
/// per-head sink logits (float32 [H], or NULL) beside the mask.
@_cdecl("fm_dispatch_prefill_sinks")
public func fm_dispatch_prefill_sinks(
    _ registry: OpaquePointer?, _ q: UnsafePointer<FMTensor>?, _ k: UnsafePointer<FMTensor>?,
    _ v: UnsafePointer<FMTensor>?, _ mask: UnsafePointer<FMTensor>?, _ blk: UnsafePointer<FMTensor>?,
    _ sinks: UnsafePointer<FMTensor>?, _ out: UnsafePointer<FMTensor>?,
    _ options: UnsafePointer<FMPrefillOptions>?, _ err: UnsafeMutablePointer<FMError>?
) -> Int32 {
    guarded(err) { try runPrefill(registry, q, k, v, mask, blk, sinks, out, options) }
}

private func runPrefill(
    _ registry: OpaquePointer?, _ q: UnsafePointer<FMTensor>?, _ k: UnsafePointer<FMTensor>?,
    _ v: UnsafePointer<FMTensor>?, _ mask: UnsafePointer<FMTensor>?, _ blk: UnsafePointer<FMTensor>?,
    _ sinks: UnsafePointer<FMTensor>?, _ out: UnsafePointer<FMTensor>?,
    _ options: UnsafePointer<FMPrefillOptions>?
) throws {
    let op = PrefillDispatcher.op
    let reg = try Handles.registry(registry, op: op)
    guard let options = options else { throw FlashMetalError.value(op, "options is null", arg: "options") }
    let tensors = PrefillTensors(
        q: try TensorRef(q, op: op, name: "q"), k: try TensorRef(k, op: op, name: "k"),
        v: try TensorRef(v, op: op, name: "v"), out: try TensorRef(out, op: op, name: "out"),
        mask: try optionalTensor(mask, op: op, name: "mask"),
        blk: try optionalTensor(blk, op: op, name: "blk"),
        sinks: try optionalTensor(sinks, op: op, name: "sinks"))
    let o = try PrefillOptions(options.pointee)
    guard let bytes = try PrefillDispatcher.autoBlkBytes(tensors, o) else {
        try reg.run(PrefillDispatcher.makeDispatches(tensors, o), op: op)
        return
    }
    try reg.withScratch(op: op, bytes: bytes) { scratch in
        try reg.run(PrefillDispatcher.makeDispatches(tensors, o, blkMemory: scratch), op: op)
    }
}
