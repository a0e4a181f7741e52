"""The routed model as an lm-evaluation-harness model (dipaco/inference/lm_eval_adapter.py,
dipaco/inference/loglik.py) and ``dipaco-infer eval``.

Every test reads the session's ``finished`` smoke run (tests/_hostile.py; it has a dense
baseline) and never writes into it. Tasks are YAML files written here, reading local
jsonl files: nothing is downloaded.
"""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from dipaco.inference import InferenceRun
from dipaco.inference.loglik import RoutedModels, TokenRequest, score_requests, truncate_left

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from dipaco.inference.lm_eval_adapter import DipacoLM, LmEvalError  # noqa: E402

CODE = ["def add(a, b):\n    return a + b\n", "import os\nimport sys\n\nprint(os.getcwd())\n",
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
        "for i in range(10):\n    if i % 2:\n        continue\n"]


@pytest.fixture(scope="module")
def run(finished) -> InferenceRun:
    return InferenceRun.open(finished[0], device="cpu")


def _path_model(run: InferenceRun, path: int):
    """The path assembled the trainer's way (every module loaded; independent of PathLoader)."""
    from dipaco.job.evaluation import load_grid_from_checkpoint
    from modules import PathModel

    return PathModel(load_grid_from_checkpoint(run.cfg, run.checkpoint), path).eval()


def _direct_logprob(model, tokens: list[int], num_scored: int) -> float:
    """log p(last num_scored tokens | the rest), one unbatched forward of at most max_seq_len inputs."""
    tokens = tokens[-(model.cfg.max_seq_len + 1):]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([tokens[:-1]])).double()[0], -1)
    n = len(tokens) - 1
    return float(sum(logp[j, tokens[j + 1]] for j in range(n - num_scored, n)))


def _ll(context: str, continuation: str) -> Instance:
    return Instance("loglikelihood", {}, (context, continuation), 0)


def test_loglikelihood_equals_a_direct_forward_of_the_context_path(run):
    """The adapter's log-likelihood of a continuation is the path model's own, the path being
    the one the router gives the context; is_greedy is the argmax check."""
    lm = DipacoLM(run=run, batch_size=3)
    pairs = [(c[:12], c[12:]) for c in CODE] + [("x = ", "1")]
    got = lm.loglikelihood([_ll(c, k) for c, k in pairs])
    models = {}
    for (ctx, cont), (logprob, greedy) in zip(pairs, got):
        ctx_ids, cont_ids = lm._encode_pair(ctx, cont)
        path = run.route(ctx_ids)
        model = models.setdefault(path, _path_model(run, path))
        assert logprob == pytest.approx(_direct_logprob(model, ctx_ids + cont_ids, len(cont_ids)), abs=1e-4)
        assert logprob < 0 and isinstance(greedy, bool)
    # the greedy flag: a continuation made of the model's own argmax tokens is greedy
    ctx = run.encode(CODE[0])
    model = models.setdefault(run.route(ctx), _path_model(run, run.route(ctx)))
    with torch.no_grad():
        best = int(model(torch.tensor([ctx])).argmax(-1)[0, -1])
    (s,) = score_requests([TokenRequest(ctx, ctx + [best], 1)], RoutedModels(run))
    assert s.greedy
    (s,) = score_requests([TokenRequest(ctx, ctx + [(best + 1) % 512], 1)], RoutedModels(run))
    assert not s.greedy


