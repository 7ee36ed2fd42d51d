"""Muon's options from the speedrun and nanochat: Polar Express (``--muon_ns polar_express``), cautious
weight decay (``--muon_cautious``) and a momentum warmed up from 0.85 (``--muon_momentum_warmup``): each
update against a reference written here for a small matrix, and all three at once trained at ZeRO 0, 1
and 2 (the same model) and resumed in the middle of the warmup exactly."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from dsgpt2.errors import ConfigError
from dsgpt2.optim.muon import batched_muon_class, decayed_step, muon_param_groups
from dsgpt2.optim.schedule import Schedule, ScheduledLR, momentum_at
from dsgpt2.train.config import OptimizerOptions
from training import at_stage, steps, train, training_corpus

pytestmark = [
    # Inductor imports torch.utils.mkldnn, which warns of its own torch.jit use: torch's warning, not ours.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:`torch._prims_common.check` is deprecated:FutureWarning"),
]

# The five (a, b, c) of Polar Express (Amsel et al., 2025, as the modded-nanogpt speedrun prints them).
PUBLISHED = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def _deepspeed() -> Any:
    from dsgpt2.accelerator import prepare_deepspeed_environment

    prepare_deepspeed_environment()
    from deepspeed.runtime.zero.muon import original_muon

    return original_muon


def _reference_polar(g: torch.Tensor) -> torch.Tensor:
    """Polar Express in float64, written out: wide side last, ÷ (1.02·‖g‖_F), X ← aX + (bA + cA²)X."""
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (torch.linalg.matrix_norm(x) * 1.02 + 1e-6)
    for a, b, c in PUBLISHED:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize("shape", [(16, 8), (8, 16), (24, 24)])
def test_polar_express_is_the_published_iteration_and_nearer_the_polar_factor_than_the_quintic(
    shape: tuple[int, int],
) -> None:
    from dsgpt2.optim.muon_update import polar_express

    torch.manual_seed(0)
    g = torch.randn(*shape)
    with torch.compiler.set_stance("force_eager"):
        ours = polar_express(g).double()
        quintic = _deepspeed().zeropower_via_gram_newtonschulz(g, 5).double()
    torch.testing.assert_close(ours, _reference_polar(g), rtol=0, atol=2e-4)
    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    exact = u @ vh
    assert (ours - exact).abs().max() < (quintic - exact).abs().max()
    singular = torch.linalg.svdvals(ours)
    assert singular.min() > 0.8 and singular.max() < 1.2, singular  # the quintic's fall to 0.68
    assert torch.linalg.svdvals(quintic).min() < 0.75


def test_the_polar_update_is_nesterov_momentum_then_polar_express_sized_as_deepspeeds() -> None:
    from dsgpt2.optim.muon_update import muon_update

    torch.manual_seed(1)
    grad, momentum = torch.randn(2, 12, 4), torch.randn(2, 12, 4)  # two tall matrices of one shape
    beta = 0.9
    want_momentum = beta * momentum + (1 - beta) * grad
    nesterov = (1 - beta) * grad + beta * want_momentum
    want = torch.stack([_reference_polar(m) for m in nesterov]) * (12 / 4) ** 0.5  # DeepSpeed's size
    with torch.compiler.set_stance("force_eager"):
        got = muon_update(grad.clone(), momentum, beta=beta, ns_method="polar_express")
    torch.testing.assert_close(momentum, want_momentum, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=5e-4)
    # A non-finite gradient leaves the momentum alone and comes back as the update (the loss scaler's cue).
    grad[0, 0, 0] = float("inf")
    kept = momentum.clone()
    with torch.compiler.set_stance("force_eager"):
        got = muon_update(grad.clone(), momentum, beta=beta, ns_method="polar_express")
    assert torch.equal(momentum, kept) and not torch.isfinite(got).all()


def test_cautious_decay_decays_only_where_the_update_agrees_with_the_weight_in_sign() -> None:
    p = torch.tensor([[1.0, -1.0], [2.0, -2.0]])
    update = torch.tensor([[0.5, 0.5], [-0.5, 0.0]])
    lr, wd = 0.1, 0.5
    plain, cautious = p.clone(), p.clone()
    decayed_step(plain, update, lr, wd, cautious=False)
    decayed_step(cautious, update, lr, wd, cautious=True)
    # p − lr·(u + wd·p) everywhere; cautious: the decay only at (0, 0) (both +) and (1, 1) (u = 0).
    torch.testing.assert_close(
        plain, torch.tensor([[1 - 0.1 * 1.0, -1 - 0.1 * 0.0], [2 + 0.1 * -0.5, -2 + 0.1 * 1.0]])
    )
    torch.testing.assert_close(
        cautious, torch.tensor([[1 - 0.1 * 1.0, -1 - 0.1 * 0.5], [2 + 0.1 * 0.5, -2 + 0.1 * 1.0]])
    )
    # A batch of matrices (the stacked step of ZeRO 0) takes the same step as each alone.
    batch = [p.clone(), -p.clone()]
    decayed_step(batch, torch.stack([update, update]), lr, wd, cautious=True)
    assert torch.equal(batch[0], cautious)
    alone = -p.clone()
    decayed_step(alone, update, lr, wd, cautious=True)
    assert torch.equal(batch[1], alone)


@pytest.mark.parametrize("shape", [(6, 3), (3, 6)])
def test_normuon_evens_out_the_rows_of_the_longer_side_and_keeps_the_updates_size(
    shape: tuple[int, int],
) -> None:
    from dsgpt2.optim.muon_update import normuon, normuon_state

    torch.manual_seed(2)
    update = torch.randn(1, *shape) * torch.arange(1.0, shape[0] + 1).view(1, -1, 1)
    second = normuon_state(update[0]).unsqueeze(0)
    assert second.shape == ((1, 6, 1) if shape == (6, 3) else (1, 1, 6))
    # Written out, one row (of the longer side) at a time: v ← 0.95·v + 0.05·mean(row²); row ÷ sqrt(v);
    # then the whole times ‖update‖ ÷ ‖result‖.
    lines = update[0] if shape[0] >= shape[1] else update[0].T
    v = [0.05 * float((row**2).mean()) for row in lines]
    evened = torch.stack([row / v_i**0.5 for row, v_i in zip(lines, v, strict=True)])
    evened = evened * (torch.linalg.matrix_norm(lines) / torch.linalg.matrix_norm(evened))
    want = evened if shape[0] >= shape[1] else evened.T
    with torch.compiler.set_stance("force_eager"):
        got = normuon(update, second)
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(second.flatten(), torch.tensor(v), rtol=1e-5, atol=1e-7)
    # After the first step every row of the longer side has the same size, and the whole keeps its own.
    norms = torch.linalg.vector_norm(got[0] if shape[0] >= shape[1] else got[0].T, dim=1)
    torch.testing.assert_close(norms, torch.full_like(norms, float(norms.mean())), rtol=1e-5, atol=1e-6)
    assert torch.linalg.matrix_norm(got[0]) == pytest.approx(
        float(torch.linalg.matrix_norm(update[0])), rel=1e-5
    )


def _reference_soap(
    grads: list[torch.Tensor], bases: dict[int, tuple[torch.Tensor, torch.Tensor]], beta: float = 0.95
) -> list[torch.Tensor]:
    """SOAP-Muon written out for one matrix in float64: Nesterov momentum; Shampoo's factors L ← 0.95·L +
    0.05·G Gᵀ and R ← 0.95·R + 0.05·Gᵀ G, their eigenvectors taken at steps 0 and 10; from step 1,
    Adam's second moment of the gradient turned into them, v ← 0.95·v + 0.05·(Q_Lᵀ G Q_R)²; the
    momentum turned in, divided by √v + 1e-8, turned back; then Polar Express, sized √(rows / cols)
    where taller than wide. ``bases``: the eigenvectors to take at a step, where a factor's are not
    unique (a tall matrix's first Gram matrix has a null space, any basis of which is as good); each is
    checked to be the factor's."""
    rows, cols = grads[0].shape
    m = torch.zeros(rows, cols, dtype=torch.float64)
    left, right = torch.zeros(rows, rows, dtype=torch.float64), torch.zeros(cols, cols, dtype=torch.float64)
    v = torch.zeros(rows, cols, dtype=torch.float64)
    out = []
    for t, g in enumerate(g.double() for g in grads):
        m = beta * m + (1 - beta) * g
        nesterov = (1 - beta) * g + beta * m
        left, right = 0.95 * left + 0.05 * g @ g.T, 0.95 * right + 0.05 * g.T @ g
        if t % 10 == 0:
            ql, qr = (torch.linalg.eigh(left).eigenvectors, torch.linalg.eigh(right).eigenvectors)
            if t in bases:
                ql, qr = (q.double() for q in bases[t])
            for factor, q in ((left, ql), (right, qr)):  # eigenvectors of the factor, orthonormal
                torch.testing.assert_close(q.T @ q, torch.eye(len(q), dtype=q.dtype), rtol=0, atol=1e-5)
                turned = q.T @ factor @ q
                assert (turned - torch.diag(turned.diagonal())).abs().max() < 1e-5 * factor.abs().max()
        if t == 0:  # the first step starts the factors only: plain Muon
            out.append(_reference_polar(nesterov) * max(1.0, rows / cols) ** 0.5)
            continue
        v = 0.95 * v + 0.05 * (ql.T @ g @ qr) ** 2
        preconditioned = ql @ ((ql.T @ nesterov @ qr) / (v.sqrt() + 1e-8)) @ qr.T
        out.append(_reference_polar(preconditioned) * max(1.0, rows / cols) ** 0.5)
    return out


@pytest.mark.parametrize("shape", [(8, 8), (12, 8)])
def test_soap_muon_is_adam_in_shampoos_eigenbasis_then_polar_express(shape: tuple[int, int]) -> None:
    from dsgpt2.optim.muon_update import SOAP_KEYS, soap_muon_update, soap_state

    torch.manual_seed(3)
    # A gradient's scale and a fixed direction under the noise, as a layer's are: the preconditioner has
    # something to learn, and its bases, made again at step 10, change.
    base = torch.randn(*shape)
    grads = [1e-2 * (base + torch.randn(*shape)) for _ in range(12)]
    momentum = torch.zeros(1, *shape)
    state = {key: value.unsqueeze(0) for key, value in soap_state(grads[0]).items()}
    assert set(state) == set(SOAP_KEYS)
    got, bases = [], {}
    with torch.compiler.set_stance("force_eager"):
        for step, grad in enumerate(grads):
            update = soap_muon_update(
                grad.unsqueeze(0).clone(), momentum, 0.95, state, step, ns_method="polar_express"
            )
            got.append(update[0].double())
            bases[step] = (state["soap_left_basis"][0].clone(), state["soap_right_basis"][0].clone())
    square = shape[0] == shape[1]  # its first factors have no null space: its bases are unique
    want = _reference_soap(grads, {} if square else {0: bases[0], 10: bases[10]})
    for step, (ours, expected) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(ours, expected, rtol=0, atol=2e-3, msg=f"step {step}")
    # Not plain Muon: the preconditioner turns the update (the same momentum, orthogonalised alone).
    plain = _reference_polar(momentum[0] * 0.95 + 0.05 * grads[-1]) * max(1.0, shape[0] / shape[1]) ** 0.5
    assert (got[-1] - plain).abs().max() > 0.05


def _model() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))


