"""What a process imports is what it uses (the start-up half of docs/serving.md's and the
launcher's cost).

Every rank that ``launcher=spawn`` starts imports the rank's entry (and re-imports the
console script, as multiprocessing's spawn does), and every ``dipaco-infer`` call starts a
Python: a library loaded there and never used is paid once per rank and once per prompt.
Measured on 2 AMD EPYC cores: ``datasets`` (with pyarrow and pandas) about 1 s,
``torch.distributed.fsdp`` (with DTensor, torch.fx and sympy) about 1 s, ``hydra`` 0.1-0.4 s.
The rule, checked in a fresh interpreter for each entry: those load only in the commands
that use them (data preparation, ``launcher.group_parallel=fsdp``, composing a config).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# heavy libraries and the modules that load them, by who may import them
HEAVY = ("datasets", "pyarrow", "pandas", "torch.distributed.fsdp", "torch.distributed.tensor", "sympy", "hydra")

ENTRIES = {
    # a spawned or torchrun rank: the launcher's entry and the synchronous and decoupled loops
    "rank": "import dipaco.runtime.launch, dipaco.rounds.loop, dipaco.decoupled.worker",
    # the console script dipaco-train: what every spawned rank re-imports
    "dipaco-train script": "import dipaco.cli.train",
    # every inference verb, the batched engine and the server's app
    "dipaco-infer": "import dipaco.cli.infer, dipaco.inference.engine, dipaco.inference.run",
}

# what the console script itself needs: Hydra runs the app (it composes the config)
ALLOWED = {"dipaco-train script": ("hydra",)}


def _loaded(code: str) -> list[str]:
    probe = (f"import sys; {code}; "
             f"print(' '.join(sorted(m for m in sys.modules if m in {HEAVY!r})))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_an_entry_loads_no_heavy_library_it_does_not_use(entry: str) -> None:
    loaded = [m for m in _loaded(ENTRIES[entry]) if m not in ALLOWED.get(entry, ())]
    assert loaded == [], f"{entry} imports {loaded}; import them where they are used"


def test_building_and_training_a_path_loads_no_compiler() -> None:
    """A process builds its modules on "meta", materialises them and sets deterministic
    kernels: none of it may import torch._dynamo (3-5 s a process) or sympy (1 s), which
    inference never uses (modules/grid.py, dipaco/runtime/device.py). A rank still loads
    Dynamo with its first torch optimiser (torch.optim's own ``_disable_dynamo``)."""
    code = ("import sys, torch; from modules import ModelConfig, ModuleGrid, PathModel; "
            "from dipaco.runtime.device import set_deterministic; set_deterministic(True); "
            "g = ModuleGrid(ModelConfig(vocab_size=64, d_model=16, n_heads=2, max_seq_len=16), [2, 2], seed=0); "
            "m = PathModel(g, 0); m(torch.zeros(1, 8, dtype=torch.long)).sum().backward(); "
            "print(*[m for m in ('torch._dynamo', 'torch._inductor', 'sympy') if m in sys.modules] or ['none'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["none"], f"building or training a path imported {out.stdout.split()}"


def test_the_probe_sees_a_heavy_import() -> None:
    """The check can fail: the data preparation does load ``datasets``."""
    assert "datasets" in _loaded("import dipaco.job.prepare")


def test_fsdp_presence_is_answered_without_importing_it() -> None:
    code = "from dipaco.sync.fsdp import fsdp_available; assert fsdp_available() in (True, False)"
    assert "torch.distributed.fsdp" not in _loaded(code)
