"""Routed inference over a finished run: one path in memory at a time.

    run = InferenceRun.open("runs/x")                 # config, tokenizer, router, verified checkpoint
    path = run.route(run.encode("def main():"))       # the prefix chooses the path
    model = run.loader().get(path)                    # builds and loads ONLY that path's modules
    out = run.generate(run.encode("def main():"), max_new_tokens=64, reroute_every=32)
    report = run.score(docs)                          # == the trainer's routed evaluation
    export_path(run, path, "out/path_9"); model, tok = load_exported_path("out/path_9")

Rules, written once here and referred to by ``dipaco-infer --help``:

* **Checkpoint check.** By default every file listed in the checkpoint's manifest is
  hashed when the run is opened (streamed: time ∝ checkpoint size, memory constant), so
  a corrupt checkpoint is refused even if the corrupt module is not on the path used.
  ``verify="read"`` hashes only the module files actually read, just before reading them.
  Weights are read with safetensors only (never ``torch.load``).
* **Path-at-a-time.** :class:`PathLoader` builds a fresh lazy :class:`modules.ModuleGrid`
  per path and loads only that path's module files, so memory is one path (times
  ``cache_size``). Switching path drops the old path's modules before loading the new one.
* **Short prompts.** A prompt shorter than ``router.prefix_tokens`` is routed on the tokens
  it has (an empty one would go to the router's fallback path, but the CLI refuses it).
* **Re-routing** (``reroute_every=W``): the token at sequence position ``j`` is generated
  by the path of window ``j // W``, chosen by exactly :meth:`router.Router.reroute_windows`'s
  rule (window 0 by the first ``prefix_tokens`` tokens, window ``j ≥ 1`` by the
  ``prefix_tokens`` tokens before it). When a window's path differs from the current one,
  the new path is loaded and its KV cache is rebuilt from the context (a cache belongs to
  one path). Caveat: when the prompt is shorter than the prefix, window 0's path is chosen
  from the prompt alone — generation cannot see tokens it has not produced yet.
* **Long contexts.** The model always sees at most the last ``max_seq_len`` tokens. Once
  the sequence is longer, each step re-encodes that trailing window (the rotary positions
  shift), with or without KV cache, so both modes give the same tokens.
"""
from __future__ import annotations

import json
import os
import shutil
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from dipaco.checkpoint import (MANIFEST, CheckpointError, CheckpointManager, load_state, load_tensors,
                               save_tensors, sha256_file, write_json)
from dipaco.run_dir import RunDir, RunDirError
from modules import ModelConfig, ModuleGrid, PathModel

