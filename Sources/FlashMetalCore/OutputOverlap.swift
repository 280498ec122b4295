/// The one check that a call's outputs share no memory with anything else it
/// binds: a kernel writing an output over an input or a table (lengths,
/// block table, cu_seqlens) would read half-written values, or indices it
/// never validated, so any overlap is a ValueError naming the op and both
/// arguments, before any kernel runs. Registry.run applies it to every
/// call's dispatches; two read-only arguments may share memory.
extension Dispatch {
    /// Throws when a tensor some dispatch of `dispatches` writes overlaps
    /// another argument of any of them. An argument bound by several
    /// dispatches (decode's tmp, written then read) is one argument.
    public static func requireDisjointOutputs(_ dispatches: [Dispatch], op: String) throws {
        var args: [(TensorRef, written: Bool)] = []
        for d in dispatches {
            for index in d.bindings.keys.sorted() {
                guard case .buffer(let t)? = d.bindings[index] else { continue }
                let written = d.writes.contains(index)
                if let i = args.firstIndex(where: { $0.0.isSameArgument(t) }) {
                    args[i].written = args[i].written || written
                } else {
                    args.append((t, written))
                }
            }
        }
        for (i, (out, written)) in args.enumerated() where written {
            for (j, (other, _)) in args.enumerated() where j != i && out.writeOverlaps(other) {
                // Two outputs that overlap are named once, in binding order.
                if j < i && args[j].written { continue }
                throw overlapError(out, other, op: op)
            }
        }
    }

    /// Throws when one of `outputs` overlaps one of `tables`: the check
    /// above for caller tables a dispatch does not bind as they are (a
    /// dispatcher runs rewritten copies of them in library memory).
    public static func requireDisjoint(_ outputs: [TensorRef], from tables: [TensorRef], op: String) throws {
        for out in outputs {
            if let other = tables.first(where: out.writeOverlaps) { throw overlapError(out, other, op: op) }
        }
    }

    /// The tensors `dispatches` write.
    public static func written(by dispatches: [Dispatch]) -> [TensorRef] {
        dispatches.flatMap { d in
            d.writes.sorted().compactMap { i -> TensorRef? in
                if case .buffer(let t)? = d.bindings[i] { return t }
                return nil
            }
        }
    }

    private static func overlapError(_ out: TensorRef, _ other: TensorRef, op: String) -> FlashMetalError {
        .value(op, "\(out.argumentName) and \(other.argumentName) overlap in memory; the call writes "
            + "\(out.argumentName), so they must not share bytes", arg: out.name)
    }
}

extension TensorRef {
    /// Whether `other` is this very argument (the same name over the same
    /// caller memory), bound again.
    func isSameArgument(_ other: TensorRef) -> Bool {
        name == other.name && origin == other.origin && byteCount == other.byteCount
    }

    /// Whether this output, over all the bytes the caller gave it (kernels
    /// size some outputs, blk and tmp, by bytes rather than by shape),
    /// shares a byte with the memory `other`'s shape covers.
    func writeOverlaps(_ other: TensorRef) -> Bool {
        let (a, b) = (UInt(bitPattern: origin), UInt(bitPattern: other.origin))
        let (na, nb) = (UInt(byteCount), UInt(other.usedByteCount))
        return na > 0 && nb > 0 && a < b &+ nb && b < a &+ na
    }

    /// The name an overlap error gives.
    var argumentName: String { name.isEmpty ? "a library buffer" : name }
}
