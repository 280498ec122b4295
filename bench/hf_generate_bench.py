"""Hugging Face generation with flashmetal's attention backend against
torch's SDPA backend, interleaved in one process:

1. `generate()` of a tiny random-weight Llama (hidden 1024, 8 layers, 16
   query heads over 8 kv heads, head dim 64, bfloat16; a 1024-token prompt,
   128 new tokens, greedy), batch 1 unpadded and a left-padded batch of 4;
   target: flashmetal's time <= 0.8 of sdpa's. Greedy tokens of a bfloat16
   random-weight model diverge between any two backends (eager and sdpa
   too), so agreement is shown by the logits of one forward pass instead;
2. the attention call of one decode step as `generate()` makes it, through
   each backend's attention function (query [B, 16, 1, 64], keys
   [B, 8, kL, 64]; batch 1 without a mask, and a batch of 4 with Hugging
   Face's bool left-padding mask [4, 1, 1, kL]); target: flashmetal >= 2x
   faster than transformers' sdpa backend.

    python bench/hf_generate_bench.py [--runs N] [--quick]

Writes bench/HF_RESULTS.md (keeping its hand-written "## Notes" section). Needs torch and transformers (`make test-deps`).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench as common  # noqa: E402  (private library copy, torch, timing helpers)

import flashmetal as fm  # noqa: E402

torch = common.torch


def tiny_llama(quick: bool) -> Any:
    """A random-weight Llama of the issue's size (fewer layers with --quick)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2 if quick else 8,
        num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    return model.eval()