def test_the_momentum_warms_up_from_085_to_its_own_and_the_schedule_sets_it_each_step() -> None:
    assert [momentum_at(0.95, 4, s) for s in range(6)] == pytest.approx([0.85, 0.875, 0.9, 0.925, 0.95, 0.95])
    assert momentum_at(0.95, 0, 0) == 0.95  # no warmup
    model = _model()
    groups = muon_param_groups(model, {}, 1e-3, muon_lr=1e-3, momentum=0.95, momentum_warmup=4)
    optimizer = batched_muon_class()(groups, adam_optimizer=torch.optim.AdamW)
    scheduler = ScheduledLR(optimizer, Schedule(kind="wsd", peak=1e-3, total=10, warmup=0))
    muon = [g for g in optimizer.param_groups if g["use_muon"]]
    seen = []
    for _ in range(5):
        seen.append(muon[0]["momentum"])
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        with torch.compiler.set_stance("force_eager"):
            optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.85, 0.875, 0.9, 0.925, 0.95])
    assert all(g["momentum"] == pytest.approx(0.95) for g in muon)
    # The AdamW groups have no momentum of this kind.
    assert all("momentum" not in g for g in optimizer.param_groups if not g["use_muon"])


def test_a_warmup_to_a_momentum_below_its_start_is_refused() -> None:
    options = OptimizerOptions(optimizer="muon", muon_momentum=0.8, muon_momentum_warmup=100)
    with pytest.raises(ConfigError, match=r"--muon_momentum_warmup raises the momentum from 0.85"):
        options.settle(None, {})


