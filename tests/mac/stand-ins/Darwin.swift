// Stand-in for Apple's Darwin module, used only by `make mac-check` to
// type-check the package for macOS on Linux. It declares exactly the libc
// surface the package calls, as Swift imports it from the macOS SDK headers
// (names, labels, optionality: implicitly unwrapped where the header has no
// nullability annotations, non-optional/optional where it has them). Bodies
// never run: the module is only emitted, never linked.

// <stdlib.h>, <malloc/_malloc.h>
public func getenv(_ name: UnsafePointer<CChar>!) -> UnsafeMutablePointer<CChar>! { fatalError() }
public func malloc(_ __size: Int) -> UnsafeMutableRawPointer! { fatalError() }
public func calloc(_ __count: Int, _ __size: Int) -> UnsafeMutableRawPointer! { fatalError() }
public func free(_ ptr: UnsafeMutableRawPointer!) { fatalError() }
public func posix_memalign(_ __memptr: UnsafeMutablePointer<UnsafeMutableRawPointer?>!, _ __alignment: Int,
                           _ __size: Int) -> Int32 { fatalError() }
public func exit(_ status: Int32) -> Never { fatalError() }

// <unistd.h>: _SC_* are macros on Darwin, imported as Int32 constants.
public func sysconf(_ name: Int32) -> Int { fatalError() }
public var _SC_NPROCESSORS_ONLN: Int32 { 58 }
public func getpagesize() -> Int32 { fatalError() }

// <pthread.h> (nullability-audited on Darwin).
public struct pthread_mutex_t { public init() {} }
public struct pthread_mutexattr_t { public init() {} }
public func pthread_mutex_init(_ mutex: UnsafeMutablePointer<pthread_mutex_t>,
                               _ attr: UnsafePointer<pthread_mutexattr_t>?) -> Int32 { fatalError() }
public func pthread_mutex_destroy(_ mutex: UnsafeMutablePointer<pthread_mutex_t>) -> Int32 { fatalError() }
public func pthread_mutex_lock(_ mutex: UnsafeMutablePointer<pthread_mutex_t>) -> Int32 { fatalError() }
public func pthread_mutex_unlock(_ mutex: UnsafeMutablePointer<pthread_mutex_t>) -> Int32 { fatalError() }
@available(macOS 10.4, *)
public func pthread_atfork(_ prepare: (@convention(c) () -> Void)?, _ parent: (@convention(c) () -> Void)?,
                           _ child: (@convention(c) () -> Void)?) -> Int32 { fatalError() }

// <stdio.h>: FILE is struct __sFILE; stderr is the overlay's wrapper of __stderrp.
public struct __sFILE { public init() {} }
public typealias FILE = __sFILE
public var stderr: UnsafeMutablePointer<FILE> { fatalError() }
public func fopen(_ __filename: UnsafePointer<CChar>!, _ __mode: UnsafePointer<CChar>!) -> UnsafeMutablePointer<FILE>! {
    fatalError()
}
public func fclose(_ stream: UnsafeMutablePointer<FILE>!) -> Int32 { fatalError() }
public func fread(_ __ptr: UnsafeMutableRawPointer!, _ __size: Int, _ __nitems: Int,
                  _ __stream: UnsafeMutablePointer<FILE>!) -> Int { fatalError() }
public func fwrite(_ __ptr: UnsafeRawPointer!, _ __size: Int, _ __nitems: Int,
                   _ __stream: UnsafeMutablePointer<FILE>!) -> Int { fatalError() }
public func fputs(_ s: UnsafePointer<CChar>!, _ stream: UnsafeMutablePointer<FILE>!) -> Int32 { fatalError() }
