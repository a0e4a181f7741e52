"""Every path of a run as a Hugging Face Llama checkpoint, with the router that picks
one (``dipaco-infer export RUN --format hf --all``), and :func:`load_routed` to use it.

Layout of the export directory::

    routed.json              format, grid, prefix tokens, each path's directory and modules
    router/                  the run's router (npz + manifest, no pickle: router.Router.load)
    tokenizer.json           the run's tokenizer (routing encodes with it)
    path_000/ ... path_P/    one LlamaForCausalLM checkpoint per path (dipaco/inference/export_hf.py)
    manifest.json            sha256 + size of every file above
    .dipaco-export

:func:`load_routed` needs only that directory (no run directory, no dipaco model code):
it checks the manifest, routes a prompt exactly as ``dipaco-infer route`` does (same
router, same tokenizer, the first ``prefix_tokens`` tokens) and runs the chosen path with
``transformers`` (one path in memory at a time). Routers fitted on the warm-up model's
hidden states (``router.featurizer=lm``) would need that model too and are refused.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, Union

import numpy as np
import torch

from dipaco.storage.atomic import write_json
from dipaco.run.checkpoint import MANIFEST, CheckpointError, CheckpointManager
from dipaco.storage.hashing import sha256_file
from dipaco.data import Tokenizer
from dipaco.inference.export import EXPORT_MARKER, check_export_target, staged_export
from dipaco.inference.export_hf import ExportError, write_llama_files
from dipaco.inference.model_card import MODEL_CARD, write_hf_extras
from dipaco.inference.run import InferenceRun
from dipaco.storage.held import check_unchanged, identity
from router import Router

ROUTED_FORMAT = "dipaco-routed-hf"
ROUTED_VERSION = 1
ROUTED_INFO = "routed.json"


def path_dir_name(path_id: int) -> str:
    """Directory of path ``path_id`` inside a routed export."""
    return f"path_{int(path_id):03d}"


def export_routed_hf(run: InferenceRun, out_dir: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write every path of ``run`` as a Llama checkpoint plus its router; return the directory.

    Staged inside the folder and moved in, like every export (:mod:`dipaco.run.owned`);
    ``overwrite`` replaces only the files an earlier export wrote.
    """
    if run.cfg.router.featurizer == "lm":
        raise ExportError("the router routes on the warm-up model's hidden states (router.featurizer=lm), "
                          "which a Llama export does not carry; export one path at a time with --path")
    out = Path(out_dir).expanduser().resolve()
    check_export_target(out, overwrite, (ROUTED_INFO, "tokenizer.json", MANIFEST, EXPORT_MARKER, MODEL_CARD))
    with staged_export(out, overwrite) as staging:
        grid = run.new_grid()
        loader = run.loader()
        paths = {}
        for p in range(run.num_paths):
            write_llama_files(loader.get(p), run.tokenizer, staging / path_dir_name(p))
            paths[str(p)] = {"dir": path_dir_name(p), "path": list(grid.path_of(p)),
                             "modules": grid.module_ids_of_path(p)}
        run.router.save(staging / "router")
        run.tokenizer.save(str(staging))
        write_json(staging / ROUTED_INFO, {
            "format": ROUTED_FORMAT, "version": ROUTED_VERSION, "grid": list(run.cfg.grid.levels),
            "num_paths": run.num_paths, "prefix_tokens": run.prefix_tokens, "paths": paths,
            "source": {"run_dir": str(run.run.root), "checkpoint": run.checkpoint.name,
                       "best_weights": bool(run.best_paths)}})
        write_hf_extras(run, staging, list(range(run.num_paths)), routed=True)
        (staging / EXPORT_MARKER).write_text(f"{ROUTED_FORMAT} v{ROUTED_VERSION}\n", encoding="utf-8")
        files = sorted(p for p in staging.rglob("*") if p.is_file())
        write_json(staging / MANIFEST, {"files": {str(p.relative_to(staging)): {
            "sha256": sha256_file(p), "bytes": p.stat().st_size} for p in files}})
    return out


