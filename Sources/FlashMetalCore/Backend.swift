/// An execution engine for Dispatch values. Backends are shared by threads:
/// implementations must be safe to call concurrently.
public protocol Backend: AnyObject {
    /// "cpu", "sim" or "metal".
    var name: String { get }
    /// Compiles or resolves the kernel specialised by the key's constants.
    /// Called once per key; the registry caches the result.
    func makePipeline(_ key: PipelineKey) throws -> AnyObject
    /// Runs dispatches in order; each sees the writes of the ones before it.
    func run(_ dispatches: [Dispatch], pipelines: [AnyObject]) throws
    func beginBatch() throws
    func endBatch() throws
}

extension Backend {
    /// Opens a batch scope: until the matching endBatch, a backend may defer
    /// its work (Metal: one command buffer, committed at the end). Outputs
    /// are valid only after endBatch. Synchronous backends do nothing.
    public func beginBatch() throws {}
    public func endBatch() throws {}
}