@pytest.mark.parametrize(
    ("ds", "said"),
    [
        ({"zero_optimization": {"stage": 2}}, "ZeRO stage 2's partitioned Muon"),
        ({"bf16": {"enabled": True}}, "DeepSpeed's bf16 optimizer (the config's bf16 section)"),
        ({"fp16": {"enabled": True}}, "DeepSpeed's fp16 optimizer"),
    ],
)
@pytest.mark.parametrize("flag", ["normuon", "soap"])
def test_normuon_and_soap_are_refused_where_muons_matrices_step_as_flat_partitions(
    ds: dict, said: str, flag: str
) -> None:
    options = OptimizerOptions(optimizer="muon", **{f"muon_{flag}": True})
    with pytest.raises(ConfigError, match=f"--muon_{flag} keeps .*, which {re.escape(said)}"):
        options.settle(None, ds)
    autocast = {"torch_autocast": {"enabled": True}}
    OptimizerOptions(optimizer="muon", **{f"muon_{flag}": True}).settle(None, autocast)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return training_corpus(tmp_path_factory)


VARIANTS = ("--optimizer", "muon", "--lr_schedule", "wsd", "--muon_lr", "0.03", "--muon_ns", "polar_express",
            "--muon_cautious", "--muon_momentum_warmup", "4")  # fmt: skip
