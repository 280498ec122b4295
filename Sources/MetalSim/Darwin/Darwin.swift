// The Darwin module of the metal-sim build (Linux only): glibc, with
// getpagesize() answering Apple silicon's 16 KiB VM page, so host code
// written for macOS sizes its no-copy buffers as it does on a Mac.
// https://developer.apple.com/documentation/apple-silicon/addressing-architectural-differences-in-your-macos-code
// ("Apple silicon uses 16 KB memory pages").
@_exported import Glibc

/// Apple silicon's VM page size in bytes.
public func getpagesize() -> Int32 { 16384 }
