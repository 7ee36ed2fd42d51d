from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import ROOT
from dsgpt2.errors import ConfigError
from dsgpt2.model.gpt2 import PRESETS, build_model, gpt2_config, param_groups
from dsgpt2.optim.ds_config import build_ds_config, zero_stage
from dsgpt2.train.plan import gpt2_parameters, plan

DS_CONFIGS = sorted((ROOT / "configs").glob("ds_config*.json"))


@pytest.mark.parametrize("path", DS_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_deepspeed_config_loads(path: Path) -> None:
    device = "cpu" if path.name == "ds_config_cpu.json" else "cuda"
    for world in (1, 8):
        cfg = build_ds_config(path, world_size=world, train_iters=500, device=device).config
        assert (
            cfg["train_batch_size"]
            == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * world
        )
        assert cfg["scheduler"]["params"]["total_num_steps"] == 500
    assert zero_stage(cfg) in (0, 1, 2, 3)


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(data))
    return path


def test_batch_arithmetic_and_precision_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"train_batch_size 10 ≠ .* 4 × .* 1 × world size 2 = 8"):
        build_ds_config(
            _write(tmp_path, {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}), 2, 10, "cpu"
        )
    cfg = build_ds_config(
        _write(tmp_path, {"train_batch_size": 32, "gradient_accumulation_steps": 2}), 4, 10, "cpu"
    ).config
    assert cfg["train_micro_batch_size_per_gpu"] == 4
    with pytest.raises(ConfigError, match="not divisible"):
        build_ds_config(
            _write(tmp_path, {"train_batch_size": 30, "gradient_accumulation_steps": 4}), 1, 10, "cpu"
        )
    with pytest.raises(ConfigError, match="must be a positive integer"):
        build_ds_config(_write(tmp_path, {"train_micro_batch_size_per_gpu": 0}), 1, 10, "cpu")
    with pytest.raises(ConfigError, match=r"bf16 needs a GPU.*ds_config_cpu\.json"):
        build_ds_config(ROOT / "configs" / "ds_config.json", 1, 10, "cpu")
    both = {"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True}, "bf16": {"enabled": True}}
    with pytest.raises(ConfigError, match="both enabled"):
        build_ds_config(_write(tmp_path, both), 1, 10, "cuda")
    with pytest.raises(ConfigError, match="file not found"):
        build_ds_config(tmp_path / "none.json", 1, 10, "cpu")


def test_presets_and_tokenizer_sizes() -> None:
    cfg = gpt2_config("tiny", vocab_size=777, context=64, eot=0, pad=1)
    assert (cfg.vocab_size, cfg.n_positions, cfg.eos_token_id, cfg.pad_token_id) == (777, 64, 0, 1)
    assert cfg.tie_word_embeddings
    with pytest.raises(ConfigError, match="--model_select 'huge'"):
        gpt2_config("huge", 100, 64, 0, 1)
    model = build_model(cfg)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    total, _ = gpt2_parameters(cfg.n_layer, cfg.n_embd, 777, 64)
    assert total == sum(p.numel() for p in model.parameters())


def test_weight_decay_spares_biases_and_layer_norms() -> None:
    model = build_model(gpt2_config("tiny", 300, 32, 0, 1))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"])
    assert all(
        names[id(p)].endswith(".bias") or ".ln_" in names[id(p)] or "ln_f" in names[id(p)]
        for p in no_decay["params"]
    )
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_plan_orders_the_options_sensibly() -> None:
    total, rows = plan("112m")
    assert 120e6 < total < 130e6  # GPT-2 small
    by = {r.option: r for r in rows}
    assert by["stage 2 + optimizer offload"].gpu_bytes < by["stage 2"].gpu_bytes
    assert (
        by["stage 3 + optimizer offload + param offload"].gpu_bytes < by["stage 0 (data parallel)"].gpu_bytes
    )
    assert set(PRESETS) >= {"tiny", "112m", "112m_half", "345m"}


def test_perplexity_is_exp_of_the_loss_and_stays_finite() -> None:
    import math

    from dsgpt2.model.gpt2 import perplexity

    assert perplexity(2.0) == math.exp(2.0)
    assert math.isfinite(perplexity(1e6)) and perplexity(1e6) == perplexity(700.0)


def test_bits_per_byte_is_the_summed_loss_in_bits_over_the_bytes() -> None:
    import math

    from dsgpt2.model.gpt2 import bits_per_byte

    # 100 tokens of 4 bytes at a mean loss of ln 16 nats (4 bits) each: 1 bit per byte.
    assert bits_per_byte(100 * math.log(16), 400) == pytest.approx(1.0)
    assert bits_per_byte(5.0, 0) is None  # tokens that stand for no text (special tokens only)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("chunk", [0, 4096])
def test_plan_activations_match_what_autograd_keeps_at_full_depth(checkpointing: bool, chunk: int) -> None:
    """The plan probes one and two blocks at 32 and 64 tokens; scaled to 6 blocks and a 3 × 96 micro-batch
    it gives the bytes autograd keeps there, measured whole."""
    from dsgpt2.train.plan import _saved_bytes, activations

    est = activations("112m_half", 512, 96, 3, checkpointing, loss_chunk=chunk)
    whole = _saved_bytes(
        "112m_half", 512, PRESETS["112m_half"].n_layer, 96, checkpointing, chunk=chunk, rows=3
    )
    assert est.saved == pytest.approx(whole, rel=0.02)
    assert est.total > est.saved > 0 and est.fixed >= 0


@pytest.mark.floor  # fake tensors are torch.compile's machinery: the count holds on every torch admitted
@pytest.mark.parametrize(("checkpointing", "chunk"), [(False, 0), (True, 0), (False, 64)])
def test_the_plans_fake_forward_counts_the_bytes_a_real_one_keeps(checkpointing: bool, chunk: int) -> None:
    """The plan counts on fake tensors; a real bf16 forward of the same model keeps the same bytes."""
    from types import SimpleNamespace

    import torch

    from dsgpt2.model.gpt2 import batch_inputs, checkpoint_activations
    from dsgpt2.model.loss import with_chunked_loss
    from dsgpt2.train.plan import _saved_bytes

    cfg = gpt2_config("tiny", 512, 96, 0, 0)
    cfg._attn_implementation = "sdpa"
    model = build_model(cfg).to(torch.bfloat16)
    with_chunked_loss(model, chunk)
    if checkpointing:
        checkpoint_activations(model)
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 512, (3, 96))
    inputs = batch_inputs(SimpleNamespace(input_ids=ids, attention_mask=torch.ones_like(ids)), "cpu")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**inputs, labels=ids)  # as the trainer calls it
    fake = _saved_bytes("tiny", 512, PRESETS["tiny"].n_layer, 96, checkpointing, chunk=chunk, rows=3)
    assert fake == sum(kept.values())


