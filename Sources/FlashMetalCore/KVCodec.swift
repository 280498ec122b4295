import CFlashMetal

/// A quantized-KV codec: head dim, code width and the seed of its rotation
/// signs. The one owner of which codecs exist and of their storage layout
/// (Resources/shaders/kv_codec.h has the math).
public struct KVCodec: Equatable, Sendable {
    /// The op name errors about the codec itself carry.
    public static let op = "kv_codec"
    /// Code widths with a Lloyd–Max table (Resources/shaders/kv_codec_tables.h).
    public static let widths = [2, 3, 4, 5, 6, 8]
    /// Head dims and their rotation block: one Hadamard transform over a
    /// power-of-two head dim, blocks of 16, 32 and 64 for 80, 96 and 192.
    public static let blocks: [Int: Int] = [64: 64, 128: 128, 256: 256, 512: 512, 80: 16, 96: 32, 192: 64]
    /// The supported head dims, ascending.
    public static var headDims: [Int] { blocks.keys.sorted() }

    public let headDim: Int
    public let bits: Int
    public let seed: UInt64

    /// A validated codec; a bad head dim or width is a value error naming `op`.
    public init(headDim: Int, bits: Int, seed: UInt64, op: String = KVCodec.op) throws {
        guard Self.blocks[headDim] != nil else {
            throw FlashMetalError.value(op, "head_dim must be \(oneOf(Self.headDims)), got \(headDim)", arg: "head_dim")
        }
        guard Self.widths.contains(bits) else {
            throw FlashMetalError.value(op, "bits must be \(oneOf(Self.widths)), got \(bits)", arg: "bits")
        }
        self.headDim = headDim
        self.bits = bits
        self.seed = seed
    }

    /// The codec an FMKVCodec describes.
    public init(_ c: FMKVCodec, op: String) throws {
        try self.init(headDim: Int(c.head_dim), bits: Int(c.bits), seed: c.seed, op: op)
    }

    /// Coordinates per rotation block.
    public var block: Int { Self.blocks[headDim]! }
    /// Rotation blocks per row: one float32 norm each.
    public var numBlocks: Int { headDim / block }
    /// Bytes of codes per row: headDim * bits / 8, padded to 16.
    public var rowBytes: Int { (headDim * bits / 8 + 15) / 16 * 16 }

    /// The kernels' parameters.
    public var params: KVCodecParams {
        KVCodecParams(seed: seed, head_dim: Int32(headDim), bits: Int32(bits), block: Int32(block),
                      row_bytes: Int32(rowBytes), _pad: (0, 0))
    }
}

/// kv_encode / kv_dequantize: one row per threadgroup of `threads` threads.
public enum KVCodecCapability {
    /// Input dtypes of kv_encode.
    public static let encodeTypes: [DType] = [.f32, .f16, .bf16]
    /// Threads per threadgroup (loops cover the head dim).
    public static let threads = 32
    /// The largest number of rows (threadgroups) of one dispatch.
    public static let maxRows = Int(Int32.max)
    /// The (q/out, dense side) dtypes the attention over codes has kernels
    /// for: float32 q/out with a dense side of any dtype (f32 also when
    /// none is), and 16-bit q/out with a dense side of their dtype (or none).
    public static let codesIO: [(io: DType, dense: DType)] =
        encodeTypes.map { (DType.f32, $0) } + [(.f16, .f16), (.bf16, .bf16)]
    /// Every kernel of the ops.
    public static var kernels: [KernelSpec] {
        encodeTypes.map { .kvEncode(input: $0) } + [.kvDequantize]
            + codesIO.map { .kvCodesDecode(io: $0.io, dense: $0.dense) } + encodeTypes.map { .kvCodesReduce(io: $0) }
            + codesIO.map { .kvCodesPrefill(io: $0.io, dense: $0.dense) }
            + encodeTypes.map { .kvCodesAppend(input: $0) }
    }
}

/// Buffer indices of kv_encode.
public enum KVEncodeBuffer {
    /// KVCodecParams.
    public static let params = Int(FM_KVENC_BUF_PARAMS.rawValue)
    /// [R, D] rows to encode.
    public static let x = Int(FM_KVENC_BUF_X.rawValue)
    /// uint8 [R, row_bytes] out.
    public static let codes = Int(FM_KVENC_BUF_CODES.rawValue)
    /// float32 [R, num_blocks] out.
    public static let norms = Int(FM_KVENC_BUF_NORMS.rawValue)
}

/// Buffer indices of kv_dequantize.
public enum KVDequantizeBuffer {
    /// KVCodecParams.
    public static let params = Int(FM_KVDEQ_BUF_PARAMS.rawValue)
    /// uint8 [R, row_bytes].
    public static let codes = Int(FM_KVDEQ_BUF_CODES.rawValue)
    /// float32 [R, num_blocks].
    public static let norms = Int(FM_KVDEQ_BUF_NORMS.rawValue)
    /// float32 [R, D] out.
    public static let out = Int(FM_KVDEQ_BUF_OUT.rawValue)
}
