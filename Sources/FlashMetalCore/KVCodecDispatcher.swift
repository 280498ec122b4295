import CFlashMetal

/// kv_encode and kv_dequantize: rows [..., D] to codes [..., row_bytes] and
/// norms [..., num_blocks] of a KVCodec, and back to float32 [..., D]. The
/// leading shapes must agree. Registry.run refuses outputs that share bytes
/// with another argument. Zero rows make no dispatch.
public enum KVCodecDispatcher {
    /// The op name encode errors carry.
    public static let encodeOp = "kv_encode"
    /// The op name dequantize errors carry.
    public static let dequantizeOp = "kv_dequantize"

    /// The row count of a leading shape, checked against the dispatch limit.
    static func rows(_ lead: [Int], op: String) throws -> Int {
        var n = 1
        for d in lead {
            let (p, o) = n.multipliedReportingOverflow(by: d)
            n = o ? Int.max : p
        }
        if n > KVCodecCapability.maxRows {
            throw FlashMetalError.value(op, "\(n) rows (the product of the leading dims \(lead)) exceed \(KVCodecCapability.maxRows)")
        }
        return n
    }

    /// `t` is [lead..., last] of `dtype`, with its bytes.
    static func require(_ t: TensorRef, _ name: String, dtype: DType, lead: [Int], last: Int, op: String) throws {
        try t.requireDType([dtype], op: op, name: name)
        try t.requireBytes(op: op, name: name)
        if t.shape != lead + [last] {
            throw FlashMetalError.value(op, "\(name) shape \(t.shape) must be \(lead + [last])", arg: name)
        }
    }

    static func dispatch(_ kernel: KernelSpec, _ codec: KVCodec, rows: Int, bindings: [Int: Binding],
                         writes: Set<Int>) -> Dispatch {
        Dispatch(kernel: kernel, grid: Size3(rows, 1, 1), threadgroup: Size3(KVCodecCapability.threads, 1, 1),
                 bindings: bindings, writes: writes)
    }

    /// x [..., D] (float32, float16, bfloat16) -> codes, norms; nil for zero rows.
    public static func encode(_ codec: KVCodec, x: TensorRef, codes: TensorRef, norms: TensorRef) throws -> Dispatch? {
        let op = encodeOp
        try x.requireDType(KVCodecCapability.encodeTypes, op: op, name: "x")
        try x.requireBytes(op: op, name: "x")
        guard x.rank >= 1, x.shape.last == codec.headDim else {
            throw FlashMetalError.value(op, "x shape \(x.shape) must end in the codec's head_dim \(codec.headDim)")
        }
        let lead = Array(x.shape.dropLast())
        try require(codes, "codes", dtype: .u8, lead: lead, last: codec.rowBytes, op: op)
        try require(norms, "norms", dtype: .f32, lead: lead, last: codec.numBlocks, op: op)
        let n = try rows(lead, op: op)
        if n == 0 { return nil }
        return dispatch(.kvEncode(input: x.dtype), codec, rows: n, bindings: [
            KVEncodeBuffer.params: .bytes(bytesOf(codec.params)), KVEncodeBuffer.x: .buffer(x),
            KVEncodeBuffer.codes: .buffer(codes), KVEncodeBuffer.norms: .buffer(norms),
        ], writes: [KVEncodeBuffer.codes, KVEncodeBuffer.norms])
    }

    /// codes, norms -> out float32 [..., D]; nil for zero rows.
    public static func dequantize(_ codec: KVCodec, codes: TensorRef, norms: TensorRef,
                                  out: TensorRef) throws -> Dispatch? {
        let op = dequantizeOp
        try codes.requireDType([.u8], op: op, name: "codes")
        try codes.requireBytes(op: op, name: "codes")
        guard codes.rank >= 1, codes.shape.last == codec.rowBytes else {
            throw FlashMetalError.value(op, "codes shape \(codes.shape) must end in the codec's row_bytes \(codec.rowBytes)")
        }
        let lead = Array(codes.shape.dropLast())
        try require(norms, "norms", dtype: .f32, lead: lead, last: codec.numBlocks, op: op)
        try require(out, "out", dtype: .f32, lead: lead, last: codec.headDim, op: op)
        let n = try rows(lead, op: op)
        if n == 0 { return nil }
        return dispatch(.kvDequantize, codec, rows: n, bindings: [
            KVDequantizeBuffer.params: .bytes(bytesOf(codec.params)), KVDequantizeBuffer.codes: .buffer(codes),
            KVDequantizeBuffer.norms: .buffer(norms), KVDequantizeBuffer.out: .buffer(out),
        ], writes: [KVDequantizeBuffer.out])
    }
}
