import CFlashMetal

/// A borrowed, C-contiguous host tensor. The library never owns the memory;
/// the dispatchers prove `byteCount` covers the shape before any kernel runs.
public struct TensorRef: @unchecked Sendable {
    /// The first byte.
    public let data: UnsafeMutableRawPointer
    /// Bytes the caller says `data` holds.
    public let byteCount: Int
    /// Element type.
    public let dtype: DType
    /// Dimensions, outermost first (C order).
    public let shape: [Int]
    /// FMTensor.tag: 0 for caller memory, else a live fm_alloc_blk buffer.
    public let tag: UInt64
    /// The argument this tensor was passed as ("" for library memory): what
    /// an overlap error names.
    public let name: String
    /// The caller memory this tensor stands for: `data`, or for a private
    /// copy (`Registry.withPrivateCopies`) the caller's tensor it was copied
    /// from. Overlap checks compare these.
    public let origin: UnsafeMutableRawPointer

    /// A tensor over memory the caller keeps alive.
    public init(data: UnsafeMutableRawPointer, byteCount: Int, dtype: DType, shape: [Int], tag: UInt64 = 0,
                name: String = "", origin: UnsafeMutableRawPointer? = nil) {
        self.data = data
        self.byteCount = byteCount
        self.dtype = dtype
        self.shape = shape
        self.tag = tag
        self.name = name
        self.origin = origin ?? data
    }

    /// The same memory, argument and origin read as another shape (at most
    /// `byteCount` bytes).
    public func reshaped(_ shape: [Int], dtype: DType? = nil, byteCount: Int? = nil) -> TensorRef {
        TensorRef(data: data, byteCount: byteCount ?? self.byteCount, dtype: dtype ?? self.dtype, shape: shape,
                  tag: tag, name: name, origin: origin)
    }

    /// This tensor read from `copy` (a private copy of its bytes), still
    /// standing for the caller's memory.
    public func copied(to copy: UnsafeMutableRawPointer) -> TensorRef {
        TensorRef(data: copy, byteCount: usedByteCount, dtype: dtype, shape: shape, tag: 0, name: name,
                  origin: origin)
    }

    /// The number of dimensions.
    public var rank: Int { shape.count }

    /// Reads an ABI tensor, rejecting what cannot describe host memory.
    public init(_ t: UnsafePointer<FMTensor>?, op: String, name: String) throws {
        guard let t = t?.pointee else { throw FlashMetalError.value(op, "\(name) is null", arg: name) }
        guard let dtype = DType(rawValue: t.dtype) else {
            throw FlashMetalError.type(op, "\(name) has an unknown dtype code \(t.dtype)", arg: name)
        }
        guard t.ndim >= 0 && t.ndim <= 8 else {
            throw FlashMetalError.value(op, "\(name) has rank \(t.ndim); at most 8 is supported", arg: name)
        }
        let shape = withUnsafeBytes(of: t.shape) { raw in
            Array(raw.bindMemory(to: Int64.self).prefix(Int(t.ndim))).map { Int($0) }
        }
        if let bad = shape.first(where: { $0 < 0 }) {
            throw FlashMetalError.value(op, "\(name) has a negative dimension \(bad) in shape \(shape)", arg: name)
        }
        guard t.nbytes <= UInt64(Int.max) else {
            throw FlashMetalError.value(op, "\(name) byte length \(t.nbytes) is out of range", arg: name)
        }
        guard let data = t.data else { throw FlashMetalError.value(op, "\(name) data pointer is null", arg: name) }
        try BlkAllocations.validate(tag: t.tag, data: data, byteCount: Int(t.nbytes), op: op, name: name)
        self.init(data: data, byteCount: Int(t.nbytes), dtype: dtype, shape: shape, tag: t.tag, name: name)
        // The buffer covers the shape before any dispatcher looks at the dims
        // (a huge dim with a tiny buffer must not reach size arithmetic).
        try requireBytes(op: op, name: name)
    }

    /// Element count of the shape, or nil when it overflows.
    public var elementCount: Int? {
        var n = 1
        for d in shape {
            let (p, o) = n.multipliedReportingOverflow(by: d)
            if o { return nil }
            n = p
        }
        return n
    }

    /// The bytes a kernel may touch: the shape's, at most the buffer's.
    public var usedByteCount: Int {
        guard let n = elementCount, case let (bytes, false) = n.multipliedReportingOverflow(by: dtype.byteSize)
        else { return byteCount }
        return min(bytes, byteCount)
    }

    /// Whether this tensor and `other` share a byte of the caller memory
    /// their shapes cover.
    public func overlaps(_ other: TensorRef) -> Bool {
        let (a, b) = (UInt(bitPattern: origin), UInt(bitPattern: other.origin))
        let (na, nb) = (UInt(usedByteCount), UInt(other.usedByteCount))
        return na > 0 && nb > 0 && a < b &+ nb && b < a &+ na
    }

    /// Proves the buffer holds the shape's bytes.
    public func requireBytes(op: String, name: String) throws {
        guard let n = elementCount, case let (bytes, false) = n.multipliedReportingOverflow(by: dtype.byteSize)
        else { throw FlashMetalError.value(op, "\(name) shape \(shape) is too large", arg: name) }
        if byteCount < bytes {
            throw FlashMetalError.value(
                op, "\(name) buffer too small: shape \(shape) of \(dtype.name) needs \(bytes) bytes, got \(byteCount)", arg: name)
        }
    }

    /// Throws a ValueError naming `op` and `name` unless the rank is one of `ranks`.
    public func requireRank(_ ranks: [Int], op: String, name: String) throws {
        if !ranks.contains(rank) {
            let want = ranks.map(String.init).joined(separator: " or ")
            throw FlashMetalError.value(op, "\(name) must have rank \(want), got shape \(shape)", arg: name)
        }
    }

    /// Throws a TypeError naming `op` and `name` unless the dtype is one of `allowed`.
    public func requireDType(_ allowed: [DType], op: String, name: String) throws {
        if !allowed.contains(dtype) {
            let want = allowed.map(\.name).joined(separator: " or ")
            throw FlashMetalError.type(op, "\(name) must be \(want), got \(dtype.name)", arg: name)
        }
    }
}
