/// An execution engine for Dispatch values. Backends are shared by threads:
/// implementations must be safe to call concurrently.
public protocol Backend: AnyObject {
    /// "cpu", "sim" or "metal".
    var name: String { get }
    /// Whether work inside a batch scope may run only when the scope ends
    /// (Metal: one command buffer). Scratch memory of such work is kept until
    /// then; a synchronous backend (false) has run each dispatch on return.
    var defersWork: Bool { get }
    /// Whether a decode over quantized caches splits its keys across the
    /// dispatch grid (GPU threadgroups, then a reduce dispatch) rather than
    /// inside its one dispatch (the cpu's workers).
    var splitsKeysInGrid: Bool { get }
    /// Compiles or resolves the kernel specialised by the key's constants.
    /// Called once per key; the registry caches the result.
    func makePipeline(_ key: PipelineKey) throws -> AnyObject
    /// Runs dispatches in order; each sees the writes of the ones before it.
    func run(_ dispatches: [Dispatch], pipelines: [AnyObject]) throws
    /// Opens a batch scope: until endBatch, a backend may defer its work.
    /// Outputs are valid only after endBatch. The registry calls it for the
    /// outermost scope only (it counts the nesting), never twice in a row.
    func beginBatch() throws
    /// Closes the scope and runs the deferred work.
    func endBatch() throws
}

extension Backend {
    /// Conservative default: a backend that does not say otherwise may defer.
    public var defersWork: Bool { true }
    /// GPU backends split keys over threadgroups.
    public var splitsKeysInGrid: Bool { true }
    /// Synchronous backends have nothing to open.
    public func beginBatch() throws {}
    /// Synchronous backends have nothing to flush.
    public func endBatch() throws {}
}
