"""Whether a run's model can fit the machine, from its shape: the estimate of what it holds for certain,
and the refusals it makes before anything is built."""

from __future__ import annotations

import pytest

from dsgpt2.errors import ConfigError
from dsgpt2.model.gpt2 import PRESETS, build_model, count_parameters, gpt2_config
from dsgpt2.train.fits import Memory, Placement, check_fits, least_needs, parameters

GB = 10**9


def preset(name: str, context: int, vocab: int = 50257) -> object:
    return gpt2_config(name, vocab, context, vocab - 1, vocab - 1)


def test_the_parameters_counted_from_the_shape_are_the_models() -> None:
    from transformers import GPT2Config

    odd = GPT2Config(n_layer=3, n_embd=48, n_head=3, n_inner=100, vocab_size=300, n_positions=77,
                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    for cfg in (preset("tiny", 128, 512), odd):
        assert sum(parameters(cfg).values()) == count_parameters(build_model(cfg))


def test_weights_larger_than_the_memory_are_refused_naming_the_position_table() -> None:
    cfg = preset("tiny", 64, 512)
    cfg.n_positions = 10**9  # a --model_config's n_positions, far beyond the run's context
    with pytest.raises(ConfigError) as refused:
        check_fits(cfg, 64, Placement(4), Memory(host=64 * GB))
    said = str(refused.value)
    assert "float32 weights" in said and "this machine has 64.0 GB" in said
    assert "n_positions in --model_config" in said


def test_activations_at_the_micro_batch_larger_than_the_memory_are_refused_naming_the_flags() -> None:
    context = 1 << 20
    cfg = preset("112m", context)
    needs = least_needs(cfg, context, Placement(4))
    assert needs[1].parts[1][1] == 2 * 12 * 4 * context * 768  # the blocks' inputs, 2 bytes each
    with pytest.raises(ConfigError, match="--context_length or the micro-batch"):
        check_fits(cfg, context, Placement(4), Memory(host=64 * GB))
    # On a GPU the same: the device's memory, not the host's, holds the activations.
    with pytest.raises(ConfigError, match=r"80.0 GB \(on its GPU\)"):
        check_fits(cfg, context, Placement(4, "cuda"), Memory(host=1000 * GB, device=80 * GB))
    check_fits(cfg, context, Placement(1, "cuda"), Memory(host=1000 * GB, device=80 * GB))


@pytest.mark.parametrize("name", list(PRESETS))
def test_the_presets_train_where_they_are_meant_to(name: str) -> None:
    """Every preset at its own context on one 80 GB GPU at a micro-batch of 16 (1.5b: 4), and a host of
    32 GB; the tiny one on a 4 GB CPU machine."""
    p = PRESETS[name]
    micro = 4 if name == "1.5b" else 16
    check_fits(preset(name, p.context), p.context, Placement(micro, "cuda"), Memory(32 * GB, 80 * GB))
    if name == "tiny":
        check_fits(preset(name, p.context, 512), p.context, Placement(16), Memory(4 * GB))


def test_zero_3_and_offload_take_the_weights_off_the_gpu() -> None:
    cfg = preset("1.5b", 1024)
    small = Memory(host=1000 * GB, device=4 * GB)
    with pytest.raises(ConfigError, match="on its GPU"):
        check_fits(cfg, 1024, Placement(1, "cuda"), small)
    check_fits(cfg, 1024, Placement(1, "cuda", stage=3, params_offloaded=True), small)
    check_fits(cfg, 1024, Placement(1, "cuda", world=8, stage=3), small)
