import FlashMetalSim
import Glibc

/// Apple silicon's VM page: bytesNoCopy needs a pointer and a length that
/// are multiples of it.
/// https://developer.apple.com/documentation/metal/mtldevice/makebuffer(bytesnocopy:length:options:deallocator:)
let pageSize = 16384

/// Returns the system's default device: the first device of
/// FLASHMETAL_METAL_SIM_DEVICES (see `MTLCopyAllDevices`).
public func MTLCreateSystemDefaultDevice() -> MTLDevice? { MTLCopyAllDevices().first }

/// The devices this runtime emulates, in the order of the comma-separated
/// FLASHMETAL_METAL_SIM_DEVICES (default "m2"): "m2" is an Apple GPU of the
/// Apple8 and Metal 3 families; "paravirtual" is the paravirtual device of
/// macOS virtual machines (Apple5 / Mac2, no Metal 3), as GitHub's macOS
/// runners expose. Both run kernels on the simulator.
public func MTLCopyAllDevices() -> [MTLDevice] {
    let spec = getenv("FLASHMETAL_METAL_SIM_DEVICES").map { String(cString: $0) } ?? "m2"
    return spec.split(separator: ",").compactMap { SimDevice.named(String($0)) }
}

final class SimDevice: MTLDevice {
    let name: String
    let families: Set<MTLGPUFamily>
    /// FLASHMETAL_METAL_SIM_MAX_BUFFER bytes, else 4 GiB: makeBuffer of
    /// more returns nil.
    /// https://developer.apple.com/documentation/metal/mtldevice/maxbufferlength
    let maxBufferLength: Int
    /// Apple GPUs: 32 KiB (Metal feature set tables).
    let maxThreadgroupMemoryLength = 32768

    private init(name: String, families: Set<MTLGPUFamily>) {
        self.name = name
        self.families = families
        maxBufferLength = MetalSim.env("FLASHMETAL_METAL_SIM_MAX_BUFFER", 1 << 32)
    }

    nonisolated(unsafe) private static var made: [String: SimDevice] = [:]
    private static let lock = SimLock()

    /// One device object per kind for the process, as Metal returns.
    static func named(_ kind: String) -> SimDevice? {
        lock.locked {
            if let d = made[kind] { return d }
            let d: SimDevice
            switch kind.trimmingSpaces {
            case "m2":
                d = SimDevice(name: "Apple M2 (metal-sim: the flashmetal GPU simulator)",
                              families: [.apple1, .apple2, .apple3, .apple4, .apple5, .apple6, .apple7, .apple8,
                                         .mac2, .common1, .common2, .common3, .metal3])
            case "paravirtual":
                d = SimDevice(name: "Apple Paravirtual device (metal-sim)",
                              families: [.apple1, .apple2, .apple3, .apple4, .apple5, .mac2, .common1, .common2,
                                         .common3])
            default: return nil
            }
            made[kind] = d
            return d
        }
    }

    func supportsFamily(_ gpuFamily: MTLGPUFamily) -> Bool { families.contains(gpuFamily) }

    func makeCommandQueue() -> MTLCommandQueue? { SimCommandQueue(device: self, maxCommandBufferCount: 64) }

    func makeBuffer(bytes pointer: UnsafeRawPointer, length: Int, options: MTLResourceOptions) -> MTLBuffer? {
        guard length > 0, length <= maxBufferLength else { return nil }
        guard let b = SimBuffer(copying: pointer, length: length) else { return nil }
        MetalSim.count { $0.bytesCopiedIn += length; $0.copyBuffers += 1 }
        return b
    }

    func makeBuffer(bytesNoCopy pointer: UnsafeMutableRawPointer, length: Int, options: MTLResourceOptions,
                    deallocator: ((UnsafeMutableRawPointer, Int) -> Void)?) -> MTLBuffer? {
        // FLASHMETAL_METAL_SIM_WRAP=0 refuses every wrap, as Metal does for
        // memory it cannot map (tests of the host code's copy path).
        guard length > 0, length <= maxBufferLength, length % pageSize == 0,
              UInt(bitPattern: pointer) % UInt(pageSize) == 0, MetalSim.env("FLASHMETAL_METAL_SIM_WRAP", 1) != 0 else {
            MetalSim.count { $0.noCopyRefused += 1 }
            return nil
        }
        MetalSim.count { $0.bytesWrapped += length; $0.wraps += 1 }
        return SimBuffer(wrapping: pointer, length: length, deallocator: deallocator)
    }

    func makeLibrary(source: String, options: MTLCompileOptions?) throws -> MTLLibrary {
        let o = options ?? MTLCompileOptions()
        // bfloat is MSL 3.1.
        // https://developer.apple.com/documentation/metal/mtllanguageversion/version3_1
        if o.languageVersion.rawValue < MTLLanguageVersion.version3_1.rawValue && source.contains("bfloat") {
            throw MTLLibraryError(code: .compileFailure,
                                  message: "bfloat needs Metal Shading Language 3.1 (languageVersion \(o.languageVersion))")
        }
        // The simulator computes precise math functions and IEEE-safe
        // arithmetic; a library compiled for fast math would compute other
        // values on a GPU. mathFloatingPointFunctions defaults to .fast.
        // https://developer.apple.com/documentation/metal/mtlcompileoptions/mathfloatingpointfunctions
        // https://developer.apple.com/documentation/metal/mtlcompileoptions/mathmode
        guard o.mathMode == .safe, o.mathFloatingPointFunctions == .precise else {
            throw MTLLibraryError(code: .unsupported, message:
                "metal-sim computes precise math only: compile with mathMode = .safe and "
                    + "mathFloatingPointFunctions = .precise (got \(o.mathMode), \(o.mathFloatingPointFunctions))")
        }
        return SimLibrary(source: source)
    }

