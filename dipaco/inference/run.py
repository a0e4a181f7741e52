"""Opening a finished run for inference: config, tokenizer, router, verified checkpoint,
and a path-at-a-time model loader. The rules shared by every inference verb are in
:mod:`dipaco.inference` (the package docstring).
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from dipaco.plan.build import build_grid
from dipaco.config import ConfigError, eval_window
from dipaco.runtime.device import cuda_count
from dipaco.run.checkpoint import MANIFEST, CheckpointError, CheckpointManager, round_dir_name
from dipaco.storage.held import HeldFiles
from dipaco.data import Tokenizer
from dipaco.rounds.dense import load_dense_grid
from dipaco.rounds.early_stopping import load_best_path
from dipaco.rounds.evaluate import evaluate_routed, evaluate_single
from dipaco.run.fingerprint import check_config, verify_checkpoint, verify_outputs
from dipaco.inference.generate import Generation, generate_routed
from modules.features import lm_featurizer
from dipaco.run.run_dir import RunDir, RunDirError
from modules import ModuleGrid, PathModel
from router import Router


# --------------------------------------------------------------------------- opening a run


@dataclass
class InferenceRun:
    """A finished run opened for inference (no module weights loaded yet).

    Attributes:
        run: the run directory's named files.
        cfg: the resolved training config (:class:`dipaco.config.Config`).
        tokenizer: the run's tokenizer.
        router: the run's router (LM features wired in when the run used them).
        checkpoint: the verified checkpoint directory weights are read from.
        manifest: that checkpoint's manifest (sha256 + size per file).
        verify: ``"all"`` (every file hashed at open) or ``"read"`` (not at open); either
            way each module file is hashed again as it is read (rule 1: verified where read),
            so a file damaged or replaced while a server runs fails the paths that read it.
        held: the open descriptor of every module file of ``checkpoint`` (rule 2: what this
            process reads is held, so a checkpoint pruned or replaced by a run that goes on
            training is still read whole, as it was when opened).
        best_paths: read each path from its kept best weights when the run kept them
            (``trainer.path_early_stopping``, ``checkpoints/best_paths/``), as the job's
            final evaluation does; other paths come from ``checkpoint``.
    """

    run: RunDir
    cfg: Any
    tokenizer: Any
    router: Any
    checkpoint: Path
    manifest: dict
    verify: str = "all"
    best_paths: bool = False
    held: Optional[HeldFiles] = None

    @classmethod
    def open(cls, run_dir: str | os.PathLike, *, checkpoint: Optional[str] = None,
             verify: str = "all", need_weights: bool = True, device: Optional[str] = None) -> "InferenceRun":
        """Open ``run_dir``; raise :class:`RunDirError` / :class:`CheckpointError` naming the bad file.

        Args:
            checkpoint: ``None`` (newest, with each path's kept best weights when the run
                used ``trainer.path_early_stopping``), a round number, a ``round_NNNNNN``
                name or a path (that checkpoint's weights only).
            verify: ``"all"`` or ``"read"`` (see the module docstring).
            need_weights: ``False`` for routing only: no checkpoint is looked up.
            device: ``auto`` | ``cuda`` | ``cpu`` for the path models (and the LM
                featurizer); default: the run's ``trainer.device``.
        """
        if device == "cuda" and cuda_count() == 0:  # refused before any loading
            raise ConfigError("device", "cuda requested but no CUDA device is visible", "use --device auto or cpu")
        if verify not in ("all", "read"):
            raise ValueError(f"verify must be 'all' or 'read', got {verify!r}")
        run = RunDir.at(run_dir)
        if not run.root.is_dir():
            what = "is not a directory" if run.root.exists() else "does not exist"
            raise RunDirError(f"run directory {run.root} {what} (give the folder of a finished dipaco-train run)")
        cfg = run.load_config()
        # config.yaml builds the model the weights are loaded into and says how the router
        # reads: edited after training (rope_theta, norm_eps, max_seq_len, ...) it would run
        # the weights as another model, silently; the resume's rule refuses it here too
        check_config(run, cfg, artefacts=("checkpoints", "router"),
                     fix=f"put back the config.yaml the run was trained with ({run.config})")
        if device is not None:
            cfg.trainer.device = device
        run.require(run.tokenizer, "tokenizer")
        # every file read is the one the run was made with (docs/design.md contract 9)
        verify_outputs(run, ("tokenizer", "router", "warmup"))
        tokenizer = Tokenizer.load(str(run.tokenizer))
        router = _load_router(run, cfg)
        ckpt, manifest = Path(), {}
        if need_weights:
            ckpt = _find_checkpoint(run, checkpoint)
            verify_checkpoint(run, ckpt)  # a checkpoint of this run at all, before its files are hashed
            manifest = CheckpointManager.verify(ckpt) if verify == "all" else _read_manifest(ckpt)
        best = need_weights and checkpoint is None and bool(cfg.trainer.path_early_stopping) \
            and run.best_paths.is_dir()
        return cls(run=run, cfg=cfg, tokenizer=tokenizer, router=router, checkpoint=ckpt,
                   manifest=manifest, verify=verify, best_paths=best,
                   held=HeldFiles(ckpt, manifest.get("files", {}), "modules/") if need_weights else None)

    # ---------------------------------------------------------------- routing

    @property
    def prefix_tokens(self) -> int:
        """Tokens of a document's start that choose its path."""
        return int(self.router.prefix_tokens)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no eos appended, as in training)."""
        return list(self.tokenizer.encode(text))

    def route(self, token_ids: Sequence[int]) -> int:
        """Path id of one document by its first ``prefix_tokens`` tokens (fewer: what exists)."""
        return int(self.router.route(np.asarray(token_ids, dtype=np.int64)))

    def path_info(self, path_id: int) -> dict[str, Any]:
        """``path_id``, the path tuple (module index per level) and its module ids."""
        grid = self.new_grid()
        return {"path_id": int(path_id), "path": list(grid.path_of(int(path_id))),
                "modules": grid.module_ids_of_path(int(path_id))}

    @property
    def num_paths(self) -> int:
        return int(self.router.num_paths)

    # ---------------------------------------------------------------- weights

    def new_grid(self) -> ModuleGrid:
        """An empty lazy grid shaped like the run's (builds nothing until asked)."""
        return build_grid(self.cfg)

    def module_file(self, module_id: str) -> Path:
        """The checkpoint file holding ``module_id``'s weights (named in the manifest)."""
        rel = f"modules/{module_id}.safetensors"
        if rel not in self.manifest.get("files", {}):
            raise CheckpointError(f"checkpoint {self.checkpoint} has no {rel} in its manifest")
        return self.checkpoint / rel

    def load_module_into(self, grid: ModuleGrid, module_id: str) -> None:
        """Read one module's weights into ``grid`` (builds only that module) from the held
        file, checked against the manifest as it is read (dipaco/storage/held.py)."""
        path = self.module_file(module_id)
        if self.held is None:
            self.held = HeldFiles(self.checkpoint, self.manifest.get("files", {}), "modules/")
        state = self.held.load_state(f"modules/{module_id}.safetensors")
        try:
            grid.load_module_state_dict(module_id, state)
        except ValueError as e:
            raise CheckpointError(f"checkpoint file {path} does not fit the run's model config: {e}") from None

    def close(self) -> None:
        """Let go of the held checkpoint files (a process's exit does it too)."""
        if self.held is not None:
            self.held.close()

    def loader(self, cache_size: int = 1) -> "PathLoader":
        """A path-at-a-time model loader over this run's checkpoint."""
        return PathLoader(self, cache_size=cache_size)

    # ---------------------------------------------------------------- use

    def generate(self, prompt_ids: Sequence[int], **kwargs: Any) -> "Generation":
        """Routed generation; see :func:`generate_routed` for the arguments."""
        return generate_routed(self, prompt_ids, **kwargs)

    def _eval_settings(self, seq_len: Optional[int], batch_size: Optional[int],
                       whole_documents: bool) -> tuple[int, int]:
        """``seq_len`` and ``batch_size`` as the job's evaluation uses them, unless given."""
        t = self.cfg.trainer
        default = eval_window(self.cfg) if whole_documents else t.seq_len
        seq_len = default if seq_len is None else int(seq_len)
        if not 1 <= seq_len < self.cfg.model.max_seq_len + 1:
            raise ValueError(f"seq_len must be in [1, {self.cfg.model.max_seq_len}] (model.max_seq_len), got {seq_len}")
        return seq_len, t.eval_batch_size if batch_size is None else int(batch_size)

    def score(self, docs: Sequence[Sequence[int]], *, reroute_every: Optional[int] = None,
              batch_size: Optional[int] = None, seq_len: Optional[int] = None,
              loader: Optional["PathLoader"] = None, whole_documents: bool = False) -> dict:
        """Routed perplexity of token documents with the job's rule (``evaluate_routed``).

        Defaults (``seq_len``, ``batch_size``) come from the run's trainer config, so scoring
        the run's validation documents reproduces ``summary.json``'s ``routed_ppl``
        (``routed_ppl_long`` with ``whole_documents``: windows of ``seq_len``, default
        :func:`dipaco.config.eval_window`).
        """
        seq_len, batch_size = self._eval_settings(seq_len, batch_size, whole_documents)
        loader = loader or self.loader()
        return evaluate_routed(
            [np.asarray(d, dtype=np.int64) for d in docs], loader.get, seq_len=seq_len,
            prefix_tokens=self.prefix_tokens, route_batch=self.router.route_batch,
            reroute_windows=self.router.reroute_windows, reroute_every=reroute_every,
            batch_size=batch_size, whole_documents=whole_documents)

    def dense_model(self) -> PathModel:
        """The run's same-size dense baseline (``baseline/``) as one model (eval mode)."""
        if not (self.run.baseline / "modules.safetensors").is_file():
            raise RunDirError(f"{self.run.root} has no dense baseline ({self.run.baseline}): the run was made "
                              "with trainer.dense_baseline=false or stopped before it. Fix: drop --dense")
        return PathModel(load_dense_grid(self.cfg, self.run.baseline), 0).eval()

    def score_dense(self, docs: Sequence[Sequence[int]], *, batch_size: Optional[int] = None,
                    seq_len: Optional[int] = None, whole_documents: bool = False) -> dict:
        """Perplexity of the run's same-size dense baseline (``baseline/``) on ``docs``,
        with the rule of :meth:`score`: the routed ÷ dense ratio on any set of documents."""
        seq_len, batch_size = self._eval_settings(seq_len, batch_size, whole_documents)
        model = self.dense_model()
        return evaluate_single([np.asarray(d, dtype=np.int64) for d in docs], model, seq_len=seq_len,
                               prefix_tokens=self.prefix_tokens, batch_size=batch_size,
                               whole_documents=whole_documents)