RUN = ("--train_iters", "6", "--save_interval", "3")


@pytest.mark.slow
def test_the_three_train_the_same_model_at_each_zero_stage_and_resume_mid_warmup_exactly(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    straight = train(at_stage(corpus, tmp_path / "z0", 0), tmp_path / "z0", *VARIANTS, *RUN)
    said = "(lr 0.03, momentum 0.95 (from 0.85 over 4 steps), weight decay 0.1 (cautious), rms scale: ×"
    assert said in straight.stderr, straight.stderr[-3000:]
    plain = train(at_stage(corpus, tmp_path / "plain", 0), tmp_path / "plain", *VARIANTS[:6], *RUN)
    a, p = steps(tmp_path / "z0"), steps(tmp_path / "plain")
    assert a[6]["loss"] < a[1]["loss"] - 0.3  # it learns
    assert a[2]["loss"] != p[2]["loss"]  # and the options change what it learns
    assert "; Polar Express) on 0.1M weights" in straight.stderr
    assert "; quintic Newton–Schulz) on 0.1M weights" in plain.stderr
    for stage in (1, 2):
        run = tmp_path / f"z{stage}"
        staged = at_stage(corpus, run, stage)
        crashed = train(staged, run, *VARIANTS, *RUN, check=False, faults=("--exit_after", "5"))
        assert crashed.returncode == 17
        assert (run / "ckpt" / "latest").read_text() == "global_step3"  # in the middle of the warmup
        resumed = train(
            staged, run, "--train_iters", "6", "--save_interval", "3"
        )  # the options from the checkpoint
        for taken in ("--muon_ns polar_express,", "--muon_cautious,", "--muon_momentum_warmup 4"):
            assert taken in resumed.stderr, resumed.stderr[-3000:]
        assert "this run's, not the checkpoint's" not in resumed.stderr
        b = steps(run)
        assert sorted(b) == list(range(1, 7))
        for step in range(1, 7):
            assert a[step]["block_ids"] == b[step]["block_ids"], step
            for x, y in zip(a[step]["losses"], b[step]["losses"], strict=True):
                assert abs(x - y) <= 1e-5, (stage, step, x, y)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flag", "named", "keeps"),
    [
        ("normuon", "NorMuon", "a second moment for each row of a matrix"),
        ("soap", "SOAP", "two factors and a second moment for each whole matrix"),
    ],
)
def test_normuon_and_soap_train_at_zero_0_resume_exactly_and_are_refused_at_zero_1(
    corpus: dict[str, Path], tmp_path: Path, flag: str, named: str, keeps: str
) -> None:
    variant = (*VARIANTS[:6], f"--muon_{flag}")
    straight = train(at_stage(corpus, tmp_path / "a", 0), tmp_path / "a", *variant, *RUN)
    assert f"; quintic Newton–Schulz, {named}) on 0.1M weights" in straight.stderr, straight.stderr[-3000:]
    staged = at_stage(corpus, tmp_path / "b", 0)
    crashed = train(staged, tmp_path / "b", *variant, *RUN, check=False, faults=("--exit_after", "5"))
    assert crashed.returncode == 17
    resumed = train(staged, tmp_path / "b", "--train_iters", "6", "--save_interval", "3")
    assert f"--muon_{flag}," in resumed.stderr
    a, b = steps(tmp_path / "a"), steps(tmp_path / "b")
    assert a[6]["loss"] < a[1]["loss"] - 0.3
    for step in range(1, 7):
        assert a[step]["losses"] == pytest.approx(b[step]["losses"], abs=1e-5), step
    refused = train(at_stage(corpus, tmp_path / "c", 1), tmp_path / "c", *variant, *RUN, check=False)
    assert refused.returncode == 2
    (line,) = refused.stderr.strip().splitlines()
    assert f"--muon_{flag} keeps {keeps}, which ZeRO stage 1's" in line


