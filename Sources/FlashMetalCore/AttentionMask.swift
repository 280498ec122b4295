import CFlashMetal

/// The additive-or-bool attention mask of prefill and sdpa. Its shape
/// broadcasts to `[B, H, qL, kL]` as torch's does, aligned from the right:
/// rank 2 `[qL, kL]`, rank 3 `[H, qL, kL]` or rank 4 `[B, H, qL, kL]`, where
/// each of B, H and qL may be 1 (that axis then has stride 0, so a
/// `[B, 1, qL, kL]` or `[B, 1, 1, kL]` mask is read in place, never expanded).
/// The key axis must be kL.
public enum AttentionMask {
    /// Validates `mask` for an op with I/O dtype `io` and returns its
    /// (batch, head, row) element strides.
    public static func params(_ mask: TensorRef, io: DType, batch: Int, heads: Int, qL: Int, kL: Int,
                              op: String) throws -> AttnMaskParams {
        if mask.dtype != io && mask.dtype != .bool {
            throw FlashMetalError.type(op, "mask must be \(io.name) (additive) or bool, got \(mask.dtype.name)", arg: "mask")
        }
        try mask.requireRank([2, 3, 4], op: op, name: "mask")
        let full = Array([batch, heads, qL, kL].suffix(mask.rank))
        let fits = zip(mask.shape, full).enumerated().allSatisfy { i, p in
            p.0 == p.1 || (p.0 == 1 && i < mask.rank - 1)
        }
        if !fits {
            let want = full.dropLast().map { "\($0)|1" } + ["\(kL)"]
            throw FlashMetalError.value(op, "mask shape \(mask.shape) must be \(full) "
                                        + "(rank \(mask.rank); broadcast: [\(want.joined(separator: ", "))])", arg: "mask")
        }
        try mask.requireBytes(op: op, name: "mask")
        // Element strides of the mask's own (contiguous) shape, 0 on broadcast axes,
        // then padded on the left to (batch, head, row).
        var strides = [Int64](repeating: 0, count: mask.rank)
        var step: Int64 = 1
        for i in stride(from: mask.rank - 1, through: 0, by: -1) {
            strides[i] = mask.shape[i] == 1 ? 0 : step
            step *= Int64(mask.shape[i])
        }
        let lead = [Int64](repeating: 0, count: 4 - mask.rank) + strides
        return AttnMaskParams(M_strides: (lead[0], lead[1], lead[2]))
    }
}
