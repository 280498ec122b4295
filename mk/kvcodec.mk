# mk/kvcodec.mk — the quantized-KV codec's Lloyd–Max tables, designed in
# float64 by python/flashmetal/_lloyd_max.py and embedded as a header the
# shaders, the simulator and the cpu kernels include. tests/python/
# test_kv_codec.py fails when the checked-in header differs from this output.
.PHONY: kv-codec-tables

kv-codec-tables: venv
	$(PY) python/flashmetal/_lloyd_max.py > Resources/shaders/.kv_codec_tables.h.tmp
	mv -f Resources/shaders/.kv_codec_tables.h.tmp Resources/shaders/kv_codec_tables.h
