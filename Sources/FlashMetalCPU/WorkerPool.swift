import Dispatch
import FlashMetalCPUKernels
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// Spreads independent work items over the machine's cores.
/// FLASHMETAL_NUM_THREADS overrides the core count.
///
/// Items are handed out dynamically (an atomic counter), so uneven items
/// (causal prefill) balance; which worker runs an item never changes what
/// the item computes. One item, or one thread, runs inline on the calling
/// thread: no wake-up cost for tiny problems (decode with a short cache).
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
    /// `workers` caps the parallelism (e.g. 1 for a problem too small to
    /// pay a thread wake-up).
    func forEach(_ count: Int, workers maxWorkers: Int = Int.max, _ body: (Int, Int) -> Void) {
        let workers = min(threads, count, max(1, maxWorkers))
        if workers <= 1 {
            for i in 0..<count { body(0, i) }
            return
        }
        var next: Int64 = 0
        withUnsafeMutablePointer(to: &next) { counter in
            DispatchQueue.concurrentPerform(iterations: workers) { w in
                while true {
                    let i = Int(fm_atomic_fetch_add_i64(counter, 1))
                    if i >= count { break }
                    body(w, i)
                }
            }
        }
    }
}
