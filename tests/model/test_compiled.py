"""What runs under ``torch.compile`` computes what eager does: the model paths the trainer compiles
(the chunked loss inside the graph with ``--doc_mask`` and activation checkpointing; beside it is
``test_lmloss.py``'s) and Muon's compiled update (either iteration). Marked ``floor``: ``make test-floor``
runs them on every torch ``pyproject.toml`` admits (under torch 2.11 the compiled chunked loss once gave
zero gradients while 2.13 gave the eager ones).
"""

from __future__ import annotations

import contextlib
import copy
import os
from types import SimpleNamespace

import pytest
import torch

from dsgpt2.data.packing import IGNORE
from dsgpt2.model.gpt2 import batch_inputs, build_model, checkpoint_activations, gpt2_config
from dsgpt2.model.loss import lm_head_nll, with_chunked_loss
from precision import ns_dtype, ns_in_fp32

VOCAB, B, T = 300, 3, 40
# Three chunks of the 117 tokens with a label, the last one short: each chunk is a few kernels of its own
# to compile, so no more of them than the accumulation across chunks needs.
CHUNK = 50
EOT = VOCAB - 1

pytestmark = [
    pytest.mark.floor,
    # Inductor imports torch.utils.mkldnn, which warns of its own torch.jit use; dynamo, tracing, makes an
    # autograd.Function context and reads .grad of its proxies: torch's warnings, not ours.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"),
    pytest.mark.filterwarnings("ignore:`torch._prims_common.check` is deprecated:FutureWarning"),
    # torch 2.11's profiler, at its end.
    pytest.mark.filterwarnings("ignore:.*Profiler clears events at the end of each cycle:UserWarning"),
    pytest.mark.filterwarnings(
        "ignore:Skipping serialization of skipfiles_inline_module_allowlist:UserWarning"
    ),
]


