/// A Metal function-constant value as the pipelines are specialised by it.
public enum ConstantValue: Hashable, Sendable, CustomStringConvertible {
    /// A `bool` constant.
    case bool(Bool)
    /// An `int` constant.
    case int(Int32)

    /// "true"/"false" or the integer.
    public var description: String {
        switch self {
        case .bool(let b): return b ? "true" : "false"
        case .int(let i): return String(i)
        }
    }
}

/// Function constants by index, kept sorted so equal sets hash equally.
public struct FunctionConstants: Hashable, Sendable, CustomStringConvertible {
    /// The (index, value) pairs in ascending index order.
    public private(set) var entries: [(index: Int, value: ConstantValue)]

    /// Sorts `pairs` by index.
    public init(_ pairs: [(Int, ConstantValue)] = []) {
        entries = pairs.sorted { $0.0 < $1.0 }.map { (index: $0.0, value: $0.1) }
    }

    /// The value at `index`, or nil.
    public subscript(index: Int) -> ConstantValue? {
        entries.first { $0.index == index }?.value
    }

    /// The bool at `index`; nil when unset or an int.
    public func bool(_ index: Int) -> Bool? {
        if case .bool(let b)? = self[index] { return b }
        return nil
    }

    /// The int at `index`; nil when unset or a bool.
    public func int(_ index: Int) -> Int32? {
        if case .int(let i)? = self[index] { return i }
        return nil
    }

    /// Equal when the same indices hold the same values.
    public static func == (a: FunctionConstants, b: FunctionConstants) -> Bool {
        a.entries.elementsEqual(b.entries) { $0.index == $1.index && $0.value == $1.value }
    }

    /// Hashes the sorted entries.
    public func hash(into h: inout Hasher) {
        for e in entries {
            h.combine(e.index)
            h.combine(e.value)
        }
    }

    /// "index=value,..." in index order.
    public var description: String {
        entries.map { "\($0.index)=\($0.value)" }.joined(separator: ",")
    }
}

/// The pipeline cache key: (kernel, function constants), as mlx-native's
/// KernelRegistry keys its compiled pipelines.
public struct PipelineKey: Hashable, Sendable, CustomStringConvertible {
    /// The kernel's typed identity.
    public let spec: KernelSpec
    /// The values the pipeline is specialised by.
    public let constants: FunctionConstants

    /// The key of `spec` specialised by `constants`.
    public init(spec: KernelSpec, constants: FunctionConstants) {
        self.spec = spec
        self.constants = constants
    }

    /// The kernel's name (derived from `spec`).
    public var kernel: String { spec.name }

    /// "name[index=value,...]".
    public var description: String { "\(kernel)[\(constants)]" }
}
