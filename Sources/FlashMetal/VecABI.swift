import CFlashMetal
import FlashMetalCore

/// fm_dispatch_vec of flashmetal.h: split-KV decode then its reduce; without
/// a caller tmp the library allocates scratch for exactly as long as the work.
@_cdecl("fm_dispatch_vec")
public func fm_dispatch_vec(
    _ registry: OpaquePointer?, _ q: UnsafePointer<FMTensor>?, _ k: UnsafePointer<FMTensor>?,
    _ v: UnsafePointer<FMTensor>?, _ signs: UnsafePointer<FMTensor>?, _ tmp: UnsafePointer<FMTensor>?,
    _ out: UnsafePointer<FMTensor>?, _ options: UnsafePointer<FMVecOptions>?,
    _ err: UnsafeMutablePointer<FMError>?
) -> Int32 {
    guarded(err) {
        let op = VecDispatcher.op
        let reg = try Handles.registry(registry, op: op)
        guard let options = options else { throw FlashMetalError.value(op, "options is null", arg: "options") }
        let o = try VecOptions(options.pointee)
        // The public function the caller runs names the caches its own way.
        let (kName, vName) = vecCacheNames(publicOp(err))
        let qt = try TensorRef(q, op: op, name: "q")
        let kt = try TensorRef(k, op: op, name: kName)
        let given = try optionalTensor(tmp, op: op, name: "tmp")
        let sg = try optionalTensor(signs, op: op, name: "fwht_signs")
        let v = try TensorRef(v, op: op, name: vName)
        let out = try TensorRef(out, op: op, name: "out")
        func tensors(_ tmp: TensorRef) -> VecTensors {
            var t = VecTensors(q: qt, k: kt, v: v, out: out, tmp: tmp, signs: sg)
            (t.kName, t.vName) = (kName, vName)
            return t
        }
        if let given = given {
            try reg.run(VecDispatcher.makeDispatches(tensors(given), o), op: op)
            return
        }
        // Sized from validated shapes; the full validation runs in makeDispatches.
        let s = try VecDispatcher.shapes(q: qt, k: kt, v: v, kName: kName, vName: vName)
        try reg.withScratch(op: op, bytes: VecDispatcher.tmpByteCount(rows: s.rows, headDim: s.headDimV)) { tmp in
            try reg.run(VecDispatcher.makeDispatches(tensors(tmp), o), op: op)
        }
    }
}

/// The names of k and v in the errors of the public function `op` that runs
/// the decode: flash_attn_decode's k_cache/v_cache, the drop-in's key/value,
/// else the C function's own k/v.
func vecCacheNames(_ op: String?) -> (String, String) {
    switch op {
    case VecDispatcher.publicName?: return ("k_cache", "v_cache")
    case "scaled_dot_product_attention"?: return ("key", "value")
    default: return ("k", "v")
    }
}
