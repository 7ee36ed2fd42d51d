"""``--optimizer muon``: Muon on the blocks' matrices and AdamW on the rest, under ZeRO 0, 1 and 2 (the
same model at each stage), resumed exactly; bad flags, ZeRO 3 and a checkpoint of the other optimizer
refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from dsgpt2.errors import ConfigError
from dsgpt2.optim.muon import MUON_LR, MUON_MOMENTUM, MUON_MOMENTUM_KEY, muon_param_groups
from dsgpt2.optim.schedule import Schedule, ScheduledLR
from dsgpt2.train.config import OptimizerOptions, ScheduleOptions, TrainConfig
from precision import ns_in_fp32
from training import at_stage, steps, train, training_corpus

MUON = ("--optimizer", "muon", "--lr_schedule", "wsd", "--muon_lr", "0.03")
RUN = ("--train_iters", "6", "--save_interval", "3")


def tiny_model() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest() -> None:
    model = tiny_model()
    adamw = {"weight_decay": 0.1, "betas": [0.9, 0.95]}
    groups = muon_param_groups(
        model, adamw, 1e-3, muon_lr=0.02, momentum=0.9, weight_decay=0.05, scale="spectral"
    )
    names = {id(p): n for n, p in model.named_parameters()}
    by_group = [sorted(names[id(p)] for p in g["params"]) for g in groups]
    muon = sorted(n for g, ns in zip(groups, by_group, strict=True) if g["use_muon"] for n in ns)
    assert muon == sorted(f"transformer.h.{i}.{m}.weight" for i in range(2)
                          for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))  # fmt: skip
    # One Muon group per update size, each layer's spectral factor over DeepSpeed's (Conv1D: (in, out)).
    factors = {}
    for g, ns in zip(groups, by_group, strict=True):
        if g["use_muon"]:
            assert g["momentum"] == 0.9 and g["lr_scale"] == pytest.approx(20.0 * g["muon_factor"])
            assert g["lr"] == pytest.approx(0.02 * g["muon_factor"])
            assert g["lr"] * g["weight_decay"] == pytest.approx(0.02 * 0.05)  # the same decay per step
            factors.update({n.split(".", 3)[3]: g["muon_factor"] for n in ns})
    assert factors == pytest.approx({"attn.c_attn.weight": 3**0.5, "attn.c_proj.weight": 1.0,
                                     "mlp.c_fc.weight": 2.0, "mlp.c_proj.weight": 0.5})  # fmt: skip
    decayed, plain = by_group[:2]
    assert decayed == ["transformer.wpe.weight", "transformer.wte.weight"]  # the head is tied to wte
    assert all(".ln_" in n or n.endswith(".bias") or n.startswith("transformer.ln_f") for n in plain)
    assert [g["weight_decay"] for g in groups[:2]] == [0.1, 0.0]
    assert all(not g["use_muon"] and g["betas"] == (0.9, 0.95) and g["lr"] == 1e-3 for g in groups[:2])
    assert sum(len(g) for g in by_group) == len(list(model.parameters()))  # each weight once
    assert all(p.use_muon == g["use_muon"] for g in groups for p in g["params"])
    # DeepSpeed's rule on the stored shape (runs before --muon_scale): one group, as they saved.
    legacy = muon_param_groups(model, {}, 1e-3, muon_lr=0.02, momentum=0.9, scale="storage")
    assert [g["muon_factor"] for g in legacy if g["use_muon"]] == [1.0]


class _Block:
    """The three linear layers of a GPT-2 block whose shapes differ, as ``Conv1D`` (GPT-2's (in, out)
    storage) or ``nn.Linear`` ((out, in)), named as the model names them."""

    @staticmethod
    def build(linear: bool, width: int = 16) -> Any:
        import torch
        from transformers.pytorch_utils import Conv1D

        def layer(fan_in: int, fan_out: int) -> Any:
            return torch.nn.Linear(fan_in, fan_out) if linear else Conv1D(fan_out, fan_in)

        block = torch.nn.Module()
        block.attn, block.mlp = torch.nn.Module(), torch.nn.Module()
        block.attn.c_attn = layer(width, 3 * width)
        block.mlp.c_fc, block.mlp.c_proj = layer(width, 4 * width), layer(4 * width, width)
        model = torch.nn.Module()
        model.transformer = torch.nn.Module()
        model.transformer.h = torch.nn.ModuleList([block])
        return model


# DeepSpeed's import and its compiled Newton–Schulz warn about torch APIs it calls (not ours).
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:`torch._prims_common.check` is deprecated:FutureWarning")
@pytest.mark.parametrize("scale", ["spectral", "rms"])
def test_a_conv1d_model_and_a_linear_model_holding_the_same_weights_take_the_same_step(scale: str) -> None:
    """The update is sized by the layer's (fan-out, fan-in), not by how its weight is stored."""
    import torch

    from dsgpt2.optim.muon import build_muon

    torch.manual_seed(0)
    conv, linear = _Block.build(linear=False), _Block.build(linear=True)
    pairs = [
        (c, lin) for c, lin in zip(conv.modules(), linear.modules(), strict=True) if hasattr(c, "weight")
    ]
    for c, lin in pairs:
        with torch.no_grad():
            lin.weight.copy_(c.weight.T)
            lin.bias.copy_(c.bias)
        c.weight.grad = torch.randn_like(c.weight)
        lin.weight.grad = c.weight.grad.T.clone()
        c.bias.grad = lin.bias.grad = torch.zeros_like(c.bias)

    def step(model: Any, how: str) -> None:
        ds = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}}
        settings = OptimizerOptions("muon", muon_lr=0.02, muon_weight_decay=0.1, muon_scale=how)
        with torch.compiler.set_stance("force_eager"):  # as a CPU run steps (test_compiled.py compiles it)
            build_muon(model, ds["optimizer"]["params"], 1e-3, settings).step()

    before = {id(c): c.weight.detach().clone() for c, _ in pairs}
    with ns_in_fp32():  # the same numbers, not two orders of half-precision sums
        step(conv, scale)
        step(linear, scale)
    for c, lin in pairs:
        assert torch.allclose(c.weight, lin.weight.T, atol=1e-6), type(c).__name__
        moved = (c.weight - before[id(c)]).norm()
        assert moved > 1e-3
    # DeepSpeed's own rule reads the stored shape: the MLP's layers take each other's step size.
    conv, linear = _Block.build(linear=False), _Block.build(linear=True)
    for c, lin in ((conv.transformer.h[0].mlp.c_fc, linear.transformer.h[0].mlp.c_fc),):
        with torch.no_grad():
            lin.weight.copy_(c.weight.T)
        c.weight.grad = torch.randn_like(c.weight)
        lin.weight.grad = c.weight.grad.T.clone()
    for model in (conv, linear):
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    step(conv, "storage")
    step(linear, "storage")
    c, lin = conv.transformer.h[0].mlp.c_fc, linear.transformer.h[0].mlp.c_fc
    assert not torch.allclose(c.weight, lin.weight.T, atol=1e-4)


