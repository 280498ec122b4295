// The Metal protocols the runtime implements, with Apple's signatures
// (ObjC protocols as class-bound Swift protocols).

public protocol MTLResource: AnyObject {}

public protocol MTLBuffer: MTLResource {
    var length: Int { get }
    func contents() -> UnsafeMutableRawPointer
}

public protocol MTLFunction: AnyObject {
    var name: String { get }
}

public protocol MTLLibrary: AnyObject {
    func makeFunction(name: String, constantValues: MTLFunctionConstantValues) throws -> MTLFunction
}

public protocol MTLComputePipelineState: AnyObject {
    var maxTotalThreadsPerThreadgroup: Int { get }
}

public protocol MTLCommandEncoder: AnyObject {
    func endEncoding()
}

public protocol MTLComputeCommandEncoder: MTLCommandEncoder {
    func setComputePipelineState(_ state: MTLComputePipelineState)
    func setBytes(_ bytes: UnsafeRawPointer, length: Int, index: Int)
    func setBuffer(_ buffer: MTLBuffer?, offset: Int, index: Int)
    func setThreadgroupMemoryLength(_ length: Int, index: Int)
    func dispatchThreadgroups(_ threadgroupsPerGrid: MTLSize, threadsPerThreadgroup: MTLSize)
    func memoryBarrier(scope: MTLBarrierScope)
}

public protocol MTLCommandBuffer: AnyObject {
    var status: MTLCommandBufferStatus { get }
    var error: Error? { get }
    func makeComputeCommandEncoder(dispatchType: MTLDispatchType) -> MTLComputeCommandEncoder?
    func commit()
    func waitUntilCompleted()
}

public protocol MTLCommandQueue: AnyObject {
    func makeCommandBuffer() -> MTLCommandBuffer?
}

public protocol MTLDevice: AnyObject {
    var name: String { get }
    var maxBufferLength: Int { get }
    var maxThreadgroupMemoryLength: Int { get }
    func supportsFamily(_ gpuFamily: MTLGPUFamily) -> Bool
    func makeCommandQueue() -> MTLCommandQueue?
    func makeBuffer(bytes pointer: UnsafeRawPointer, length: Int, options: MTLResourceOptions) -> MTLBuffer?
    func makeBuffer(bytesNoCopy pointer: UnsafeMutableRawPointer, length: Int, options: MTLResourceOptions,
                    deallocator: ((UnsafeMutableRawPointer, Int) -> Void)?) -> MTLBuffer?
    func makeLibrary(source: String, options: MTLCompileOptions?) throws -> MTLLibrary
    func makeComputePipelineState(function computeFunction: MTLFunction) throws -> MTLComputePipelineState
}
