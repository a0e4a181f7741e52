"""What a process imports is what it uses (the start-up half of docs/serving.md's and the
launcher's cost).

Every rank that ``launcher=spawn`` starts imports the rank's entry (and re-imports the
console script, as multiprocessing's spawn does), and every ``dipaco-infer`` call starts a
Python: a library loaded there and never used is paid once per rank and once per prompt.
Measured on 2 AMD EPYC cores: ``datasets`` (with pyarrow and pandas) about 1 s,
``torch.distributed.fsdp`` (with DTensor, torch.fx and sympy) about 1 s, ``torch._dynamo``
3-5 s, ``hydra`` 0.1-0.4 s. The rule: those load only in the commands that use them (data
preparation, ``launcher.group_parallel=fsdp``, ``trainer.compile`` or a torch optimiser,
composing a config).

One fresh interpreter takes the steps below in order (a fresh one per step would cost a
torch import each) and reports the heavy modules loaded after each; a step may add only
what it is allowed, and the last step shows that the probe sees a heavy import at all.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.multiprocess  # a fresh interpreter: not in the fast lane

HEAVY = ("datasets", "pyarrow", "pandas", "torch.distributed.fsdp", "torch.distributed.tensor", "sympy",
         "torch._dynamo", "torch._inductor", "hydra")

# (step, code, what it may add): in this order, in one interpreter
STEPS = [
    # asked by the preflight of every run: answered without importing FSDP2
    ("fsdp presence", "from dipaco.sync.fsdp import fsdp_available; fsdp_available()", ()),
    # a spawned or torchrun rank: the launcher's entry and the synchronous and decoupled loops
    ("rank", "import dipaco.runtime.launch, dipaco.rounds.loop, dipaco.decoupled.worker", ()),
    # every inference verb, the batched engine and the run it opens
    ("dipaco-infer", "import dipaco.cli.infer, dipaco.inference.engine, dipaco.inference.run", ()),
    # what a rank and an inference process do with modules: build on meta, materialise,
    # deterministic kernels, forward and backward (no optimiser: torch.optim loads Dynamo)
    ("a path built and trained",
     "import torch; from modules import ModelConfig, ModuleGrid, PathModel; "
     "from dipaco.runtime.device import set_deterministic; set_deterministic(True); "
     "g = ModuleGrid(ModelConfig(vocab_size=64, d_model=16, n_heads=2, max_seq_len=16), [2, 2], seed=0); "
     "PathModel(g, 0)(torch.zeros(1, 8, dtype=torch.long)).sum().backward()", ()),
    # the console script dipaco-train, which every spawned rank re-imports: Hydra runs its app
    ("dipaco-train script", "import dipaco.cli.train", ("hydra",)),
    # the data preparation does load datasets: the probe can see a heavy import
    ("data preparation", "import dipaco.job.prepare", ("datasets", "pyarrow", "pandas")),
]


@pytest.fixture(scope="module")
def loaded_after_each_step() -> dict[str, list[str]]:
    lines = ["import json, sys", "out = {}"]
    for name, code, _ in STEPS:
        lines += [code, f"out[{name!r}] = sorted(m for m in sys.modules if m in {HEAVY!r})"]
    lines.append("print(json.dumps(out))")
    res = subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True, timeout=300,
                         cwd=REPO)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("step", [name for name, _, _ in STEPS[:-1]])
def test_a_step_loads_no_heavy_library_it_does_not_use(step: str, loaded_after_each_step: dict) -> None:
    allowed: set[str] = set()
    for name, _, may in STEPS:
        allowed |= set(may)
        if name == step:
            break
    extra = sorted(set(loaded_after_each_step[step]) - allowed)
    assert extra == [], f"{step} imports {extra}; import them where they are used"


def test_the_probe_sees_a_heavy_import(loaded_after_each_step: dict) -> None:
    assert "datasets" in loaded_after_each_step["data preparation"]
