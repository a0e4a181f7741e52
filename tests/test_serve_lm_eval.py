"""lm-evaluation-harness's ``local-completions`` model against ``dipaco-serve`` gives the scores
``dipaco-infer eval`` gives: a local multiple-choice task (lm-eval
sends each context + choice as token ids with ``echo``, ``logprobs=1``, ``max_tokens=1``)
and a ``generate_until`` task with more than 4 stop strings and no ``max_gen_toks``
(lm-eval's default 256 tokens: past the smoke model's 128-token context, which the server
allows with ``--slide-past-context``, as ``dipaco-infer eval`` slides). Every context is at
least the routing prefix, so the server (which routes the context + choice it is sent)
and the adapter (which routes the context alone) choose the same path. Offline: local task
files, the tokenizer from ``dipaco-infer export --format hf``; the server and its engines
in processes of their own.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("tenacity", reason="lm-eval's API models need its [api] extra (the eval extra installs it)")

from test_lm_eval import MC_YAML, gen_yaml, local_task  # noqa: E402
from test_serve_cli import _serve  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

CODE = ["def add(first_number, second_number):\n    total = first_number + second_number\n",
        "import os\nimport sys\n\nprint(os.getcwd(), sys.argv, os.environ.get('HOME'))\n",
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
        "for index in range(10):\n    if index % 2:\n        continue\n    print(index)\n"]
UNTIL = ["\n\n", "#", "class ", "import ", "print(", "    return"]  # more than OpenAI's 4


def _tasks(folder: Path) -> Path:
    folder.mkdir()
    mc = [{"question": c[:48], "choices": [c[48:70], CODE[(i + 1) % 4][48:70], " pass"], "label": 0}
          for i, c in enumerate(CODE)]
    local_task(folder, "s_mc", mc, MC_YAML + "  - metric: acc_norm\n")
    local_task(folder, "s_gen", [{"prompt": c[:50], "answer": c[50:60]} for c in CODE], gen_yaml(json.dumps(UNTIL)))
    return folder


def test_local_completions_against_the_server_scores_as_dipaco_infer_eval(finished, tmp_path, capsys) -> None:
    import lm_eval.models.openai_completions  # noqa: F401 - registers local-completions (as lm_eval's CLI does)
    from lm_eval.api.instance import Instance
    from lm_eval.tasks import TaskManager

    from dipaco.cli.infer import main as infer
    from dipaco.inference import InferenceRun
    from dipaco.inference.lm_eval_adapter import DipacoLM, offline

    run_dir = finished[0]
    run = InferenceRun.open(run_dir)
    assert all(len(run.encode(c[:48])) >= run.prefix_tokens for c in CODE)  # the precondition holds
    tasks = _tasks(tmp_path / "tasks")
    infer(["export", str(run_dir), "--path", "0", "--format", "hf", "--out", str(tmp_path / "hf")])
    infer(["eval", str(run_dir), "--tasks", "s_mc,s_gen", "--include-path", str(tasks), "--out",
           str(tmp_path / "eval.json")])
    want = json.loads((tmp_path / "eval.json").read_text())["routed"]["results"]
    capsys.readouterr()

    for url in _serve(run_dir, tmp_path, "--slide-past-context", "--max-tokens-cap", "512"):
        model_args = (f"base_url={url}/v1/completions,model={Path(run_dir).resolve().name},"
                      f"tokenizer_backend=huggingface,tokenizer={tmp_path / 'hf'},num_concurrent=1,max_retries=1")
        with offline():
            out = lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=["s_mc", "s_gen"],
                                          task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
                                          log_samples=True, bootstrap_iters=0)
        # lm-eval's default backend (auto) finds the server's own tokenizer endpoints
        from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

        assert check_remote_tokenizer_support(url + "/v1/completions")
        remote = RemoteTokenizer(url + "/v1/completions")
        assert remote.encode(CODE[0]) == run.encode(CODE[0]) and remote.eos_token_id == run.tokenizer.eos_id
    got = out["results"]
    for task, metric in [("s_mc", "acc,none"), ("s_mc", "acc_norm,none"), ("s_gen", "exact_match,none")]:
        assert got[task][metric] == want[task][metric], (task, metric, got[task], want[task])
    # each choice's log-likelihood is the adapter's (not only the accuracy they sum to)
    adapter = DipacoLM(run=run)
    for sample in out["samples"]["s_mc"]:
        pairs = [tuple(a) for a in sample["arguments"]]  # (context, choice) of each request
        assert len(pairs) == 3 and pairs[0][0] == sample["doc"]["question"]
        mine = adapter.loglikelihood([Instance("loglikelihood", {}, p, 0) for p in pairs])
        for (ll, _), (theirs, _) in zip(mine, [r[0] for r in sample["resps"]]):
            assert float(theirs) == pytest.approx(ll, abs=1e-4)
    gens = [s["resps"][0][0] for s in out["samples"]["s_gen"]]
    assert any(gens) and all(not any(u in g for u in UNTIL) for g in gens)