def test_choices_share_the_context_path_and_each_path_loads_once(run):
    """Multiple choice: every choice of a question is scored by the path of the question's
    context (never by one chosen on the choice); requests are grouped by path, so each path is
    loaded once even with one path in memory, and the results come back in input order."""
    models = RoutedModels(run, max_loaded_paths=1)
    questions = [run.encode(c) for c in CODE * 2]
    choices = [run.encode(x) for x in (" yes", " no", " maybe")]
    reqs = [TokenRequest(q, q + c, len(c)) for q in questions for c in choices]
    loads, forwards = [], Counter()
    get = models.loader.get

    def counted(p: int):
        loads.append(p)
        model = get(p)
        model.register_forward_hook(lambda *_: forwards.update([p]))
        return model

    models.get = counted
    scores = score_requests(reqs, models, batch_size=2)
    by_question = [{s.path for s in scores[i:i + 3]} for i in range(0, len(scores), 3)]
    assert all(len(p) == 1 for p in by_question)
    assert [p.pop() for p in by_question] == [run.route(q) for q in questions]
    assert sorted(loads) == sorted(set(loads)) and models.loader.loads == len(set(loads))
    # one path's requests fill batches together: ceil(n / batch_size) forwards per path
    per_path = Counter(s.path for s in scores)
    assert forwards == Counter({p: -(-n // 2) for p, n in per_path.items()})
    # input order: the same request scored alone gives the same number
    (alone,) = score_requests([reqs[4]], RoutedModels(run))
    assert scores[4].logprob == pytest.approx(alone.logprob, abs=1e-5)


def test_every_choice_is_scored_by_the_path_of_the_question(run):
    """A short question whose choices, routed with the question, would go to different
    paths: the adapter scores every choice with the question's own path."""
    ctx = "x ="
    choices = [" " + c for c in CODE] + [" 'a string'", " [1, 2, 3]"]
    ctx_ids = run.encode(ctx)
    assert len({run.route(ctx_ids + run.encode(c)) for c in choices}) > 1  # the test means something
    lm = DipacoLM(run=run)
    lm.loglikelihood([_ll(ctx, c) for c in choices])
    assert lm.last_paths == [run.route(ctx_ids)] * len(choices)


def test_long_context_is_left_truncated_but_routed_on_its_own_prefix(run):
    """Context + continuation over max_seq_len + 1 tokens: the oldest tokens are dropped (as
    lm-eval's HF model does), the path is still the untruncated context's."""
    L = run.cfg.model.max_seq_len
    ctx = run.encode("\n".join(CODE) * 20)
    assert len(ctx) > 2 * L
    cont = run.encode(" return 0")
    (s,) = score_requests([TokenRequest(ctx, ctx + cont, len(cont))], RoutedModels(run))
    assert s.path == run.route(ctx)
    assert s.logprob == pytest.approx(_direct_logprob(_path_model(run, s.path), ctx + cont, len(cont)), abs=1e-4)
    assert len(truncate_left(TokenRequest(ctx, ctx + cont, len(cont)), L).tokens) == L + 1
    with pytest.raises(ValueError, match="does not fit"):
        truncate_left(TokenRequest(ctx, ctx + ctx, len(ctx)), L)
    lm = DipacoLM(run=run)
    with pytest.raises(LmEvalError, match="max_seq_len"):
        lm.loglikelihood([_ll("x", "\n".join(CODE) * 20)])


@pytest.mark.parametrize("which", ["first", "last"])
def test_rolling_equals_inference_score_where_the_protocols_coincide(run, monkeypatch, which):
    """loglikelihood_rolling sums InferenceRun.score's per-token losses: both score the
    document after lm-eval's end-of-text token in windows of max_seq_len targets, when the
    whole document goes to one path and its routing prefix is scored too (prefix_tokens=1:
    only the end-of-text token is unscored input). Documents of L and 2L tokens, where lm-eval's
    last window (a full context) and score's long protocol (a fresh window) coincide."""
    L = run.cfg.model.max_seq_len
    text = "\n".join(CODE) * 30
    ids = run.encode(text)
    docs = [ids[:L], ids[:2 * L], ids[5:5 + L]]
    texts = [run.tokenizer.decode(d) for d in docs]
    assert [run.encode(t) for t in texts] == docs  # the decoded text encodes back to the same tokens
    path = 0 if which == "first" else run.num_paths - 1
    monkeypatch.setattr(run.router, "route_batch", lambda prefixes: np.full(len(prefixes), path, dtype=np.int64))
    monkeypatch.setattr(run.router, "prefix_tokens", 1)
    lm = DipacoLM(run=run, batch_size=2)
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), 0) for t in texts])
    eos = run.tokenizer.eos_id
    for doc, total in zip(docs, got):
        rep = run.score([[eos, *doc]], seq_len=L, whole_documents=True, batch_size=2)
        assert rep["num_tokens"] == len(doc) and list(rep["per_path"]) == [str(path)]
        assert total == pytest.approx(-rep["loss"] * rep["num_tokens"], rel=1e-5)


def test_a_rolling_document_is_routed_on_its_own_prefix(run):
    """Every window of a long document is scored by the path of the document's first
    prefix_tokens tokens (the router's rule for documents)."""
    texts = [c * 40 for c in CODE[:2]]
    lm = DipacoLM(run=run)
    for t in texts:
        lm.requests_per_path.clear()
        (total,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), 0)])
        assert total < 0
        assert set(lm.requests_per_path) == {run.route(run.encode(t))}
        assert sum(lm.requests_per_path.values()) > 1  # several windows