def test_what_the_first_step_compiles_is_said() -> None:
    from dsgpt2.train.engine import first_step_compiles

    assert first_step_compiles("adamw", False) is None
    assert first_step_compiles("muon", False) is None
    assert first_step_compiles("adamw", True) == "the model (--compile)"
    assert first_step_compiles("muon", True) == "the model (--compile) and Muon's Newton–Schulz iteration"


@pytest.mark.parametrize("method", ["gram", "polar_express"])
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_without_compile_the_newton_schulz_iteration_runs_eagerly(method: str) -> None:
    """DeepSpeed decorates Muon's update with torch.compile at import, and dsgpt2 its Polar Express one: a
    run without --compile (a CPU's default) runs either eagerly, nothing traced, and the update is the
    same."""
    import warnings

    from dsgpt2.train.engine import compile_stance

    with warnings.catch_warnings():  # torch's own deprecations, at the import of its compiler
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch._dynamo.utils import counters

        from dsgpt2.optim import muon_update

    torch.manual_seed(0)
    grad = torch.randn(2, 8, 32)
    beta = torch.tensor(0.95)
    compiled = (
        muon_update.compiled(muon_update._polar_update)
        if method == "polar_express"
        else muon_update._deepspeed()
    )
    try:
        compile_stance(False)
        before = sum(counters["frames"].values())
        update = muon_update.muon_update(grad.clone(), torch.zeros_like(grad), beta, ns_method=method)
        assert sum(counters["frames"].values()) == before
        inner = compiled._torchdynamo_orig_callable
        if method == "polar_express":
            reference = inner(grad.clone(), torch.zeros_like(grad), beta, 5, True)
        else:
            reference = inner(grad.clone(), torch.zeros_like(grad), beta, ns_method=method)
        assert torch.equal(update, reference)
    finally:
        compile_stance(True)


