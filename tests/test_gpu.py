"""End-to-end runs on a CUDA device (every test carries the ``gpu`` marker: skipped without CUDA).

The decisions behind them (device per rank, backend, bad combinations) are unit-tested
without a GPU in ``tests/test_device.py``; the learner's precision and speed options in
``tests/test_precision.py``. Here: the trainer really places everything on the GPU,
spawned ranks share one GPU without an invalid ordinal, and both give the local
backend's weights.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dipaco.config import compose_config
from dipaco.job.train import train
from test_train import SMOKE, assert_same_weights, module_weights

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def gpu_local_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    run_dir = tmp_path_factory.mktemp("gpu_local")
    # compile off: these check placement and equality, not speed (compile has its own test)
    summary = train(compose_config(SMOKE + ["launcher=local", "launcher.nproc=4", "trainer.compile=false"], run_dir))
    return run_dir, summary


def test_default_device_is_the_gpu_and_summary_says_so(gpu_local_run: tuple[Path, dict]) -> None:
    _, summary = gpu_local_run
    assert summary["device"].startswith("cuda")
    assert summary["peak_memory_bytes"] > 0
    assert 1.0 < summary["routed_ppl"] < 512


@pytest.mark.multiprocess
@pytest.mark.parametrize("nproc", [2, 4])
def test_more_spawned_ranks_than_gpus_run_and_match_local(gpu_local_run: tuple[Path, dict], tmp_path: Path,
                                                          nproc: int) -> None:
    """Ranks take GPU LOCAL_RANK % count; sharing a GPU means gloo, never a bad ordinal."""
    if torch.cuda.device_count() >= nproc:
        pytest.skip("needs fewer GPUs than ranks")
    run_dir, summary = gpu_local_run
    spawned = train(compose_config(SMOKE + ["launcher=spawn", f"launcher.nproc={nproc}", "trainer.compile=false"],
                                   tmp_path))
    assert spawned["device"].startswith("cuda")
    assert_same_weights(module_weights(run_dir, 2), module_weights(tmp_path, 2), atol=1e-4)


def test_bf16_and_compile_run_end_to_end(tmp_path: Path) -> None:
    summary = train(compose_config(SMOKE + ["trainer.precision=bf16", "trainer.compile=true"], tmp_path))
    assert summary["precision"] == "bf16" and summary["device"].startswith("cuda")
    assert 1.0 < summary["routed_ppl"] < 512
