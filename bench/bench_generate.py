"""Generation benchmark.

- generation tokens/s: ``dsgpt2 generate``'s path (:class:`dsgpt2.infer.generate.Generator`: text prompt in,
  settings checked, private seeded RNG, stop tokens, text out) ÷ transformers' ``model.generate`` on
  token ids with the same settings, on the same exported model (target ≥ 0.95); the line notes when
  the two generated different numbers of tokens (the rate is per token either way).
"""

from __future__ import annotations

from pathlib import Path

import torch

from bench.common import Metric, paired_times

PROMPT = "Return a new list containing all items from the iterable"


def make_export(texts: list[str], out: Path) -> Path:
    """A 4-layer GPT-2 (256 wide, 256 positions) with a 4,096-token vocabulary, saved as an export."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from dsgpt2.tokenizer.bpe import VocabSettings, train_vocab

    model_dir = out / "generate_bench_model"
    if (model_dir / "config.json").exists():
        return model_dir
    tok_dir = out / "generate_bench_tok"
    train_vocab(iter(texts), tok_dir, VocabSettings(vocab_size=4096), "bench", progress=False)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    config = GPT2Config(
        vocab_size=len(tok), n_positions=256, n_embd=256, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(str(model_dir))
    tok.save_pretrained(str(model_dir))
    return model_dir


def generation_speed(texts: list[str], results: Path, repeats: int = 7, new_tokens: int = 96) -> list[Metric]:
    from dsgpt2.infer.generate import Generator, SamplingParams
    from dsgpt2.infer.loading import load_model

    gen = Generator(load_model(make_export(texts, results)))
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.8, top_k=50, top_p=0.95, seed=1)
    model = gen.model
    ids = torch.tensor([gen.encode(PROMPT)])
    counts: dict[str, int] = {}

    def ours() -> None:
        counts["ours"] = gen.generate(PROMPT, params)[0].tokens

    def anchor() -> None:
        torch.manual_seed(params.seed)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=True,
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                eos_token_id=gen.eot,
                pad_token_id=gen.eot,
            )
        counts["anchor"] = out.shape[1] - ids.shape[1]

    t_ours, t_anchor = paired_times(ours, anchor, repeats)
    ours_tps, anchor_tps = counts["ours"] / t_ours, counts["anchor"] / t_anchor
    note = "" if counts["ours"] == counts["anchor"] else f"{counts['ours']} vs {counts['anchor']} tokens"
    return [
        Metric(
            "generation (÷ model.generate)",
            ours_tps,
            anchor_tps,
            "tokens/s",
            ">= 0.95",
            ours_tps / anchor_tps >= 0.95,
            note,
        )
    ]
