"""The module grid: every module of a DiPaCo model, named, seeded, and built on demand.

A grid ``[K_0, K_1, …]`` has ``K_l`` alternative modules at level ``l``; a path picks
one module per level, so there are ``∏ K_l`` paths. Path ids are the mixed-radix number
of the path with level 0 most significant: in ``[4, 4]`` path ``(2, 1)`` is id ``9``.

Module ids, in the one global order every rank uses (e.g. to create process groups)::

    "embed"            (or "embed.p0", "embed.p1", … with private_embed)
    "L0.0" … "L0.{K0-1}", "L1.0", …
    "head"             (or "head.p0", … with private_head)

Modules are built lazily on first access and cached, so a process that only runs one
path holds one path's memory. A module's initial weights depend only on
``(seed, module_id)`` (and the ``ModelConfig``): never on build order, on the process, or
on the global torch RNG, which building does not touch.
"""
from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence

import torch
import torch.nn as nn

from .config import ModelConfig
from .layers import LevelModule, LMHead, init_parameters_

EMBED = "embed"
HEAD = "head"
_LEVEL_RE = re.compile(r"^L(\d+)\.(\d+)$")
_PRIVATE_RE = re.compile(r"^(embed|head)\.p(\d+)$")

StateDict = Mapping[str, torch.Tensor]