@dataclass
class RoutedLlama:
    """A routed export opened for use: route a prompt, run its path with ``transformers``.

    Attributes:
        directory: the export directory.
        router: the run's router.
        tokenizer: the run's tokenizer (what routing and the path models read).
        info: ``routed.json``.
    """

    directory: Path
    router: Router
    tokenizer: Tokenizer
    info: dict
    _loaded: dict = field(default_factory=dict, repr=False)
    manifest: dict = field(default_factory=dict, repr=False)  # relative name -> sha256, bytes
    _checked: dict = field(default_factory=dict, repr=False)  # path -> identity when it last matched

    @property
    def num_paths(self) -> int:
        return int(self.info["num_paths"])

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no eos appended, as in training)."""
        return list(self.tokenizer.encode(text))

    def route(self, prompt: Union[str, Sequence[int]]) -> int:
        """The path of a prompt (text or token ids), by its first ``prefix_tokens`` tokens."""
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return int(self.router.route(np.asarray(ids, dtype=np.int64)))

    def model(self, path_id: int) -> Any:
        """Path ``path_id`` as ``transformers.LlamaForCausalLM`` (eval, fp32); one path is
        kept in memory at a time."""
        path_id = int(path_id)
        if path_id not in self._loaded:
            if not 0 <= path_id < self.num_paths:
                raise ValueError(f"path {path_id} is not in [0, {self.num_paths})")
            from transformers import LlamaForCausalLM  # optional dependency: only this loader needs it

            self._loaded.clear()  # drop the previous path before loading the next
            where = self.directory / self.info["paths"][str(path_id)]["dir"]
            # verified where read: a path folder changed since the export was opened is refused, naming the file
            for rel, file_info in self.manifest.items():
                if rel.startswith(f"{where.name}/"):
                    check_unchanged(self.directory / rel, file_info, self._checked)
            self._loaded[path_id] = LlamaForCausalLM.from_pretrained(where).eval()  # fp32, as written
        return self._loaded[path_id]

    @torch.no_grad()
    def logits(self, prompt: Union[str, Sequence[int]]) -> tuple[int, torch.Tensor]:
        """``(path, logits [1, T, vocab])`` of the routed path over the prompt's tokens."""
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        path = self.route(ids)
        return path, self.model(path)(torch.tensor([ids])).logits

    @torch.no_grad()
    def generate(self, prompt: str, max_new_tokens: int = 32, **kwargs: Any) -> tuple[int, str]:
        """``(path, continuation)``: the routed path continues ``prompt`` (``generate``'s
        keyword arguments pass through; greedy by default)."""
        ids = self.encode(prompt)
        path = self.route(ids)
        out = self.model(path).generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                        do_sample=kwargs.pop("do_sample", False), **kwargs)
        return path, self.tokenizer.decode(out[0, len(ids):].tolist())


def load_routed(directory: str | os.PathLike) -> RoutedLlama:
    """Open a directory written by ``dipaco-infer export RUN --format hf --all``.

    Every file is checked against ``manifest.json`` first; a missing or altered one raises
    :class:`CheckpointError` naming it. Path models load on first use.
    """
    d = Path(directory).expanduser().resolve()
    if not d.is_dir():
        raise CheckpointError(f"routed export directory {d} does not exist")
    manifest = CheckpointManager.verify(d, allow_extra=True)["files"]  # the user's notes beside it are never read
    checked = {d / rel: identity(d / rel) for rel in manifest}  # as hashed just now
    try:
        info = json.loads((d / ROUTED_INFO).read_text(encoding="utf-8"))
        if info.get("format") != ROUTED_FORMAT or info.get("version") != ROUTED_VERSION:
            raise ValueError(f"format {info.get('format')!r} v{info.get('version')!r} is not "
                             f"{ROUTED_FORMAT!r} v{ROUTED_VERSION}")
        router = Router.load(d / "router", expected_grid=info["grid"])
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise CheckpointError(f"unreadable routed export {d}: {e}") from None
    return RoutedLlama(directory=d, router=router, tokenizer=Tokenizer.load(str(d / "tokenizer.json")), info=info,
                       manifest=manifest, _checked=checked)


__all__ = ["ROUTED_FORMAT", "RoutedLlama", "export_routed_hf", "load_routed", "path_dir_name"]