EXPORT_FORMAT = "dipaco-path"
EXPORT_VERSION = 1


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
        verify: ``"all"`` (hashed at open) or ``"read"`` (each module file hashed when read).
    """

    run: RunDir
    cfg: Any
    tokenizer: Any
    router: Any
    checkpoint: Path
    manifest: dict
    verify: str = "all"

    @classmethod
    def open(cls, run_dir: str | os.PathLike, *, checkpoint: Optional[str] = None,
             verify: str = "all", need_weights: bool = True) -> "InferenceRun":
        """Open ``run_dir``; raise :class:`RunDirError` / :class:`CheckpointError` naming the bad file.

        Args:
            checkpoint: ``None`` (newest), a round number, a ``round_NNNNNN`` name or a path.
            verify: ``"all"`` or ``"read"`` (see the module docstring).
            need_weights: ``False`` for routing only: no checkpoint is looked up.
        """
        if verify not in ("all", "read"):
            raise ValueError(f"verify must be 'all' or 'read', got {verify!r}")
        run = RunDir.at(run_dir)
        if not run.root.is_dir():
            raise RunDirError(f"run directory {run.root} does not exist")
        cfg = run.load_config()
        from dipaco.data import Tokenizer

        tokenizer = Tokenizer.load(str(run.require(run.tokenizer, "tokenizer")))
        router = _load_router(run, cfg)
        ckpt, manifest = Path(), {}
        if need_weights:
            ckpt = _find_checkpoint(run, checkpoint)
            manifest = CheckpointManager.verify(ckpt) if verify == "all" else _read_manifest(ckpt)
        return cls(run=run, cfg=cfg, tokenizer=tokenizer, router=router, checkpoint=ckpt,
                   manifest=manifest, verify=verify)

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
        from dipaco.build import build_grid

        return build_grid(self.cfg)

    def module_file(self, module_id: str) -> Path:
        """The checkpoint file holding ``module_id``'s weights (checked against the manifest)."""
        rel = f"modules/{module_id}.safetensors"
        info = self.manifest.get("files", {}).get(rel)
        if info is None:
            raise CheckpointError(f"checkpoint {self.checkpoint} has no {rel} in its manifest")
        path = self.checkpoint / rel
        if self.verify == "read":
            if not path.is_file():
                raise CheckpointError(f"checkpoint file {path} is listed in the manifest but missing")
            if path.stat().st_size != info["bytes"] or sha256_file(path) != info["sha256"]:
                raise CheckpointError(f"checkpoint file {path} does not match its manifest hash")
        return path

    def load_module_into(self, grid: ModuleGrid, module_id: str) -> None:
        """Read one module's weights from the checkpoint into ``grid`` (builds only that module)."""
        path = self.module_file(module_id)
        state = load_state(path)
        try:
            grid.load_module_state_dict(module_id, state)
        except ValueError as e:
            raise CheckpointError(f"checkpoint file {path} does not fit the run's model config: {e}") from None

    def loader(self, cache_size: int = 1) -> "PathLoader":
        """A path-at-a-time model loader over this run's checkpoint."""
        return PathLoader(self, cache_size=cache_size)

    # ---------------------------------------------------------------- use

    def generate(self, prompt_ids: Sequence[int], **kwargs: Any) -> "Generation":
        """Routed generation; see :func:`generate_routed` for the arguments."""
        return generate_routed(self, prompt_ids, **kwargs)

    def score(self, docs: Sequence[Sequence[int]], *, reroute_every: Optional[int] = None,
              batch_size: Optional[int] = None, seq_len: Optional[int] = None,
              loader: Optional["PathLoader"] = None) -> dict:
        """Routed perplexity of token documents with the trainer's rule (``evaluate_routed``).

        Defaults (``seq_len``, ``batch_size``) come from the run's trainer config, so scoring
        the run's validation documents reproduces ``summary.json``'s ``routed_ppl``.
        """
        from dipaco.evaluate import evaluate_routed

        t = self.cfg.trainer
        seq_len = t.seq_len if seq_len is None else int(seq_len)
        if not 1 <= seq_len < self.cfg.model.max_seq_len + 1:
            raise ValueError(f"seq_len must be in [1, {self.cfg.model.max_seq_len}] (model.max_seq_len), got {seq_len}")
        loader = loader or self.loader()
        return evaluate_routed(
            [np.asarray(d, dtype=np.int64) for d in docs], loader.get, seq_len=seq_len,
            prefix_tokens=self.prefix_tokens, route_batch=self.router.route_batch,
            reroute_windows=self.router.reroute_windows, reroute_every=reroute_every,
            batch_size=t.eval_batch_size if batch_size is None else int(batch_size))


def _load_router(run: RunDir, cfg: Any) -> Any:
    from router import Router

    run.require(run.router / "manifest.json", "router manifest")
    featurizer_fn = None
    if cfg.router.featurizer == "lm":
        # The router was fitted on the warm-up model's hidden states: it needs that model
        # (one path's size) to featurize prefixes.
        from dipaco.dense import dense_grid, load_dense_state
        from dipaco.prepare import lm_featurizer

        run.require(run.warmup / "modules.safetensors", "warm-up model (router.featurizer=lm)")
        warm = dense_grid(cfg)
        for mid, sd in load_dense_state(run.warmup).items():
            warm.load_module_state_dict(mid, sd)
        featurizer_fn = lm_featurizer(warm)
    try:
        return Router.load(run.router, featurizer_fn=featurizer_fn, expected_grid=list(cfg.grid.levels))
    except (ValueError, OSError) as e:
        raise RunDirError(f"cannot load router {run.router}: {e}") from None


def _find_checkpoint(run: RunDir, which: Optional[str]) -> Path:
    """The checkpoint to read: newest by default. Unlike training's resume, a corrupt newest
    checkpoint is refused, not silently replaced by an older one (pass ``checkpoint=``)."""
    from dipaco.checkpoint import round_dir_name

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


# --------------------------------------------------------------------------- generation


