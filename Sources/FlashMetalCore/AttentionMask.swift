import CFlashMetal

/// The additive-or-bool attention mask of prefill and sdpa: `[qL, kL]`
/// broadcast over batch and heads, or `[B, H, qL, kL]`.
public enum AttentionMask {
    /// Validates `mask` for an op with I/O dtype `io` and returns its
    /// (batch, head, row) element strides.
    public static func params(_ mask: TensorRef, io: DType, batch: Int, heads: Int, qL: Int, kL: Int,
                              op: String) throws -> AttnMaskParams {
        if mask.dtype != io && mask.dtype != .bool {
            throw FlashMetalError.type(op, "mask must be \(io.name) (additive) or bool, got \(mask.dtype.name)")
        }
        try mask.requireRank([2, 4], op: op, name: "mask")
        let want = mask.rank == 2 ? [qL, kL] : [batch, heads, qL, kL]
        if mask.shape != want {
            throw FlashMetalError.value(op, "mask shape \(mask.shape) must be \(want) (rank \(mask.rank))")
        }
        try mask.requireBytes(op: op, name: "mask")
        let (ql64, kl64) = (Int64(qL), Int64(kL))
        return AttnMaskParams(M_strides: mask.rank == 2
            ? (0, 0, kl64)
            : (Int64(heads) * ql64 * kl64, ql64 * kl64, kl64))
    }
}
