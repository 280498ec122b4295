import CFlashMetal
import FlashMetalCore
import FlashMetalCPUKernels

/// Spreads independent work items over the machine's cores through the
/// process's one worker pool (pool.c): every cpu registry shares it, it
/// starts on the first job that needs a second thread, and it holds at most
/// FLASHMETAL_NUM_THREADS threads (default: the online CPUs), the caller
/// included.
///
/// Items are handed out dynamically (an atomic counter), so uneven items
/// (causal prefill) balance; which worker runs an item never changes what
/// the item computes. The calling thread works too and never waits for a
/// sleeping worker; one item, one thread, or a pool busy with another
/// caller's job runs inline. Workers spin briefly after a job, so back-to-back
/// calls do not pay a thread wake-up. Inside `interruptible`, a SIGINT skips
/// the items not yet started.
final class WorkerPool: Sendable {
    /// Threads a job may use, the caller included.
    let threads: Int

    init() {
        threads = Int(fm_pool_threads())
    }

    /// Calls `body(worker, item)` for every item in 0..<count; each worker
    /// index (< threads) runs on one thread at a time, so per-worker scratch
    /// is safe. `workers` caps the parallelism (e.g. 1 for a problem too
    /// small to pay for a second thread).
    func forEach(_ count: Int, workers maxWorkers: Int = Int.max, _ body: (Int, Int) -> Void) {
        guard count > 0 else { return }
        let workers = min(threads, count, max(1, maxWorkers))
        withoutActuallyEscaping(body) { esc in
            let items = ItemBody(esc)
            withExtendedLifetime(items) {
                _ = fm_pool_run(Int64(count), Int64(workers), { ctx, w, i in
                    Unmanaged<ItemBody>.fromOpaque(ctx!)._withUnsafeGuaranteedRef { $0.body(Int(w), Int(i)) }
                }, Unmanaged.passUnretained(items).toOpaque())
            }
        }
    }

    /// Runs `body` (one backend call) cancellable by SIGINT: when one arrives,
    /// the remaining items of every job are skipped and `interrupted` is
    /// thrown once `body` returns.
    func interruptible(_ what: @autoclosure () -> String, _ body: () throws -> Void) throws {
        let previous = fm_interrupt_arm()
        defer { fm_interrupt_disarm(previous) }
        try body()
        if fm_interrupt_pending() != 0 {
            throw FlashMetalError(FM_ERROR_INTERRUPTED, "\(what()): interrupted by SIGINT (the output is unspecified)")
        }
    }
}

/// A job's item function, called by every worker through a borrowed
/// reference: loading a closure stored in plain memory would retain and
/// release its context on every item, an atomic on one cache line that all
/// workers share (measurable with thousands of small decode items).
private final class ItemBody {
    let body: (Int, Int) -> Void
    init(_ body: @escaping (Int, Int) -> Void) { self.body = body }
}
