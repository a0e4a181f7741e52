"""The configuration schema: dataclasses registered in Hydra's ConfigStore.

The YAML files in ``conf/<group>/`` are choices *within* this schema; a key that is not
declared here is rejected by Hydra before any work starts. Every key's domain (range,
names, bounds) is declared in :mod:`dipaco.config.domains`, in one table keyed by dotted name;
``validate_config`` (:mod:`dipaco.config.validate`) checks the domains and the combinations
before any work (docs/design.md contract 6) and raises :class:`ConfigError`, which the
CLIs print as one line naming the key and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from dipaco.config.cluster import ClusterConfig
from dipaco.config.decoupled import DecoupledConfig
from dipaco.config.names import codec_options
from modules.config import ModelConfig
from router.methods import MethodSettings
from router.settings import RouterSettings


@dataclass
class DataConfig:
    """Where documents come from (docs/design.md, "Data flow", first box)."""

    # multidomain (the default: five labelled domains from this install, docs/data.md) |
    # python_sources | jsonl | json | parquet | text | hub | tokens (pre-tokenized)
    source: str = "multidomain"
    # local file, glob or directory (jsonl/json/parquet/text), a hub dataset name or a
    # save_to_disk folder (hub), or a directory of token shards (tokens)
    path: Optional[str] = None
    # hub sources only: the dataset's config name and split
    hub_config: Optional[str] = None
    hub_split: str = "train"
    # hub sources only: stream records (load_dataset(streaming=True)) instead of
    # downloading and converting the whole dataset first; max_documents then takes the
    # first N usable documents of the stream (a hash sample would need all of it)
    streaming: bool = False
    # the record key holding a document's text (data=tokens: its token ids)
    text_field: str = "text"
    # a label used only to *evaluate* routing (NMI), never to route
    label_field: Optional[str] = None
    id_field: Optional[str] = None
    # the document family splits are keyed by (e.g. the source file of a chunk): no group
    # has documents in two splits. None: the document id (every document its own group)
    group_field: Optional[str] = None
    # a sample of documents by id hash (not by group: splits stay keyed by group either way)
    max_documents: Optional[int] = None
    # a sample of the *training* split by id hash: validation, test and the tokenizer's
    # text stay whole, so runs on more or less training data are scored on the same documents
    max_train_documents: Optional[int] = None
    # data scaled with paths: max_train_documents = documents_per_path × number of paths (set
    # one of the two). DiPaCo's gain needs data that grows with the paths; with a fixed corpus
    # 16 paths read the same documents as 4, each path a quarter as many.
    documents_per_path: Optional[int] = None
    # python_sources, multidomain: top-level stdlib packages left out. `test` alone is ~55% of the
    # stdlib bytes and would swamp every other domain.
    exclude_packages: List[str] = field(
        default_factory=lambda: ["test", "tests", "idlelib", "lib2to3", "turtledemo"]
    )
    # multidomain: characters per domain at most (one domain must not swamp the others)
    domain_max_chars: int = 24_000_000
    # multidomain: the installed distributions whose files (with their requirements, transitively)
    # give the corpus. Named here, not read from dipaco's own requirements, so that a dependency
    # added to the code does not change the default corpus and every result measured on it
    # (adding simpy to install_requires did, by 14 files). The list is dipaco's requirements of
    # 2026-11-26; one not installed is left out with a warning.
    packages: List[str] = field(
        default_factory=lambda: ["torch", "numpy", "faiss-cpu", "scikit-learn", "datasets", "hydra-core",
                                 "omegaconf", "tokenizers", "safetensors", "tqdm", "matplotlib", "tensorboard",
                                 "simpy"]
    )
    # documents are cut along top-level definitions into chunks of about this size
    target_doc_chars: int = 2400
    # documents longer than this are truncated (huge inputs must not blow up memory)
    max_doc_chars: int = 20000
    min_doc_chars: int = 64
    val_fraction: float = 0.05
    test_fraction: float = 0.05
    # auto: a source's own validation/test splits are kept, the ones it lacks drawn by hash of
    # the group; hash: every split by hash, whatever the source has (docs/data.md)
    splits: str = "auto"
    # the BPE is trained on documents spread evenly over the training split, at most this
    # many bytes of text (the built-in corpora fit whole) and documents (null: no limit)
    tokenizer_sample_bytes: Optional[int] = 64 * 2**20
    tokenizer_sample_documents: Optional[int] = None
    # where tokenized datasets are cached; None: <run_dir>/cache
    cache_dir: Optional[str] = None
    # an existing HF tokenizer.json, or a local transformers tokenizer directory, to use
    # instead of training a BPE; the CLIs set model.vocab_size from it
    tokenizer: Optional[str] = None


@dataclass
class GridConfig:
    """The grid of modules: K alternative modules per level."""

    levels: List[int] = field(default_factory=lambda: [2, 2])
    private_embed: bool = False
    private_head: bool = False
    # R copies of every path, each trained by its own worker group on a random R-th of
    # the path's shard and synchronised with DiLoCo (R=4 on grid=dense is flat DiLoCo
    # with 4 workers: the baseline a DiPaCo grid is compared with)
    replicas: int = 1


@dataclass
class RouterConfig(RouterSettings, MethodSettings):
    """How documents are assigned to paths (router/ package).

    The router's own settings (``prefix_tokens``, ``cluster_tokens``, ``reroute_context``,
    ``top_k``, ``capacity_factor``, ``balance``, ``soft_capacity_factor``,
    ``prompt_classifier``) are :class:`router.settings.RouterSettings`'s fields, and the
    routing methods' settings (``niter``, ``fine_clusters``, ...) the fields of their
    config dataclasses (``router/methods/``, gathered in ``MethodSettings``): each is
    declared there once, with its comment, and is ``router.<name>`` here.
    """

    # a routing method: a name of router.methods.REGISTRY (each has a YAML in conf/router/)
    method: str = "product"
    featurizer: str = "tfidf"  # tfidf (sklearn) | lm (mean hidden state of the warm-up model)
    feature_dim: int = 64
    # EM re-shard (docs/evaluation.md): after this round, score documents under every path
    # and re-assign them; None: off
    reshard_at_round: Optional[int] = None
    # repeat the re-shard every R rounds after reshard_at_round (while < trainer.rounds); None: once
    reshard_every: Optional[int] = None
    # documents scored under every path (the E step); the rest are routed by the classifier
    reshard_documents: int = 2000
    # classifier: a classifier of the lowest-loss path routes every document | loss: the
    # scored documents take their lowest-loss paths under routing's balance (router/em.py)
    reshard_assign: str = "classifier"
    # evaluation: re-route every W tokens (None: route once by the prefix)
    reroute_every: Optional[int] = None


@dataclass
class OuterOptimizerConfig:
    """The outer optimiser each module applies to its averaged pseudo-gradient."""

    name: str = "sgd"  # any torch.optim class, case-insensitive
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True


@dataclass
class DiLoCoConfig:
    """Per-module DiLoCo synchronisation."""

    inner_steps: int = 50  # H
    mode: str = "sync"  # sync | decoupled
    outer: OuterOptimizerConfig = field(default_factory=OuterOptimizerConfig)
    codec: str = "none"  # none | fp16 | bf16 | int8 | int4 | fp8 | topk
    codec_block: int = 256  # int8, int4, fp8: elements per scale
    codec_topk_fraction: float = 0.01  # topk: share of entries kept
    error_feedback: bool = False
    # how lossy codecs cross a module group: reduce_scatter (compressed two-phase
    # all-reduce, ~2 encoded copies per rank), all_gather (k−1 copies), or auto (fewer bytes)
    lossy_exchange: str = "auto"
    # scale each module's averaged pseudo-gradient by sqrt(#sharing paths) (option)
    sharing_rescale: bool = False
    # α, the weight of a path's pseudo-gradient in a module's average: tokens (trained
    # this round: equal for every path in sync mode, a uniform mean) or shard_size
    # (tokens × the path's shard size / the mean shard size, as in the DiPaCo paper)
    alpha: str = "tokens"
    # where each module's θ_global, outer momentum and round buffers live: auto = the
    # module's own device (a GPU: no PCIe round trip per path and round) for the
    # synchronous, unsharded sync with codec none; cpu otherwise, or when set to cpu
    outer_device: str = "auto"
    # streaming DiLoCo (arXiv 2501.18512; dipaco/plan/stagger.py): each module launches its
    # exchange at its own inner step of the round, the path keeps training while it travels,
    # and streaming_delay (τ) steps later the new global weights land; only a fragment of a
    # path is in flight at a time. Synchronous rounds (false) exchange every module at step H.
    streaming: bool = False
    streaming_delay: int = 1  # τ, inner steps from a module's launch to its new weights landing
    # the paper's α: the share of the live weights kept when the global ones land (τ ≥ 1;
    # τ = 0 replaces them, as synchronous DiLoCo); torchft's fragment_update_alpha
    streaming_mix: float = 0.5
    # the path's stages (embed, each level, head) cut into this many consecutive fragments,
    # each with its own launch step (None: one per stage)
    streaming_fragments: Optional[int] = None
    # launch steps spread evenly over the round (even), or with gaps in proportion to each
    # fragment's bytes, so the bytes in flight stay level (size)
    streaming_spread: str = "even"
    # diloco.mode=decoupled: decoupled workers, synchronisers, quorum, grace, staleness (docs/decoupled.md)
    decoupled: DecoupledConfig = field(default_factory=DecoupledConfig)


@dataclass
class TrainerConfig:
    """The inner loop, evaluation and checkpoints."""

    rounds: int = 16
    # inner steps per path for the whole run; when set, rounds = total_steps // H, so a
    # sweep over H (diloco.inner_steps) keeps the steps per path fixed
    total_steps: Optional[int] = None
    # what more rounds on resume do to the learning-rate schedule: continue (the launch's;
    # the added rounds at min_lr_ratio x lr) | restart (a new warm-up and cosine). dipaco/config/schedule.py
    extend_schedule: str = "continue"
    # [start, end, ...] rounds of each schedule segment ([]: one over trainer.rounds); set by resume=true
    lr_segments: List[int] = field(default_factory=list)
    batch_size: int = 16  # sequences per inner step per path (split over the worker group)
    seq_len: int = 128
    lr: float = 3e-3  # inner AdamW peak learning rate
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # dense warm-up before the paths fork, as a fraction of one path's inner steps
    # (the DiPaCo paper pretrains a dense model for ~27% of the steps)
    warmup_fraction: float = 0.0
    dense_baseline: bool = True  # same-size dense model, same inner steps, all data
    # documents of the split scored: spread evenly over it (a split is sorted by domain), None = all
    eval_max_documents: Optional[int] = 400
    # the split the final evaluation scores: "validation" (where settings are chosen and
    # path early stopping picks its weights) or "test" (held out from both: report on it)
    eval_split: str = "validation"
    eval_batch_size: int = 16
    # also score each validation document whole, in consecutive windows of eval_seq_len
    # tokens (None: trainer.seq_len, the trained length), prefix excluded: summary.json's *_long keys
    eval_long: bool = False
    eval_seq_len: Optional[int] = None
    # keep each path's weights with the best loss on its own validation shard (checked
    # every eval_every rounds) in checkpoints/best_paths/; the final evaluation uses them
    path_early_stopping: bool = False
    eval_every: int = 1  # rounds
    checkpoint_every: int = 1  # rounds
    keep_last: int = 2
    # stop (as if preempted) after this many rounds, checkpoint written; resume=true goes on
    stop_after_rounds: Optional[int] = None
    threads: Optional[int] = None  # torch threads per process (None: torch default)
    # where every stage computes (dipaco/runtime/device.py): auto = CUDA when present, else cpu
    device: str = "auto"
    # autocast dtype for compute: fp32 | bf16 | fp16 (fp16: CUDA only, with a loss
    # scaler); parameters, AdamW state and pseudo-gradients stay fp32 whatever it is
    precision: str = "fp32"
    # torch.compile the path models: None = on for CUDA, off for the CPU
    compile: Optional[bool] = None
    compile_backend: str = "inductor"
    # recompute each block's activations in backward (less memory, ~1/3 more compute)
    activation_checkpointing: bool = False
    # gradient accumulation: each inner step's batch in this many slices (same update)
    micro_batches: int = 1
    # deterministic kernels (dipaco/runtime/device.py: set_deterministic): on CUDA, bit-identical
    # reruns and resumes at some speed cost; off, atomics in backward vary in the last bits
    deterministic: bool = False
    plots: bool = True
    progress: bool = True  # tqdm bars, drawn only when stderr is a terminal (dipaco/runtime/progress.py)


@dataclass
class LauncherConfig:
    """How ranks are started."""

    name: str = "local"  # local | spawn | torchrun | slurm
    nproc: int = 1  # ranks started on this host (spawn); ranks per node (slurm)
    group_size: int = 1  # G: ranks per worker group (data parallel inside a path)
    # how a worker group shares a path: replicate (every rank holds the modules, gradients
    # all-reduced) | fsdp (FSDP2: parameters, gradients, AdamW and outer state sharded, docs/gpu.md)
    group_parallel: str = "replicate"
    backend: str = "auto"  # auto | gloo | nccl
    timeout_s: float = 300.0  # collective timeout: a dead rank fails the run, never hangs it
    # launcher=spawn only: one torch elastic agent per worker group meeting in a c10d
    # rendezvous, so a lost group leaves and the others go on from the last round
    # checkpoint (dipaco/runtime/elastic_spawn.py; torchrun: --nnodes=MIN:MAX, docs/launch.md)
    elastic: bool = False
    min_nproc: Optional[int] = None  # elastic: the fewest ranks the run goes on with (null: one worker group)
    max_restarts: int = 3  # elastic: restarts of each agent's ranks after a failure; rejoins of a lost group
    rejoin_after_s: Optional[float] = None  # elastic: restart a lost group after this (null: never)
    # launcher=slurm only (conf/launcher/slurm.yaml maps these onto hydra.launcher.*)
    partition: Optional[str] = None  # required: the SLURM partition (sbatch --partition)
    nodes: int = 1
    gpus_per_node: Optional[int] = None  # None on CPU nodes
    cpus_per_task: Optional[int] = None  # CPUs (= torch threads) per rank; conf/launcher/slurm.yaml: 8
    max_requeues: int = 3  # SIGUSR2 before the time limit: checkpoint, requeue (dipaco/runtime/preempt.py)
    dry_run: bool = False  # print the job script and each task's environment, submit nothing
    mem_gb: Optional[int] = None
    timeout_min: int = 60  # the job's time limit
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    # rendezvous port on the first node (MASTER_ADDR is its host name)
    master_port: int = 29500


@dataclass
class LoggingConfig:
    """Which metrics are taken and where they go besides metrics.jsonl (always written)
    and the PNG plots (docs/metrics.md)."""

    tensorboard: bool = True  # event files in <run_dir>/tb/ (tensorboard --logdir <run_dir>)
    wandb: bool = False  # needs `pip install wandb`; refused at validation when missing
    wandb_project: str = "dipaco"
    wandb_entity: Optional[str] = None
    wandb_mode: str = "online"  # online | offline (sync later with `wandb sync`) | disabled
    # the W&B run's name (None: the run directory's name), group (None: the sweep folder's
    # name for a sweep's run, else none) and tags; the W&B run id is the run's own (run_uid)
    run_name: Optional[str] = None
    wandb_group: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    # per-step health metrics (loss, grad norm, lr, tokens/s, MFU, memory) every this many
    # inner steps of each path; 0: per round only. Read from the device once per turn.
    every_steps: int = 10
    # validation loss per round on the first N validation documents of each path's
    # validation shard (a fixed sample, scored after the outer step); 0: none
    val_documents: int = 0
    # the device's dense peak TFLOP/s for MFU; None: the datasheet value of a known GPU,
    # else no MFU (never a guess on the CPU)
    peak_tflops: Optional[float] = None


@dataclass
class Config:
    """The root config of ``dipaco-train`` and ``dipaco-route``."""

    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    grid: GridConfig = field(default_factory=GridConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # dipaco-plan --simulate only
    resume: bool = False
    # the run directory; the CLIs fill it from Hydra's output dir, tests pass a tmp dir
    run_dir: Optional[str] = None
    # free-form tag stored in summary.json (sweeps use it to label rows)
    tag: Optional[str] = None


def eval_window(cfg: Config) -> int:
    """Window length of the long evaluation protocol: ``trainer.eval_seq_len`` or, unset,
    the training sequence length (``trainer.seq_len``): positions past it were never
    trained, and scoring them measures length extrapolation, not the paths
    (docs/evaluation.md: the grid lost to dense there)."""
    t = cfg.trainer
    return int(t.seq_len) if t.eval_seq_len is None else int(t.eval_seq_len)


def codec_kwargs(d: DiLoCoConfig) -> dict[str, Any]:
    """The keyword arguments of ``make_codec(d.codec, ...)`` for this config: the options
    its registry line (``dipaco.config.names.CODECS``) names."""
    return codec_options(d)
