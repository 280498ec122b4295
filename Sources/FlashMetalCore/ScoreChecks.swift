/// The checks of the score transform every attention op shares:
/// s = softcap(scale * q.k).
public enum ScoreChecks {
    /// A finite scale, and a softcap of 0 (off) or a finite value > 0.
    public static func requireScaleAndSoftcap(_ scale: Float, _ softcap: Float, op: String) throws {
        if !scale.isFinite { throw FlashMetalError.value(op, "scale must be finite, got \(scale)", arg: "scale") }
        if !(softcap.isFinite && softcap >= 0) {
            throw FlashMetalError.value(op, "softcap must be 0 (off) or a finite value > 0, got \(softcap)", arg: "softcap")
        }
    }
}
