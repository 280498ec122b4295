/// A 3-D size: grid of threadgroups or threads per threadgroup.
public struct Size3: Hashable, Sendable, CustomStringConvertible {
    /// The extents along each axis.
    public var x: Int, y: Int, z: Int
    /// (x, y, z).
    public init(_ x: Int, _ y: Int, _ z: Int) { self.x = x; self.y = y; self.z = z }
    /// x * y * z.
    public var count: Int { x * y * z }
    /// "(x, y, z)".
    public var description: String { "(\(x), \(y), \(z))" }
}

/// What sits at one buffer index of a kernel.
public enum Binding: @unchecked Sendable {
    /// Caller memory, bound without a copy.
    case buffer(TensorRef)
    /// A parameter struct passed by value (Metal's setBytes).
    case bytes([UInt8])
}

/// Everything a backend needs to run one kernel launch: produced once by a
/// dispatcher, run by any backend.
public struct Dispatch: @unchecked Sendable {
    /// The kernel and its function constants.
    public let pipeline: PipelineKey
    /// Threadgroups per grid (dispatchThreadgroups).
    public let grid: Size3
    /// Threads per threadgroup.
    public let threadgroup: Size3
    /// What each buffer index holds.
    public let bindings: [Int: Binding]
    /// Threadgroup-memory lengths by index (setThreadgroupMemoryLength).
    public let threadgroupMemory: [Int: Int]
    /// Buffer indices the kernel writes (a backend that copies memory in
    /// copies back only these). Defaults to every `.buffer` binding.
    public let writes: Set<Int>
    /// The kernel is correct for any threadgroup width that is a multiple of
    /// 32 up to `threadgroup.x`: a backend whose pipeline allows fewer threads
    /// may launch the largest such width instead of failing.
    public let threadgroupFlexible: Bool

    /// A launch of `kernel` specialised by `constants`: `grid` threadgroups of
    /// `threadgroup` threads, with buffers and threadgroup memory by index.
    public init(kernel: KernelSpec, constants: FunctionConstants = FunctionConstants(),
                grid: Size3, threadgroup: Size3, bindings: [Int: Binding],
                threadgroupMemory: [Int: Int] = [:], writes: Set<Int>? = nil,
                threadgroupFlexible: Bool = false) {
        self.pipeline = PipelineKey(spec: kernel, constants: constants)
        self.grid = grid
        self.threadgroup = threadgroup
        self.bindings = bindings
        self.threadgroupMemory = threadgroupMemory
        self.writes = writes ?? Set(bindings.compactMap { i, b in
            if case .buffer = b { return i } else { return nil }
        })
        self.threadgroupFlexible = threadgroupFlexible
    }

    /// The kernel's name.
    public var kernel: String { pipeline.kernel }
    /// The kernel's typed identity.
    public var spec: KernelSpec { pipeline.spec }
    /// The function constants of the pipeline.
    public var constants: FunctionConstants { pipeline.constants }

    /// The caller tensor bound at `index`; an internal error when absent.
    public func buffer(_ index: Int) throws -> TensorRef {
        guard case .buffer(let t)? = bindings[index] else {
            throw FlashMetalError.internalError("\(kernel): no buffer at index \(index)")
        }
        return t
    }

    /// Reads a parameter struct bound with setBytes.
    public func params<T>(_ index: Int, as: T.Type) throws -> T {
        guard case .bytes(let b)? = bindings[index], b.count == MemoryLayout<T>.size else {
            throw FlashMetalError.internalError("\(kernel): no \(T.self) at index \(index)")
        }
        return b.withUnsafeBytes { $0.loadUnaligned(as: T.self) }
    }
}

/// Turns a parameter struct into the bytes of a `.bytes` binding.
public func bytesOf<T>(_ value: T) -> [UInt8] {
    withUnsafeBytes(of: value) { Array($0) }
}
