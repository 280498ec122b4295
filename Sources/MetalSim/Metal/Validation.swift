import Glibc

// The metal-sim runtime: Apple's Metal API (the part the Metal backend
// uses) on Linux, whose GPU is the flashmetal simulator. Settings, read
// from the environment when an object is made or a command buffer runs:
//   FLASHMETAL_METAL_SIM_DEVICES      devices listed, first = default ("m2";
//                                     "paravirtual" lacks Apple7 / Metal 3)
//   FLASHMETAL_METAL_SIM_MAX_THREADS  pipelines' maxTotalThreadsPerThreadgroup
//   FLASHMETAL_METAL_SIM_MAX_BUFFER   the device's maxBufferLength
//   FLASHMETAL_METAL_SIM_ORDER        "reverse" (default) or "shuffle:<seed>":
//                                     order of barrier-free concurrent dispatches
//   FLASHMETAL_METAL_SIM_DROP_BARRIER n: ignore each encoder's n-th memoryBarrier
//   FLASHMETAL_METAL_SIM_WRAP         0: refuse every bytesNoCopy wrap
//   FLASHMETAL_METAL_SIM_BOUNDS       0: leave kernels' loads and stores
//                                     unchecked against the bound buffers

/// Not Metal API: the metal-sim runtime's own controls and observations.
/// Every rule the runtime enforces is a `MetalSim.Rule`; a broken rule is a
/// violation: logged to stderr, counted, kept as `lastViolation`, handed to
/// `onViolation` when set, and, when it happens while a command buffer is
/// encoded or run, it fails that command buffer (status .error with the
/// violation as its error), so the host code sees it as a GPU error.
public enum MetalSim {
    /// A rule of Apple's Metal documentation this runtime checks.
    public enum Rule: String, CaseIterable, Sendable {
        case oneEncoderAtATime = "lifecycle.one-encoder-at-a-time"
        case endEncodingBeforeCommit = "lifecycle.end-encoding-before-commit"
        case encodeAfterEnd = "lifecycle.encode-after-end-encoding"
        case encodeAfterCommit = "lifecycle.encode-after-commit"
        case commitOnce = "lifecycle.commit-once"
        case waitBeforeCommit = "lifecycle.wait-before-commit"
        case encoderReleasedOpen = "lifecycle.encoder-released-without-end-encoding"
        case noAutoreleasePool = "autorelease.no-pool"
        case queueDeadlock = "autorelease.queue-deadlock"
        case bufferOffset = "buffers.offset"
        case setBytesLength = "buffers.set-bytes-length"
        case outOfBounds = "buffers.out-of-bounds"
        case noPipeline = "pipelines.no-pipeline-state"
        case threadsPerThreadgroup = "pipelines.threads-per-threadgroup"
        case threadgroupMemoryLength = "pipelines.threadgroup-memory-length"
        case threadgroupMemoryTotal = "pipelines.threadgroup-memory-total"
        case kernelFailed = "pipelines.kernel-failed"

        /// The Apple documentation page the rule comes from.
        public var documentation: String {
            let m = "https://developer.apple.com/documentation/metal/"
            switch self {
            case .oneEncoderAtATime, .endEncodingBeforeCommit, .encodeAfterEnd, .encoderReleasedOpen:
                return m + "mtlcommandencoder/endencoding()"
            case .encodeAfterCommit, .commitOnce: return m + "mtlcommandbuffer/commit()"
            case .waitBeforeCommit: return m + "mtlcommandbuffer/waituntilcompleted()"
            case .noAutoreleasePool:
                return "https://developer.apple.com/documentation/foundation/nsautoreleasepool"
            case .queueDeadlock: return m + "mtldevice/makecommandqueue(maxcommandbuffercount:)"
            case .bufferOffset, .outOfBounds: return m + "mtlcomputecommandencoder/setbuffer(_:offset:index:)"
            case .setBytesLength: return m + "mtlcomputecommandencoder/setbytes(_:length:index:)"
            case .noPipeline: return m + "mtlcomputecommandencoder/setcomputepipelinestate(_:)"
            case .threadsPerThreadgroup: return m + "mtlcomputepipelinestate/maxtotalthreadsperthreadgroup"
            case .threadgroupMemoryLength: return m + "mtlcomputecommandencoder/setthreadgroupmemorylength(_:index:)"
            case .threadgroupMemoryTotal: return m + "mtldevice/maxthreadgroupmemorylength"
            case .kernelFailed: return m + "mtlcommandbuffer/error"
            }
        }
    }

