#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// A pthread mutex: the Swift standard library has none and Foundation is
/// kept out of the library.
///
/// fork()-safe: a fork waits until no Lock is held (every live Lock is taken
/// before the fork and given back after it, in parent and child), so a child
/// never inherits a lock held by a thread that does not exist there, nor the
/// data it guards half-updated.
public final class Lock: @unchecked Sendable {
    private let mutex: UnsafeMutablePointer<pthread_mutex_t>

    /// An unlocked mutex.
    public init() {
        mutex = .allocate(capacity: 1)
        pthread_mutex_init(mutex, nil)
        ForkGuard.register(mutex)
    }

    deinit {
        ForkGuard.unregister(mutex)
        pthread_mutex_destroy(mutex)
        mutex.deallocate()
    }

    /// Runs `body` holding the mutex.
    public func withLock<R>(_ body: () throws -> R) rethrows -> R {
        pthread_mutex_lock(mutex)
        defer { pthread_mutex_unlock(mutex) }
        return try body()
    }
}

/// Every live Lock's mutex, in creation order. Locks nest newest-outside
/// (a Registry's lock is made after its backend's and held around calls
/// into it), so the fork handler takes them newest first.
private enum ForkGuard {
    nonisolated(unsafe) static var mutexes: [UnsafeMutablePointer<pthread_mutex_t>] = []
    static let listMutex: UnsafeMutablePointer<pthread_mutex_t> = {
        let m = UnsafeMutablePointer<pthread_mutex_t>.allocate(capacity: 1)
        pthread_mutex_init(m, nil)
        pthread_atfork({ ForkGuard.takeAll() }, { ForkGuard.releaseAll() }, { ForkGuard.releaseAll() })
        return m
    }()

    static func register(_ m: UnsafeMutablePointer<pthread_mutex_t>) {
        pthread_mutex_lock(listMutex)
        mutexes.append(m)
        pthread_mutex_unlock(listMutex)
    }

    static func unregister(_ m: UnsafeMutablePointer<pthread_mutex_t>) {
        pthread_mutex_lock(listMutex)
        if let i = mutexes.lastIndex(of: m) { mutexes.remove(at: i) }
        pthread_mutex_unlock(listMutex)
    }

    static func takeAll() {
        pthread_mutex_lock(listMutex)
        for m in mutexes.reversed() { pthread_mutex_lock(m) }
    }

    /// In the parent, and in the child (where the forking thread, the owner
    /// of every one of them, is the only thread).
    static func releaseAll() {
        for m in mutexes { pthread_mutex_unlock(m) }
        pthread_mutex_unlock(listMutex)
    }
}
