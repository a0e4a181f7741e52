"""The engine's logit rules and log-probabilities (dipaco/inference/sampling.py, engine_rows.py),
which the server's vLLM fields and ``logprobs``/``echo`` reach: the rules on a tensor, then
on the session's tiny trained run (tests/_hostile.py ``finished``) the prompt's
log-probabilities equal ``dipaco-infer score``'s, a token's equal a direct forward's, and a
row's numbers do not depend on its batch.
"""
from __future__ import annotations

import math

import pytest
import torch

from dipaco.inference.engine_rows import Request
from dipaco.inference.sampling import check_shaping, sample_token, shape_logits, shapes_logits

TEXTS = ["def parse_args(argv):\n    parser = argparse.ArgumentParser()\n    parser.add_argument('--x')\n",
         "class Cache:\n    def __init__(self, size):\n        self.size = size\n        self.items = {}\n"]


# --------------------------------------------------------------------------- the rules on a tensor


def test_each_logit_rule_as_documented() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    plain = Request([1])
    assert not shapes_logits(plain)
    bias = shape_logits(logits, Request([1], logit_bias={0: -100.0, 4: 2.5}), [1], [], eos=3)
    assert bias.tolist() == [-98.0, -1.0, 0.5, 3.0, 2.5]
    rep = shape_logits(logits, Request([1], repetition_penalty=2.0), [0], [1], eos=3)
    assert rep.tolist() == [1.0, -2.0, 0.5, 3.0, 0.0]  # seen: positive divided, negative multiplied
    pen = shape_logits(logits, Request([1], presence_penalty=1.0, frequency_penalty=0.5), [2], [3, 3, 4], eos=0)
    assert pen.tolist() == [2.0, -1.0, 0.5, 3.0 - 1.0 - 1.0, 0.0 - 1.0 - 0.5]  # generated tokens only
    held = shape_logits(logits, Request([1], min_tokens=2, stop_ids=(2,)), [1], [4], eos=3)
    assert held[3] == held[2] == -math.inf and held[0] == 2.0
    assert shape_logits(logits, Request([1], min_tokens=2, stop_ids=(2,)), [1], [4, 4], eos=3).tolist() == \
        logits.tolist()  # min_tokens reached: nothing held back
    ignored = shape_logits(logits, Request([1], min_tokens=2, stop_at_eos=False), [1], [], eos=3)
    assert ignored[3] == 3.0  # ignore_eos: the end-of-text is a token like another


def test_min_p_keeps_the_tokens_near_the_likeliest() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    draws = {int(sample_token(logits, 1.0, None, None, torch.Generator().manual_seed(s), min_p=0.5))
             for s in range(200)}
    assert draws == {0, 1}  # 0.15 and 0.05 are under half of 0.5


def test_a_temperature_too_small_to_divide_by_is_greedy() -> None:
    """5e-324 lies in the server's [0, 2]; dividing by it overflowed the logits, the softmax
    was NaN and the draw raised, failing the engine's whole step (every open request)."""
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    for t in (5e-324, 1e-300, 9e-6):
        assert int(sample_token(logits, t, 2, 0.5, torch.Generator().manual_seed(0), min_p=0.5)) == 1


@pytest.mark.parametrize("field,value,words", [("repetition_penalty", 0.0, "[0.01"), ("min_tokens", -1, ">= 0"),
                                               ("stop_ids", (99,), "token id"), ("logit_bias", {0: 101.0}, "[-100"),
                                               ("presence_penalty", float("nan"), "finite"), ("logprobs", -1, "[0, 10]")])
def test_the_engine_refuses_rules_outside_their_domain(field, value, words) -> None:
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(")):
        check_shaping(Request([1], **{field: value}), 10)


# --------------------------------------------------------------------------- on the trained run


@pytest.fixture(scope="module")
def run(finished):
    from dipaco.inference import InferenceRun

    return InferenceRun.open(finished[0])


def _events(engine, requests) -> list:
    ids = [engine.submit(r) for r in requests]
    got: dict = {i: [] for i in ids}
    while engine.has_work():
        for ev in engine.step():
            got[ev.request_id].append(ev)
    return [got[i] for i in ids]


def test_prompt_logprobs_equal_dipaco_infer_scores_and_a_token_its_forward(run) -> None:
    from dipaco.inference.engine import RoutedEngine

    engine = RoutedEngine(run, max_batch_size=4)
    prompts = [run.encode(t) for t in TEXTS]
    *scored, generated = _events(engine, [Request(p, max_new_tokens=0, prompt_logprobs=3) for p in prompts] +
                                 [Request(prompts[0], max_new_tokens=3, logprobs=2)])
    for ids, evs in zip(prompts, scored):
        (ev,) = evs
        assert ev.finished and ev.token is None and ev.finish_reason == "length"
        lp = ev.prompt_logprobs
        assert len(lp) == len(ids) and lp[0] is None and all(len(x[1]) == 3 for x in lp[1:])
        rep = run.score([ids])  # the prefix is routing input, not scored, in dipaco-infer score
        assert list(rep["per_path"]) == [str(ev.path)]
        assert -sum(x[0] for x in lp[run.prefix_tokens:]) == pytest.approx(rep["loss"] * rep["num_tokens"], rel=1e-5)
        for x in lp[1:]:
            assert [v for _, v in x[1]] == sorted((v for _, v in x[1]), reverse=True) and x[0] <= x[1][0][1]
    # a generated token's log-probability: a direct forward of the path over prompt + tokens
    model = run.loader().get(generated[0].path)
    seq = prompts[0] + [e.token for e in generated]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([seq[:-1]])).float()[0], -1)
    for k, ev in enumerate(generated):
        assert ev.logprob[0] == pytest.approx(float(logp[len(prompts[0]) - 1 + k, ev.token]), abs=1e-4)
        assert ev.logprob[1][0][0] == int(logp[len(prompts[0]) - 1 + k].argmax())  # greedy: the likeliest


def test_a_rows_rules_and_numbers_do_not_depend_on_its_batch(run) -> None:
    from dipaco.inference.engine import RoutedEngine

    p = run.encode(TEXTS[1])
    shaped = dict(max_new_tokens=8, temperature=0.8, seed=3, repetition_penalty=1.5, logit_bias={5: 3.0},
                  min_p=0.05, logprobs=2, prompt_logprobs=1)
    (alone,) = _events(RoutedEngine(run, max_batch_size=8), [Request(p, **shaped)])
    crowd = [Request(run.encode(t), max_new_tokens=8, temperature=0.9, seed=i) for i, t in enumerate(TEXTS * 2)]
    with_crowd = _events(RoutedEngine(run, max_batch_size=8), crowd[:2] + [Request(p, **shaped)] + crowd[2:])[2]
    key = [(e.token, e.logprob) for e in alone]
    assert key == [(e.token, e.logprob) for e in with_crowd]
    assert alone[0].prompt_logprobs == with_crowd[0].prompt_logprobs
    stop = alone[2].token  # a stop token id ends the row there, its token kept
    (stopped,) = _events(RoutedEngine(run), [Request(p, **{**shaped, "stop_ids": (stop,)})])
    first = next(k for k, e in enumerate(alone) if e.token == stop)
    assert [e.token for e in stopped] == [e.token for e in alone[:first + 1]]
    assert stopped[-1].finish_reason == "stop"
