/// Tile geometry of the prefill kernels (seed 000), the one place it lives:
/// BQ query rows and BK key columns per tile, WM x WN simdgroups.
public struct PrefillGeometry: Equatable, Sendable {
    public let bq: Int
    public let bk: Int
    public let wm: Int
    public let wn: Int

    public init(bq: Int, bk: Int, wm: Int, wn: Int) {
        self.bq = bq; self.bk = bk; self.wm = wm; self.wn = wn
    }

    /// The head dims that have a prefill kernel.
    public static let headDims = [64, 128, 256, 512]

    /// nil for a head dim without a kernel.
    public static func forHeadDim(_ d: Int) -> PrefillGeometry? {
        switch d {
        case 64, 128, 256: return PrefillGeometry(bq: 32, bk: 16, wm: 4, wn: 1)
        case 512: return PrefillGeometry(bq: 8, bk: 8, wm: 1, wn: 1)
        default: return nil
        }
    }

    public var threadsPerGroup: Size3 { Size3(32, wm, wn) }

    /// Tile counts for a (qL, kL) problem, as AttnParams carries them.
    public func tiles(qL: Int, kL: Int) -> PrefillTiles {
        PrefillTiles(nq: (qL + bq - 1) / bq, nk: (kL + bk - 1) / bk,
                     nqAligned: qL / bq, nkAligned: kL / bk,
                     qLRem: qL % bq, kLRem: kL % bk)
    }
}

public struct PrefillTiles: Equatable, Sendable {
    public let nq: Int, nk: Int, nqAligned: Int, nkAligned: Int, qLRem: Int, kLRem: Int

    public init(nq: Int, nk: Int, nqAligned: Int, nkAligned: Int, qLRem: Int, kLRem: Int) {
        self.nq = nq; self.nk = nk; self.nqAligned = nqAligned; self.nkAligned = nkAligned
        self.qLRem = qLRem; self.kLRem = kLRem
    }
}

/// Function-constant indices shared by the prefill and blk kernels (seeds 000, 001).
public enum PrefillConstant {
    public static let alignQ = 200
    public static let alignK = 201
    public static let hasMask = 300
    public static let doCausal = 301
    public static let hasBlk = 303
    public static let blkBQ = 400
    public static let blkBK = 401
}
