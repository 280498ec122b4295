/// The argument checks the ops share, each with one spelling of its
/// message. Tensors are named as the public function's parameters (q, k, v,
/// out, k_cache, ...); dims as batch, "the q heads" / "the k heads" (heads
/// of a named tensor), head_dim, q_len and "the cache capacity" (the key
/// rows k holds per sequence).
public enum Checks {
    /// `t` has `ref`'s shape: "v shape [..] must equal k shape [..]", naming `name`.
    public static func sameShape(_ t: TensorRef, _ name: String, as ref: TensorRef, _ refName: String,
                                 op: String) throws {
        if t.shape != ref.shape {
            throw FlashMetalError.value(op, "\(name) shape \(t.shape) must equal \(refName) shape \(ref.shape)",
                                        arg: name)
        }
    }

    /// One dim agrees between two tensors: "k head_dim (128) must equal q
    /// head_dim (64)", naming `name`.
    public static func sameDim(_ dim: String, _ value: Int, of name: String, as expected: Int, of refName: String,
                               op: String) throws {
        if value != expected {
            throw FlashMetalError.value(op, "\(name) \(dim) (\(value)) must equal \(refName) \(dim) (\(expected))",
                                        arg: name)
        }
    }

    /// `value > 0`: "num_heads must be > 0, got 0", naming `arg`.
    public static func positive(_ what: String, _ value: Int, op: String, arg: String) throws {
        if value <= 0 { throw FlashMetalError.value(op, "\(what) must be > 0, got \(value)", arg: arg) }
    }

    /// The heads of q group evenly over those of `kName` (the keys), both
    /// > 0: "the q heads (6) must be a multiple of the k_cache heads (4)".
    public static func heads(_ heads: Int, kvHeads: Int, of kName: String, op: String, headsArg: String = "q",
                             kvHeadsArg: String) throws {
        try positive("the q heads", heads, op: op, arg: headsArg)
        try positive("the \(kName) heads", kvHeads, op: op, arg: kvHeadsArg)
        if heads % kvHeads != 0 {
            throw FlashMetalError.value(
                op, "the q heads (\(heads)) must be a multiple of the \(kName) heads (\(kvHeads))", arg: headsArg)
        }
    }

    /// The score transform every attention op shares, s = softcap(scale *
    /// q.k): a finite scale, and a softcap of 0 (off) or a finite value > 0.
    public static func scaleAndSoftcap(_ scale: Float, _ softcap: Float, op: String) throws {
        if !scale.isFinite { throw FlashMetalError.value(op, "scale must be finite, got \(scale)", arg: "scale") }
        if !(softcap.isFinite && softcap >= 0) {
            throw FlashMetalError.value(op, "softcap must be 0 (off) or a finite value > 0, got \(softcap)",
                                        arg: "softcap")
        }
    }

    /// `0 < kv_len <= capacity`.
    public static func kvLen(_ kvLen: Int, capacity: Int, op: String) throws {
        try positive("kv_len", kvLen, op: op, arg: "kv_len")
        if kvLen > capacity {
            throw FlashMetalError.value(op, "kv_len (\(kvLen)) must be <= the cache capacity (\(capacity))",
                                        arg: "kv_len")
        }
    }
}

extension Checks {
    /// `t` has `ref`'s dtype: "k dtype float16 does not match q dtype bfloat16", naming `name`.
    public static func sameDType(_ t: TensorRef, _ name: String, as ref: TensorRef, _ refName: String,
                                 op: String) throws {
        if t.dtype != ref.dtype {
            throw FlashMetalError.type(
                op, "\(name) dtype \(t.dtype.name) does not match \(refName) dtype \(ref.dtype.name)", arg: name)
        }
    }
}

extension Checks {
    /// v's head dim of its own (flash-attn's head_dim_v): k's head dim
    /// `kDim` equals q's `qDim` (when given), `v` has `k`'s shape but for its
    /// last dim, and `out` has `q`'s shape with v's head dim last. Returns v's
    /// head dim. "k head_dim (4) must equal q head_dim (8)"; "v shape [..]
    /// must equal k shape [..] but for the head dim"; "out shape [..] must be
    /// [..] (q's shape with v's head dim)".
    public static func valueShapes(v: TensorRef, _ vName: String, k: TensorRef, _ kName: String,
                                   out: TensorRef, q: TensorRef, op: String, kDim: Int? = nil,
                                   qDim: Int? = nil) throws -> Int {
        if let kd = kDim, let qd = qDim { try sameDim("head_dim", kd, of: kName, as: qd, of: "q", op: op) }
        if v.rank != k.rank || v.rank == 0 || Array(v.shape.dropLast()) != Array(k.shape.dropLast()) {
            throw FlashMetalError.value(
                op, "\(vName) shape \(v.shape) must equal \(kName) shape \(k.shape) but for the head dim", arg: vName)
        }
        let dv = v.shape[v.rank - 1]
        let want = Array(q.shape.dropLast()) + [dv]
        if out.shape != want {
            throw FlashMetalError.value(op, "out shape \(out.shape) must be \(want) (q's shape with \(vName)'s head dim)",
                                        arg: "out")
        }
        return dv
    }
}
