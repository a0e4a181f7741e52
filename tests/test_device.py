"""Device, backend and bad-combination decisions (dipaco/runtime/device.py), with fake GPU counts.

Nothing here needs a GPU: the decision functions take the device count as an argument,
so the one-GPU/many-ranks cases that crashed on a real H100 are checked on any machine.
"""
from __future__ import annotations

import os

import pytest
import torch

from dipaco.config import ConfigError, LauncherConfig, TrainerConfig, compose_config
from dipaco.runtime.device import (choose_backend, choose_device, config_problems, peak_memory_bytes, rank_device,
                           maybe_compile, set_deterministic, to_device)
from dipaco.job.preflight import preflight  # validate_config, then the checks that ask torch and the machine


@pytest.mark.parametrize("gpus,local_ranks,expected", [
    (1, [0, 1, 2, 3], ["cuda:0"] * 4),  # more ranks than GPUs: all share GPU 0, no bad ordinal
    (2, [0, 1, 2, 3], ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]),
    (8, [0, 7], ["cuda:0", "cuda:7"]),
    (0, [0, 1], ["cpu", "cpu"]),
])
def test_auto_device_takes_local_rank_mod_gpu_count(gpus: int, local_ranks: list[int], expected: list[str]) -> None:
    assert [str(choose_device("auto", r, gpus)) for r in local_ranks] == expected


def test_cpu_is_cpu_and_cuda_without_gpu_is_refused() -> None:
    assert choose_device("cpu", 3, 8) == torch.device("cpu")
    with pytest.raises(ValueError, match="trainer.device=cuda"):
        choose_device("cuda", 0, 0)
    with pytest.raises(ValueError, match="must be one of"):
        choose_device("tpu", 0, 1)


@pytest.mark.parametrize("gpus,local_world,expected", [
    (1, 1, "nccl"),
    (1, 2, "gloo"),  # two ranks on one GPU: nccl would refuse, gloo stages through the CPU
    (2, 4, "gloo"),
    (4, 4, "nccl"),
    (8, 4, "nccl"),
])
def test_nccl_only_when_every_rank_of_the_host_owns_a_gpu(gpus: int, local_world: int, expected: str) -> None:
    placement = rank_device("auto", "auto", local_rank=0, local_world=local_world, device_count=gpus)
    assert placement.backend == expected
    assert placement.device == torch.device("cuda", 0)


def test_backend_on_cpu_and_explicit_choices() -> None:
    cpu = torch.device("cpu")
    assert choose_backend("auto", cpu, 4, 0) == "gloo"
    assert choose_backend("gloo", torch.device("cuda", 0), 1, 1) == "gloo"
    with pytest.raises(ValueError, match="one GPU per rank"):
        choose_backend("nccl", torch.device("cuda", 0), 2, 1)
    with pytest.raises(ValueError, match="one GPU per rank"):
        choose_backend("nccl", cpu, 1, 0)


def test_rank_device_reads_the_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    p = rank_device("auto", "auto", device_count=2)
    assert (str(p.device), p.backend, p.local_rank, p.local_world) == ("cuda:1", "gloo", 3, 4)
    assert "gloo" in p.describe()


def _problems(gpus: int, **kw) -> list[str]:
    trainer_keys = {f for f in TrainerConfig.__dataclass_fields__}
    t = TrainerConfig(**{k: v for k, v in kw.items() if k in trainer_keys})
    la = LauncherConfig(**{k: v for k, v in kw.items() if k not in trainer_keys})
    return [key for key, _, _ in config_problems(t, la, device_count=gpus)]


def test_bad_combinations_name_their_key() -> None:
    assert _problems(0) == []
    assert _problems(0, precision="fp16") == ["trainer.precision"]  # fp16 on the CPU
    assert _problems(1, precision="fp16") == []  # fp16 on CUDA: fine (with a loss scaler)
    assert _problems(0, precision="bf16") == []
    assert _problems(0, precision="fp8") == ["trainer.precision"]
    assert _problems(0, device="cuda") == ["trainer.device"]
    assert _problems(1, device="cuda") == []
    assert _problems(0, backend="nccl") == ["launcher.backend"]
    assert _problems(0, compile=True, compile_backend="no-such-backend") == ["trainer.compile_backend"]
    assert _problems(0, compile=True, compile_backend="eager") == []
    # compile defaults to on for CUDA: a bad backend is refused there without compile=true
    assert _problems(1, compile_backend="no-such-backend") == ["trainer.compile_backend"]
    assert _problems(0, batch_size=8, group_size=2, micro_batches=3) == ["trainer.micro_batches"]
    assert _problems(0, batch_size=8, group_size=2, micro_batches=2) == []
    # launcher=slurm is validated on the submitting host: the nodes' GPUs count, not its own
    assert _problems(0, name="slurm", gpus_per_node=8, device="cuda", precision="fp16") == []
    assert _problems(4, name="slurm", gpus_per_node=0, device="cuda") == ["trainer.device"]


def test_preflight_refuses_in_one_line() -> None:
    cfg = compose_config(["model=tiny", "trainer=tiny", "trainer.precision=fp16", "trainer.device=cpu"])
    with pytest.raises(ConfigError, match=r"^config error: trainer.precision: .*Fix: use trainer.precision=bf16"):
        preflight(cfg)


