"""Routed inference over a finished run: one path in memory at a time.

    run = InferenceRun.open("runs/x")                 # config, tokenizer, router, verified checkpoint
    path = run.route(run.encode("def main():"))       # the prefix chooses the path
    model = run.loader().get(path)                    # builds and loads ONLY that path's modules
    out = run.generate(run.encode("def main():"), max_new_tokens=64, reroute_every=32)
    gens = RoutedEngine(run, max_batch_size=32).generate([Request(ids) for ids in prompts])  # batched
    report = run.score(docs)                          # == the job's routed evaluation
    export_path(run, path, "out/path_9"); model, tok = load_exported_path("out/path_9")
    export_path_hf(run, path, "out/llama_9")          # transformers.LlamaForCausalLM loads it
    export_routed_hf(run, "out/routed"); routed = load_routed("out/routed")  # every path + the router
    path, logits = routed.logits("def main():")       # no run directory needed

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
  rule (window 0 by the first ``prefix_tokens`` tokens, window ``j ≥ 1`` by every token
  before it, or the last ``router.reroute_context`` of them). When a window's path differs from the current one,
  the new path is loaded and its KV cache is rebuilt from the context (a cache belongs to
  one path). Caveat: when the prompt is shorter than the prefix, window 0's path is chosen
  from the prompt alone — generation cannot see tokens it has not produced yet.
* **Long contexts.** The model always sees at most the last ``max_seq_len`` tokens. Once
  the sequence is longer, each step re-encodes that trailing window (the rotary positions
  shift), with or without KV cache, so both modes give the same tokens.
"""
from __future__ import annotations

from dipaco.inference.export import EXPORT_FORMAT, EXPORT_VERSION, export_path, load_exported_path
from dipaco.inference.export_hf import ExportError, export_path_hf
from dipaco.inference.engine import Request, RoutedEngine, TokenEvent
from dipaco.inference.generate import Generation, generate_routed
from dipaco.inference.routed_hf import RoutedLlama, export_routed_hf, load_routed
from dipaco.inference.run import InferenceRun, PathLoader, parse_path

__all__ = ["InferenceRun", "PathLoader", "parse_path", "Generation", "generate_routed",
           "RoutedEngine", "Request", "TokenEvent",
           "export_path", "load_exported_path", "EXPORT_FORMAT", "EXPORT_VERSION",
           "export_path_hf", "ExportError", "export_routed_hf", "load_routed", "RoutedLlama"]