    /// One broken rule.
    public struct Violation: Error, CustomStringConvertible, Sendable {
        public let rule: Rule
        public let message: String
        public var description: String {
            "Metal API validation (metal-sim): \(rule.rawValue): \(message) [\(rule.documentation)]"
        }
    }

    /// What the runtime has done since the process started (all counters
    /// only grow, except `liveCommandBuffers`).
    public struct Counters: Sendable, Equatable {
        public var commandBuffers = 0, commits = 0, encoders = 0, dispatches = 0, barriers = 0
        /// Bytes of caller memory wrapped by makeBuffer(bytesNoCopy:).
        public var bytesWrapped = 0
        /// Bytes copied into new buffers by makeBuffer(bytes:).
        public var bytesCopiedIn = 0
        /// Bytes of makeBuffer(bytes:) buffers whose contents() the host
        /// read after a command buffer completed (what it copies back).
        public var bytesCopiedOut = 0
        public var violations = 0
        /// Command buffers not deallocated yet.
        public var liveCommandBuffers = 0
        /// makeBuffer(bytesNoCopy:) calls refused (unaligned, too long).
        public var noCopyRefused = 0
        /// Buffers made by makeBuffer(bytesNoCopy:) (wraps of host memory).
        public var wraps = 0
        /// Buffers made by makeBuffer(bytes:) (copies of host memory).
        public var copyBuffers = 0
    }

    nonisolated(unsafe) private static var state = Counters()
    nonisolated(unsafe) private static var last: Violation?
    private static let lock = SimLock()

    /// Called on every violation when set (tests record them here).
    nonisolated(unsafe) public static var onViolation: ((Violation) -> Void)?

    public static var counters: Counters { lock.locked { state } }
    public static var lastViolation: Violation? { lock.locked { last } }

    static func count(_ update: (inout Counters) -> Void) { lock.locked { update(&state) } }

    /// Records a violation (see the type's comment) and returns it.
    @discardableResult
    static func violate(_ rule: Rule, _ message: String) -> Violation {
        let v = Violation(rule: rule, message: message)
        lock.locked {
            state.violations += 1
            last = v
        }
        fputs("\(v)\n", stderr)
        onViolation?(v)
        return v
    }

    /// An integer setting from the environment, or `fallback`.
    static func env(_ name: String, _ fallback: Int) -> Int {
        guard let p = getenv(name), let v = Int(String(cString: p)) else { return fallback }
        return v
    }

    /// maxTotalThreadsPerThreadgroup of every pipeline made from now on:
    /// FLASHMETAL_METAL_SIM_MAX_THREADS (32...1024, a multiple of 32), else
    /// 1024. A real pipeline's limit depends on the kernel's register use.
    public static var maxThreadsPerThreadgroup: Int {
        let v = env("FLASHMETAL_METAL_SIM_MAX_THREADS", 1024)
        return v >= 32 && v <= 1024 && v % 32 == 0 ? v : 1024
    }
}

/// A pthread mutex for the runtime's own state.
final class SimLock: @unchecked Sendable {
    private var m = pthread_mutex_t()
    init() { pthread_mutex_init(&m, nil) }
    deinit { pthread_mutex_destroy(&m) }
    func locked<T>(_ body: () throws -> T) rethrows -> T {
        pthread_mutex_lock(&m)
        defer { pthread_mutex_unlock(&m) }
        return try body()
    }
}