# --------------------------------------------------------------------------- generation


def test_gen_settings_and_stop_strings():
    from dipaco.inference.lm_generate import cut_at_stop, gen_settings

    s = gen_settings({"until": "\n", "max_gen_toks": 8, "do_sample": False, "temperature": 0.7}, "<eot>")
    assert (s.until, s.max_gen_toks, s.temperature) == (["\n", "<eot>"], 8, 0.0)  # greedy unless do_sample
    assert gen_settings({"do_sample": True, "temperature": 0.5}, "").temperature == 0.5
    with pytest.raises(ValueError, match="num_beams"):
        gen_settings({"num_beams": 4}, "")
    with pytest.raises(ValueError, match="top_p"):
        gen_settings({"do_sample": True, "top_p": 1.5}, "")
    assert gen_settings({"do_sample": True, "top_p": 0.9, "top_k": 5}, "").top_p == 0.9
    assert cut_at_stop("a + b\nreturn<eot>", ["\n", "<eot>"]) == "a + b"
    assert cut_at_stop("abc", ["x"]) == "abc" and cut_at_stop("xy", ["y", "x"]) == ""


def test_generate_until_is_routed_greedy_generation_cut_at_until(run):
    """generate_until continues each context with the path of its prefix, greedily, and cuts
    the text before the first stop string; the dense model generates with the baseline."""
    lm = DipacoLM(run=run, batch_size=2)
    kwargs = {"until": ["\n"], "max_gen_toks": 8}
    texts = lm.generate_until([Instance("generate_until", {}, (c, kwargs), 0) for c in CODE[:3]])  # batched by path
    for ctx, text in zip(CODE, texts):
        gen = run.generate(run.encode(ctx), max_new_tokens=8, temperature=0.0)  # one prompt alone
        assert text == run.tokenizer.decode(gen.tokens).split("\n")[0]
    assert lm.requests_per_path == Counter(run.route(run.encode(c)) for c in CODE[:3])
    ctx = CODE[2]
    dense = DipacoLM(run=run, dense=True)
    (dtext,) = dense.generate_until([Instance("generate_until", {}, (ctx, {"until": [], "max_gen_toks": 6}), 0)])
    assert isinstance(dtext, str) and set(dense.requests_per_path) == {0}


# --------------------------------------------------------------------------- dipaco-infer eval


COMMON = "test_split: test\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {f}\n"
MC_YAML = ("output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
           "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n")


def gen_yaml(until: str, extra: str = "") -> str:
    """A ``generate_until`` task's spec: ``until`` as YAML, ``extra`` more generation_kwargs lines."""
    return ("output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
            f"generation_kwargs:\n  until: {until}\n{extra}  do_sample: false\n"
            "metric_list:\n  - metric: exact_match\n")


def local_task(folder: Path, task: str, rows: list[dict], spec: str) -> None:
    """One local lm-eval task: ``rows`` as ``folder/<task>.jsonl`` and its YAML (``spec``: what
    follows the data source: the output type, the fields, the metrics)."""
    data = folder / f"{task}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{task}.yaml").write_text(f"task: {task}\n" + COMMON.format(f=data) + spec)


