/// Tile geometry of a prefill kernel: BQ query rows and BK key
/// columns per tile, WM x WN simdgroups. The rows live in PrefillCapability.
public struct PrefillGeometry: Equatable, Sendable {
    /// Query rows per tile.
    public let bq: Int
    /// Key columns per tile.
    public let bk: Int
    /// Simdgroups along the query rows.
    public let wm: Int
    /// Simdgroups along the keys.
    public let wn: Int

    /// A tile geometry (rows of PrefillCapability.geometry).
    public init(bq: Int, bk: Int, wm: Int, wn: Int) {
        self.bq = bq; self.bk = bk; self.wm = wm; self.wn = wn
    }

    /// The head dims that have a prefill kernel.
    public static var headDims: [Int] { PrefillCapability.headDims }

    /// The geometry of the kernel that runs head dim `d`; nil when none does.
    public static func forHeadDim(_ d: Int) -> PrefillGeometry? {
        PrefillCapability.tileHeadDim(d).flatMap { PrefillCapability.geometry[$0] }
    }

    /// Threads per threadgroup: one simdgroup of 32 per (WM, WN) cell.
    public var threadsPerGroup: Size3 { Size3(32, wm, wn) }

    /// Tile counts for a (qL, kL) problem, as AttnParams carries them.
    public func tiles(qL: Int, kL: Int) -> PrefillTiles {
        PrefillTiles(nq: (qL + bq - 1) / bq, nk: (kL + bk - 1) / bk,
                     nqAligned: qL / bq, nkAligned: kL / bk,
                     qLRem: qL % bq, kLRem: kL % bk)
    }
}

/// The tile counts of one prefill problem (AttnParams' NQ...kL_rem).
public struct PrefillTiles: Equatable, Sendable {
    /// Query tiles (ceil), key tiles (ceil), whole tiles of each, remainders.
    public let nq: Int, nk: Int, nqAligned: Int, nkAligned: Int, qLRem: Int, kLRem: Int

    /// Tile counts as AttnParams carries them.
    public init(nq: Int, nk: Int, nqAligned: Int, nkAligned: Int, qLRem: Int, kLRem: Int) {
        self.nq = nq; self.nk = nk; self.nqAligned = nqAligned; self.nkAligned = nkAligned
        self.qLRem = qLRem; self.kLRem = kLRem
    }
}
