import CFlashMetal
import XCTest

/// The parameter structs must match mlx-native's byte for byte: the GPU reads
/// them as raw bytes.
final class LayoutTests: XCTestCase {
    func testAttnParams() {
        XCTAssertEqual(MemoryLayout<AttnParams>.size, 160)
        let fields: [(PartialKeyPath<AttnParams>, Int)] = [
            (\.B, 0), (\.H, 4), (\.D, 8), (\.qL, 12), (\.kL, 16), (\.gqa_factor, 20),
            (\.scale, 24), (\.softcapping, 28), (\.NQ, 32), (\.NK, 36), (\.NQ_aligned, 40),
            (\.NK_aligned, 44), (\.qL_rem, 48), (\.kL_rem, 52), (\.qL_off, 56), (\.Dv, 60),
            (\.Q_strides, 64), (\.K_strides, 88), (\.V_strides, 112), (\.O_strides, 136),
        ]
        for (kp, off) in fields { XCTAssertEqual(MemoryLayout<AttnParams>.offset(of: kp), off, "\(kp)") }
    }

    func testAttnMaskParams() {
        XCTAssertEqual(MemoryLayout<AttnMaskParams>.size, 24)
        XCTAssertEqual(MemoryLayout<AttnMaskParams>.offset(of: \.M_strides), 0)
    }

    func testBlkParams() {
        XCTAssertEqual(MemoryLayout<BlkParams>.size, 16)
        let fields: [(PartialKeyPath<BlkParams>, Int)] = [
            (\.seq_len_q, 0), (\.seq_len_k, 4), (\.mask_row_stride, 8), (\._pad, 12),
        ]
        for (kp, off) in fields { XCTAssertEqual(MemoryLayout<BlkParams>.offset(of: kp), off, "\(kp)") }
    }

    func testFlashAttnVecParams() {
        XCTAssertEqual(MemoryLayout<FlashAttnVecParams>.size, 48)
        let fields: [(PartialKeyPath<FlashAttnVecParams>, Int)] = [
            (\.n_heads, 0), (\.n_kv_heads, 4), (\.head_dim, 8), (\.kv_seq_len, 12), (\.kv_capacity, 16),
            (\.scale, 20), (\.mask_type, 24), (\.sliding_window, 28), (\.softcap, 32), (\.nwg, 36),
            (\.head_dim_v, 40),
        ]
        for (kp, off) in fields { XCTAssertEqual(MemoryLayout<FlashAttnVecParams>.offset(of: kp), off, "\(kp)") }
    }

    func testFlashAttnVecReduceParams() {
        XCTAssertEqual(MemoryLayout<FlashAttnVecReduceParams>.size, 8)
        XCTAssertEqual(MemoryLayout<FlashAttnVecReduceParams>.offset(of: \.nrows), 0)
        XCTAssertEqual(MemoryLayout<FlashAttnVecReduceParams>.offset(of: \.head_dim), 4)
    }

    func testSdpaParams() {
        XCTAssertEqual(MemoryLayout<SdpaParams>.size, 32)
        let fields: [(PartialKeyPath<SdpaParams>, Int)] = [
            (\.n_heads, 0), (\.n_kv_heads, 4), (\.head_dim, 8), (\.seq_len, 12), (\.kv_seq_len, 16),
            (\.scale, 20), (\.kv_capacity, 24), (\.do_causal, 28),
        ]
        for (kp, off) in fields { XCTAssertEqual(MemoryLayout<SdpaParams>.offset(of: kp), off, "\(kp)") }
    }

    func testSdpaExtParams() {
        XCTAssertEqual(MemoryLayout<SdpaExtParams>.size, 16)
        let fields: [(PartialKeyPath<SdpaExtParams>, Int)] = [
            (\.softcap, 0), (\.q_offset, 4), (\.window, 8), (\.head_dim_v, 12),
        ]
        for (kp, off) in fields { XCTAssertEqual(MemoryLayout<SdpaExtParams>.offset(of: kp), off, "\(kp)") }
    }
}
