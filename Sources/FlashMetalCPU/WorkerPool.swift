import Dispatch
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// Spreads independent work items over the machine's cores.
/// FLASHMETAL_NUM_THREADS overrides the core count.
final class WorkerPool: @unchecked Sendable {
    let threads: Int

    init() {
        if let s = getenv("FLASHMETAL_NUM_THREADS"), let n = Int(String(cString: s)), n > 0 {
            threads = n
        } else {
            threads = max(1, Int(sysconf(Int32(_SC_NPROCESSORS_ONLN))))
        }
    }

    /// Calls `body(worker, item)` for every item in 0..<count; each worker
    /// index runs on one thread at a time, so per-worker scratch is safe.
    func forEach(_ count: Int, _ body: (Int, Int) -> Void) {
        let workers = min(threads, count)
        if workers <= 1 {
            for i in 0..<count { body(0, i) }
            return
        }
        DispatchQueue.concurrentPerform(iterations: workers) { w in
            var i = w
            while i < count {
                body(w, i)
                i += workers
            }
        }
    }
}