def test_plan_prints_activations_and_the_largest_micro_batch_that_fits(tmp_path: Path) -> None:
    from conftest import run_cli

    def largest(memory: str) -> list[str]:
        out = run_cli("plan", "--model_select", "tiny", "--vocab_size", "512", "--micro_batch", "4",
                      "--gpu_memory", memory, cwd=tmp_path)  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert "activations of a micro-batch of 4 × 128 tokens (bf16, eager)" in out.stdout
        return [line.split()[-1] for line in out.stdout.splitlines() if line.startswith("  stage ")]

    small, large = largest("0.05"), largest("2")
    assert len(small) == len(large) == 7
    assert all(int(b) > int(a) for a, b in zip(small, large, strict=True))
    bad = run_cli("plan", "--model_select", "tiny", "--gpu_memory", "0", cwd=tmp_path)
    assert bad.returncode == 2 and "--gpu_memory: must be a positive number, got '0'" in bad.stderr


def test_torch_autocast_is_a_precision_and_names_its_dtype(tmp_path: Path) -> None:
    from dsgpt2.optim.ds_config import precision

    base = {"train_micro_batch_size_per_gpu": 1}
    bf16 = {**base, "torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    assert precision(bf16) == "bf16" and precision(base) == "fp32"
    assert precision({**base, "bfloat16": {"enabled": True}}) == "bf16"  # DeepSpeed's former name
    assert precision({**base, "torch_autocast": {"enabled": True, "dtype": "torch.float16"}}) == "fp16"
    with pytest.raises(ConfigError, match=r"bf16 needs a GPU.*ds_config_cpu\.json"):
        build_ds_config(_write(tmp_path, bf16), 1, 10, "cpu")
    with pytest.raises(ConfigError, match='torch_autocast needs a "dtype"'):
        build_ds_config(_write(tmp_path, {**base, "torch_autocast": {"enabled": True}}), 1, 10, "cuda")
    with pytest.raises(ConfigError, match="both enabled"):
        build_ds_config(_write(tmp_path, {**bf16, "bf16": {"enabled": True}}), 1, 10, "cuda")


def test_parameters_are_counted_whole_under_zero_3() -> None:
    """ZeRO 3 leaves each rank an empty tensor per parameter, its whole size in ``ds_numel``."""
    import torch

    from dsgpt2.model.gpt2 import count_parameters

    layer = torch.nn.Linear(4, 3)
    assert count_parameters(layer) == 15
    for p in layer.parameters():
        p.ds_numel = p.numel()  # type: ignore[attr-defined]
        p.data = torch.empty(0)
    assert count_parameters(layer) == 15