def prompts(batch: int, length: int, padded: bool) -> tuple[Any, Any]:
    """Token ids [batch, length] and their attention mask; with `padded` the
    rows hold length, 7/8, 3/4 and 1/2 of it real tokens, left-padded."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 4096, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        for b, frac in enumerate((1.0, 0.875, 0.75, 0.5)[:batch]):
            pad = length - int(length * frac)
            ids[b, :pad] = 0
            mask[b, :pad] = 0
    return ids, mask


def timed_rounds(fns: dict[str, Callable[[], Any]], runs: int) -> dict[str, list[float]]:
    """Each function once per round, in alternating order, `runs` rounds."""
    secs: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(runs):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            fns[name]()
            secs[name].append(time.perf_counter() - t0)
    return secs


def generate_rows(model: Any, fm_name: str, runs: int, quick: bool) -> list[str]:
    length, new = (128, 16) if quick else (1024, 128)
    lines = ["| case | sdpa s | flashmetal s | flashmetal / sdpa (median of rounds) "
             "| prompt logits max abs diff to sdpa: flashmetal / eager |",
             "|---|---:|---:|---:|---|"]
    for label, batch, padded in (("batch 1, unpadded", 1, False), ("batch 4, left-padded", 4, True)):
        ids, mask = prompts(batch, length, padded)

        def run(impl: str, ids: Any = ids, mask: Any = mask) -> None:
            model.set_attn_implementation(impl)
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, pad_token_id=0)

        secs = timed_rounds({"sdpa": lambda: run("sdpa"), fm_name: lambda: run(fm_name)}, runs)
        ratio = statistics.median(f / s for f, s in zip(secs[fm_name], secs["sdpa"]))
        logits = {}
        for impl in ("sdpa", "eager", fm_name):
            model.set_attn_implementation(impl)
            with torch.inference_mode():
                logits[impl] = model(input_ids=ids, attention_mask=mask).logits.float()[mask.bool()]
        diff = {impl: (logits[impl] - logits["sdpa"]).abs().max().item() for impl in ("eager", fm_name)}
        lines.append(f"| {label} | {statistics.median(secs['sdpa']):.2f} | {statistics.median(secs[fm_name]):.2f} "
                     f"| {ratio:.2f} | {diff[fm_name]:.3g} / {diff['eager']:.3g} |")
        print(lines[-1], flush=True)
    return lines


def decode_call_rows(runs: int, quick: bool) -> list[str]:
    """One decode step's attention call as `generate()` makes it: through
    transformers' attention-function contract, flashmetal's backend
    (`hf.attention_forward`) against transformers' own sdpa backend
    (`sdpa_attention_forward`, which hands torch's SDPA the kv heads as
    its version does: enable_gqa, packed query heads or repeated kv heads)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    import flashmetal.integrations.hf as fm_hf

    class Attention(torch.nn.Module):  # what both backends read of a layer
        is_causal = True
        num_key_value_groups = 2

    module = Attention()
    lines = ["| case | keys | torch SDPA µs | flashmetal µs | torch / flashmetal (median of rounds) | route |",
             "|---|---:|---:|---:|---:|---|"]
    g = torch.Generator().manual_seed(2)
    for batch, case in ((1, "batch 1, no mask"), (4, "batch 4, left padding")):
        for kl in ((256,) if quick else (1152, 4096)):
            q = torch.randn(batch, 16, 1, 64, generator=g).to(torch.bfloat16)
            k = torch.randn(batch, 8, kl, 64, generator=g).to(torch.bfloat16)
            v = torch.randn(batch, 8, kl, 64, generator=g).to(torch.bfloat16)
            mask = None
            if batch > 1:  # transformers' bool padding mask: the first keys of rows 1.. hidden
                mask = torch.ones(batch, 1, 1, kl, dtype=torch.bool)
                for b in range(1, batch):
                    mask[b, ..., :kl * b // 8] = False
            calls = 50

            def fm_step(q: Any = q, k: Any = k, v: Any = v, mask: Any = mask) -> None:
                for _ in range(calls):
                    fm_hf.attention_forward(module, q, k, v, mask, scaling=0.125)

            def torch_step(q: Any = q, k: Any = k, v: Any = v, mask: Any = mask) -> None:
                for _ in range(calls):
                    sdpa_attention_forward(module, q, k, v, mask, scaling=0.125)

            with torch.inference_mode():
                secs = timed_rounds({"torch": torch_step, "fm": fm_step}, runs)
            ratio = statistics.median(t / f for t, f in zip(secs["torch"], secs["fm"]))
            route = fm.last_route().kernel
            lines.append(f"| {case} | {kl} | {statistics.median(secs['torch']) / calls * 1e6:.0f} "
                         f"| {statistics.median(secs['fm']) / calls * 1e6:.0f} | {ratio:.2f} | {route} |")
            print(lines[-1], flush=True)
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="interleaved rounds per case")
    ap.add_argument("--quick", action="store_true", help="2 layers, 128-token prompt, 16 new tokens")
    ap.add_argument("--out", default=str(HERE / "HF_RESULTS.md"))
    args = ap.parse_args()
    if torch is None:
        print("hf bench: torch is not installed (make test-deps); nothing measured")
        return 0
    try:
        import flashmetal.integrations.hf as fm_hf
    except ImportError as e:
        print(f"hf bench: {e} (make test-deps); nothing measured")
        return 0
    info = fm.info()
    torch.set_num_threads(int(info["threads"]))
    fm_name = fm_hf.register()
    model = tiny_llama(args.quick)
    print("attention call at one decode step:", flush=True)
    call = decode_call_rows(args.runs, args.quick)
    print("generate():", flush=True)
    gen = generate_rows(model, fm_name, args.runs, args.quick)
    head = [
        "# Hugging Face generation: flashmetal vs torch SDPA (cpu)",
        "",
        f"Machine: {common.cpu_model()}, {info['cpu_isa']}, {info['threads']} threads; torch "
        f"{torch.__version__}; {args.runs} interleaved rounds; {'--quick' if args.quick else 'full size'}.",
        "Written by `python bench/hf_generate_bench.py` (`make bench-hf`, part of `make bench`).",
        "",
        "Targets: `generate()` at <= 0.8 of sdpa's time; the decode-step attention >= 2x faster.",
        "",
        "## Attention call of one decode step (16/8 heads, D 64, bf16; each backend's attention function)",
        "",
    ]
    text = "\n".join(head + call + ["", "## generate() of a random-weight Llama (hidden 1024, 16/8 heads, bf16)", ""]
                     + gen + [""] + common.notes(args.out)).rstrip("\n") + "\n"
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