def _batch() -> SimpleNamespace:
    """Documents of several lengths packed end to end (end-of-text between them), labels with gaps."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB - 1, (B, T), generator=g)
    ids[:, [5, 17, 18, 30]] = EOT
    labels = ids.clone()
    labels[torch.rand(B, T, generator=g) < 0.2] = IGNORE
    return SimpleNamespace(input_ids=ids, labels=labels, attention_mask=torch.ones_like(ids))


def _model(chunk: int = CHUNK, *, in_graph: bool = False, activations: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(gpt2_config("tiny", VOCAB, T, eot=EOT, pad=EOT)).float()
    model = with_chunked_loss(model, chunk, compiled=in_graph)
    if activations:
        checkpoint_activations(model)
    return model.train()


def _loss_and_grads(model: torch.nn.Module, doc_mask: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    batch = _batch()
    model.zero_grad(set_to_none=True)
    loss = model(**batch_inputs(batch, "cpu", EOT if doc_mask else None), labels=batch.labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_chunked_loss_compiled_alone_has_the_eager_gradients() -> None:
    """The loss function as torch.compile traces it into the model's graph: its gradients are the eager
    ones, not zeros (what torch 2.11 gave while the Function's output was accumulated in place)."""
    torch.manual_seed(0)
    h0 = torch.randn(2, 9, 8, requires_grad=True)
    w = torch.randn(16, 8, requires_grad=True)
    labels = torch.randint(0, 16, (2, 9))
    labels[0, 3] = IGNORE

    def mean_nll(h0: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        nll, n = lm_head_nll(h0 * 1.0, w, labels, 8)  # 16 tokens: two chunks (a short last one: below)
        return nll / n

    got = []
    for fn in (mean_nll, torch.compile(mean_nll)):
        h0.grad = w.grad = None
        loss = fn(h0, w, labels)
        loss.backward()
        got.append((loss.detach(), h0.grad.clone(), w.grad.clone()))
    (eager_loss, eager_h, eager_w), (loss, dh, dw) = got
    assert eager_h.abs().sum() > 0 and eager_w.abs().sum() > 0
    torch.testing.assert_close(loss, eager_loss)
    torch.testing.assert_close(dh, eager_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw, eager_w, rtol=1e-5, atol=1e-6)


# The eager chunked loss against transformers' own, and the loss left beside the graph: test_lmloss.py
# (floor too). The loss traced into the model's graph, with the paths the trainer adds to it (--doc_mask,
# activation checkpointing), in one model: a compile of a model takes the better part of a minute of a
# CPU, and what any of them breaks under it breaks this one.
@pytest.mark.slow
def test_compiled_doc_mask_and_activation_checkpointing_give_the_eager_loss_and_gradients() -> None:
    """The compiled model, its chunked loss inside its graph, gives the eager loss and gradients (not the
    zeros torch 2.11 once gave), as one compiled region per call: no graph break at the loss."""
    eager = _model(in_graph=True, activations=True)
    compiled = copy.deepcopy(eager)
    compiled.compile()
    torch._dynamo.reset()
    want_loss, want = _loss_and_grads(eager, doc_mask=True)
    prof = torch.profiler.profile()
    for call in range(2):  # the call that compiles, and one that runs the compiled code as it is
        with prof if call else contextlib.nullcontext():
            got_loss, got = _loss_and_grads(compiled, doc_mask=True)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
        assert want.keys() == got.keys()
        for name, grad in want.items():
            assert grad.abs().sum() > 0 or name.endswith("bias"), name
            torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    regions = {e.name for e in prof.events() if e.name.startswith("Torch-Compiled Region")}
    # Speed, not correctness, where an older torch (2.7) breaks transformers' GPT-2 into several graphs.
    assert len(regions) == 1 or os.environ.get("DSGPT2_FLOOR_LANE"), regions


@pytest.mark.slow  # compiles the Newton–Schulz iteration
@pytest.mark.parametrize("method", ["gram", "polar_express"])
def test_muons_compiled_update_is_the_eager_one_and_a_warming_momentum_compiles_once(method: str) -> None:
    """Muon's update (momentum, then the iteration of --muon_ns: DeepSpeed's Gram Newton–Schulz or Polar
    Express, compiled whatever --compile says) on a batch of matrices of one shape, compiled and with
    torch's compiler stood down, in fp32 and in the dtype DeepSpeed iterates in here; a momentum that
    changes at every step (--muon_momentum_warmup) does not compile it again."""
    from dsgpt2.accelerator import prepare_deepspeed_environment

    prepare_deepspeed_environment()
    from dsgpt2.optim.muon_update import muon_update

    torch.manual_seed(0)
    grads, momentum = torch.randn(3, 48, 16), torch.randn(3, 48, 16)

    def updates(beta: float) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.compiler.set_stance("force_eager"):
            want = muon_update(grads.clone(), momentum.clone(), beta=beta, ns_method=method)
        return muon_update(grads.clone(), momentum.clone(), beta=beta, ns_method=method), want

    # In fp32 the compiled kernels give the eager numbers.
    torch._dynamo.reset()
    graphs = []
    with ns_in_fp32():
        for beta in (0.85, 0.9, 0.95):
            got, want = updates(beta)
            assert want.abs().sum() > 0
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1:] == graphs[:1] * 2, graphs
    # In the dtype DeepSpeed's iteration takes in this process (fp16 where the device multiplies it, as a
    # GPU does, unless a Muon run here set fp32 for the CPU), as close as the half type's rounding lets
    # two orders of the same sums come: a few hundredths of a unit-RMS update.
    torch._dynamo.reset()
    got, want = updates(0.95)
    if ns_dtype(method) == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    else:
        assert float((got - want).abs().max()) <= 0.05 * float(want.abs().max())


def test_normuons_compiled_step_is_the_eager_one() -> None:
    """NorMuon's evening out of an update's rows (--muon_normuon), compiled and eager, over three steps."""
    from dsgpt2.optim.muon_update import normuon, normuon_state

    torch.manual_seed(0)
    updates = [torch.randn(3, 48, 16) for _ in range(3)]
    torch._dynamo.reset()
    eager_state, compiled_state = (torch.stack([normuon_state(u) for u in updates[0]]) for _ in range(2))
    for update in updates:
        with torch.compiler.set_stance("force_eager"):
            want = normuon(update, eager_state)
        got = normuon(update, compiled_state)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(compiled_state, eager_state, rtol=1e-4, atol=1e-6)


def test_soap_muons_compiled_update_is_the_eager_one() -> None:
    """SOAP-Muon's update (--muon_soap: the Shampoo factors, Adam in their eigenbasis, the orthogonalisation),
    compiled and eager, over three steps past its first, its state alike."""
    from dsgpt2.optim.muon_update import SOAP_KEYS, soap_muon_update, soap_state

    torch.manual_seed(0)
    # Square: a tall matrix's first factor has a null space, whose basis eigh may choose either way.
    base = torch.randn(3, 24, 24)
    grads = [1e-2 * (base + torch.randn(3, 24, 24)) for _ in range(4)]
    torch._dynamo.reset()
    states = [{k: torch.stack([soap_state(g)[k] for g in grads[0]]) for k in SOAP_KEYS} for _ in range(2)]
    momenta = [torch.zeros(3, 24, 24) for _ in range(2)]
    for step, grad in enumerate(grads):
        with torch.compiler.set_stance("force_eager"):
            want = soap_muon_update(
                grad.clone(), momenta[0], 0.95, states[0], step, ns_method="polar_express"
            )
        got = soap_muon_update(grad.clone(), momenta[1], 0.95, states[1], step, ns_method="polar_express")
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
    for key in SOAP_KEYS:
        torch.testing.assert_close(states[1][key], states[0][key], rtol=1e-4, atol=1e-6, msg=key)