@dataclass
class Generation:
    """The result of :func:`generate_routed`.

    Attributes:
        prompt: prompt token ids.
        tokens: generated token ids (eos included when generation stopped on it).
        window_paths: the path of each window of ``reroute_every`` tokens over
            ``prompt + tokens`` (``router.reroute_windows``'s rule); without re-routing, ``[path]``.
        switches: ``(sequence position, path)`` each time generation started using a path.
        stopped_at_eos: generation ended on the eos token.
    """

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    window_paths: list[int] = field(default_factory=list)
    switches: list[tuple[int, int]] = field(default_factory=list)
    stopped_at_eos: bool = False

    @property
    def sequence(self) -> list[int]:
        """Prompt followed by the generated tokens."""
        return self.prompt + self.tokens


class _PathDecoder:
    """Next-token logits of one path over a growing sequence, with or without KV cache."""

    def __init__(self, model: PathModel, use_kv_cache: bool) -> None:
        self.model = model
        self.max_len = model.cfg.max_seq_len
        self.cache = model.new_kv_cache(1, self.max_len) if use_kv_cache else None
        self.start = 0  # sequence position of the cache's first token

    @torch.no_grad()
    def next_logits(self, seq: list[int]) -> torch.Tensor:
        """Logits ``[V]`` for the token after ``seq`` (seeing its last ``max_seq_len`` tokens)."""
        if self.cache is None:
            window = seq[-self.max_len:]
            return self.model(torch.tensor([window], dtype=torch.long))[0, -1]
        new = seq[self.start + self.cache.length:]
        if self.cache.length + len(new) > self.max_len or not new:
            # The window slid (rotary positions shift) or nothing is new: re-encode it.
            self.cache.reset()
            self.start = max(0, len(seq) - self.max_len)
            new = seq[self.start:]
        return self.model(torch.tensor([new], dtype=torch.long), self.cache)[0, -1]