def test_the_schedule_scales_each_groups_rate() -> None:
    import torch

    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [w], "lr": 1.0}, {"params": [], "lr": 1.0, "lr_scale": 20.0}])
    sched = ScheduledLR(opt, Schedule("wsd", 1e-3, 100, 10, 0.1, 0.2))
    sched.step()
    adam, muon = (g["lr"] for g in opt.param_groups)
    assert adam == pytest.approx(2e-4) and muon == pytest.approx(20 * adam)
    assert sched.get_lr() == [adam, muon]


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"optimizer": "sgd"}, "--optimizer"),
        ({"optimizer": "adamw", "muon_lr": 0.01},
         "--muon_lr set the Muon optimizer, and this run trains with --optimizer adamw"),
        ({"optimizer": "adamw", "muon_momentum": 0.9}, "add --optimizer muon, or leave out --muon_momentum"),
        ({"optimizer": "adamw", "muon_weight_decay": 0.1}, "leave out --muon_weight_decay"),
        ({"optimizer": "adamw", "muon_scale": "rms"}, "leave out --muon_scale"),
        ({"optimizer": "muon", "muon_lr": -0.1}, "--muon_lr"),
        ({"optimizer": "muon", "muon_lr": 0.0}, "--muon_lr"),
        ({"optimizer": "muon", "muon_momentum": -0.5}, "--muon_momentum"),
        ({"optimizer": "muon", "muon_momentum": 1.0}, "--muon_momentum must be a number in [0, 1), got 1.0"),
        ({"muon_weight_decay": -1.0}, "--muon_weight_decay"),
        ({"muon_scale": "foo"}, "--muon_scale"),
    ],
)  # fmt: skip
def test_bad_optimizer_options_are_one_line(options: dict, said: str) -> None:
    with pytest.raises(ConfigError, match=None) as err:
        OptimizerOptions(**options)
    assert said in str(err.value) and "\n" not in str(err.value)


def test_a_resumes_switches_are_said_as_the_command_line_types_them() -> None:
    """The settings a resume takes from its checkpoint are named as flags one could type: a switch off is
    ``--no_muon_cautious``, not ``--muon_cautious False`` (a flag that takes no value)."""
    from dsgpt2.train.config import DataOptions

    cfg = TrainConfig(DataOptions(None), optim=OptimizerOptions(optimizer="muon", muon_soap=False))
    saved = {"optimizer": "muon", "lr_schedule": "wsd", "muon_weight_decay": 0.1, "muon_cautious": False,
             "muon_normuon": True, "muon_soap": True}  # fmt: skip
    (said,) = [line for line in cfg.settle(saved) if "continues with it" in line]
    flags = ("--muon_weight_decay 0.1", "--no_muon_cautious", "--muon_normuon")
    assert all(f"{flag}, " in said for flag in flags), said
    assert "False" not in said and "True" not in said and "muon_soap" not in said  # typed: not taken
    assert (cfg.optim.muon_cautious, cfg.optim.muon_normuon, cfg.optim.muon_soap) == (False, True, False)


