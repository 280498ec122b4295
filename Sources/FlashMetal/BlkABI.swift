import CFlashMetal
import FlashMetalCore
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// Buffers handed out by fm_alloc_blk; fm_free_blk frees only these.
enum BlkAllocations {
    private static let lock = Lock()
    nonisolated(unsafe) private static var live: Set<UnsafeMutableRawPointer> = []

    static func insert(_ p: UnsafeMutableRawPointer) { lock.withLock { _ = live.insert(p) } }
    static func remove(_ p: UnsafeMutableRawPointer) -> Bool { lock.withLock { live.remove(p) != nil } }
}

@_cdecl("fm_blk_byte_len")
public func fm_blk_byte_len(_ qLen: Int64, _ kLen: Int64, _ headDim: Int32, _ out: UnsafeMutablePointer<Int>?,
                            _ err: UnsafeMutablePointer<CChar>?, _ errlen: Int) -> Int32 {
    guarded(err, errlen) {
        guard let out = out else { throw FlashMetalError.value(BlkDispatcher.sizeOp, "out is null") }
        out.pointee = try BlkDispatcher.byteLength(qL: Int(qLen), kL: Int(kLen), headDim: Int(headDim))
    }
}

@_cdecl("fm_alloc_blk")
public func fm_alloc_blk(_ qLen: Int64, _ kLen: Int64, _ headDim: Int32, _ out: UnsafeMutablePointer<FMTensor>?,
                         _ err: UnsafeMutablePointer<CChar>?, _ errlen: Int) -> Int32 {
    guarded(err, errlen) {
        let op = "alloc_blk"
        guard let out = out else { throw FlashMetalError.value(op, "out is null") }
        let bytes = try BlkDispatcher.byteLength(qL: Int(qLen), kL: Int(kLen), headDim: Int(headDim), op: op)
        let (nq, nk) = try BlkDispatcher.tiles(qL: Int(qLen), kL: Int(kLen), headDim: Int(headDim), op: op)
        guard let p = calloc(bytes, 1) else {
            throw FlashMetalError.value(op, "cannot allocate \(bytes) bytes")
        }
        BlkAllocations.insert(p)
        var t = FMTensor()
        t.data = p
        t.nbytes = UInt64(bytes)
        t.dtype = DType.u8.rawValue
        t.ndim = 2
        t.shape.0 = Int64(nq)
        t.shape.1 = Int64(nk)
        out.pointee = t
    }
}

@_cdecl("fm_free_blk")
public func fm_free_blk(_ blk: UnsafeMutablePointer<FMTensor>?, _ err: UnsafeMutablePointer<CChar>?,
                        _ errlen: Int) -> Int32 {
    guarded(err, errlen) {
        let op = "free_blk"
        guard let blk = blk else { throw FlashMetalError.value(op, "blk is null") }
        guard let p = blk.pointee.data else { return }
        guard BlkAllocations.remove(p) else {
            throw FlashMetalError.value(op, "blk data \(p) was not allocated by fm_alloc_blk (or was already freed)")
        }
        free(p)
        blk.pointee.data = nil
        blk.pointee.nbytes = 0
    }
}

@_cdecl("fm_dispatch_blk")
public func fm_dispatch_blk(_ registry: OpaquePointer?, _ mask: UnsafePointer<FMTensor>?,
                            _ blkOut: UnsafePointer<FMTensor>?, _ headDim: Int32,
                            _ err: UnsafeMutablePointer<CChar>?, _ errlen: Int) -> Int32 {
    guarded(err, errlen) {
        let op = BlkDispatcher.op
        let reg = try Handles.registry(registry, op: op)
        let m = try TensorRef(mask, op: op, name: "mask")
        let b = try TensorRef(blkOut, op: op, name: "blk_out")
        try reg.run([BlkDispatcher.makeDispatch(mask: m, blk: b, headDim: Int(headDim))])
    }
}
