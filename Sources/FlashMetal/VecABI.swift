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
        let qt = try TensorRef(q, op: op, name: "q")
        let kt = try TensorRef(k, op: op, name: "k")
        let given = try optionalTensor(tmp, op: op, name: "tmp")
        let sg = try optionalTensor(signs, op: op, name: "fwht_signs")
        let v = try TensorRef(v, op: op, name: "v")
        let out = try TensorRef(out, op: op, name: "out")
        if let given = given {
            try reg.run(VecDispatcher.makeDispatches(
                VecTensors(q: qt, k: kt, v: v, out: out, tmp: given, signs: sg), o), op: op)
            return
        }
        // Sized from validated shapes; the full validation runs in makeDispatches.
        let s = try VecDispatcher.shapes(q: qt, k: kt)
        try reg.withScratch(op: op, bytes: VecDispatcher.tmpByteCount(rows: s.rows, headDim: s.headDim)) { tmp in
            try reg.run(VecDispatcher.makeDispatches(
                VecTensors(q: qt, k: kt, v: v, out: out, tmp: tmp, signs: sg), o), op: op)
        }
    }
}
