import CFlashMetal
import FlashMetalCore

/// fm_dispatch_kv_append of flashmetal.h: k_new/v_new written into the
/// (paged) caches at each sequence's current length; every table entry and
/// length is checked before anything is written.
@_cdecl("fm_dispatch_kv_append")
public func fm_dispatch_kv_append(
    _ registry: OpaquePointer?, _ kNew: UnsafePointer<FMTensor>?, _ vNew: UnsafePointer<FMTensor>?,
    _ kCache: UnsafePointer<FMTensor>?, _ vCache: UnsafePointer<FMTensor>?,
    _ cacheSeqlens: UnsafePointer<FMTensor>?, _ blockTable: UnsafePointer<FMTensor>?,
    _ err: UnsafeMutablePointer<FMError>?
) -> Int32 {
    guarded(err) {
        let op = KVAppendDispatcher.op
        let reg = try Handles.registry(registry, op: op)
        // flash_attn_with_kvcache calls the new rows k and v.
        let (kNewName, vNewName) = publicOp(err) == AttnOp.kvcache.name ? ("k", "v") : ("k_new", "v_new")
        var t = KVAppendTensors(
            kNew: try TensorRef(kNew, op: op, name: kNewName), vNew: try TensorRef(vNew, op: op, name: vNewName),
            kCache: try TensorRef(kCache, op: op, name: "k_cache"), vCache: try TensorRef(vCache, op: op, name: "v_cache"),
            seqlens: try TensorRef(cacheSeqlens, op: op, name: "cache_seqlens"),
            blockTable: try optionalTensor(blockTable, op: op, name: "block_table"))
        (t.kNewName, t.vNewName) = (kNewName, vNewName)
        if let d = try KVAppendDispatcher.makeDispatch(t) { try reg.run([d]) }
    }
}