def _sample(logits: torch.Tensor, temperature: float, top_k: Optional[int],
            generator: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    scaled = logits.double() / temperature
    if top_k is not None:
        kth = torch.topk(scaled, min(int(top_k), scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return int(torch.multinomial(F.softmax(scaled, dim=-1), 1, generator=generator))


def generate_routed(
    run: InferenceRun,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    seed: int = 0,
    reroute_every: Optional[int] = None,
    use_kv_cache: bool = True,
    stop_at_eos: bool = True,
    loader: Optional[PathLoader] = None,
    on_token: Optional[Callable[[int], None]] = None,
) -> Generation:
    """Continue ``prompt_ids`` with the path its prefix routes to (re-routing every W tokens).

    Args:
        temperature: 0 is greedy; otherwise softmax sampling at this temperature.
        top_k: sample among the ``top_k`` likeliest tokens only.
        seed: seeds the sampler (a private generator; the global RNG is untouched).
        reroute_every: W; ``None`` routes once by the prompt.
        use_kv_cache: ``False`` re-runs the whole context each step (slow; same tokens).
        stop_at_eos: stop after generating the eos token.
        loader: a :class:`PathLoader` to use (default: a fresh one, one path in memory).
        on_token: called with each generated token id as soon as it is chosen.
    """
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty: generation needs at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if reroute_every is not None and reroute_every < 1:
        raise ValueError(f"reroute_every must be >= 1 token, got {reroute_every}")
    loader = loader or run.loader()
    generator = torch.Generator().manual_seed(int(seed))
    eos = run.tokenizer.eos_id
    out = Generation(prompt=prompt)
    seq = list(prompt)
    P = run.prefix_tokens
    window_path: dict[int, int] = {}

    def path_at(pos: int) -> int:
        """Path generating sequence position ``pos`` (reroute_windows's rule)."""
        j = 0 if reroute_every is None else pos // reroute_every
        if j not in window_path:
            if reroute_every is None:
                ctx = prompt
            elif j == 0:
                ctx = seq[:P]
            else:
                ctx = seq[max(0, j * reroute_every - P): j * reroute_every]
            window_path[j] = run.route(ctx)
        return window_path[j]

    decoder: Optional[_PathDecoder] = None
    for _ in range(max_new_tokens):
        p = path_at(len(seq))
        if decoder is None or decoder.model.path_id != p:
            decoder = None  # release the old path's cache before loading the new path
            decoder = _PathDecoder(loader.get(p), use_kv_cache)
            out.switches.append((len(seq), p))
        tok = _sample(decoder.next_logits(seq), temperature, top_k, generator)
        seq.append(tok)
        out.tokens.append(tok)
        if on_token is not None:
            on_token(tok)
        if stop_at_eos and tok == eos:
            out.stopped_at_eos = True
            break
    if reroute_every is None:
        out.window_paths = [path_at(0)]
    else:
        # Windows that hold only prompt tokens were never needed for generating; fill them
        # (and a window the last token opened) in by the same rule, for the record.
        n_windows = -(-len(seq) // reroute_every)
        out.window_paths = [path_at(j * reroute_every) for j in range(n_windows)]
    return out


# --------------------------------------------------------------------------- export


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


def export_path(run: InferenceRun, path_id: int, out_dir: str | os.PathLike, *,
                overwrite: bool = False) -> Path:
    """Write path ``path_id`` as a standalone model directory; return it.

    Layout: ``model.safetensors`` (keys ``<module_id>/<param>``), ``config.json``
    (ModelConfig, the path, module ids, grid shape, source run and checkpoint),
    ``tokenizer.json`` and ``manifest.json`` (sha256 + size of each, the checkpoint
    format, so :meth:`CheckpointManager.verify` checks it). Written into a temporary
    sibling directory, then renamed: never half-written.
    """
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty (pass --force to replace it)")
    grid = run.new_grid()
    module_ids = grid.module_ids_of_path(int(path_id))
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for mid in module_ids:
        run.load_module_into(grid, mid)
        for name, t in grid.module_state_dict(mid).items():
            tensors[f"{mid}/{name}"] = t
    save_tensors(tmp / "model.safetensors", tensors, meta={"format": EXPORT_FORMAT, "module_ids": module_ids})
    shutil.copyfile(run.run.tokenizer, tmp / "tokenizer.json")
    g = run.cfg.grid
    write_json(tmp / "config.json", {
        "format": EXPORT_FORMAT,
        "version": EXPORT_VERSION,
        "model": run.cfg.model.to_dict() if hasattr(run.cfg.model, "to_dict") else dict(vars(run.cfg.model)),
        "path_id": int(path_id),
        "path": list(grid.path_of(int(path_id))),
        "module_ids": module_ids,
        "grid": {"levels": list(g.levels), "private_embed": bool(g.private_embed),
                 "private_head": bool(g.private_head)},
        "seed": int(run.cfg.seed),
        "prefix_tokens": run.prefix_tokens,
        "source": {"run_dir": str(run.run.root), "checkpoint": run.checkpoint.name,
                   "module_sha256": {mid: run.manifest["files"][f"modules/{mid}.safetensors"]["sha256"]
                                     for mid in module_ids}},
    })
    files = sorted(p for p in tmp.iterdir() if p.is_file())
    write_json(tmp / MANIFEST, {"files": {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                                          for p in files}})
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def load_exported_path(directory: str | os.PathLike) -> tuple[PathModel, Any]:
    """Load a directory written by :func:`export_path` (or ``dipaco-infer export``).

    Checks every file against ``manifest.json`` first, then builds a lazy grid of the
    source run's shape in which only the exported path's modules are built and loaded.
    No router is needed. Returns ``(PathModel in eval mode, Tokenizer)``; raises
    :class:`CheckpointError` naming the file when anything is missing or corrupt.
    """
    from dipaco.data import Tokenizer

    d = Path(directory).expanduser().resolve()
    if not d.is_dir():
        raise CheckpointError(f"exported path directory {d} does not exist")
    CheckpointManager.verify(d)
    try:
        info = json.loads((d / "config.json").read_text(encoding="utf-8"))
        if info.get("format") != EXPORT_FORMAT or info.get("version") != EXPORT_VERSION:
            raise ValueError(f"format {info.get('format')!r} v{info.get('version')!r} is not "
                             f"{EXPORT_FORMAT!r} v{EXPORT_VERSION}")
        cfg = ModelConfig(**info["model"])
        g = info["grid"]
        grid = ModuleGrid(cfg, g["levels"], private_embed=g["private_embed"],
                          private_head=g["private_head"], seed=int(info.get("seed", 0)))
        path_id = int(info["path_id"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"unreadable {d / 'config.json'}: {e}") from None
    tensors, _ = load_tensors(d / "model.safetensors")
    for mid in grid.module_ids_of_path(path_id):
        state = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.split("/", 1)[0] == mid}
        try:
            grid.load_module_state_dict(mid, state)
        except ValueError as e:
            raise CheckpointError(f"{d / 'model.safetensors'}: {e}") from None
    model = PathModel(grid, path_id).eval()
    model.grid = grid
    return model, Tokenizer.load(str(d / "tokenizer.json"))
