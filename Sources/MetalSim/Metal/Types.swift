// Value types, enums and option classes of Apple's Metal framework, as the
// metal-sim runtime implements them: Apple's names, labels, raw values and
// defaults (developer.apple.com/documentation/metal).

public struct MTLSize {
    public var width: Int, height: Int, depth: Int
    public init() { width = 0; height = 0; depth = 0 }
    public init(width: Int, height: Int, depth: Int) { self.width = width; self.height = height; self.depth = depth }
}

public struct MTLResourceOptions: OptionSet, Sendable {
    public let rawValue: UInt
    public init(rawValue: UInt) { self.rawValue = rawValue }
    public static let storageModeShared = MTLResourceOptions([])
}

public struct MTLBarrierScope: OptionSet, Sendable {
    public let rawValue: UInt
    public init(rawValue: UInt) { self.rawValue = rawValue }
    public static let buffers = MTLBarrierScope(rawValue: 1 << 0)
    public static let textures = MTLBarrierScope(rawValue: 1 << 1)
}

public enum MTLDispatchType: UInt, Sendable {
    case serial = 0
    case concurrent = 1
}

public enum MTLLanguageVersion: UInt, Sendable {
    case version1_1 = 65537, version1_2 = 65538, version2_0 = 131072, version2_1 = 131073
    case version2_2 = 131074, version2_3 = 131075, version2_4 = 131076, version3_0 = 196608
    case version3_1 = 196609, version3_2 = 196610
}

public enum MTLMathMode: Int, Sendable {
    case safe = 0
    case relaxed = 1
    case fast = 2
}

public enum MTLMathFloatingPointFunctions: Int, Sendable {
    case fast = 0
    case precise = 1
}

public enum MTLDataType: UInt, Sendable {
    case float = 3
    case int = 29
    case uint = 33
    case bool = 53
}

public enum MTLCommandBufferStatus: UInt, Sendable {
    case notEnqueued = 0, enqueued, committed, scheduled, completed, error
}

public enum MTLGPUFamily: Int, Sendable {
    case apple1 = 1001, apple2 = 1002, apple3 = 1003, apple4 = 1004, apple5 = 1005
    case apple6 = 1006, apple7 = 1007, apple8 = 1008, apple9 = 1009
    case mac1 = 2001, mac2 = 2002
    case common1 = 3001, common2 = 3002, common3 = 3003
    case metal3 = 5001
}

/// Why a command buffer failed (MTLCommandBufferError.Code's cases).
public struct MTLCommandBufferError: Error, CustomStringConvertible, Sendable {
    public enum Code: UInt, Sendable {
        case none = 0, `internal` = 1, timeout = 2, pageFault = 3, accessRevoked = 4, notPermitted = 7
        case outOfMemory = 8, invalidResource = 9, memoryless = 10, stackOverflow = 12
    }
    public let code: Code
    /// What went wrong, as this runtime saw it.
    public let message: String
    public var description: String { "MTLCommandBufferError(\(code)): \(message)" }
}

/// A library or function could not be made (MTLLibraryError's role).
public struct MTLLibraryError: Error, CustomStringConvertible, Sendable {
    public enum Code: UInt, Sendable {
        case unsupported = 1, `internal` = 2, compileFailure = 3, compileWarning = 4
        case functionNotFound = 5, fileNotFound = 6
    }
    public let code: Code
    public let message: String
    public var description: String { "MTLLibraryError(\(code)): \(message)" }
}

open class MTLCompileOptions {
    public init() {}
    /// Apple's default is the newest version the OS supports.
    open var languageVersion: MTLLanguageVersion = .version3_2
    /// Apple's default: true (fast math).
    open var fastMathEnabled: Bool = true
    /// Apple's default: .fast.
    open var mathMode: MTLMathMode = .fast
    /// Apple's default: .fast.
    open var mathFloatingPointFunctions: MTLMathFloatingPointFunctions = .fast
}

open class MTLFunctionConstantValues {
    /// One value set by setConstantValue, as its bytes and declared type.
    struct Value {
        let type: MTLDataType
        let int: Int32
    }
    var values: [Int: Value] = [:]

    public init() {}

    /// Copies the value at `value` as a constant of `type` at `index`.
    open func setConstantValue(_ value: UnsafeRawPointer, type: MTLDataType, index: Int) {
        let v: Int32
        switch type {
        case .bool: v = value.load(as: UInt8.self) != 0 ? 1 : 0
        case .int, .uint: v = value.loadUnaligned(as: Int32.self)
        case .float: v = Int32(bitPattern: value.loadUnaligned(as: UInt32.self))
        }
        values[index] = Value(type: type, int: v)
    }
}
