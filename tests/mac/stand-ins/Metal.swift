// Stand-in for Apple's Metal framework, used only by `make mac-check` to
// type-check the Metal backend for macOS on Linux. It declares exactly the
// API Sources/FlashMetalMetal calls, with the signatures, argument labels,
// optionality, `throws` and macOS availability of Apple's documentation
// (developer.apple.com/documentation/metal). Enum raw values are Apple's.
// Nothing here runs. Value types and classes stay apart from the metal-sim
// runtime's (Sources/MetalSim/Metal/Types.swift): here they carry only what
// the backend uses, each with its macOS availability; there they carry every
// case and Apple's defaults, which the runtime acts on.

@available(macOS 10.11, *)
public struct MTLSize {
    public var width: Int, height: Int, depth: Int
    public init() { width = 0; height = 0; depth = 0 }
    public init(width: Int, height: Int, depth: Int) { self.width = width; self.height = height; self.depth = depth }
}

@available(macOS 10.11, *)
public struct MTLResourceOptions: OptionSet, Sendable {
    public let rawValue: UInt
    public init(rawValue: UInt) { self.rawValue = rawValue }
    public static let storageModeShared = MTLResourceOptions([])
}

@available(macOS 10.14, *)
public struct MTLBarrierScope: OptionSet, Sendable {
    public let rawValue: UInt
    public init(rawValue: UInt) { self.rawValue = rawValue }
    public static let buffers = MTLBarrierScope(rawValue: 1 << 0)
}

@available(macOS 10.14, *)
public enum MTLDispatchType: UInt, Sendable {
    case serial = 0
    case concurrent = 1
}

@available(macOS 10.11, *)
public enum MTLLanguageVersion: UInt, Sendable {
    @available(macOS 10.11, *) case version1_1 = 65537
    @available(macOS 10.12, *) case version1_2 = 65538
    @available(macOS 10.13, *) case version2_0 = 131072
    @available(macOS 10.14, *) case version2_1 = 131073
    @available(macOS 10.15, *) case version2_2 = 131074
    @available(macOS 11.0, *) case version2_3 = 131075
    @available(macOS 12.0, *) case version2_4 = 131076
    @available(macOS 13.0, *) case version3_0 = 196608
    @available(macOS 14.0, *) case version3_1 = 196609
    @available(macOS 15.0, *) case version3_2 = 196610
}

@available(macOS 15.0, *)
public enum MTLMathMode: Int, Sendable {
    case safe = 0
    case relaxed = 1
    case fast = 2
}

@available(macOS 15.0, *)
public enum MTLMathFloatingPointFunctions: Int, Sendable {
    case fast = 0
    case precise = 1
}

@available(macOS 10.15, *)
public enum MTLGPUFamily: Int, Sendable {
    @available(macOS 11.0, *) case apple7 = 1007
    case mac2 = 2002
    @available(macOS 13.0, *) case metal3 = 5001
}

@available(macOS 10.11, *)
public enum MTLDataType: UInt, Sendable {
    case float = 3
    case int = 29
    case uint = 33
    case bool = 53
}

@available(macOS 10.11, *)
public enum MTLCommandBufferStatus: UInt, Sendable {
    case notEnqueued = 0, enqueued, committed, scheduled, completed, error
}

// The protocols (MTLDevice, MTLBuffer, the encoders, ...) are compiled in
// from Sources/MetalSim/Metal/Protocols.swift: one declaration for this
// stand-in and the metal-sim runtime.

@available(macOS 10.11, *)
open class MTLCompileOptions {
    public init() {}
    open var languageVersion: MTLLanguageVersion = .version1_1
    @available(macOS, introduced: 10.11, deprecated: 15.0, message: "Use mathMode instead")
    open var fastMathEnabled: Bool = true
    @available(macOS 15.0, *)
    open var mathMode: MTLMathMode { get { .fast } set {} }
    @available(macOS 15.0, *)
    open var mathFloatingPointFunctions: MTLMathFloatingPointFunctions { get { .fast } set {} }
}

@available(macOS 10.12, *)
open class MTLFunctionConstantValues {
    public init() {}
    open func setConstantValue(_ value: UnsafeRawPointer, type: MTLDataType, index: Int) {}
}

@available(macOS 10.11, *)
public func MTLCreateSystemDefaultDevice() -> MTLDevice? { _StandIn.defaultDevice }

@available(macOS 10.11, *)
public func MTLCopyAllDevices() -> [MTLDevice] { _StandIn.allDevices }

/// From the ObjectiveC module, which Metal's Foundation import brings in.
@available(macOS 10.0, *)
public func autoreleasepool<Result>(invoking body: () throws -> Result) rethrows -> Result { try body() }

/// Not Metal API: what the two device functions return when the stand-in is
/// linked into tests/mac/metal_fake (a fake device run on Linux).
public enum _StandIn {
    nonisolated(unsafe) public static var defaultDevice: MTLDevice?
    nonisolated(unsafe) public static var allDevices: [MTLDevice] = []
}