def test_the_momentum_reaches_the_update_in_float32_whatever_the_buffers_dtype() -> None:
    """ZeRO 1 and 2 keep Muon's momentum in the gradients' dtype: 0.95 made a bf16 tensor would be
    0.9492, and every step would fold in 1.6 % more of the gradient than asked."""
    from dsgpt2.optim.muon_update import muon_update

    grad = torch.ones(4, 2, dtype=torch.bfloat16)
    momentum = torch.zeros(4, 2, dtype=torch.bfloat16)
    with torch.compiler.set_stance("force_eager"):
        muon_update(grad, momentum, 0.95, ns_method="polar_express")
    assert (
        momentum[0, 0].item() == torch.tensor(0.05, dtype=torch.bfloat16).item()
    )  # not bf16(1 − bf16(0.95))


def test_a_resume_trains_its_first_step_with_this_runs_warmed_momentum() -> None:
    """A checkpoint of a run without a momentum warmup, resumed at step 2 with --muon_momentum_warmup 4:
    its first step's momentum is the warmup's (0.9), not the checkpoint's 0.95, although the checkpoint's
    optimizer and schedule states load after this run's groups were built."""
    from dsgpt2.checkpoints.ds_checkpoint import load

    model = _model()
    optimizer = batched_muon_class()(
        muon_param_groups(model, {}, 1e-3, muon_lr=1e-3, momentum=0.95, momentum_warmup=4),
        adam_optimizer=torch.optim.AdamW,
    )
    scheduler = ScheduledLR(optimizer, Schedule(kind="wsd", peak=1e-3, total=10, warmup=0))

    class Engine:  # what DeepSpeed's load does to the groups: the checkpoint's, then its schedule
        def __init__(self) -> None:
            self.optimizer, self.lr_scheduler = optimizer, scheduler

        def load_checkpoint(self, *args: Any, **kwargs: Any) -> tuple[str, dict]:
            for g in optimizer.param_groups:
                if g["use_muon"]:
                    g.update(momentum=0.95, momentum_peak=0.95, momentum_warmup=0)
            scheduler.load_state_dict({"last_step": 2})
            return "global_step2", {}

    load(Engine(), Path("unused"), "global_step2")
    muon = [g for g in optimizer.param_groups if g["use_muon"]]
    assert muon and all(g["momentum"] == pytest.approx(0.9) and g["momentum_warmup"] == 4 for g in muon)