def test_unknown_outer_device_is_refused_in_one_line() -> None:
    cfg = compose_config(["model=tiny", "trainer=tiny", "diloco.outer_device=gpu"])
    with pytest.raises(ConfigError, match=r"^config error: diloco.outer_device: unknown value 'gpu'. Fix: use one of auto, cpu"):
        preflight(cfg)


def test_set_deterministic_switches_torch_and_cublas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        set_deterministic(True)
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert not torch.utils.deterministic.fill_uninitialized_memory  # no NaN fill of new buffers
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"  # read by cuBLAS at its start
        set_deterministic(False)
        assert not torch.are_deterministic_algorithms_enabled()
        assert torch.utils.deterministic.fill_uninitialized_memory  # torch's default again
    finally:
        torch.use_deterministic_algorithms(before)


def test_compiling_hands_the_kernels_determinism_to_the_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """set_deterministic skips torch's public call (it would import Inductor: 3-7 s a
    process; tests/test_import_cost.py checks that it does not); maybe_compile makes it
    before compiling, with the kernels' current setting, so Inductor gets the same flag."""
    calls: list[tuple[bool, bool]] = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda mode, warn_only=False: calls.append((mode, warn_only)))
    monkeypatch.setattr(torch, "compile", lambda model, backend=None: ("compiled", model))
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    model = torch.nn.Linear(2, 2)
    assert maybe_compile(model, False) is model and calls == []  # nothing compiles: no call
    assert maybe_compile(model, True) == ("compiled", model) and calls == [(True, False)]


def test_rank_device_describes_a_gpu_this_host_lacks() -> None:
    """A placement for a fake GPU count (plans, tests) must not ask CUDA about a missing GPU."""
    p = rank_device("auto", "auto", local_rank=5, local_world=8, device_count=8)
    assert str(p.device) == "cuda:5" and "cuda:5 (cuda; 8 GPU(s)" in p.describe()


def test_to_device_and_peak_memory_on_cpu() -> None:
    x = torch.arange(6)
    assert to_device(x, torch.device("cpu")) is x
    assert peak_memory_bytes(torch.device("cpu")) > 10 * 2**20  # peak RSS of this process


@pytest.mark.gpu
def test_batches_go_to_the_gpu_pinned_and_asynchronously() -> None:
    dev = choose_device("auto")
    assert dev.type == "cuda"
    y = to_device(torch.arange(6), dev)
    assert y.device == dev and torch.equal(y.cpu(), torch.arange(6))


def test_memory_plan_per_rank() -> None:
    """dipaco-plan's memory model: 16 B per held parameter plus AdamW per path, and
    activations that shrink with bf16, checkpointing and micro-batches."""
    from dipaco.cli.plan import format_memory, memory_for

    def plan(*overrides: str):
        cfg = compose_config(["model=paper", *overrides])
        preflight(cfg)
        return cfg, memory_for(cfg)

    cfg, rows = plan("launcher=spawn", "launcher.nproc=4")
    assert [label for label, _ in rows] == ["4 worker groups"]  # one path each: all alike
    mem = rows[0][1]
    path = 174_692_224  # parameters of one paper path on 2 levels (12 blocks, d=896, 32k vocabulary)
    assert (mem.parameters, mem.gradients, mem.optimizer, mem.outer) == (4 * path, 4 * path, 8 * path, 20 * path)
    assert "4 worker groups" in format_memory(cfg, rows)
    local = plan()[1]
    assert [label for label, _ in local] == ["the process"]  # holds every module, 4 AdamW states
    assert local[0][1].optimizer == 4 * mem.optimizer and local[0][1].parameters > mem.parameters
    # the outer state is per held module (5 fp32 copies: the cosine report's running sum
    # included), not per path that shares it
    assert local[0][1].outer == 5 * local[0][1].parameters
    acts = {o: plan("launcher=spawn", "launcher.nproc=4", o)[1][0][1].activations
            for o in ("trainer.precision=fp32", "trainer.precision=bf16",
                      "trainer.activation_checkpointing=true", "trainer.micro_batches=4")}
    assert acts["trainer.precision=bf16"] < acts["trainer.precision=fp32"]
    # the 32k-vocabulary logits are not checkpointed: they dominate at seq_len 128
    assert acts["trainer.activation_checkpointing=true"] < acts["trainer.precision=fp32"] / 2
    assert acts["trainer.micro_batches=4"] == pytest.approx(acts["trainer.precision=fp32"] / 4, rel=0.01)


def test_plan_capacity_line() -> None:
    """dipaco-plan's capacity line: the share of a path that routing can specialise."""
    from dipaco.cli.plan import format_capacity

    def line(*overrides: str) -> str:
        cfg = compose_config(["model=tiny", *overrides])
        preflight(cfg)
        return format_capacity(cfg)

    assert " 0 (0%) in modules not every path shares" in line("grid=dense")
    assert "(1.00x a path)" in line("grid=dense")
    two, four = line("model.layers_per_level=1"), line("model.layers_per_level=2")
    share = lambda text: int(text.split("(")[1].split("%")[0])  # noqa: E731
    assert 0 < share(two) < share(four) < 100  # deeper levels: more of a path is routed
    assert "x a path)" in four and "(1.00x" not in four


def test_infer_refuses_cuda_without_a_gpu(tmp_path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: --device cuda is valid here")
    from dipaco.inference import InferenceRun

    with pytest.raises(ConfigError, match="device: cuda requested .*Fix: use --device auto or cpu"):
        InferenceRun.open(tmp_path, device="cuda")  # before the run directory is even read
