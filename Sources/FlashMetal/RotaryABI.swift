import CFlashMetal
import FlashMetalCore

/// fm_dispatch_rotary of flashmetal.h: x rotated into out with the cos/sin
/// tables at each sequence's positions; every position is checked first.
@_cdecl("fm_dispatch_rotary")
public func fm_dispatch_rotary(
    _ registry: OpaquePointer?, _ x: UnsafePointer<FMTensor>?, _ cos: UnsafePointer<FMTensor>?,
    _ sin: UnsafePointer<FMTensor>?, _ offsets: UnsafePointer<FMTensor>?, _ out: UnsafePointer<FMTensor>?,
    _ interleaved: Int32, _ perRow: Int32, _ xName: UnsafePointer<CChar>?,
    _ err: UnsafeMutablePointer<FMError>?
) -> Int32 {
    guarded(err) {
        let op = RotaryDispatcher.op
        let reg = try Handles.registry(registry, op: op)
        let name = xName.map { String(cString: $0) } ?? "x"
        let xs = try TensorRef(x, op: op, name: name)
        let (c, s) = (try TensorRef(cos, op: op, name: "rotary_cos"), try TensorRef(sin, op: op, name: "rotary_sin"))
        let o = try TensorRef(out, op: op, name: "out")
        let tables = [try TensorRef(offsets, op: op, name: "cache_seqlens")]
        try reg.withPrivateCopies(op: op, tables) { copies in
            var t = RotaryTensors(x: xs, cos: c, sin: s, offsets: copies[0]!, out: o, interleaved: interleaved != 0,
                                  perRow: perRow != 0)
            t.xName = name
            if let d = try RotaryDispatcher.makeDispatch(t) { try reg.run([d], op: op) }
        }
    }
}
