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
        let (kn, vn) = (try TensorRef(kNew, op: op, name: kNewName), try TensorRef(vNew, op: op, name: vNewName))
        let (kc, vc) = (try TensorRef(kCache, op: op, name: "k_cache"), try TensorRef(vCache, op: op, name: "v_cache"))
        let tables = [try TensorRef(cacheSeqlens, op: op, name: "cache_seqlens"),
                      try optionalTensor(blockTable, op: op, name: "block_table")]
        try reg.withPrivateCopies(op: op, tables) { c in
            var t = KVAppendTensors(kNew: kn, vNew: vn, kCache: kc, vCache: vc, seqlens: c[0]!, blockTable: c[1])
            (t.kNewName, t.vNewName) = (kNewName, vNewName)
            if let d = try KVAppendDispatcher.makeDispatch(t) { try reg.run([d], op: op) }
        }
    }
}