def _tasks(folder: Path, hub: bool = False) -> Path:
    """Three local tasks (multiple choice, rolling perplexity, generation) over jsonl files."""
    folder.mkdir(exist_ok=True)
    mc = [{"question": c[:14], "choices": [c[14:40], CODE[(i + 1) % 4][14:40], " pass"], "label": 0}
          for i, c in enumerate(CODE)]
    local_task(folder, "t_mc", mc, MC_YAML)
    local_task(folder, "t_ppl", [{"text": c} for c in CODE], (
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"))
    local_task(folder, "t_gen", [{"prompt": c[:20], "answer": c[20:30]} for c in CODE],
               gen_yaml("['\\n']", "  max_gen_toks: 8\n"))
    (folder / "hub.yaml").write_text("task: t_hub\ndataset_path: someone/some_dataset\noutput_type: "
                                     "loglikelihood_rolling\ntest_split: test\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n")
    (folder / "gone.yaml").write_text("task: t_gone\n" + COMMON.format(f=folder / "missing.jsonl") + (
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"))
    return folder


def _eval(capsys, *argv) -> tuple[int, str, str]:
    from dipaco.cli.infer import main

    try:
        main(["eval", *map(str, argv)])
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow
def test_eval_end_to_end_routed_and_dense(finished, run, tmp_path, capsys):
    """One command: three local tasks (loglikelihood, rolling, generation) scored routed and
    dense; a table and a JSON report with routed/dense per metric, whose numbers are the
    adapter's (bits per byte from its rolling log-likelihoods)."""
    tasks = _tasks(tmp_path / "tasks")
    out = tmp_path / "eval.json"
    code, stdout, err = _eval(capsys, finished[0], "--tasks", "t_mc,t_ppl,t_gen", "--include-path", tasks,
                              "--limit", "3", "--dense", "--out", out, "--device", "cpu")
    assert code == 0, err[-3000:]
    assert stdout.splitlines()[0].split() == ["task", "metric", "routed", "dense", "routed/dense"]
    report = json.loads(out.read_text())
    rows = {(r["task"], r["metric"]): r for r in report["comparison"]}
    assert {("t_mc", "acc"), ("t_ppl", "word_perplexity"), ("t_ppl", "bits_per_byte"), ("t_gen", "exact_match")} <= set(rows)
    for r in rows.values():
        assert r["dense"] is not None and (r["ratio"] is None or r["ratio"] == pytest.approx(r["routed"] / r["dense"]))
    assert 0 < rows[("t_ppl", "bits_per_byte")]["routed"] < 20 and rows[("t_mc", "acc")]["routed"] in (0, 1 / 3, 2 / 3, 1)
    assert set(report["dense"]["requests_per_path"]) == {"0"}
    for key in ("routed", "dense"):
        lls = DipacoLM(run=run, dense=key == "dense").loglikelihood_rolling(
            [Instance("loglikelihood_rolling", {}, (c,), 0) for c in CODE[:3]])
        bpb = -sum(lls) / sum(len(c.encode()) for c in CODE[:3]) / np.log(2)
        assert report[key]["results"]["t_ppl"]["bits_per_byte,none"] == pytest.approx(bpb, rel=1e-6)
    assert report["routed"]["requests_per_path"] and report["run_dir"] == str(finished[0])
    # an earlier report may be replaced; nothing else is ever overwritten
    (tmp_path / "other.json").write_text("{}")
    code, _, err = _eval(capsys, finished[0], "--tasks", "t_mc", "--include-path", tasks, "--out", tmp_path / "other.json")
    assert code == 2 and "never overwritten" in err


def _one_line(code: int, err: str, *needles: str) -> None:
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("dipaco: error:"), err[-2000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_eval_refuses_tasks_that_are_not_local_in_one_line(finished, tmp_path, capsys):
    tasks = _tasks(tmp_path / "tasks")
    run_dir = finished[0]
    _one_line(*_eval(capsys, run_dir, "--tasks", "t_hub", "--include-path", tasks)[::2], "t_hub", "hub", "offline")
    _one_line(*_eval(capsys, run_dir, "--tasks", "t_gone", "--include-path", tasks)[::2], "t_gone", "missing.jsonl")
    _one_line(*_eval(capsys, run_dir, "--tasks", "hellaswag", "--include-path", tasks)[::2], "hellaswag", "local")
    _one_line(*_eval(capsys, run_dir, "--tasks", "t_mc")[::2], "--include-path")
    _one_line(*_eval(capsys, run_dir, "--tasks", "t_mc", "--include-path", tmp_path / "nope")[::2], "not a directory")


def test_a_missing_lm_eval_is_one_line_naming_the_extra(finished, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` now fails, as when not installed
    monkeypatch.delitem(sys.modules, "dipaco.inference.lm_eval_adapter")
    _one_line(*_eval(capsys, finished[0], "--tasks", "t", "--include-path", tmp_path)[::2], 'pip install -e ".[eval]"')


def test_the_example_tasks_are_local_and_the_model_is_registered(monkeypatch):
    """examples/lm_eval_tasks/ (the README's command) passes the offline check from the
    repository root; lm-eval finds the model by the name 'dipaco'."""
    from lm_eval.api.registry import get_model

    from dipaco.inference.lm_eval_adapter import resolve_tasks

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    _, names = resolve_tasks(["python_mc", "python_ppl", "python_gen"], "examples/lm_eval_tasks")
    assert names == ["python_mc", "python_ppl", "python_gen"]
    assert get_model("dipaco") is DipacoLM