def test_a_new_run_trains_with_muon_under_wsd_and_a_resumed_one_with_its_checkpoints_optimizer() -> None:
    from dsgpt2.train.config import DataOptions

    def settled(saved: dict | None = None, unfit: str | None = None, **given: Any) -> TrainConfig:
        schedule = {k: given.pop(k) for k in ("lr_schedule",) if k in given}
        cfg = TrainConfig(
            DataOptions(None), schedule=ScheduleOptions(**schedule), optim=OptimizerOptions(**given)
        )
        cfg.settle(saved, unfit)
        return cfg

    new = settled()
    o = new.optim
    # Every Muon setting recorded as it trains: a resume keeps it whatever the defaults become.
    assert (o.optimizer, new.schedule.lr_schedule, o.muon_scale, o.muon_momentum, o.muon_weight_decay) == (
        "muon",
        "wsd",
        "rms",
        MUON_MOMENTUM,
        0.0,
    )
    # Under rms the decay is the DeepSpeed config's AdamW decay, recorded as such.
    adamw_decay = {"optimizer": {"type": "AdamW", "params": {"weight_decay": 0.1}}}
    cfg = TrainConfig(DataOptions(None))
    cfg.settle(None, None, adamw_decay)
    assert cfg.optim.muon_weight_decay == 0.1 and cfg.to_dict()["muon_weight_decay"] == 0.1
    assert new.to_dict()["optimizer"] == "muon" and MUON_LR == 0.02 and MUON_MOMENTUM == 0.95
    # Where Muon cannot train (ZeRO 3, an offloaded optimizer: DeepSpeed offloads only its own), a new
    # run takes AdamW, and says why.
    from dsgpt2.optim.muon import muon_unfit

    offload = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert "offloads the optimizer" in str(muon_unfit(offload))
    assert muon_unfit({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}}) is None
    cfg = TrainConfig(DataOptions(None))
    said = cfg.settle(None, "ZeRO stage 3 shards each matrix")
    assert cfg.optim.optimizer == "adamw" and cfg.schedule.lr_schedule == "deepspeed"
    assert said == [
        "optimizer: AdamW, not Muon, under this DeepSpeed config: ZeRO stage 3 shards each matrix"
    ]
    # A resume takes what its checkpoint trained with, and says so.
    adamw = TrainConfig(DataOptions(None))
    said = adamw.settle({"optimizer": "adamw", "lr_schedule": "cosine"})
    assert (adamw.optim.optimizer, adamw.schedule.lr_schedule) == ("adamw", "cosine")
    assert said == ["the checkpoint to resume was trained with --optimizer adamw, --lr_schedule cosine: "
                    "this run continues with it"]  # fmt: skip
    # A Muon checkpoint saved before --muon_scale and --muon_weight_decay: DeepSpeed's rule, no decay.
    legacy = settled({"optimizer": "muon", "lr_schedule": "wsd", "muon_lr": 0.03})
    assert (legacy.optim.optimizer, legacy.optim.muon_scale, legacy.optim.muon_weight_decay) == (
        "muon", "storage", 0.0)  # fmt: skip
    assert settled({"optimizer": "muon", "muon_scale": "rms"}, optimizer="muon").optim.muon_scale == "rms"
    # Saved under rms by a version that left the decay unrecorded: it trained with the DeepSpeed config's
    # decay, not the 0.0 of the checkpoints before the option, and a resume says nothing of it.
    unrecorded = TrainConfig(DataOptions(None))
    said = unrecorded.settle(
        {"optimizer": "muon", "lr_schedule": "wsd", "muon_scale": "rms"}, None, adamw_decay
    )
    assert unrecorded.optim.muon_weight_decay == 0.1 and not any("weight_decay" in line for line in said)
    assert settled({"optimizer": "muon"}, muon_scale="spectral").optim.muon_scale == "spectral"
    assert settled(muon_scale="spectral").optim.muon_weight_decay == 0.0  # recorded, whatever the default
    # A checkpoint of AdamW with Muon's flags typed: AdamW was asked for by the checkpoint, in one line.
    with pytest.raises(ConfigError, match="--muon_lr set the Muon optimizer"):
        settled({"optimizer": "adamw"}, muon_lr=0.01)


def test_muon_needs_its_own_schedule() -> None:
    from dsgpt2.train.config import DataOptions

    for optim in (OptimizerOptions(optimizer="muon"), OptimizerOptions()):
        with pytest.raises(ConfigError, match="--lr_schedule deepspeed gives every weight one learning rate"):
            cfg = TrainConfig(
                DataOptions(None), schedule=ScheduleOptions(lr_schedule="deepspeed"), optim=optim
            )
            cfg.settle(None)
    adamw = TrainConfig(DataOptions(None), optim=OptimizerOptions(optimizer="adamw"))
    adamw.settle(None)
    assert adamw.schedule.lr_schedule == "deepspeed"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return training_corpus(tmp_path_factory)


