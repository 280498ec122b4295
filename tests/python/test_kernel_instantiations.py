"""The shaders' INSTANTIATE_KERNEL lines are the capability tables': every
generated block of Resources/shaders is what tools/gen_instantiations.py
writes from the built library's kernel list (fm_kernel_instantiations), every
kernel the library can request is instantiated once with the tables' template
arguments, and no shader instantiates a kernel the tables do not define."""
from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

import pytest

from flashmetal import _loader

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gen_instantiations", ROOT / "tools" / "gen_instantiations.py")
assert _spec and _spec.loader
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)

KERNELS = gen.library_kernels(_loader.library_path())
FILES = gen.shader_files(gen.SHADERS)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_generated_blocks_are_the_generators_output(path):
    text = path.read_text()
    diff = list(difflib.unified_diff(text.split("\n"), gen.render(text, KERNELS, where=path.name).split("\n"),
                                     "checked in", "generated", lineterm="", n=0))
    assert not diff, (f"{path.name}: its generated INSTANTIATE_KERNEL block differs from the capability tables "
                      "(run `make kernel-instantiations`):\n" + "\n".join(diff[:20]))


def test_shaders_instantiate_exactly_the_tables_kernels():
    assert gen.disagreements([p.read_text() for p in FILES], KERNELS) == []


def test_prefill_and_decode_kernels_are_generated():
    """Each prefill and decode kernel's line lies inside a generated block."""
    generated = {line for path in FILES for line in gen.generated_lines(path.read_text(), where=path.name)}
    ops = [k for k in KERNELS if k.name.startswith(("flash_attn_prefill_", "flash_attn_vec_"))]
    assert len(ops) > 80
    assert [k.name for k in ops if k.line not in generated] == []


def test_the_library_lists_prefill_kernels_with_their_geometry():
    """fm_kernel_instantiations carries the tables' facts (spot checks of
    three kinds of prefill rows and a decode row)."""
    by_name = {k.name: k for k in KERNELS}
    assert by_name["flash_attn_prefill_bf16_d128"].line == (
        'INSTANTIATE_KERNEL("flash_attn_prefill_bf16_d128", flash_attn_prefill, bfloat, bfloat, 32, 16, 128, 4, 1)')
    assert by_name["flash_attn_prefill_f16_d576_boolmask"].args == (
        "half", "uchar", "16", "64", "576", "1", "8", "8", "8", "512")
    assert by_name["flash_attn_prefill_f32_d512"].function == "flash_attn_prefill_split"
    assert by_name["flash_attn_vec_bf16kv_dk80"].args == ("bfloat", "80")
    assert len(by_name) == len(KERNELS)


# ---- the generator on made-up tables ---------------------------------------

TABLE = gen.parse("k_d64 body float 64\nk_d128 body float 128\nother_f32 other float")
SOURCE = "\n".join(["// head", f"{gen.BEGIN} body", 'INSTANTIATE_KERNEL("k_d64", body, float, 64)', gen.END,
                    'INSTANTIATE_KERNEL("other_f32", other, float)', ""])


def test_render_writes_a_new_table_row_into_its_block():
    """A head dim added to a table appears in the block, in the table's order;
    lines outside blocks stay as written."""
    out = gen.render(SOURCE, TABLE)
    assert out.split("\n") == ["// head", f"{gen.BEGIN} body", gen.NOTE,
                               'INSTANTIATE_KERNEL("k_d64", body, float, 64)',
                               'INSTANTIATE_KERNEL("k_d128", body, float, 128)', gen.END,
                               'INSTANTIATE_KERNEL("other_f32", other, float)', ""]
    assert gen.render(out, TABLE) == out
    assert gen.disagreements([out], TABLE) == []


def test_disagreements_name_missing_extra_and_doubled_kernels():
    problems = gen.disagreements([SOURCE + 'INSTANTIATE_KERNEL("k_d64", body, float, 64)\n'
                                  'INSTANTIATE_KERNEL("gone", body, float, 1)\n'], TABLE)
    assert problems == ['not instantiated (or with other template arguments): '
                        'INSTANTIATE_KERNEL("k_d128", body, float, 128)',
                        'instantiated but in no capability table: INSTANTIATE_KERNEL("gone", body, float, 1)',
                        "instantiated more than once: k_d64"]


@pytest.mark.parametrize("text,message", [
    (f"{gen.BEGIN} body\nx\n", "without its"),
    (f"x\n{gen.END}\n", "without a BEGIN"),
    (f"{gen.BEGIN}\n{gen.END}\n", "names no template function"),
    (f"{gen.BEGIN} nobody\n{gen.END}\n", "no kernel of the capability tables uses nobody"),
    (f"{gen.BEGIN} body\n{gen.END}\n{gen.BEGIN} body\n{gen.END}\n", "body is named by two generated blocks"),
    (f"{gen.BEGIN} body\n{gen.BEGIN} other\n{gen.END}\n", "without its"),
])
def test_render_refuses_malformed_blocks(text, message):
    with pytest.raises(ValueError, match=message):
        gen.render(text, TABLE, where="t.metal")


_sim_spec = importlib.util.spec_from_file_location("gen_sim_sources", ROOT / "tools" / "gen_sim_sources.py")
assert _sim_spec and _sim_spec.loader
gen_sim = importlib.util.module_from_spec(_sim_spec)
_sim_spec.loader.exec_module(gen_sim)


def test_simulator_sources_are_the_generators_output():
    """Each shader has its sim source and counted copy, as
    tools/gen_sim_sources.py writes them, and no other source sits beside them."""
    assert gen_sim.problems() == [], "run `make kernel-instantiations`"
    assert len(gen_sim.expected()) == 2 * len(FILES)


def test_counted_copy_includes_system_header_users_outside_the_namespace():
    """kv_codec.h includes <stdint.h>: a namespace cannot hold it, so the
    counted copies of the shaders that include it include it first."""
    text = gen_sim.counted_source("kv_codes_decode", (gen.SHADERS / "kv_codes_decode.metal").read_text())
    assert text.index('shaders/kv_codec.h"') < text.index("namespace fmsim_counted {")
    assert "kv_codec.h" not in gen_sim.counted_source("sdpa", (gen.SHADERS / "sdpa.metal").read_text())