def _load_router(run: RunDir, cfg: Any) -> Any:
    run.require(run.router / "manifest.json", "router manifest")
    featurizer_fn = None
    if cfg.router.featurizer == "lm":
        # The router was fitted on the warm-up model's hidden states: it needs that model
        # (one path's size) to featurize prefixes.
        run.require(run.warmup / "modules.safetensors", "warm-up model (router.featurizer=lm)")
        featurizer_fn = lm_featurizer(load_dense_grid(cfg, run.warmup))
    try:
        return Router.load(run.router, featurizer_fn=featurizer_fn, expected_grid=list(cfg.grid.levels))
    except (ValueError, OSError) as e:
        raise RunDirError(f"cannot load router {run.router}: {e}") from None


def _find_checkpoint(run: RunDir, which: Optional[str]) -> Path:
    """The checkpoint to read: newest by default. Unlike training's resume, a corrupt newest
    checkpoint is refused, not silently replaced by an older one (pass ``checkpoint=``)."""
    root = run.require(run.checkpoints, "checkpoints folder")
    mgr = CheckpointManager(root)
    if which is None:
        rounds = mgr.list_rounds()
        if not rounds:
            raise RunDirError(f"no checkpoint under {root} (did training finish a round?)")
        return mgr.final_dir(rounds[-1])
    which = str(which)
    if which.isdigit():
        path = mgr.final_dir(int(which))
    elif os.sep in which or which.startswith("."):
        path = Path(which).expanduser().resolve()
    else:
        path = root / which
    if not path.is_dir():
        names = ", ".join(round_dir_name(r) for r in mgr.list_rounds()) or "none"
        raise RunDirError(f"checkpoint {path} does not exist (available: {names})")
    return path


