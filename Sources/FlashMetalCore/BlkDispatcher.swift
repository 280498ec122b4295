import CFlashMetal

/// The host logic of the tile-skip pre-pass `flash_attn_prefill_blk_*`.
/// Classifies each (BQ, BK) tile of a [qL, kL] additive mask: 0 = every cell
/// <= -1e30 (skip the tile), 2 = every cell exactly 0 (skip the mask add),
/// else 1. A partial right-edge K tile is always 1. (BQ, BK) are those of
/// the prefill that consumes the blk (PrefillCapability for its head dim).
///
/// Grid (NK, NQ, 1) of 32 threads; buffers BlkBuffer (mask, blk, BlkParams);
/// int constants blk_bq/blk_bk (FunctionConstantIndex).
public enum BlkDispatcher {
    /// The op name errors carry.
    public static let op = "flash_attn_prefill_blk"
    /// The op name of fm_blk_byte_len's errors.
    public static let sizeOp = "blk_byte_len"

    /// Tile counts (NQ, NK) for a [qL, kL] mask consumed by a prefill of `headDim`.
    public static func tiles(qL: Int, kL: Int, headDim: Int, op: String = sizeOp) throws -> (nq: Int, nk: Int) {
        try Checks.positive("q_len", qL, op: op, arg: "q_len")
        try Checks.positive("kv_len", kL, op: op, arg: "kv_len")
        if qL > Int(Int32.max) || kL > Int(Int32.max) {
            throw FlashMetalError.value(op, "q_len (\(qL)) and kv_len (\(kL)) must fit in int32", arg: "q_len")
        }
        let geo = try PrefillCapability.geometry(headDim: headDim, op: op)
        return ((qL + geo.bq - 1) / geo.bq, (kL + geo.bk - 1) / geo.bk)
    }

    /// Bytes of a blk buffer: NQ*NK rounded up to a multiple of 32, at least 32.
    public static func byteLength(qL: Int, kL: Int, headDim: Int, op: String = sizeOp) throws -> Int {
        let (nq, nk) = try tiles(qL: qL, kL: kL, headDim: headDim, op: op)
        let (raw, o) = nq.multipliedReportingOverflow(by: nk)
        if o || raw > Int.max - 31 {
            throw FlashMetalError.value(op, "nq (\(nq)) * nk (\(nk)) overflows")
        }
        return max((raw + 31) & ~31, 32)
    }

    /// Validates a call and builds its dispatch. Preconditions: a rank-2
    /// mask in BlkCapability.maskTypes, a prefill head dim, a uint8 blk_out
    /// of at least NQ*NK bytes.
    public static func makeDispatch(mask: TensorRef, blk: TensorRef, headDim: Int) throws -> Dispatch {
        try mask.requireRank([2], op: op, name: "mask")
        try mask.requireDType(BlkCapability.maskTypes, op: op, name: "mask")
        try blk.requireDType([.u8], op: op, name: "blk_out")
        let (qL, kL) = (mask.shape[0], mask.shape[1])
        let (nq, nk) = try tiles(qL: qL, kL: kL, headDim: headDim, op: op)
        try mask.requireBytes(op: op, name: "mask")
        let need = nq * nk
        if blk.byteCount < need {
            throw FlashMetalError.value(op, "blk_out buffer too small: expected at least \(need) bytes (NQ=\(nq), NK=\(nk)), got \(blk.byteCount)", arg: "blk_out")
        }
        // A tagged blk (fm_alloc_blk) is trusted by prefill for the geometry
        // it was allocated for: filling it for another one would be a silent
        // wrong result there.
        try BlkAllocations.requireMadeFor(blk, headDim: headDim, qL: qL, kL: kL, op: op, name: "blk_out")
        let geo = try PrefillCapability.geometry(headDim: headDim, op: op)
        let params = BlkParams(seq_len_q: Int32(qL), seq_len_k: Int32(kL), mask_row_stride: Int32(kL), _pad: 0)
        return Dispatch(
            kernel: .blk(mask: mask.dtype),
            constants: FunctionConstants([(FunctionConstantIndex.blkBQ, .int(Int32(geo.bq))),
                                          (FunctionConstantIndex.blkBK, .int(Int32(geo.bk)))]),
            grid: Size3(nk, nq, 1), threadgroup: Size3(32, 1, 1),
            bindings: [BlkBuffer.mask: .buffer(mask), BlkBuffer.out: .buffer(blk),
                       BlkBuffer.params: .bytes(bytesOf(params))],
            writes: [BlkBuffer.out])
    }
}
