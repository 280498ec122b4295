import CFlashMetal
import FlashMetalCore

/// fm_blk_byte_len of flashmetal.h: the byte length of a blk for a mask and head dim.
@_cdecl("fm_blk_byte_len")
public func fm_blk_byte_len(_ qLen: Int64, _ kLen: Int64, _ headDim: Int32, _ out: UnsafeMutablePointer<Int>?,
                            _ err: UnsafeMutablePointer<FMError>?) -> Int32 {
    guarded(err) {
        guard let out = out else { throw FlashMetalError.value(BlkDispatcher.sizeOp, "out is null", arg: "out") }
        out.pointee = try BlkDispatcher.byteLength(qL: Int(qLen), kL: Int(kLen), headDim: Int(headDim))
    }
}

/// fm_alloc_blk of flashmetal.h: a zeroed, tagged, library-owned blk buffer.
@_cdecl("fm_alloc_blk")
public func fm_alloc_blk(_ qLen: Int64, _ kLen: Int64, _ headDim: Int32, _ out: UnsafeMutablePointer<FMTensor>?,
                         _ err: UnsafeMutablePointer<FMError>?) -> Int32 {
    guarded(err) {
        let op = "alloc_blk"
        guard let out = out else { throw FlashMetalError.value(op, "out is null", arg: "out") }
        let bytes = try BlkDispatcher.byteLength(qL: Int(qLen), kL: Int(kLen), headDim: Int(headDim), op: op)
        let (nq, nk) = try BlkDispatcher.tiles(qL: Int(qLen), kL: Int(kLen), headDim: Int(headDim), op: op)
        let (p, tag) = try BlkAllocations.allocate(bytes: bytes, headDim: Int(headDim), qL: Int(qLen),
                                                   kL: Int(kLen), op: op)
        var t = FMTensor()
        t.data = p
        t.tag = tag
        t.nbytes = UInt64(bytes)
        t.dtype = DType.u8.rawValue
        t.ndim = 2
        t.shape.0 = Int64(nq)
        t.shape.1 = Int64(nk)
        out.pointee = t
    }
}

/// fm_free_blk of flashmetal.h: frees a live tagged blk; a stale copy is an error.
@_cdecl("fm_free_blk")
public func fm_free_blk(_ blk: UnsafeMutablePointer<FMTensor>?, _ err: UnsafeMutablePointer<FMError>?) -> Int32 {
    guarded(err) {
        let op = "free_blk"
        guard let blk = blk else { throw FlashMetalError.value(op, "blk is null", arg: "blk") }
        guard let p = blk.pointee.data else { return }
        try BlkAllocations.free(tag: blk.pointee.tag, data: p, op: op)
        blk.pointee.data = nil
        blk.pointee.nbytes = 0
        blk.pointee.tag = 0
    }
}

/// fm_dispatch_blk of flashmetal.h: runs the blk pre-pass over an additive mask.
@_cdecl("fm_dispatch_blk")
public func fm_dispatch_blk(_ registry: OpaquePointer?, _ mask: UnsafePointer<FMTensor>?,
                            _ blkOut: UnsafePointer<FMTensor>?, _ headDim: Int32,
                            _ err: UnsafeMutablePointer<FMError>?) -> Int32 {
    guarded(err) {
        let op = BlkDispatcher.op
        let reg = try Handles.registry(registry, op: op)
        let m = try TensorRef(mask, op: op, name: "mask")
        let b = try TensorRef(blkOut, op: op, name: "blk_out")
        try reg.run([BlkDispatcher.makeDispatch(mask: m, blk: b, headDim: Int(headDim))], op: op)
    }
}