def _read_manifest(ckpt: Path) -> dict:
    mpath = ckpt / MANIFEST
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
        manifest["files"].items()
        return manifest
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {ckpt} has no {MANIFEST}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"unreadable manifest {mpath}: {e}") from None


# --------------------------------------------------------------------------- path at a time


class PathLoader:
    """Hands out :class:`PathModel`\\ s, loading only the modules of the paths asked for.

    Each path gets its own fresh lazy grid holding just its modules; at most
    ``cache_size`` paths stay loaded (least recently used is dropped first — before the
    next one is built, so peak memory stays ``cache_size`` paths). ``loads`` counts paths
    loaded from disk; ``grids`` exposes the live grids (for memory checks).
    """

    def __init__(self, run: InferenceRun, cache_size: int = 1) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.run = run
        self.cache_size = int(cache_size)
        self._models: "OrderedDict[int, PathModel]" = OrderedDict()
        self.loads = 0

    def get(self, path_id: int) -> PathModel:
        """The model of ``path_id`` (eval mode), loaded on first use."""
        path_id = int(path_id)
        if path_id in self._models:
            self._models.move_to_end(path_id)
            return self._models[path_id]
        if not 0 <= path_id < self.run.num_paths:
            raise ValueError(f"path {path_id} is not in [0, {self.run.num_paths})")
        while len(self._models) >= self.cache_size:
            self._models.popitem(last=False)  # drop before building: memory stays bounded
        grid = self.run.new_grid()
        if not (self.run.best_paths and load_best_path(self.run.run, grid, path_id)):
            for mid in grid.module_ids_of_path(path_id):
                self.run.load_module_into(grid, mid)
        model = PathModel(grid, path_id).eval()
        model.grid = grid  # kept for inspection: which modules this process built
        self._models[path_id] = model
        self.loads += 1
        return model

    @property
    def loaded_paths(self) -> list[int]:
        """Paths currently in memory, least recently used first."""
        return list(self._models)

    def built_module_ids(self) -> set[str]:
        """Module ids materialised across the live grids."""
        return {mid for m in self._models.values() for mid in m.grid.built_modules()}


def parse_path(spec: str, grid: ModuleGrid) -> int:
    """A path id from ``"9"`` or a path tuple ``"2,1"`` / ``"(2, 1)"``; ``ValueError`` otherwise."""
    s = str(spec).strip().strip("()[]")
    try:
        parts = [int(x) for x in s.replace(" ", "").split(",") if x != ""]
    except ValueError:
        parts = []
    if len(parts) == 1 and "," not in s:
        if 0 <= parts[0] < grid.num_paths:
            return parts[0]
    elif len(parts) == grid.num_levels and all(0 <= k < K for k, K in zip(parts, grid.levels)):
        return grid.path_id_of(parts)
    raise ValueError(f"--path {spec!r} is not a path of grid {grid.levels}: give an id in "
                     f"[0, {grid.num_paths}) or one index per level, e.g. "
                     f"{','.join('0' for _ in grid.levels)}")
