import CFlashMetal

/// The tensors and flags of one rotary call.
public struct RotaryTensors {
    /// [B, L, H, D] rows to rotate.
    public var x: TensorRef
    /// [seqlen_ro, rotary_dim / 2] tables, one float dtype.
    public var cos: TensorRef, sin: TensorRef
    /// int32 [B]: each sequence's first position.
    public var offsets: TensorRef
    /// [B, L, H, D] of x's dtype: the rotated rows.
    public var out: TensorRef
    /// Pairs (2j, 2j+1) (GPT-J) instead of (j, j + rotary_dim/2) (GPT-NeoX).
    public var interleaved: Bool
    /// Row i of a sequence at offsets[b] + i; else every row at offsets[b].
    public var perRow: Bool
    /// The caller's name of x in errors.
    public var xName = "x"

    /// The tensors and flags of a call.
    public init(x: TensorRef, cos: TensorRef, sin: TensorRef, offsets: TensorRef, out: TensorRef,
                interleaved: Bool, perRow: Bool) {
        self.x = x; self.cos = cos; self.sin = sin; self.offsets = offsets; self.out = out
        self.interleaved = interleaved; self.perRow = perRow
    }
}

/// rotary (flash_attn_with_kvcache's rotary_cos/rotary_sin, flash-attn's
/// apply_rotary_emb with seqlen_offsets): x rotated into out. Every position
/// a row reads is checked against seqlen_ro before the dispatch is made.
///
/// Grid (L, H, B) of RotaryCapability.threads threads; buffers RotaryBuffer.
public enum RotaryDispatcher {
    /// The op name errors carry.
    public static let op = "rotary"

    /// Validates a call and builds its dispatch; nil when x has no rows
    /// (L == 0), after the same validation.
    public static func makeDispatch(_ t: RotaryTensors) throws -> Dispatch? {
        let types = RotaryCapability.types
        try t.x.requireDType(types, op: op, name: t.xName)
        try t.cos.requireDType(types, op: op, name: "rotary_cos")
        if t.sin.dtype != t.cos.dtype {
            throw FlashMetalError.type(op, "rotary_sin dtype \(t.sin.dtype.name) does not match rotary_cos dtype \(t.cos.dtype.name)", arg: "rotary_sin")
        }
        if t.out.dtype != t.x.dtype {
            throw FlashMetalError.type(op, "out dtype \(t.out.dtype.name) does not match \(t.xName) dtype \(t.x.dtype.name)", arg: "out")
        }
        for (x, n) in [(t.x, t.xName), (t.out, "out")] {
            try x.requireRank([4], op: op, name: n)
            try x.requireBytes(op: op, name: n)
        }
        for (x, n) in [(t.cos, "rotary_cos"), (t.sin, "rotary_sin")] {
            try x.requireRank([2], op: op, name: n)
            try x.requireBytes(op: op, name: n)
        }
        try Checks.sameShape(t.out, "out", as: t.x, t.xName, op: op)
        try Checks.sameShape(t.sin, "rotary_sin", as: t.cos, "rotary_cos", op: op)
        let (batch, rows, heads, d) = (t.x.shape[0], t.x.shape[1], t.x.shape[2], t.x.shape[3])
        let (seqlenRo, half) = (t.cos.shape[0], t.cos.shape[1])
        try Checks.positive("batch", batch, op: op, arg: t.xName)
        try Checks.positive("the \(t.xName) heads", heads, op: op, arg: t.xName)
        try Checks.positive("head_dim", d, op: op, arg: t.xName)
        if half == 0 || half > d / 2 {
            throw FlashMetalError.value(
                op, "rotary_cos must be [seqlen_ro, rotary_dim / 2] with 0 < rotary_dim <= head_dim (\(d)), got shape "
                    + "\(t.cos.shape) (rotary_dim \(2 * half))", arg: "rotary_cos")
        }
        let limit = Int(Int32.max)
        if [rows, heads, d, seqlenRo].contains(where: { $0 > limit }) {
            throw FlashMetalError.value(op, "\(t.xName)'s dims and seqlen_ro must fit int32", arg: t.xName)
        }
        try SequenceTables.requireInt32(t.offsets, shape: [batch], op: op, name: "cache_seqlens")
        let span = rows == 0 ? 0 : (t.perRow ? rows : 1)
        for b in 0..<batch {
            let start = SequenceTables.int32(t.offsets, b)
            if start < 0 || start + span > seqlenRo {
                let last = t.perRow ? "cache_seqlens[\(b)] + \(rows) rows of \(t.xName) - 1 = \(start + span - 1)"
                    : "cache_seqlens[\(b)] = \(start)"
                throw FlashMetalError.value(
                    op, "the position \(last) is outside rotary_cos's positions [0, \(seqlenRo)) (its dim 0, seqlen_ro)",
                    arg: start < 0 ? "cache_seqlens" : "rotary_cos")
            }
        }
        if rows == 0 { return nil }

        let params = RotaryParams(n_rows: Int32(rows), n_heads: Int32(heads), head_dim: Int32(d),
                                  rotary_half: Int32(half), interleaved: t.interleaved ? 1 : 0,
                                  per_row: t.perRow ? 1 : 0)
        let bindings: [Int: Binding] = [
            RotaryBuffer.params: .bytes(bytesOf(params)), RotaryBuffer.x: .buffer(t.x),
            RotaryBuffer.cos: .buffer(t.cos), RotaryBuffer.sin: .buffer(t.sin),
            RotaryBuffer.offsets: .buffer(t.offsets), RotaryBuffer.out: .buffer(t.out),
        ]
        return Dispatch(kernel: .rotary(x: t.x.dtype, tables: t.cos.dtype), grid: Size3(rows, heads, batch),
                        threadgroup: Size3(RotaryCapability.threads, 1, 1), bindings: bindings,
                        writes: [RotaryBuffer.out])
    }
}
