"""The head dims each op has a kernel for, read from the library's capability
tables (`fm.supported_head_dims`), so a test that means "every head dim"
follows the tables instead of restating them. `test_api_contract` pins the
tables' contents once."""
from __future__ import annotations

import flashmetal as fm

# The two-byte prefill tiles (512 included) and the float32 ones.
PREFILL = fm.supported_head_dims("flash_attn_prefill")
PREFILL_F32 = fm.supported_head_dims("flash_attn_prefill_f32")
# The decode tiles: the prefill tiles plus MLA's 576 (q/k over a 512-wide v).
DECODE = fm.supported_head_dims("flash_attn_decode")
# The head dims a KVCodec encodes.
CODEC = fm.supported_head_dims("kv_codec")
# The tiles any D <= 512 runs on (the smallest tile >= D, with the true D).
PADDED_TILES = tuple(d for d in PREFILL if d <= 512)
