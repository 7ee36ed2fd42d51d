"""The batched decoding loop: rows batched or alone give the same tokens, transformers' greedy
decoding is matched, seeds, stop strings, streaming deltas, cancellation."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conftest import tiny_export
from dsgpt2.infer.decode import Decoder, DecodeRequest, Delta, run
from dsgpt2.infer.generate import Generator
from dsgpt2.infer.loading import load_model
from dsgpt2.infer.settings import SamplingParams

GREEDY = SamplingParams(max_new_tokens=20, temperature=0, repetition_penalty=1.0)


@pytest.fixture(scope="module")
def gen(tmp_path_factory: pytest.TempPathFactory, sample_texts: list[str]) -> Generator:
    return Generator(load_model(tiny_export(tmp_path_factory.mktemp("decode"), sample_texts[:300], 128)))


def prompts(gen: Generator) -> list[list[int]]:
    texts = ["Return", "Return the list of all the files in", "The " * 12 + "value of the"]
    return [gen.encode(t) for t in texts]


def alone(gen: Generator, ids: list[int], params: SamplingParams, **kw: Any) -> DecodeRequest:
    request = DecodeRequest(ids, params, **kw)
    run(Decoder(gen.model, gen.tokenizer, gen.eot, gen.device), [request])
    return request


def hf_greedy(gen: Generator, ids: list[int], n: int, penalty: float = 1.0) -> list[int]:
    with torch.no_grad():
        out = gen.model.generate(
            input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n, do_sample=False, repetition_penalty=penalty, eos_token_id=None,
            pad_token_id=gen.eot, temperature=None, top_k=None, top_p=None,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def test_greedy_matches_transformers_alone_batched_and_joining_mid_flight(gen: Generator) -> None:
    ps = prompts(gen)
    expected = [alone(gen, p, GREEDY).samples[0].ids for p in ps]
    for p, ids in zip(ps, expected, strict=True):
        if gen.eot in ids:  # we stop at end-of-text; transformers was told not to
            ids = ids[: ids.index(gen.eot)]
        assert hf_greedy(gen, p, len(ids)) == ids
    batched = [DecodeRequest(p, GREEDY) for p in ps]
    run(Decoder(gen.model, gen.tokenizer, gen.eot, gen.device), batched)
    assert [r.samples[0].ids for r in batched] == expected
    # The long prompt starts alone; the others join after 5 steps (its cache is then longer
    # than theirs), then a fourth joins after 3 more.
    decoder = Decoder(gen.model, gen.tokenizer, gen.eot, gen.device)
    late = [DecodeRequest(p, GREEDY) for p in ps]
    decoder.add([late[2]])
    for _ in range(5):
        decoder.step()
    decoder.add(late[:2])
    assert len(decoder) == 3 and decoder.mask.shape[0] == 3
    for _ in range(3):
        decoder.step()
    fourth = DecodeRequest(ps[1], replace_params(GREEDY, max_new_tokens=4))
    decoder.add([fourth])
    while len(decoder):
        decoder.step()
    assert [r.samples[0].ids for r in late] == expected
    assert fourth.samples[0].ids == expected[1][:4] and fourth.samples[0].finish_reason == "length"
    assert decoder.mask.shape == (0, 0)  # every row left, the cache with them


def replace_params(params: SamplingParams, **kw: Any) -> SamplingParams:
    from dataclasses import replace

    return replace(params, **kw)


def test_repetition_penalty_and_filters_match_their_definitions(gen: Generator) -> None:
    p = prompts(gen)[1]
    penalized = replace_params(GREEDY, repetition_penalty=1.7)
    assert alone(gen, p, penalized).samples[0].ids == hf_greedy(gen, p, 20, penalty=1.7)
    greedy = alone(gen, p, GREEDY).samples[0].ids
    # top-k 1, or a nucleus smaller than any token's probability, is greedy whatever the seed.
    for seed in (1, 2):
        for params in (
            SamplingParams(max_new_tokens=20, temperature=1.5, top_k=1, seed=seed),
            SamplingParams(max_new_tokens=20, temperature=1.5, top_k=0, top_p=1e-6, seed=seed),
        ):
            assert alone(gen, p, params).samples[0].ids == greedy


def test_top_k_sampling_stays_among_the_k_likeliest(gen: Generator) -> None:
    p = prompts(gen)[0]
    with torch.no_grad():
        logits = gen.model(torch.tensor([p])).logits[0, -1]
    top3 = set(logits.topk(3).indices.tolist())
    firsts = {
        alone(gen, p, SamplingParams(max_new_tokens=1, temperature=100, top_k=3, seed=s)).samples[0].ids[0]
        for s in range(40)
    }
    assert firsts == top3  # a hot temperature reaches all three, never a fourth


def test_seeds_repeat_whatever_shares_the_batch(gen: Generator) -> None:
    ps = prompts(gen)
    params = SamplingParams(max_new_tokens=24, temperature=1.0, top_k=0, top_p=1.0, num_samples=3, seed=7)
    first = alone(gen, ps[1], params)
    assert alone(gen, ps[1], params).samples == first.samples
    # Batched with rows whose filters differ (top-k wider, narrower, none) and a greedy one.
    others = [
        DecodeRequest(ps[0], replace_params(params, seed=8, top_k=50)),
        DecodeRequest(ps[2], GREEDY),
        DecodeRequest(ps[0], replace_params(params, seed=9, top_k=5, top_p=0.5)),
    ]
    for p in (params, replace_params(params, top_k=20)):
        mixed = DecodeRequest(ps[1], p)
        run(Decoder(gen.model, gen.tokenizer, gen.eot, gen.device), [others[0], mixed, *others[1:]])
        assert [s.ids for s in mixed.samples] == [s.ids for s in alone(gen, ps[1], p).samples]
    mixed = DecodeRequest(ps[1], params)
    run(Decoder(gen.model, gen.tokenizer, gen.eot, gen.device), [others[0], mixed])
    assert [s.ids for s in mixed.samples] == [s.ids for s in first.samples]
    # A top-k wider than the vocabulary is no limit.
    assert alone(gen, ps[1], replace_params(params, top_k=10**6)).samples == first.samples
    assert len({tuple(s.ids) for s in first.samples}) == 3  # n samples differ
    # A sample is the same however many were asked for.
    assert alone(gen, ps[1], replace_params(params, num_samples=1)).samples == first.samples[:1]
    assert alone(gen, ps[1], replace_params(params, seed=8)).samples != first.samples


def test_stop_strings_cut_the_text_and_deltas_add_up_to_it(gen: Generator) -> None:
    p = prompts(gen)[1]
    params = replace_params(GREEDY, max_new_tokens=40)
    full = alone(gen, p, params).samples[0].text
    assert len(full) > 20, full
    stop = full[12:16]
    deltas: list[Delta] = []
    cut = alone(gen, p, params, stop_texts=["\x00never", stop], on_delta=deltas.append).samples[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    assert "".join(d.text for d in deltas) == cut.text
    assert [d.finish_reason for d in deltas].count("stop") == 1 and deltas[-1].finish_reason == "stop"
    assert all(stop not in d.text for d in deltas)
    # Without stops the deltas are the whole text too, ending with "length".
    deltas.clear()
    plain = alone(gen, p, params, on_delta=deltas.append).samples[0]
    assert "".join(d.text for d in deltas) == plain.text == full
    assert deltas[-1].finish_reason == "length" and len(deltas) > 5
    # A stripped reply: no leading or trailing whitespace, streamed or not.
    deltas.clear()
    stripped = alone(gen, gen.encode("x"), params, strip=True, on_delta=deltas.append).samples[0]
    assert stripped.text == stripped.text.strip() and "".join(d.text for d in deltas) == stripped.text


def test_a_cancelled_request_leaves_and_the_others_go_on(gen: Generator) -> None:
    ps = prompts(gen)
    expected = alone(gen, ps[0], GREEDY).samples[0].ids
    decoder = Decoder(gen.model, gen.tokenizer, gen.eot, gen.device)
    keep, drop = DecodeRequest(ps[0], GREEDY), DecodeRequest(ps[2], GREEDY)
    decoder.add([drop, keep])
    decoder.step()
    drop.cancelled.set()
    decoder.step()
    assert len(decoder) == 1 and len(drop.samples[0].ids) == 2 and not drop.done
    # The padding columns only the cancelled (longer) prompt needed went with it.
    assert decoder.mask.shape == (1, len(ps[0]) + 2) and bool(decoder.mask.all())
    while len(decoder):
        decoder.step()
    assert keep.samples[0].ids == expected
    assert decoder.rngs == [] and decoder.cache is None


def test_generator_streams_the_text_it_returns(gen: Generator) -> None:
    pieces: list[str] = []
    params = SamplingParams(max_new_tokens=12, temperature=0.9, seed=3)
    out = gen.generate_ids(prompts(gen)[0], params, on_text=pieces.append)
    assert pieces and "".join(pieces) == out[0].text
    assert gen.generate_ids(prompts(gen)[0], params)[0] == out[0]


def test_the_cache_goes_by_the_name_the_models_forward_takes(gen: Generator) -> None:
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns); the range
    still admits versions before it, which know only the old name."""
    import transformers
    from packaging.version import Version

    from dsgpt2.infer.decode import cache_argument

    class Before:
        def forward(self, input_ids: Any, past_key_values: Any = None, use_cache: bool = False) -> None: ...

    class Since:
        def forward(self, input_ids: Any, cache: Any = None, use_cache: bool = False) -> None: ...

    assert cache_argument(Before()) == "past_key_values" and cache_argument(Since()) == "cache"
    renamed = Version(transformers.__version__) >= Version("5.24")
    assert gen.decoder.cache_arg == ("cache" if renamed else "past_key_values")
