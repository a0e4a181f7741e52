"""A refusal's fix works, for the console scripts' own lines too: every
``dipaco.cli.errors.fail(...)`` of dipaco/cli/ and dipaco/serve/ that proposes a fix on
the command line (``use --flag V``, ``add --flag V``, ``drop --flag``, ``choose another
--flag``) is met here, its fix is read from the message, applied to the refused command
once, and the command then runs. A source scan makes sure no such line is left out of the
table. (validate.py's refusals have the same test in tests/test_refusal_fixes.py.) Lines
whose fix is not an argument (install an extra, submit from a SLURM login node) are not
proposals this test can apply."""
from __future__ import annotations

import ast
import json
import re
import socket
from pathlib import Path

import pytest

from _hostile import run_cli
from dipaco.cli import infer as infer_cli
from dipaco.cli import plan as plan_cli
from dipaco.cli import serve as serve_cli

REPO = Path(__file__).resolve().parents[1]
# a fix proposed on the command line: the verb, the flag, and for use/add its value
FIX = re.compile(r"\b(use|add|drop|choose another) (--[\w-]+)(?: ([^\s,)]+))?")
TAKES_VALUE = {"--out", "--top-k", "--seq-len", "--format", "--port", "--file"}


def apply_fix(argv: list[str], message: str, placeholders: dict[str, str]) -> list[str]:
    """``argv`` with the first fix ``message`` proposes applied."""
    m = FIX.search(message)
    assert m, f"no fix proposed in {message!r}"
    verb, flag, value = m.groups()
    value = placeholders.get(value, value)
    argv = list(argv)
    if verb == "add":
        return argv + [flag] + ([] if value is None else [value])  # a switch takes no value
    i = argv.index(flag)
    if verb == "drop":
        return argv[:i] + argv[i + 1 + (flag in TAKES_VALUE):]
    argv[i + 1] = placeholders[flag] if verb == "choose another" else value
    return argv


def _fix_proposing_fails() -> set[tuple[str, str]]:
    """(file, function) of every fail(...) whose literal text proposes a command-line fix."""
    found = set()
    for folder in ("cli", "serve"):
        for path in sorted((REPO / "dipaco" / folder).glob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for fn in ast.walk(tree):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for call in ast.walk(fn):
                    if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "fail" and call.args:
                        text = "".join(n.value for n in ast.walk(call.args[0])
                                       if isinstance(n, ast.Constant) and isinstance(n.value, str))
                        if FIX.search(text):
                            found.add((path.name, fn.name))
    return found


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, str]:
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(3)))
    return {"DOCS": str(docs), "F": str(tmp_path / "generated.jsonl"), "OUT": str(tmp_path / "out")}


# (the fail's file and function, the refused command with placeholders, the text of its line)
ROWS = [
    (("infer.py", "cmd_route"), ["route", "RUN", "--text", "def f(x):", "--top-k", "9"], "use --top-k 4"),
    (("infer.py", "cmd_score"), ["score", "RUN", "--file", "DOCS", "--seq-len", "999"], "use --seq-len 128"),
    (("infer.py", "cmd_export"), ["export", "RUN", "--all", "--out", "OUT"], "add --format hf"),
    (("infer_args.py", "mode_flags"), ["generate", "RUN", "--prompt", "def ", "--max-new-tokens", "2", "--out", "F"],
     "drop --out"),
    (("infer_generate.py", "_out_file"), ["generate", "RUN", "--file", "DOCS", "--max-new-tokens", "2", "--resume"],
     "add --out F"),
    (("infer_args.py", "out_file"), ["score", "RUN", "--file", "DOCS", "--force"], "drop --force"),
]


def test_every_fail_line_that_proposes_a_fix_is_in_the_table() -> None:
    # _bind and plan.py's options: their own tests below (another console script)
    covered = {row[0] for row in ROWS} | {("serve.py", "_bind"), ("plan.py", "_options"), ("plan.py", "_check_outputs")}
    assert _fix_proposing_fails() <= covered, _fix_proposing_fails() - covered
    assert apply_fix(["a", "--out", "x", "--resume"], "drop --out", {}) == ["a", "--resume"]


@pytest.mark.parametrize(("source", "argv", "said"), ROWS, ids=[r[0][1] + ":" + r[2] for r in ROWS])
def test_a_cli_refusals_fix_applied_once_works(finished, inputs, capsys, monkeypatch, source, argv, said) -> None:
    places = {**inputs, "RUN": str(finished[0])}
    argv = [places.get(a, a) for a in argv]
    code, err = run_cli(infer_cli.main, argv, capsys, monkeypatch)
    assert code == 2 and said in err and len(err.strip().splitlines()) == 1, err
    fixed = apply_fix(argv, err, places)
    code, err = run_cli(infer_cli.main, fixed, capsys, monkeypatch)
    assert code == 0, (fixed, err[-2000:])


def test_a_busy_port_proposes_another_and_another_binds(capsys) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        with pytest.raises(SystemExit) as e:
            serve_cli._bind("127.0.0.1", port)
        assert e.value.code == 2 and "choose another --port" in capsys.readouterr().err
        free = socket.socket()
        free.bind(("127.0.0.1", 0))
        other = free.getsockname()[1]
        free.close()
        argv = apply_fix(["--host", "127.0.0.1", "--port", str(port)], "choose another --port", {"--port": str(other)})
        sock = serve_cli._bind(argv[1], int(argv[3]))
        sock.close()
    finally:
        busy.close()


def test_dipaco_plans_json_without_simulate_proposes_simulate_and_it_runs(tmp_path, capsys, monkeypatch) -> None:
    out = tmp_path / "sim.json"
    argv = ["experiment=smoke", "cluster.chips=4", "cluster.step_s=0.5", "--json", str(out)]
    code, err = run_cli(plan_cli.main, argv, capsys, monkeypatch)
    assert code == 2 and "add --simulate" in err and len(err.strip().splitlines()) == 1, err
    code, err = run_cli(plan_cli.main, apply_fix(argv, err, {}), capsys, monkeypatch)
    assert code == 0 and out.is_file(), err[-2000:]
