"""The training recipe's pure parts: learning-rate schedules, FLOPs and MFU, document masks."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from dsgpt2.errors import ConfigError
from dsgpt2.model.gpt2 import build_model, count_parameters, doc_position_ids, flops_per_token, gpt2_config
from dsgpt2.optim.ds_config import EngineConfig, build_ds_config, check_attention, schedule_note
from dsgpt2.optim.schedule import Schedule, ScheduledLR, lr_at
from dsgpt2.train.config import OptimizerOptions, ScheduleOptions
from dsgpt2.train.metrics import device_peak_tflops


def test_cosine_warms_up_then_falls_to_the_floor() -> None:
    s = Schedule("cosine", peak=1e-3, total=100, warmup=10, min_ratio=0.1)
    lrs = [lr_at(s, step) for step in range(100)]
    assert lrs[0] == pytest.approx(1e-4)
    assert lrs[9] == pytest.approx(1e-3)
    assert lrs[10] == pytest.approx(1e-3)
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:]))
    assert lrs[55] == pytest.approx(1e-4 + 0.9e-3 * 0.5, rel=1e-6)  # half way down
    assert lr_at(s, 100) == pytest.approx(1e-4)
    assert lr_at(s, 1000) == pytest.approx(1e-4)


def test_wsd_holds_the_peak_then_decays_over_the_last_share() -> None:
    s = Schedule("wsd", peak=1e-3, total=100, warmup=5, min_ratio=0.0, decay_fraction=0.2)
    assert s.decay_start == 80
    assert [lr_at(s, step) for step in (5, 40, 79)] == [1e-3] * 3
    assert lr_at(s, 90) == pytest.approx(0.5e-3)
    assert lr_at(s, 100) == 0.0


def test_extending_wsd_before_its_decay_continues_without_a_jump() -> None:
    short = Schedule("wsd", 1e-3, total=100, warmup=5)
    longer = Schedule("wsd", 1e-3, total=200, warmup=5)
    assert [lr_at(short, s) for s in range(80)] == [lr_at(longer, s) for s in range(80)]
    cos_short, cos_longer = Schedule("cosine", 1e-3, 100, 5), Schedule("cosine", 1e-3, 200, 5)
    assert lr_at(cos_short, 60) != pytest.approx(lr_at(cos_longer, 60))  # the cosine is redrawn


def test_schedule_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="--warmup_iters 100"):
        Schedule("cosine", 1e-3, total=100, warmup=100)
    with pytest.raises(ConfigError, match="--min_lr_ratio"):
        Schedule("wsd", 1e-3, 100, 1, min_ratio=2.0)
    with pytest.raises(ConfigError, match="--lr"):
        ScheduleOptions(lr=-1.0)
    with pytest.raises(ConfigError, match="--lr_schedule 'linear'"):
        ScheduleOptions(lr_schedule="linear")


def test_scheduler_sets_the_optimizer_and_resumes_from_its_state() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p, torch.nn.Parameter(torch.zeros(1))], lr=9.0)
    s = Schedule("cosine", 1e-3, total=50, warmup=5)
    sched = ScheduledLR(opt, s)
    assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(s, 0))
    for _ in range(7):
        sched.step()
    state = sched.state_dict()
    assert state["last_step"] == 7 and state["schedule"]["kind"] == "cosine"
    fresh = ScheduledLR(torch.optim.AdamW([p], lr=9.0), s)
    fresh.load_state_dict(state)
    assert fresh.optimizer.param_groups[0]["lr"] == pytest.approx(lr_at(s, 7))
    assert fresh.get_lr() == [pytest.approx(lr_at(s, 7))]


def test_a_checkpoint_of_deepspeeds_scheduler_resumes_on_ours_and_back() -> None:
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    theirs = WarmupDecayLR(opt, total_num_steps=100, warmup_num_steps=5, warmup_max_lr=1e-3)
    for _ in range(12):
        theirs.step()
    ours = ScheduledLR(opt, Schedule("wsd", 1e-3, 100, 5))
    ours.load_state_dict(theirs.state_dict())
    assert ours.last_step == 12
    again = WarmupDecayLR(opt, total_num_steps=100, warmup_num_steps=5, warmup_max_lr=1e-3)
    again.load_state_dict(ours.state_dict())
    assert again.last_batch_iteration == theirs.last_batch_iteration


def _ds(**extra: object) -> dict:
    return {
        "optimizer": {"type": "AdamW", "params": {"lr": 6e-4}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 40, "warmup_max_lr": 6e-4}},
        **extra,
    }


def _built(tmp_path, data: dict, opts: ScheduleOptions, train_iters: int, optimizer=None) -> EngineConfig:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, **data}))
    return build_ds_config(path, 1, train_iters, "cpu", schedule=opts, optimizer=optimizer)


def test_the_deepspeed_config_is_built_once_with_the_schedule_replaced_or_kept(tmp_path) -> None:
    ds = _built(tmp_path, _ds(), ScheduleOptions(lr_schedule="cosine", lr=1e-3), train_iters=1000)
    # The replaced scheduler is said, as the replaced clipping is; a kept one, or none, is not.
    assert ds.notes == (
        "learning rate: --lr_schedule cosine (peak 0.001, 40 warm-up steps) in place of the DeepSpeed "
        "config's scheduler (WarmupDecayLR)",
    )
    assert schedule_note(_ds()["scheduler"], None) is None and schedule_note(None, ds.schedule) is None
    assert ds.schedule == Schedule("cosine", 1e-3, 1000, 40, 0.1, 0.2)
    assert "scheduler" not in ds.config and ds.config["optimizer"]["params"]["lr"] == 1e-3
    assert ds.optimizer_params["lr"] == 1e-3
    short = _built(tmp_path, _ds(), ScheduleOptions(lr_schedule="wsd"), train_iters=100).schedule
    assert short is not None and short.warmup == 10 and short.peak == 6e-4  # a tenth at most
    kept = _built(tmp_path, _ds(), ScheduleOptions(lr_schedule="deepspeed", lr=2e-3), train_iters=100)
    assert kept.schedule is None and kept.notes == ()
    assert kept.config["scheduler"]["params"] == {"warmup_num_steps": 40, "warmup_max_lr": 2e-3,
                                                  "total_num_steps": 100}  # fmt: skip
    with pytest.raises(ConfigError, match="set --lr"):
        _built(
            tmp_path, {"optimizer": {"type": "AdamW", "params": {}}}, ScheduleOptions(lr_schedule="wsd"), 100
        )
    # The optimizer's needs are built in, not patched on after: Muon's config holds no optimizer block
    # and no clipping, and the settings AdamW's part takes are kept beside it.
    muon = OptimizerOptions("muon")
    muon.settle(None)
    ds = _built(tmp_path, {**_ds(), "gradient_clipping": 1.0}, ScheduleOptions(lr_schedule="wsd"), 100,
                muon.chosen())  # fmt: skip
    assert "optimizer" not in ds.config and ds.config["gradient_clipping"] == 0.0
    assert ds.notes[-1] == "Muon: gradient clipping (1.0 in the DeepSpeed config) is off"
    assert ds.optimizer_params == {"lr": 6e-4}


@pytest.mark.parametrize(
    ("section", "said"),
    [
        ({"zero_optimization": {"stage": 5}}, "zero_optimization.stage must be 0, 1, 2 or 3, not 5"),
        ({"zero_optimization": {"stage": "2"}}, "zero_optimization.stage must be 0, 1, 2 or 3, not '2'"),
        ({"zero_optimization": []}, '"zero_optimization" must be a JSON object, not []'),
        ({"gradient_clipping": "x"}, "gradient_clipping must be a number ≥ 0 (0: none), not 'x'"),
        ({"optimizer": {"type": "Lamb2"}}, "optimizer type 'Lamb2' is not one DeepSpeed has; use AdamW"),
        ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}},
         "optimizer.params.betas must be two numbers in [0, 1), not [0.9]"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": -1}}}, "optimizer.params.lr must be a number ≥ 0"),
        ({"optimizer": {"type": "AdamW", "params": {"eps": "tiny"}}}, "optimizer.params.eps must be a"),
        ({"scheduler": {"type": "Nope"}}, "scheduler type 'Nope' is not one DeepSpeed has: use one of "
         "LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR, or leave the scheduler out"),
    ],
)  # fmt: skip
def test_a_deepspeed_config_value_that_would_fail_after_the_build_is_one_line_first(
    tmp_path: Path, section: dict, said: str
) -> None:
    """Each of these ended a run in DeepSpeed's or our own traceback once the model was built (an
    assertion, a pydantic error, an unpacking, an index out of range): refused as the file is read."""
    with pytest.raises(ConfigError) as refused:
        _built(tmp_path, section, ScheduleOptions(lr_schedule="wsd", lr=1e-3), 10)
    assert str(refused.value).startswith(f"--deepspeed_config {tmp_path / 'ds.json'}: ")
    assert said in str(refused.value)
    # What DeepSpeed takes, torch.optim's optimizers by name included, stays accepted.
    _built(tmp_path, {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, ScheduleOptions(lr=1e-3), 10)


def test_presets_pretrain_without_dropout_and_a_model_config_keeps_its_own(tmp_path) -> None:
    for preset in ("tiny", "112m"):
        cfg = gpt2_config(preset, 100, 32, 0, 1)
        assert cfg.resid_pdrop == cfg.embd_pdrop == cfg.attn_pdrop == 0.0
    (tmp_path / "c.json").write_text('{"n_layer": 1, "n_embd": 32, "n_head": 2, "resid_pdrop": 0.1}')
    assert gpt2_config(None, 100, 32, 0, 1, config_json=tmp_path / "c.json").resid_pdrop == 0.1


def test_flops_per_token_counts_every_parameter_and_attention() -> None:
    cfg = gpt2_config("tiny", 512, 64, 0, 1)
    params = count_parameters(build_model(cfg))
    assert flops_per_token(cfg, 64) == 6 * params + 12 * cfg.n_layer * 64 * cfg.n_embd
    big = gpt2_config("112m", 50257, 1024, 0, 1)
    assert flops_per_token(big, 1024) / 6 == pytest.approx(143.3e6, rel=1e-3)  # 124.4M + attention


def test_peak_flops_are_known_for_common_gpus_at_half_precision_only() -> None:
    assert device_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4)
    assert device_peak_tflops("NVIDIA H100 PCIe", "fp16") == 756.0
    assert device_peak_tflops("NVIDIA A100-SXM4-40GB", "bf16") == 312.0
    assert device_peak_tflops("NVIDIA A100-SXM4-40GB", "fp32") is None
    assert device_peak_tflops("Some Accelerator", "bf16") is None


def test_flash_attention_is_refused_where_it_cannot_run() -> None:
    with pytest.raises(ConfigError, match="needs a GPU"):
        check_attention("flash_attention_2", "cpu", {})
    check_attention("sdpa", "cpu", {})


def test_positions_restart_after_each_end_of_text() -> None:
    ids = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 3], [1, 2, 3, 4, 5, 6, 7, 8]])
    assert doc_position_ids(ids, eot=0).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], list(range(8))]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_document_cannot_see_the_one_before_it_in_a_packed_block(attn: str) -> None:
    cfg = gpt2_config("tiny", 100, 32, 0, 1)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    first, second = torch.tensor([[5, 6, 7, 0]]), torch.tensor([[8, 9, 10, 11, 12]])
    packed = torch.cat([first, second], dim=1)
    with torch.no_grad():
        masked = model(input_ids=packed, position_ids=doc_position_ids(packed, 0), use_cache=False).logits
        alone = model(input_ids=second, use_cache=False).logits
        plain = model(input_ids=packed, use_cache=False).logits
        changed = packed.clone()
        changed[0, :3] = torch.tensor([40, 41, 42])  # another first document
        masked_changed = model(input_ids=changed, position_ids=doc_position_ids(changed, 0), use_cache=False)
    assert torch.allclose(masked[0, 4:], alone[0], atol=1e-5)
    assert torch.allclose(masked_changed.logits[0, 4:], masked[0, 4:], atol=1e-6)
    assert not torch.allclose(plain[0, 4:], alone[0], atol=1e-3)  # without the mask it does see it
    assert math.isfinite(float(masked.sum()))


def test_a_train_record_on_a_gpu_carries_the_allocator_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """``peak_memory_gb`` is read from the CUDA allocator where the losses live on a GPU (stood in for
    here: no GPU on this machine); ``test_gpu`` checks it against a real device."""
    from types import SimpleNamespace

    from dsgpt2.train.runlog import RunLog

    class OnGpu(torch.Tensor):
        @property
        def is_cuda(self) -> bool:
            return True

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * 2**30)
    run = SimpleNamespace(log_block_ids=False)  # rank 1: no files of its own
    log = RunLog(run, {}, resolved="", rank=1, world=2, flops_per_token=1.0, peak_flops=None, start=(0, 0))
    written: list[dict] = []
    log.write = written.append
    log.log_train(1, 64, [torch.tensor(2.0).as_subclass(OnGpu)], [], 1e-3)
    log.log_train(2, 128, [torch.tensor(2.0)], [], 1e-3)
    assert written[0]["peak_memory_gb"] == 3.0 and "peak_memory_gb" not in written[1]


RECIPES = sorted(p for p in (ROOT / "configs" / "recipes").iterdir() if p.suffix in (".yaml", ".toml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_a_recipe_names_a_deepspeed_config_holding_nothing_it_replaces(recipe: Path) -> None:
    """A recipe sets its schedule, so its DeepSpeed config holds no scheduler; a Muon recipe (Muon trains
    unclipped) no clipping: one source for each setting. The config loads as every shipped one does."""
    from dsgpt2.settings.runfile import read_run_file

    keys = read_run_file(recipe)
    path = ROOT / keys["deepspeed_config"]
    ds = json.loads(path.read_text(encoding="utf-8"))
    assert "scheduler" not in ds and keys["lr_schedule"] in ("cosine", "wsd")
    if keys.get("optimizer", "muon") == "muon":
        assert not ds.get("gradient_clipping"), path
    assert ds["optimizer"]["params"]["lr"] == keys["lr"]  # the one rate, said twice alike
    device = "cuda" if "torch_autocast" in ds else "cpu"
    assert build_ds_config(path, world_size=2, train_iters=100, device=device).config["train_batch_size"] > 0


def test_a_deepspeed_optimizer_or_scheduler_refusing_its_params_is_one_line() -> None:
    """An unknown key in the config's scheduler or optimizer params, or a value DeepSpeed's scheduler
    refuses: DeepSpeed's constructor raised a TypeError or ValueError traceback; any other error is
    still raised as it is."""
    from dsgpt2.errors import ConfigError
    from dsgpt2.train.engine import _config_refusals

    def _scheduler_from_config() -> None:
        raise TypeError("WarmupDecayLR.__init__() got an unexpected keyword argument 'bogus'")

    def _configure_basic_optimizer() -> None:
        raise TypeError("AdamW.__init__() got an unexpected keyword argument 'bogus'")

    for raising, section in (
        (_scheduler_from_config, "scheduler"),
        (_configure_basic_optimizer, "optimizer"),
    ):
        with (
            pytest.raises(
                ConfigError, match=rf"^--deepspeed_config: its {section} refused its params \(.*'bogus'\)"
            ),
            _config_refusals(),
        ):
            raising()
    with pytest.raises(TypeError, match="a bug"), _config_refusals():
        raise TypeError("a bug")
