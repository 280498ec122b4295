/// A Metal function-constant value as the pipelines are specialised by it.
public enum ConstantValue: Hashable, Sendable, CustomStringConvertible {
    case bool(Bool)
    case int(Int32)

    public var description: String {
        switch self {
        case .bool(let b): return b ? "true" : "false"
        case .int(let i): return String(i)
        }
    }
}

/// Function constants by index, kept sorted so equal sets hash equally.
public struct FunctionConstants: Hashable, Sendable, CustomStringConvertible {
    public private(set) var entries: [(index: Int, value: ConstantValue)]

    public init(_ pairs: [(Int, ConstantValue)] = []) {
        entries = pairs.sorted { $0.0 < $1.0 }.map { (index: $0.0, value: $0.1) }
    }

    public subscript(index: Int) -> ConstantValue? {
        entries.first { $0.index == index }?.value
    }

    public func bool(_ index: Int) -> Bool? {
        if case .bool(let b)? = self[index] { return b }
        return nil
    }

    public func int(_ index: Int) -> Int32? {
        if case .int(let i)? = self[index] { return i }
        return nil
    }

    public static func == (a: FunctionConstants, b: FunctionConstants) -> Bool {
        a.entries.elementsEqual(b.entries) { $0.index == $1.index && $0.value == $1.value }
    }

    public func hash(into h: inout Hasher) {
        for e in entries {
            h.combine(e.index)
            h.combine(e.value)
        }
    }

    public var description: String {
        entries.map { "\($0.index)=\($0.value)" }.joined(separator: ",")
    }
}

/// The pipeline cache key: (kernel name, function constants), as the seeds'
/// KernelRegistry keys its compiled pipelines.
public struct PipelineKey: Hashable, Sendable, CustomStringConvertible {
    public let kernel: String
    public let constants: FunctionConstants

    public init(kernel: String, constants: FunctionConstants) {
        self.kernel = kernel
        self.constants = constants
    }

    public var description: String { "\(kernel)[\(constants)]" }
}
