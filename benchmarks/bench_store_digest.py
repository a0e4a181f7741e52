"""What verifying decoupled store blobs costs (docs/decoupled.md, issue 56 rule 1).

``python -m benchmarks.bench_store_digest [--quick | --full]``: the blobs a decoupled run
writes and reads most, at the size of a level module of ``experiment=paper`` (a 16x16
grid, 256 paths: 57,985,536 parameters per level module; ``--quick`` uses 1/8 of it):

* a module version: the synchroniser's state (θ_global and the default delayed
  Nesterov's two buffers, fp32) and a ledger of 2,000 update ids;
* an update: one α·Δ of the module, fp32 (``diloco.codec=none``, the largest).

For each, encode and decode with the digest (what the store does now: the sha256 of
the content recorded at the write, checked at the read) against without (the same
safetensors calls, nothing hashed), interleaved (``benchmarks/common.py``), and a put +
get through a ``FileStore`` on local disk for the scale of a whole store operation.
"""
from __future__ import annotations

import json
import tempfile
import time
from typing import Any, Callable

import torch

from benchmarks.common import base_parser, interleaved, load_average, print_table, write_result
from dipaco.config import DiLoCoConfig
from dipaco.config.decoupled import DecoupledConfig
from dipaco.decoupled.merge import MergingModuleSync, Update
from dipaco.decoupled.store import FileStore, _state_digest, decode_state, encode_state
from dipaco.storage.tensor_io import flatten_state, tensors_from_bytes, tensors_to_bytes, unflatten_state
from dipaco.sync.outer import outer_options

PAPER_LEVEL_MODULE = 57_985_536  # `dipaco-plan experiment=paper`: params of L0.x / L1.x


def module_version(numel: int) -> dict[str, Any]:
    """A synchroniser's module state after one step, with a ledger of 2,000 ids."""
    s = MergingModuleSync("L0.0", torch.randn(numel), list(range(16)), DecoupledConfig(),
                          outer_options(DiLoCoConfig(mode="decoupled")))
    s.offer(Update("u0", "L0.0", 0, 0, 0, 1.0, torch.randn(numel)), 0.0)
    s.step(0.0)
    state = s.state_dict()
    state["applied"].update({f"L0.0.p{i % 16}.ph{i // 16}.w{i % 7}-abcdef": 1 + i // 16 for i in range(2000)})
    return state


def update(numel: int) -> dict[str, Any]:
    return {"payload": [torch.randn(numel)]}


def _plain_encode(state: Any, meta: dict) -> bytes:
    """The encoding without a digest: the same flatten and safetensors calls."""
    tensors, skeleton = flatten_state(state)
    return tensors_to_bytes(tensors, metadata={"skeleton": json.dumps(skeleton, allow_nan=False),
                                               "meta": json.dumps(meta, allow_nan=False)})


def _plain_decode(blob: bytes) -> Any:
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])["__metadata__"]
    return unflatten_state(tensors_from_bytes(blob), json.loads(header["skeleton"]))


def _seconds(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(name: str, state: dict[str, Any], repeats: int, root: str) -> dict[str, Any]:
    meta = {"version": 1}
    blob, plain = encode_state(state, meta), _plain_encode(state, meta)
    tensors, skeleton = flatten_state(state)
    header = {"skeleton": json.dumps(skeleton, allow_nan=False), "meta": json.dumps(meta, allow_nan=False)}
    store = FileStore(root)
    store.put_state("k.st", state, meta=meta)
    enc = interleaved({"digest": lambda: _seconds(lambda: encode_state(state, meta)),
                       "plain": lambda: _seconds(lambda: _plain_encode(state, meta))}, repeats)
    dec = interleaved({"digest": lambda: _seconds(lambda: decode_state(blob)),
                       "plain": lambda: _seconds(lambda: _plain_decode(plain))}, repeats)
    sha = interleaved({"sha256": lambda: _seconds(lambda: _state_digest(tensors, header))}, repeats)["sha256"]["median"]
    io = interleaved({"put+get": lambda: _seconds(lambda: (store.put_state("k.st", state, meta=meta),
                                                            store.get_state("k.st")))}, repeats)["put+get"]["median"]
    mb = len(blob) / 1e6
    return {"blob": name, "MB": round(mb, 1), "sha256_s": sha, "sha256_GB_per_s": mb / 1e3 / sha,
            "encode_s": enc["digest"]["median"], "encode_plain_s": enc["plain"]["median"],
            "encode_ratio": enc["digest"]["median"] / enc["plain"]["median"],
            "decode_s": dec["digest"]["median"], "decode_plain_s": dec["plain"]["median"],
            "decode_ratio": dec["digest"]["median"] / dec["plain"]["median"],
            "filestore_put_get_s": io, "digest_share_of_put_get": 2 * sha / io}


def main(argv: list[str] | None = None) -> None:
    ap = base_parser(__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds per side (default 3 quick, 5 full)")
    args = ap.parse_args(argv)
    load = load_average()
    numel = PAPER_LEVEL_MODULE if args.mode == "full" else PAPER_LEVEL_MODULE // 8
    repeats = args.repeats or (5 if args.mode == "full" else 3)
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name, make in (("module version", module_version), ("update (fp32)", update)):
            rows.append(measure(name, make(numel), repeats, root))
    print_table(rows, ["blob", "MB", "sha256_s", "sha256_GB_per_s", "encode_s", "encode_plain_s", "encode_ratio",
                       "decode_s", "decode_plain_s", "decode_ratio", "filestore_put_get_s", "digest_share_of_put_get"],
                title=f"store blobs of a {numel:,}-parameter module (digest: what the store does; plain: no digest)")
    write_result("store_digest", {"numel": numel, "repeats": repeats, "rows": rows}, mode=args.mode, load_before=load,
                 out=args.out, argv=argv)


if __name__ == "__main__":
    main()
