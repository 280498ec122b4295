import CFlashMetal

/// The serving extension of one prefill dispatch (flashmetal_kernels.h's
/// AttnSeqParams at PrefillBuffer.seqParams, the int32 tables, sinks and lse,
/// and function constants 302, 304-311): everything the prefill kernel reads
/// beyond the plain prefill. Both prefill dispatchers fill one; an empty one
/// binds nothing and sets every constant false: the plain prefill kernel.
public struct PrefillExtension {
    /// Window bounds, paging and lse strides; -1 window bounds = unbounded.
    public var params = AttnSeqParams(window_left: -1, window_right: -1, page_size: 0, max_pages: 0,
                                      K_page_stride: 0, V_page_stride: 0, lse_strides: (0, 0, 0), attention_chunk: 0,
                                      key_starts_at: 0)
    /// params.window_left/right and attention_chunk apply (FM_FC_WINDOW).
    public var window = false
    /// int32 [B+1]: q/out/lse packed (FM_FC_VARLEN_Q).
    public var cuSeqlensQ: TensorRef? = nil
    /// int32 [B+1]: k/v packed (FM_FC_VARLEN_K).
    public var cuSeqlensK: TensorRef? = nil
    /// int32 [B]: each sequence's valid keys (FM_FC_KV_LENS).
    public var seqlensK: TensorRef? = nil
    /// int32 [B, max_pages]: k/v paged (FM_FC_PAGED).
    public var blockTable: TensorRef? = nil
    /// float32 [H]: per-head sink logits (FM_FC_HAS_SINKS).
    public var sinks: TensorRef? = nil
    /// float32 log-sum-exp output (FM_FC_HAS_LSE).
    public var lse: TensorRef? = nil
    /// float32 [B, H]: ALiBi slopes (FM_FC_HAS_ALIBI).
    public var alibi: TensorRef? = nil

    /// No extension: the plain prefill kernel.
    public init() {}

    /// Per-sequence lengths and positions (flashmetal_kernels.h): any table bound.
    public var perSequence: Bool { cuSeqlensQ != nil || cuSeqlensK != nil || seqlensK != nil || blockTable != nil }

    /// AttnSeqParams is bound (FM_FC_PREFILL_SEQ).
    public var isBound: Bool { window || perSequence || sinks != nil || lse != nil || alibi != nil }

    /// Function constants 302 and 304-311.
    var constants: [(Int, ConstantValue)] {
        typealias F = FunctionConstantIndex
        return [(F.hasSinks, .bool(sinks != nil)), (F.prefillSeq, .bool(isBound)), (F.window, .bool(window)),
                (F.varlenQ, .bool(cuSeqlensQ != nil)), (F.varlenK, .bool(cuSeqlensK != nil)),
                (F.kvLens, .bool(seqlensK != nil)), (F.paged, .bool(blockTable != nil)),
                (F.hasLSE, .bool(lse != nil)), (F.hasAlibi, .bool(alibi != nil))]
    }

    /// Adds the extension's buffers (and AttnSeqParams when bound).
    func bind(_ bindings: inout [Int: Binding]) {
        guard isBound else { return }
        bindings[PrefillBuffer.seqParams] = .bytes(bytesOf(params))
        let tables: [(TensorRef?, Int)] = [
            (cuSeqlensQ, PrefillBuffer.cuSeqlensQ), (cuSeqlensK, PrefillBuffer.cuSeqlensK),
            (seqlensK, PrefillBuffer.seqlensK), (blockTable, PrefillBuffer.blockTable),
            (sinks, PrefillBuffer.sinks), (lse, PrefillBuffer.lse), (alibi, PrefillBuffer.alibi),
        ]
        for case let (t?, index) in tables { bindings[index] = .buffer(t) }
    }

    /// The buffers the kernel writes besides out.
    var writes: [Int] { lse == nil ? [] : [PrefillBuffer.lse] }
}
