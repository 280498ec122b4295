/// Packed query rows after cu_seqlens_q[B] (q longer than its sequences: a
/// batch padded to a fixed size), with the out [total_q, ...] and lse
/// [H, total_q] they own. No kernel writes them.
public struct UnownedRows {
    var rows: Range<Int> = 0..<0
    var out: TensorRef? = nil, lse: TensorRef? = nil

    /// Makes the rows read as rows that see nothing (out 0, lse -inf) rather
    /// than whatever the memory held. Written now, on the host: call it once
    /// the registry has accepted the call's dispatches (an out that overlaps
    /// an input is refused there, with nothing written).
    public func clear() {
        guard !rows.isEmpty, let out else { return }
        let rowBytes = out.shape.dropFirst().reduce(1, *) * out.dtype.byteSize
        (out.data + rows.lowerBound * rowBytes).initializeMemory(as: UInt8.self, repeating: 0,
                                                                 count: rows.count * rowBytes)
        guard let lse else { return }
        let values = lse.data.assumingMemoryBound(to: Float.self)
        for h in 0..<lse.shape[0] {
            for row in rows { values[h * lse.shape[1] + row] = -.infinity }
        }
    }
}
