"""How dipaco puts bytes on disk and reads them back, for every package above it.

Atomic writes (a temporary file beside the target, fsync, rename: :mod:`.atomic`), the
one safetensors wrapper (:mod:`.tensor_io`), content hashes (:mod:`.hashing`) and the
reader of JSON-lines records (:mod:`.jsonl`). It knows nothing of runs, data or
training: the run directory (:mod:`dipaco.run`), the token stores (:mod:`dipaco.data`)
and the decoupled store build their files from these.
"""
