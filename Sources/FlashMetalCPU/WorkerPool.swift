import FlashMetalCPUKernels
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// Spreads independent work items over the machine's cores (pool.c).
/// FLASHMETAL_NUM_THREADS overrides the core count.
///
/// Items are handed out dynamically (an atomic counter), so uneven items
/// (causal prefill) balance; which worker runs an item never changes what
/// the item computes. The calling thread works too and never waits for a
/// sleeping worker; one item, one thread, or a pool busy with another
/// caller's job runs inline. Workers spin briefly after a job, so back-to-back
/// calls do not pay a thread wake-up.
final class WorkerPool: @unchecked Sendable {
    let threads: Int
    private let pool: OpaquePointer?

    init() {
        var n = max(1, Int(sysconf(Int32(_SC_NPROCESSORS_ONLN))))
        if let s = getenv("FLASHMETAL_NUM_THREADS"), let v = Int(String(cString: s)), v > 0 {
            n = v
        }
        pool = n > 1 ? fm_pool_create(Int32(min(n, 1024))) : nil
        threads = pool == nil ? 1 : Int(fm_pool_threads(pool))
    }

    deinit {
        if let p = pool { fm_pool_destroy(p) }
    }

    /// Calls `body(worker, item)` for every item in 0..<count; each worker
    /// index (< threads) runs on one thread at a time, so per-worker scratch
    /// is safe. `workers` caps the parallelism (e.g. 1 for a problem too
    /// small to pay for a second thread).
    func forEach(_ count: Int, workers maxWorkers: Int = Int.max, _ body: (Int, Int) -> Void) {
        let workers = min(threads, count, max(1, maxWorkers))
        if workers <= 1 || pool == nil {
            for i in 0..<count { body(0, i) }
            return
        }
        withoutActuallyEscaping(body) { esc in
            var box = esc
            withUnsafeMutablePointer(to: &box) { ctx in
                fm_pool_run(pool, Int64(count), Int64(workers), { ctx, w, i in
                    ctx!.assumingMemoryBound(to: ((Int, Int) -> Void).self).pointee(Int(w), Int(i))
                }, ctx)
            }
        }
    }
}
