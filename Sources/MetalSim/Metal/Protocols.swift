// The Metal protocols the backend uses, with Apple's signatures and macOS
// availability (ObjC protocols as class-bound Swift protocols): exactly the
// API Sources/FlashMetalMetal calls. One declaration for two modules named
// Metal: the metal-sim runtime (Linux), and the stand-in that `make
// mac-check` type-checks the backend against for macOS (tests/mac/stand-ins,
// which compiles this file in).

@available(macOS 10.11, *)
public protocol MTLResource: AnyObject {}

@available(macOS 10.11, *)
public protocol MTLBuffer: MTLResource {
    var length: Int { get }
    func contents() -> UnsafeMutableRawPointer
}

@available(macOS 10.11, *)
public protocol MTLFunction: AnyObject {}

@available(macOS 10.11, *)
public protocol MTLLibrary: AnyObject {
    @available(macOS 10.12, *)
    func makeFunction(name: String, constantValues: MTLFunctionConstantValues) throws -> MTLFunction
}

@available(macOS 10.11, *)
public protocol MTLComputePipelineState: AnyObject {
    var maxTotalThreadsPerThreadgroup: Int { get }
}

@available(macOS 10.11, *)
public protocol MTLCommandEncoder: AnyObject {
    func endEncoding()
}

@available(macOS 10.11, *)
public protocol MTLComputeCommandEncoder: MTLCommandEncoder {
    func setComputePipelineState(_ state: MTLComputePipelineState)
    func setBytes(_ bytes: UnsafeRawPointer, length: Int, index: Int)
    func setBuffer(_ buffer: MTLBuffer?, offset: Int, index: Int)
    func setThreadgroupMemoryLength(_ length: Int, index: Int)
    func dispatchThreadgroups(_ threadgroupsPerGrid: MTLSize, threadsPerThreadgroup: MTLSize)
    @available(macOS 10.14, *)
    func memoryBarrier(scope: MTLBarrierScope)
}

@available(macOS 10.11, *)
public protocol MTLCommandBuffer: AnyObject {
    var status: MTLCommandBufferStatus { get }
    var error: Error? { get }
    @available(macOS 10.14, *)
    func makeComputeCommandEncoder(dispatchType: MTLDispatchType) -> MTLComputeCommandEncoder?
    func commit()
    func waitUntilCompleted()
}

@available(macOS 10.11, *)
public protocol MTLCommandQueue: AnyObject {
    func makeCommandBuffer() -> MTLCommandBuffer?
}

@available(macOS 10.11, *)
public protocol MTLDevice: AnyObject {
    var name: String { get }
    @available(macOS 10.15, *)
    func supportsFamily(_ gpuFamily: MTLGPUFamily) -> Bool
    func makeCommandQueue() -> MTLCommandQueue?
    func makeBuffer(bytes pointer: UnsafeRawPointer, length: Int, options: MTLResourceOptions) -> MTLBuffer?
    func makeBuffer(bytesNoCopy pointer: UnsafeMutableRawPointer, length: Int, options: MTLResourceOptions,
                    deallocator: ((UnsafeMutableRawPointer, Int) -> Void)?) -> MTLBuffer?
    func makeLibrary(source: String, options: MTLCompileOptions?) throws -> MTLLibrary
    func makeComputePipelineState(function computeFunction: MTLFunction) throws -> MTLComputePipelineState
}