@pytest.fixture(scope="module")
def straight(corpus: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six Muon steps at ZeRO 0 without a stop."""
    run = tmp_path_factory.mktemp("muon_straight")
    done = train(at_stage(corpus, run, 0), run, *MUON, *RUN)
    assert "optimizer: Muon (lr 0.03, momentum 0.95, weight decay 0.1, rms scale" in done.stderr
    assert "gradient clipping (1.0 in the DeepSpeed config) is off" in done.stderr
    assert (
        "--lr_schedule wsd (peak 0.003, 0 warm-up steps) in place of the DeepSpeed config's scheduler"
        in done.stderr
    )
    # Without --compile (a CPU's default) the Newton–Schulz iteration runs eagerly: no compile to wait for.
    assert "the first step compiles" not in done.stderr
    return run


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_muon_trains_the_same_model_at_each_zero_stage_and_resumes_exactly(
    corpus: dict[str, Path], straight: Path, tmp_path: Path, stage: int
) -> None:
    staged = at_stage(corpus, tmp_path, stage)
    crashed = train(staged, tmp_path, *MUON, *RUN, check=False, faults=("--exit_after", "5"))
    assert crashed.returncode == 17
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step3"
    train(staged, tmp_path, *MUON, *RUN)
    a, b = steps(straight), steps(tmp_path)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for step in range(1, 7):
        assert a[step]["block_ids"] == b[step]["block_ids"], step
        for x, y in zip(a[step]["losses"], b[step]["losses"], strict=True):
            assert abs(x - y) <= 1e-5, (stage, step, x, y)
    assert a[6]["loss"] < a[1]["loss"] - 0.5
    assert b[6]["lr"] == pytest.approx(a[6]["lr"])

    if stage == 1:
        return
    typed = tmp_path / "typed"
    shutil.copytree(tmp_path / "ckpt", typed / "ckpt")  # the step-6 checkpoint, for another resume below
    # Without --optimizer, the resume continues with Muon, and says so.
    again = train(staged, tmp_path, "--train_iters", "7", "--save_interval", "3")
    said = (
        "trained with --optimizer muon, --muon_lr 0.03, --muon_momentum 0.95, --muon_weight_decay 0.1, "
        "--muon_scale rms"
    )  # every setting, recorded by the run that wrote the checkpoint
    assert said in again.stderr and "--lr_schedule wsd: this run continues with it" in again.stderr
    assert "optimizer: Muon (lr 0.03," in again.stderr and sorted(steps(tmp_path)) == list(range(1, 8))
    # Muon's settings typed at a resume take effect over those the checkpoint's optimizer state brings:
    # from the same checkpoint, the same step trains other weights, and the log says whose settings train.
    changed = train(staged, typed, "--train_iters", "7", "--save_interval", "3", "--muon_momentum", "0.5",
                    "--muon_weight_decay", "0.7")  # fmt: skip
    assert "the optimizer's momentum, weight_decay: this run's, not the checkpoint's" in changed.stderr
    assert "this run's, not the checkpoint's" not in again.stderr
    recorded = yaml.safe_load((typed / "ckpt" / "global_step7" / "config.yaml").read_text())
    assert (recorded["muon_momentum"], recorded["muon_weight_decay"]) == (0.5, 0.7)
    ours, theirs = (_weights(d / "ckpt" / "global_step7") for d in (typed, tmp_path))
    assert ours.keys() == theirs.keys() and any(not torch.equal(ours[k], theirs[k]) for k in ours)
    # The checkpoint holds Muon's state: AdamW cannot resume it, in one line.
    other = train(staged, tmp_path, "--optimizer", "adamw", "--lr_schedule", "wsd", *RUN, check=False)
    assert other.returncode == 2, other.stderr[-2000:]
    (line,) = other.stderr.strip().splitlines()
    assert "was trained with --optimizer muon and this run asks for --optimizer adamw" in line
    # Its Muon weights are grouped by update size: another --muon_scale cannot resume it either.
    other = train(staged, tmp_path, *MUON, "--muon_scale", "spectral", *RUN, check=False)
    assert other.returncode == 2, other.stderr[-2000:]
    lines = other.stderr.strip().splitlines()
    assert len(lines) == 1, other.stderr[-3000:]
    line = lines[0]
    assert "was trained with --muon_scale rms and this run asks for --muon_scale spectral" in line


def _weights(tag: Path) -> dict[str, Any]:
    """The model's weights as a checkpoint of ZeRO 0-2 holds them."""
    return torch.load(tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]


@pytest.mark.slow
def test_muon_under_zero_3_or_with_bad_flags_is_refused_before_the_model_is_built(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    staged = at_stage(corpus, tmp_path, 3)
    for extra, said in (
        (MUON, "--optimizer muon cannot train under this DeepSpeed config: ZeRO stage 3"),
        (("--muon_lr", "0.01"), "--optimizer muon cannot train under this DeepSpeed config: ZeRO stage 3"),
        (("--optimizer", "sgd"), "--optimizer"),
        (("--optimizer", "adamw", "--muon_lr", "0.01"), "--muon_lr set the Muon optimizer"),
        (("--optimizer", "muon", "--lr_schedule", "wsd", "--muon_momentum", "-1"), "--muon_momentum"),
    ):
        out = train(staged, tmp_path / "run", *extra, "--train_iters", "2", check=False)
        assert out.returncode == 2, out.stderr[-2000:]
        (line,) = out.stderr.strip().splitlines()
        assert said in line and "model " not in out.stderr


PLAIN = """
import json, sys
from transformers import GPT2LMHeadModel, pipeline
model = GPT2LMHeadModel.from_pretrained(sys.argv[1])
generate = pipeline("text-generation", model=sys.argv[1])
text = generate("def", max_new_tokens=5, do_sample=False)[0]["generated_text"]
print(json.dumps({"dsgpt2": "dsgpt2" in sys.modules, "text": text, "class": type(model).__name__}))
"""


@pytest.mark.slow
def test_the_fast_recipe_exports_a_plain_model_that_evaluates_as_trained(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    import os
    import subprocess
    import sys

    from conftest import ROOT
    from dsgpt2.checkpoints.weights import RUN_INFO
    from dsgpt2.db.config import load_config
    from dsgpt2.infer.evaluate import evaluate
    from dsgpt2.infer.loading import load_model
    from dsgpt2.infer.settings import EvalRequest
    from dsgpt2.train.metrics import read_metrics

    recipe = ROOT / "configs" / "recipes" / "fast.yaml"
    done = train(corpus, tmp_path, "--config", str(recipe), "--train_iters", "8", "--eval_interval", "8",
                 "--eval_iters", "4", "--save_interval", "8", "--warmup_iters", "2")  # fmt: skip
    said = "optimizer: Muon (lr 0.003, momentum 0.95 (from 0.85 over 300 steps), weight decay 0.1, rms scale"
    assert said in done.stderr and "; Polar Express, NorMuon) on" in done.stderr
    last = [r for r in read_metrics(tmp_path / "ws" / "metrics.jsonl") if r["event"] == "eval"][-1]
    assert last["step"] == 8
    # As a user's shell runs it: no DS_ACCELERATOR (the test process may have set one).
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "MONGO_CONNECTION_STRING")}
    export = [sys.executable, "-m", "dsgpt2", "export", "--ckpt_dir", str(tmp_path / "ckpt"), "--out",
              str(tmp_path / "hf")]  # fmt: skip
    out = subprocess.run(export, capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stderr == "" and out.stdout.startswith("exported "), out.stderr  # no DeepSpeed warning
    assert json.loads((tmp_path / "hf" / RUN_INFO).read_text())["task"] == "lm"  # chat refuses it
    plain = subprocess.run([sys.executable, "-c", PLAIN, str(tmp_path / "hf")], capture_output=True,
                           text=True, check=True)  # fmt: skip
    got = json.loads(plain.stdout.strip().splitlines()[-1])
    assert got["class"] == "GPT2LMHeadModel" and not got["dsgpt2"] and got["text"].startswith("def")
    request = EvalRequest(batch_size=4, max_batches=4, workers=0)
    report = evaluate(load_model(tmp_path / "hf"), load_config(corpus["config"]), request, progress=False)
    assert report["metrics"]["perplexity"] == pytest.approx(last["val_ppl"], rel=1e-5)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:`torch._prims_common.check` is deprecated:FutureWarning")
def test_the_matrices_of_one_shape_are_orthogonalised_together_and_step_as_one_by_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One Newton–Schulz call per shape and group, not per matrix: the same weights and momentum as
    DeepSpeed's step, matrix by matrix, over a few steps."""
    import copy

    import torch
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    from dsgpt2.optim import muon_update
    from dsgpt2.optim.muon import batched_muon_class

    torch.manual_seed(0)
    model = tiny_model()
    twin = copy.deepcopy(model)
    settings: dict[str, Any] = {"muon_lr": 0.02, "momentum": 0.95, "weight_decay": 0.1}
    ours = batched_muon_class()(
        muon_param_groups(model, {}, 1e-3, **settings), adam_optimizer=torch.optim.AdamW
    )
    theirs = MuonWithAuxAdam(muon_param_groups(twin, {}, 1e-3, **settings), adam_optimizer=torch.optim.AdamW)
    calls: list[tuple[int, ...]] = []
    real = muon_update.muon_update

    def counted(grad: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(tuple(grad.shape))
        return real(grad, *args, **kwargs)

    # A batch and one matrix at a time give the same numbers in fp32; eager, as a CPU run steps
    # (test_compiled.py compiles the update).
    with ns_in_fp32(), torch.compiler.set_stance("force_eager"):
        for step in range(3):
            grads = [torch.randn_like(p) for p in model.parameters()]
            for m, opt in ((model, ours), (twin, theirs)):
                for p, g in zip(m.parameters(), grads, strict=True):
                    p.grad = g.clone()
                if opt is ours:
                    monkeypatch.setattr(muon_update, "muon_update", counted)
                opt.step()
                monkeypatch.setattr(muon_update, "muon_update", real)
            for a, b in zip(model.parameters(), twin.parameters(), strict=True):
                assert torch.allclose(a, b, atol=1e-6), step
    # 8 matrices of 4 shapes (each its own group here): 4 calls a step, each on a batch of 2.
    assert len(calls) == 3 * 4 and all(len(shape) == 3 and shape[0] == 2 for shape in calls)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        if p.dim() == 2 and p.use_muon:
            assert torch.allclose(
                ours.state[p][MUON_MOMENTUM_KEY], theirs.state[q][MUON_MOMENTUM_KEY], atol=1e-6
            )


# DeepSpeed's import warns about a torch API it calls (not ours): run first in its process (the quick
# lane), this test is the one that meets the warning.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_the_adamw_part_steps_in_one_fused_call_as_the_per_tensor_one_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under Muon, AdamW's ~100 small tensors of a GPT-2 (embeddings, biases, norms) step in one fused
    kernel per group, not a handful of host ops each, to the same weights as torch's default."""
    import copy

    import torch
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    from dsgpt2.optim.muon import build_muon

    torch.manual_seed(0)
    model = tiny_model()
    twin = copy.deepcopy(model)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    adamw = {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}
    ours = build_muon(model, adamw, 1e-3, OptimizerOptions("muon", muon_scale="rms"))
    default = MuonWithAuxAdam(
        muon_param_groups(twin, adamw, 1e-3, muon_lr=1e-3, momentum=0.95, weight_decay=0.1, scale="rms"),
        adam_optimizer=torch.optim.AdamW,
    )
    # Only the AdamW part is looked at: the matrices' part (test_compiled.py compiles it, the tests above
    # compare it) stands aside, so what the profiler sees is AdamW's alone, and nothing is compiled.
    monkeypatch.setattr(type(ours), "_step_shape", lambda self, group, params: None)
    with torch.compiler.set_stance("force_eager"):
        ours.step()  # a step first on both: the state is made at the first
        default.step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            ours.step()
        default.step()
    names = [e.name for e in prof.events()]
    aux = [p for g in ours.param_groups if not g["use_muon"] for p in g["params"]]
    assert len(aux) > 10 and names.count("aten::_fused_adamw_") <= 2 and "aten::lerp_" not in names
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        if not getattr(p, "use_muon", False):
            assert torch.allclose(p, q, atol=1e-6)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_on_a_cpu_muon_iterates_in_fp32_where_deepspeed_would_take_fp16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DeepSpeed's Gram iteration runs in fp16 wherever the accelerator multiplies fp16 matrices, a CPU
    with AVX512-FP16 included (its answer there stood in below); a Muon run on a CPU iterates in fp32 all the
    same."""
    from deepspeed.runtime.zero.muon import original_muon

    from dsgpt2.optim.muon import build_muon

    # DeepSpeed's dtype on such a CPU; the process gets back what it had when the test ends.
    monkeypatch.setattr(original_muon, "ns_compute_dtype", lambda ns_method="gram": torch.float16)
    grad = torch.randn(2, 8, 32)

    def iteration_dtype() -> torch.dtype:
        with torch.compiler.set_stance("force_eager"):
            return original_muon.zeropower_via_gram_newtonschulz(grad, steps=5).dtype

    assert iteration_dtype() == torch.float16
    build_muon(tiny_model(), {"lr": 1e-3, "weight_decay": 0.1}, 1e-3, OptimizerOptions("muon"))
    assert iteration_dtype() == torch.float32
    assert original_muon.ns_compute_dtype("standard") == torch.float32


def test_a_resume_keeps_the_optimizer_settings_the_run_was_given() -> None:
    """A checkpoint's optimizer state carries its groups' settings (momentum, betas, decay): put back as
    this run built them, the rate and the state left as loaded."""
    from dsgpt2.checkpoints.ds_checkpoint import group_settings, keep_settings

    weights = [torch.nn.Parameter(torch.ones(3))]
    then = torch.optim.AdamW(weights, lr=0.1, betas=(0.8, 0.9), weight_decay=0.5)
    weights[0].grad = torch.ones(3)
    then.step()
    now = torch.optim.AdamW(weights, lr=0.2, betas=(0.9, 0.95), weight_decay=0.1)
    built = group_settings(now)
    now.load_state_dict(then.state_dict())
    assert now.param_groups[0]["betas"] == (0.8, 0.9)  # what loading alone leaves
    assert keep_settings(now, built) == ["betas", "weight_decay"]
    group = now.param_groups[0]
    assert (group["betas"], group["weight_decay"], group["lr"]) == ((0.9, 0.95), 0.1, 0.1)
    assert int(now.state[weights[0]]["step"]) == 1
    assert keep_settings(now, built) == []


def test_an_adamw_run_logs_its_optimizer_and_whether_it_clips(caplog: pytest.LogCaptureFixture) -> None:
    from dsgpt2.optim.ds_config import EngineConfig
    from dsgpt2.optim.optimizer import AdamW

    params = {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    section = {"optimizer": {"type": "AdamW", "params": params}}
    with caplog.at_level("INFO", logger="dsgpt2"):
        AdamW(OptimizerOptions()).build(
            tiny_model(), EngineConfig({"gradient_clipping": 1.0, **section}, params, None)
        )
        AdamW(OptimizerOptions()).build(tiny_model(), EngineConfig(section, params, None))
    # No optimizer section (only --lr's params): DeepSpeed would build none, and the first step failed in
    # an IndexError; refused in one line before the engine.
    from dsgpt2.errors import ConfigError

    with pytest.raises(
        ConfigError, match="--optimizer adamw trains with the DeepSpeed config's optimizer section"
    ):
        AdamW(OptimizerOptions()).build(
            tiny_model(), EngineConfig({"optimizer": {"params": params}}, params, None)
        )
    clipped, unclipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("optimizer:")]
    assert clipped == (
        "optimizer: AdamW (lr 0.003, betas 0.9, 0.95, eps 1e-08, weight decay 0.1 on the matrices and "
        "embeddings), gradient clipping at 1; ZeRO stage 0"
    )
    assert "no gradient clipping (the DeepSpeed config sets none" in unclipped