    func makeComputePipelineState(function computeFunction: MTLFunction) throws -> MTLComputePipelineState {
        guard let f = computeFunction as? SimFunction else {
            throw MTLLibraryError(code: .internal, message: "the function is not this runtime's")
        }
        return SimPipeline(function: f, maxThreads: MetalSim.maxThreadsPerThreadgroup)
    }
}

extension String {
    var trimmingSpaces: String { String(drop(while: { $0 == " " }).reversed().drop(while: { $0 == " " }).reversed()) }
}

final class SimBuffer: MTLBuffer {
    let base: UnsafeMutableRawPointer
    let length: Int
    /// Runtime-owned memory (makeBuffer(bytes:)), with a red zone on each side.
    let isCopy: Bool
    private let deallocator: ((UnsafeMutableRawPointer, Int) -> Void)?
    /// A command buffer that used this buffer has completed.
    var usedByCompleted = false

    static let redZone = 256
    static let redByte: UInt8 = 0xCD

    /// A page-aligned copy: one page in front (its last `redZone` bytes the
    /// front red zone), the bytes, then the back red zone.
    init?(copying src: UnsafeRawPointer, length: Int) {
        var p: UnsafeMutableRawPointer?
        guard posix_memalign(&p, pageSize, pageSize + length + Self.redZone) == 0, let mem = p else { return nil }
        base = mem + pageSize
        base.copyMemory(from: src, byteCount: length)
        (base - Self.redZone).initializeMemory(as: UInt8.self, repeating: Self.redByte, count: Self.redZone)
        (base + length).initializeMemory(as: UInt8.self, repeating: Self.redByte, count: Self.redZone)
        self.length = length
        isCopy = true
        deallocator = nil
    }

    init(wrapping p: UnsafeMutableRawPointer, length: Int, deallocator: ((UnsafeMutableRawPointer, Int) -> Void)?) {
        base = p
        self.length = length
        isCopy = false
        self.deallocator = deallocator
    }

    deinit {
        if isCopy { free(base - pageSize) } else { deallocator?(base, length) }
    }

    func contents() -> UnsafeMutableRawPointer {
        if isCopy && usedByCompleted {
            usedByCompleted = false
            MetalSim.count { $0.bytesCopiedOut += length }
        }
        return base
    }

    /// Whether the bytes around a copy are as the runtime left them.
    var redZoneIntact: Bool {
        guard isCopy else { return true }
        let before = UnsafeRawBufferPointer(start: base - Self.redZone, count: Self.redZone)
        let after = UnsafeRawBufferPointer(start: base + length, count: Self.redZone)
        return before.allSatisfy { $0 == Self.redByte } && after.allSatisfy { $0 == Self.redByte }
    }
}

final class SimLibrary: MTLLibrary {
    let source: String
    let constants: FunctionConstantTable
    init(source: String) {
        self.source = source
        constants = FunctionConstantTable(source: source)
    }

    func makeFunction(name: String, constantValues: MTLFunctionConstantValues) throws -> MTLFunction {
        // The kernel must be in this library's source (its host name in an
        // INSTANTIATE_KERNEL) and compiled into the simulator.
        guard source.contains("\"\(name)\""), fmsim_has_kernel(name) != 0 else {
            throw MTLLibraryError(code: .functionNotFound, message: "no function named '\(name)' in the library")
        }
        // Every constant the kernel reads is set, with its declared type
        // (values at other indices are ignored, as Metal does).
        for d in constants.required(byKernel: name) {
            guard let v = constantValues.values[d.index] else {
                throw MTLLibraryError(code: .compileFailure, message:
                    "function constant '\(d.name)' (index \(d.index), \(d.type)) of '\(name)' has no value")
            }
            guard FunctionConstantTable.dataType(d.type) == v.type else {
                throw MTLLibraryError(code: .compileFailure, message:
                    "function constant '\(d.name)' (index \(d.index)) of '\(name)' is declared \(d.type) and set as \(v.type)")
            }
        }
        return SimFunction(name: name, constants: constantValues.values)
    }
}

final class SimFunction: MTLFunction {
    let name: String
    let constants: [Int: MTLFunctionConstantValues.Value]
    init(name: String, constants: [Int: MTLFunctionConstantValues.Value]) {
        self.name = name
        self.constants = constants
    }
}

final class SimPipeline: MTLComputePipelineState {
    let function: SimFunction
    let maxTotalThreadsPerThreadgroup: Int
    init(function: SimFunction, maxThreads: Int) {
        self.function = function
        maxTotalThreadsPerThreadgroup = maxThreads
    }
}
