import Glibc

/// Runs `body` inside an autorelease pool: the objects Metal returns
/// autoreleased while it runs (command buffers, command encoders) stay alive
/// until it returns, then the pool releases them. On Darwin this function
/// comes from the ObjectiveC module.
/// https://developer.apple.com/documentation/objectivec/1411862-autoreleasepool
public func autoreleasepool<Result>(invoking body: () throws -> Result) rethrows -> Result {
    let pools = AutoreleasePools.current
    pools.stack.append([])
    defer { pools.stack.removeLast() }
    return try body()
}

/// The autorelease pools of one thread, innermost last.
final class AutoreleasePools {
    var stack: [[AnyObject]] = []

    private static let key: pthread_key_t = {
        var k = pthread_key_t()
        pthread_key_create(&k) { p in
            if let p { Unmanaged<AutoreleasePools>.fromOpaque(p).release() }
        }
        return k
    }()

    static var current: AutoreleasePools {
        if let p = pthread_getspecific(key) { return Unmanaged<AutoreleasePools>.fromOpaque(p).takeUnretainedValue() }
        let pools = AutoreleasePools()
        pthread_setspecific(key, Unmanaged.passRetained(pools).toOpaque())
        return pools
    }

    /// Objects autoreleased with no pool in place: never released (they
    /// leak, as on Darwin).
    nonisolated(unsafe) static var leaked: [AnyObject] = []
    private static let leakLock = SimLock()

    /// Puts `object` in the innermost pool of this thread; with none, it
    /// leaks and that is a violation (returned so the caller can fail the
    /// command buffer it belongs to).
    static func autorelease(_ object: AnyObject, what: String) -> MetalSim.Violation? {
        let pools = current
        if pools.stack.isEmpty {
            leakLock.locked { leaked.append(object) }
            return MetalSim.violate(.noAutoreleasePool,
                                    "\(what) was returned autoreleased with no autorelease pool in place: it leaks "
                                        + "(wrap each call in autoreleasepool { })")
        }
        pools.stack[pools.stack.count - 1].append(object)
        return nil
    }
}