def module_seed(seed: int, module_id: str) -> int:
    """The generator seed of one module: a stable 63-bit hash of ``f"{seed}:{module_id}"``.

    ``hash()`` is salted per process, so a cryptographic digest is used instead; every
    process and machine derives the same number.
    """
    digest = hashlib.blake2b(f"{seed}:{module_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _validate_grid(grid: Sequence[int]) -> list[int]:
    if isinstance(grid, (str, bytes)) or not isinstance(grid, Sequence) or len(grid) == 0:
        raise ValueError(
            f"grid must be a non-empty list of module counts per level, got {grid!r}; "
            f"e.g. grid=[4, 4] for 16 paths or grid=[1, 1] for a dense model"
        )
    levels = []
    for level, k in enumerate(grid):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(
                f"grid[{level}] = {k!r}: every level needs at least 1 module; "
                f"set grid[{level}] to an integer ≥ 1 (grid={list(grid)!r})"
            )
        levels.append(int(k))
    return levels


class ModuleGrid:
    """All modules of a DiPaCo model, keyed by module id, built lazily.

    Args:
        cfg: the shape of one path (validated here).
        grid: modules per level, e.g. ``[4, 4]``; ``[1] * n`` is a dense model.
        private_embed: give every path its own ``"embed.p{path_id}"`` instead of one shared ``"embed"``.
        private_head: likewise ``"head.p{path_id}"`` for the LM head.
        seed: the seed every module's initial weights derive from (with its id).
        device: where built modules live. Weights are always initialised on CPU first,
            so the same seed gives bitwise-equal modules on every device type.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        grid: Sequence[int],
        *,
        private_embed: bool = False,
        private_head: bool = False,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        cfg.validate()
        self.cfg = cfg
        self.levels: list[int] = _validate_grid(grid)
        if cfg.tie_embeddings and private_embed != private_head:
            raise ValueError(
                "tie_embeddings needs the embed and head to be shared the same way, got "
                f"private_embed={private_embed}, private_head={private_head}; set both equal "
                "or set tie_embeddings=false"
            )
        self.num_levels = len(self.levels)
        self.num_paths = math.prod(self.levels)
        self.private_embed = bool(private_embed)
        self.private_head = bool(private_head)
        self.seed = int(seed)
        self.device = torch.device(device)

        embeds = [f"{EMBED}.p{p}" for p in range(self.num_paths)] if private_embed else [EMBED]
        heads = [f"{HEAD}.p{p}" for p in range(self.num_paths)] if private_head else [HEAD]
        level_ids = [f"L{l}.{k}" for l, K in enumerate(self.levels) for k in range(K)]
        self.module_ids: list[str] = embeds + level_ids + heads
        self._position = {mid: i for i, mid in enumerate(self.module_ids)}
        self._built: dict[str, nn.Module] = {}
        self._count_cache: dict[str, int] = {}
        # Set by init_grid_from_dense: source state per kind ("embed", "L{l}.0", "head"),
        # applied to modules built later too, so warm starts keep the lazy build.
        self._dense_init: dict[str, dict[str, torch.Tensor]] | None = None

    @classmethod
    def dense(cls, cfg: ModelConfig, num_levels: int, *, seed: int = 0, device: torch.device | str = "cpu") -> "ModuleGrid":
        """A ``[1] * num_levels`` grid: the dense model a DiPaCo grid is warm-started from."""
        return cls(cfg, [1] * num_levels, seed=seed, device=device)

    def __repr__(self) -> str:
        return (
            f"ModuleGrid(levels={self.levels}, paths={self.num_paths}, modules={len(self.module_ids)}, "
            f"built={len(self._built)}, private_embed={self.private_embed}, "
            f"private_head={self.private_head}, seed={self.seed})"
        )

    # ------------------------------------------------------------------ paths

    def _check_path_id(self, path_id: int) -> int:
        if isinstance(path_id, bool) or not isinstance(path_id, int) or not 0 <= path_id < self.num_paths:
            raise ValueError(f"path_id must be an integer in [0, {self.num_paths}) for grid {self.levels}, got {path_id!r}")
        return path_id

    def path_of(self, path_id: int) -> tuple[int, ...]:
        """The module index at each level of path ``path_id`` (mixed radix, level 0 first)."""
        rest = self._check_path_id(path_id)
        digits = []
        for K in reversed(self.levels):
            digits.append(rest % K)
            rest //= K
        return tuple(reversed(digits))

    def path_id_of(self, path: Sequence[int]) -> int:
        """Inverse of :meth:`path_of`: ``(k_0, k_1, …)`` → path id."""
        if len(path) != self.num_levels:
            raise ValueError(f"a path of grid {self.levels} has {self.num_levels} entries, got {tuple(path)!r}")
        path_id = 0
        for level, (k, K) in enumerate(zip(path, self.levels)):
            if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < K:
                raise ValueError(f"path{tuple(path)!r}: level {level} has modules 0..{K - 1}, got {k!r}")
            path_id = path_id * K + k
        return path_id

    def embed_id(self, path_id: int) -> str:
        """The embed module of a path."""
        return f"{EMBED}.p{self._check_path_id(path_id)}" if self.private_embed else EMBED

    def head_id(self, path_id: int) -> str:
        """The head module of a path."""
        return f"{HEAD}.p{self._check_path_id(path_id)}" if self.private_head else HEAD

    def module_ids_of_path(self, path_id: int) -> list[str]:
        """The module ids of a path in forward order: embed, one per level, head."""
        path = self.path_of(path_id)
        return [self.embed_id(path_id), *(f"L{l}.{k}" for l, k in enumerate(path)), self.head_id(path_id)]

    def paths_of_module(self, module_id: str) -> list[int]:
        """Ids of the paths containing ``module_id`` (ascending): its module group's paths."""
        kind, level, index = self._parse(module_id)
        if index is None:  # shared embed or head
            return list(range(self.num_paths))
        if kind != "level":  # private embed/head
            return [index]
        return [p for p in range(self.num_paths) if self.path_of(p)[level] == index]

    def modules_at_level(self, level: int) -> list[str]:
        """The module ids of one level, ``"L{level}.0"`` … ``"L{level}.{K-1}"``."""
        if not 0 <= level < self.num_levels:
            raise ValueError(f"level must be in [0, {self.num_levels}), got {level}")
        return [f"L{level}.{k}" for k in range(self.levels[level])]

    # ------------------------------------------------------------------ module ids

    def _parse(self, module_id: str) -> tuple[str, int | None, int | None]:
        """``module_id`` → ``(kind, level, index)``: kind is "embed", "level" or "head";
        for private embed/head ``index`` is the path id; for shared ones it is ``None``."""
        if module_id in self._position:
            if module_id in (EMBED, HEAD):
                return module_id, None, None
            m = _LEVEL_RE.match(module_id)
            if m:
                return "level", int(m.group(1)), int(m.group(2))
            m = _PRIVATE_RE.match(module_id)
            if m:
                return m.group(1), None, int(m.group(2))
        raise KeyError(
            f"unknown module id {module_id!r} for grid {self.levels} "
            f"(valid ids look like {self.module_ids[0]!r}, 'L0.0', {self.module_ids[-1]!r})"
        )

    def kind_of(self, module_id: str) -> str:
        """``"embed"``, ``"level"`` or ``"head"``."""
        return self._parse(module_id)[0]

    def dense_source_id(self, module_id: str) -> str:
        """The module of a dense ``[1]*levels`` grid this module is warm-started from."""
        kind, level, _ = self._parse(module_id)
        return f"L{level}.0" if kind == "level" else kind

    # ------------------------------------------------------------------ building

    def _construct(self, kind: str) -> nn.Module:
        """A fresh, uninitialised module of one kind (on the current default device)."""
        cfg = self.cfg
        if kind == EMBED:
            # its weight given, not drawn: on "meta" nn.Embedding's own normal_ init runs
            # torch's Python reference kernel, whose first call imports torch._dynamo (3-5 s
            # per process on 2 cores), and module() draws every weight afresh anyway
            return nn.Embedding(cfg.vocab_size, cfg.d_model, _weight=torch.empty(cfg.vocab_size, cfg.d_model))
        if kind == HEAD:
            return LMHead(cfg)
        return LevelModule(cfg)

    def is_built(self, module_id: str) -> bool:
        """Whether ``module_id`` has been materialised in this process."""
        self._parse(module_id)
        return module_id in self._built

    def module(self, module_id: str) -> nn.Module:
        """The module object for ``module_id``, built and initialised on first access.

        Returns the cached object afterwards: every ``PathModel`` using this module holds
        this very object, so training one path updates the module for all of them.
        """
        cached = self._built.get(module_id)
        if cached is not None:
            return cached
        kind, _, _ = self._parse(module_id)
        # Allocate on "meta" (no memory, no RNG use), then materialise on CPU and draw
        # the weights from a private generator: the global RNG stays untouched, so
        # building modules in any order never changes anyone else's random numbers.
        with torch.device("meta"):
            mod = self._construct(kind)
        mod = _materialize(mod, "cpu")
        generator = torch.Generator(device="cpu")
        generator.manual_seed(module_seed(self.seed, module_id))
        init_parameters_(mod, generator, self.cfg.init_std)
        if self._dense_init is not None:
            mod.load_state_dict(self._dense_init[self.dense_source_id(module_id)])
        mod = mod.to(self.device)
        self._built[module_id] = mod
        return mod

    def build_path(self, path_id: int) -> list[nn.Module]:
        """Build (if needed) and return the modules of one path, in forward order."""
        return [self.module(mid) for mid in self.module_ids_of_path(path_id)]

    def built_modules(self) -> dict[str, nn.Module]:
        """The modules built so far, in ``module_ids`` order."""
        return {mid: self._built[mid] for mid in self.module_ids if mid in self._built}

    # ------------------------------------------------------------------ sizes

    def param_count(self, module_id: str) -> int:
        """Number of parameters of one module (does not build it)."""
        kind = self.kind_of(module_id)
        if kind not in self._count_cache:
            with torch.device("meta"):
                self._count_cache[kind] = sum(p.numel() for p in self._construct(kind).parameters())
        return self._count_cache[kind]

    def param_shapes(self, module_id: str) -> dict[str, torch.Size]:
        """``name → shape`` of one module's parameters (does not build it)."""
        with torch.device("meta"):
            return {n: p.shape for n, p in self._construct(self.kind_of(module_id)).named_parameters()}

    def path_param_count(self, path_id: int) -> int:
        """Parameters of one path: the sum over its modules (the tied weight counts once)."""
        return sum(self.param_count(mid) for mid in self.module_ids_of_path(path_id))

    def total_param_count(self) -> int:
        """Parameters of the whole grid (every module once)."""
        return sum(self.param_count(mid) for mid in self.module_ids)

    def specialised_param_count(self, path_id: int) -> int:
        """Parameters of one path in modules that not every path shares.

        These are what routing can specialise: a level module with K > 1, a private embed
        or head. The shared embed and head (and K = 1 levels) are trained by every path
        alike, so the more of a path they hold, the less a wrong path can cost.
        """
        return sum(self.param_count(mid) for mid in self.module_ids_of_path(path_id)
                   if len(self.paths_of_module(mid)) < self.num_paths)

    # ------------------------------------------------------------------ state

    def module_state_dict(self, module_id: str) -> dict[str, torch.Tensor]:
        """``state_dict()`` of one module (keys local to the module, e.g. ``"weight"``).

        Like ``nn.Module.state_dict`` the tensors share storage with the live module:
        clone them to keep a snapshot.
        """
        return self.module(module_id).state_dict()

    def load_module_state_dict(self, module_id: str, state: StateDict) -> None:
        """Copy ``state`` into one module in place (strict: same keys and shapes).

        Raises ``ValueError`` naming the module when the state does not fit.
        """
        try:
            self.module(module_id).load_state_dict(dict(state))
        except RuntimeError as err:
            raise ValueError(f"state dict does not fit module {module_id!r}: {err}") from err

    @torch.no_grad()
    def fingerprint(self, module_id: str) -> str:
        """SHA-256 of a module's parameter names, dtypes, shapes and bytes.

        Equal fingerprints on every rank prove all copies of a module start identical.
        """
        h = hashlib.sha256()
        for name, tensor in self.module_state_dict(module_id).items():
            t = tensor.detach().to("cpu").contiguous()
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return h.hexdigest()

    # ------------------------------------------------------------------ warm start

    def init_from_dense(self, dense: "ModuleGrid") -> "ModuleGrid":
        """Warm start: every module starts as the matching module of a dense grid.

        ``dense`` must be a ``[1] * num_levels`` grid with the same ``ModelConfig``. Its
        ``"embed"``, ``"L{l}.0"`` and ``"head"`` are snapshotted (cloned) now and copied into
        every copy here — ``"L{l}.k"`` for all k, and every private embed/head — both the
        modules already built and those built later. Returns ``self``.
        """
        if not isinstance(dense, ModuleGrid):
            raise TypeError(f"init_from_dense needs a ModuleGrid, got {type(dense).__name__}")
        if dense.levels != [1] * self.num_levels:
            raise ValueError(
                f"init_from_dense needs a dense grid {[1] * self.num_levels} (one module per level, "
                f"same number of levels as {self.levels}), got {dense.levels}"
            )
        if dense.cfg != self.cfg:
            raise ValueError(f"init_from_dense needs the same ModelConfig: dense has {dense.cfg}, this grid {self.cfg}")
        state = {mid: dense.module_state_dict(mid) for mid in dense.module_ids}
        return init_grid_from_dense(self, state)


def init_grid_from_dense(grid: ModuleGrid, dense_state: Mapping[str, StateDict]) -> ModuleGrid:
    """Warm-start ``grid`` from the per-module state dicts of a dense model.

    ``dense_state`` maps ``"embed"``, ``"L0.0"`` … ``"L{n-1}.0"``, ``"head"`` to state dicts
    (``"embed.p0"`` / ``"head.p0"`` are accepted too, from a dense grid with private
    embed/head). Shapes are checked up front (``ValueError`` naming the module); the
    tensors are cloned, so later changes to the dense model do not leak in. Modules of
    ``grid`` already built are overwritten now; the rest get the dense weights when built.
    """
    aliases = {f"{EMBED}.p0": EMBED, f"{HEAD}.p0": HEAD}
    given = {aliases.get(k, k): v for k, v in dense_state.items()}
    needed = [EMBED, *(f"L{l}.0" for l in range(grid.num_levels)), HEAD]
    missing = [mid for mid in needed if mid not in given]
    if missing:
        raise ValueError(
            f"dense state lacks modules {missing} (has {sorted(dense_state)}); a warm start for "
            f"grid {grid.levels} needs {needed}"
        )
    snapshot: dict[str, dict[str, torch.Tensor]] = {}
    for mid in needed:
        kind = mid if mid in (EMBED, HEAD) else "level"  # "embed" may not exist when private
        with torch.device("meta"):
            reference = grid._construct(kind).state_dict()
        state = {k: torch.as_tensor(v) for k, v in given[mid].items()}
        if set(state) != set(reference):
            raise ValueError(
                f"dense module {mid!r} has keys {sorted(state)}, expected {sorted(reference)} "
                f"(is tie_embeddings the same in both configs?)"
            )
        for key, ref in reference.items():
            if tuple(state[key].shape) != tuple(ref.shape):
                raise ValueError(
                    f"dense module {mid!r}: {key} has shape {tuple(state[key].shape)}, this grid "
                    f"needs {tuple(ref.shape)}; the dense model must use the same ModelConfig"
                )
        snapshot[mid] = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
    grid._dense_init = snapshot
    for mid, mod in grid.built_modules().items():
        mod.load_state_dict(snapshot[grid.dense_source_id(mid)])
    return grid


def _materialize(mod: nn.Module, device: str) -> nn.Module:
    """``mod.to_empty(device=device)`` without its meta kernel: ``to_empty`` allocates each
    tensor as ``empty_like`` of a meta tensor, whose first call imports torch's meta
    registrations and sympy (about 1 s of an inference process's start on 2 cores);
    ``torch.empty`` of the same shape and dtype allocates the same uninitialised storage.
    ``_apply`` is the traversal ``to_empty`` itself uses (parameters stay parameters)."""
    return mod._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
