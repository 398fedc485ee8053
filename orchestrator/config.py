"""Job configuration: typed schema, merge order, validation.

Merge order, later wins: the schema's defaults < ``conf/defaults.yaml`` < the job file's
``defaults:`` list (files under ``conf/``, e.g. ``cluster/dgx-h100``) < the job file <
``key=value`` overrides. Every value is checked against the schema by OmegaConf, then the
cross-field invariants below; the first problem raises :class:`ConfigError` naming the key.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .choices import (
    AccumSync,
    Compression,
    CpAttention,
    PipelineSchedule,
    Precision,
    Recompute,
    Strategy,
    SyncAlgorithm,
)
from .errors import ConfigError
from .sequence_split import ALLOWED_UP_TO, allowed_cps, sequence_split_problem

GPT_FACTORY = "orchestrator.workloads.gpt:build"
"""The built-in GPT's factory: the default model."""


@dataclass
class ModelConfig:
    """The model: the built-in GPT (nanoGPT's names below), or any factory by import path."""

    factory: str = GPT_FACTORY
    """`package.module:callable` returning an `nn.Module` whose forward maps token ids [B, T] to logits
    [B, T, V] (or an object with `.logits`); importable here and shipped to every worker. The
    built-in Llama family is `orchestrator.workloads.llama:build` (`args: {preset: llama3-8b}`)."""
    args: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of `factory`. The built-in GPT also receives the n_layer ... bias fields below."""
    hf_config: Optional[str] = None
    """A Hugging Face `config.json` to build a `transformers` causal LM from (random init; needs `.[hf]`);
    overrides `factory` and its `args`, so any job can be planned for another model. Nothing is
    ever downloaded."""
    hf_weights: Optional[str] = None
    """Local weights to load into the `hf_config` model: a `.safetensors` file, or a directory with
    `model.safetensors` or a sharded checkpoint (`model.safetensors.index.json`). Each rank reads
    only its own slices."""

    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 128
    """Hidden size."""
    vocab_size: int = 256
    """Vocabulary size; 256 for the byte-level tokens of the built-in data."""
    block_size: int = 128
    """Context length in tokens (the sequence length of every sample)."""
    dropout: float = 0.0
    """Dropout probability in attention and MLP (0 keeps runs bit-reproducible)."""
    bias: bool = True
    """Biases in Linear and LayerNorm layers, as GPT-2."""


@dataclass
class DataConfig:
    """Training text."""

    path: Optional[str] = None
    """What to train on, by suffix: `.bin` (nanoGPT's raw uint16 tokens), `.npy` (a 1-D integer
    array, e.g. from `prepare`) or any other file as UTF-8 text (its bytes are the tokens); None
    uses the text of Python's `pydoc_data.topics`. Token files are memory-mapped, never read whole."""
    val_fraction: float = 0.1
    """Fraction of the tokens (the tail of the file) held out for validation, unless `val_path` is set."""
    val_path: Optional[str] = None
    """A separate validation file (same formats as `path`); when set, all of `path` trains."""


@dataclass
class TrainConfig:
    """The optimisation loop."""

    max_steps: int = 300
    """Optimizer steps to run."""
    global_batch_size: int = 32
    """Sequences per optimizer step across all ranks and micro-steps."""
    micro_batch_size: Union[int, str] = "auto"
    """Sequences per rank per forward/backward; `auto` lets the planner choose."""
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 20
    """Linear warmup steps before the cosine decay."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices only (not biases, LayerNorm or embeddings' norms)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 turns clipping off."""
    eval_interval: int = 50
    """Evaluate the validation loss every this many steps (and at the first and last step)."""
    eval_iters: int = 10
    """Validation batches per evaluation."""
    precision: Precision = Precision.auto
    """`auto` (bf16 autocast on GPU, fp32 on CPU), `bf16`, `fp16` or `fp32`."""
    seed: int = 1337
    """Seed for model init and data order; the same seed gives the same run."""
    max_failures: int = 0
    """How many times the driver restarts after a worker or node failure."""
    compile: Union[bool, str] = "auto"
    """`torch.compile` each repeated block (torchtitan's per-block compile, composed with
    tensor parallelism, recomputation, FSDP2 and pipelines): `auto` compiles when the planner
    predicts the run saves twice the time compiling costs (from the speedup and compile
    time a compiled run of the same model measured, where `parallel.calibration` names it;
    else from the device's table), and runs eager, with one
    warning naming it, for a model whose block does not compile as one graph; `true` compiles
    (a block that breaks the graph is refused in one line); `false` runs eager."""


@dataclass
class ParallelConfig:
    """Sharding strategy and gradient sync; `auto` leaves a choice to the planner."""

    strategy: Strategy = Strategy.auto
    """`auto`, `ddp`, `zero1`, `zero2`, `zero3` (= `fsdp`) or `hsdp`."""
    tp: Union[int, str] = "auto"
    """Tensor-parallel degree (inside an NVLink domain); `auto` lets the planner choose."""
    dp_shard: Union[int, str] = "auto"
    """Ranks each parameter is sharded over (HSDP's shard group size); `auto` to plan."""
    cp: Union[int, str] = "auto"
    """Context-parallel degree: ranks that split every sequence into 2 x cp head-tail chunks
    (the mesh axis between dp_shard and tp; FSDP then shards over dp_shard x cp). `auto` lets
    the planner choose: it searches cp from 8,192 tokens, inside the NVLink island first.
    `model.block_size` must divide by 2 x cp."""
    cp_attention: CpAttention = CpAttention.auto
    """How attention sees the whole sequence under cp > 1: `allgather_kv` (K and V all-gathered
    over the cp group; any head count), `ulysses` (head all-to-alls, DeepSpeed-Ulysses; the
    rank's attention heads, after tensor parallelism, must divide by cp) or `auto`: the
    planner prices both on the cp group's links and keeps the faster."""
    ep: Union[int, str] = "auto"
    """Expert-parallel degree of a Mixture-of-Experts model: ranks each MoE layer's experts
    are split over, borrowed from dp_shard x cp x tp (the rest shards each expert). `auto`
    lets the planner choose (1 for a dense model); it must divide the routed experts."""
    pp: Union[int, str] = "auto"
    """Pipeline stages (the outermost mesh axis, across the slowest links). `auto` (the
    default) searches every degree whose stages fill whole nodes and divide the blocks, for a
    model that names its ends (one node, a model without ends, or a forced
    `parallel.sync=hierarchical` or `parallel.compression=powersgd`, DDP comm hooks a
    pipeline's FSDP2 stages do not run, gets none); 1 turns pipelines off. The accumulation
    steps are the micro-batches."""
    pp_schedule: PipelineSchedule = PipelineSchedule.auto
    """Pipeline schedule: `auto`, `gpipe`, `1f1b`, `interleaved_1f1b` or `zero_bubble`
    (torch's interleaved zero-bubble schedule)."""
    pp_microbatches: Union[int, str] = "auto"
    """Micro-batches each pipeline runs per optimizer step; `auto` to plan."""
    recompute: Recompute = Recompute.auto
    """Activation recomputation: `auto`, `none`, `selective` or `full`."""
    bucket_mb: Union[float, str] = "auto"
    """DDP gradient bucket size in MB; `auto` sizes it from the link latency and bandwidth."""
    sync: SyncAlgorithm = SyncAlgorithm.auto
    """Gradient all-reduce schedule: `auto`, `flat` or `hierarchical` (intra, inter, intra)."""
    compression: Compression = Compression.auto
    """Gradient compression: `auto` (only when comm-bound and allowed), `none`, `fp16`, `bf16`, `powersgd`."""
    allow_compression: bool = False
    """Let `auto` pick a lossy gradient compression when communication dominates."""
    accum_sync: AccumSync = AccumSync.auto
    """When FSDP2 reduces gradients under accumulation: `auto` (the fastest that fits),
    `per_micro_step` (reduce-scatter every micro-step: sharded gradients, traffic x accum) or
    `last_micro_step` (keep unsharded gradients until the last micro-step: one reduction).
    DDP, ZeRO-1 and pipelines always run `last_micro_step`."""
    trial: Union[int, str, bool] = "auto"
    """Confirm the plan by a short trial on the real cluster before the run: `auto` (on
    multi-node runs long enough to pay for it: up to 3 plans, the planner's choice, the plan
    that assumes equal links and the fastest runner-up inside the cost model's error band),
    `off`, or a number of plans (at least 2; runs whatever the run's length). The fastest
    measured plan is the one that trains; plan.json's `trial` says what each measured."""
    trial_steps: int = 3
    """Timed steps of each trial plan (after one untimed warm-up step); its fastest is its figure."""
    trial_budget: float = 0.05
    """The share of the run's predicted time a `parallel.trial=auto` trial may take; a run too
    short for it skips the trial."""
    calibration: Optional[str] = None
    """A run directory (or its calibration.json) whose trial measured this cluster: every plan
    is priced with its measured / predicted ratios (`plan --calibration` sets it too), and
    `train.compile=auto` with the compile gain a compiled run of the same model measured there;
    None prices from the tables and the probe alone."""


@dataclass
class ClusterConfig:
    """Which Ray cluster, and what to assume about it."""

    address: Optional[str] = None
    """Ray address: None starts a private local cluster; `auto` or `HOST:PORT` joins one."""
    num_workers: int = 2
    """Workers (CPU slots) when there is no GPU; ignored when the cluster has GPUs."""
    cpus_per_worker: float = 1.0
    """CPUs reserved for each worker actor."""
    gpu: Optional[str] = None
    """GPU model to plan for when the topology does not name one (e.g. `H100`)."""
    inter_node_gbps: Optional[float] = None
    """Network bandwidth out of one node, GB/s per direction; None derives it from the NICs."""
    inter_node_latency_us: Optional[float] = None
    """One-way latency between nodes, microseconds; None keeps the probed (or default) figure."""
    measure: bool = False
    """Time the links (and each device's matmul rate) before planning, as `probe --measure`
    does; results are cached per node, so only a node's first job pays for it."""
    placement_timeout_s: float = 120.0
    """How long to wait for the placement group before giving up with what is missing."""
    topology_file: Optional[str] = None
    """A topology capture (any probe format, one node) to plan for instead of probing; relative
    paths are looked up beside the job file, then in `conf/`. Used by `plan` only."""
    nodes: int = 1
    """How many nodes like `topology_file` the described cluster has."""


@dataclass
class CheckpointConfig:
    """Checkpoints written with torch.distributed.checkpoint."""

    enabled: bool = True
    """Write checkpoints at all (a final one at least)."""
    interval: int = 0
    """Steps between checkpoints; 0 writes only the final one."""
    path: Optional[str] = None
    """Directory (or fsspec URI) for checkpoints; None uses `<run dir>/checkpoints`."""
    keep_last: int = 2
    """How many whole checkpoints to keep."""
    async_save: bool = True
    """Write interval checkpoints in the background (`dcp.async_save`): training waits only
    while the state is copied to CPU memory, and the checkpoint is committed after the next
    step; the final checkpoint is always written before the run returns. False: every rank
    waits for each checkpoint to be written."""
    export: bool = False
    """At the end of the run, also write the final weights as safetensors to `<run dir>/export`
    (as the `export` command does; needs the `hf` extra)."""


@dataclass
class MonitorConfig:
    """What the user sees and what is written."""

    runs_dir: str = "runs"
    """Parent of the run directories (`<runs_dir>/<name>-<time>`)."""
    progress: bool = True
    """Show a live progress bar (turned off automatically when output is not a terminal)."""
    log_interval: int = 1
    """Steps between metrics lines in metrics.jsonl."""
    dashboard: bool = True
    """Start the Ray dashboard with the embedded cluster (an existing cluster has its own)."""
    trackers: List[str] = field(default_factory=list)
    """Experiment trackers the driver also logs the run to (`tensorboard`: event files in the run
    directory; `mlflow`: the server MLFLOW_TRACKING_URI names; `wandb`: Weights & Biases, offline
    with WANDB_MODE=offline); none by default. Needs the `trackers` extra."""


TRACKERS = ("tensorboard", "mlflow", "wandb")
"""The trackers `monitor.trackers` may name."""


@dataclass
class ElasticConfig:
    """How far the world may shrink or grow when the driver re-plans after a failure."""

    min_workers: int = 1
    """Fewest devices to continue with; below it the run fails instead of re-planning."""
    max_workers: int = 0
    """Most devices to use; 0 means all the cluster has."""
    hang_factor: float = 20.0
    """A rank hangs when no step finishes within hang_factor x the plan's predicted step time
    (but never sooner than hang_floor_s): every rank's stack is saved and the group restarts."""
    hang_floor_s: float = 300.0
    """Shortest wait for a step before the run counts as hung, seconds: covers the first step's
    warm-up, evaluation and checkpoint writes, which report no step while they run."""
    silent_after_s: float = 5.0
    """A rank whose control thread (which answers while it trains) has not answered for this
    long, while no step finished, hangs at once without waiting for the step-based timeout: a
    stopped or frozen process, or one holding the GIL. Seconds; 0 leaves hangs to hang_factor."""
    keep_survivors: bool = True
    """After a failure, keep every healthy rank's process (imports, device context) and replace
    only the dead or hung ranks on their own devices, when the world is unchanged, restoring
    them from the survivors' memory where the plan replicates its states; false: tear every
    rank down and re-probe, re-plan and re-place, as a changed world always does."""
    leave_timeout_s: float = 30.0
    """How long the survivors may take to leave the broken collective (one stuck in its step
    while the others have left is replaced sooner) before the whole world restarts instead,
    seconds."""


@dataclass
class JobConfig:
    """A whole training job."""

    name: str = "job"
    """Job name: prefix of the run directory and of the Ray actor names."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)


def conf_dir() -> Path:
    """The shipped defaults: $ORCHESTRATOR_CONF_DIR, else `conf/` of the source tree this
    package runs from, else the copy installed inside the package (`orchestrator/conf`)."""
    env = os.environ.get("ORCHESTRATOR_CONF_DIR")
    if env:
        return Path(env)
    source_tree = Path(__file__).resolve().parent.parent / "conf"
    return source_tree if source_tree.is_dir() else Path(__file__).resolve().parent / "conf"


def _load_yaml(path: Path, what: str) -> DictConfig:
    if not path.is_file():
        raise ConfigError(f"{what} {path}: no such file")
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # yaml.YAMLError carries the line; keep its first line
        msg = str(e).strip().splitlines()
        raise ConfigError(f"{path}: not valid YAML: {' '.join(m.strip() for m in msg[:3])}") from e
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path}: expected a mapping of config sections at the top level")
    return cfg


def _friendly(e: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(e, "full_key", None) or ""
    msg = str(e).splitlines()[0]
    if "not in struct" in msg or "Key '" in msg and "not in" in msg:
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        allowed = _allowed_keys(parent)
        return ConfigError(f"{source}: unknown key '{key}'; allowed here: {', '.join(allowed)}")
    enum = re.match(r"Invalid value '(.*)', expected one of \[(.*)\]", msg)
    if enum:  # a choice (orchestrator.choices): say it the way every other key's error reads
        return ConfigError(f"{source}: key '{key}': expected one of {enum.group(2)}, got {enum.group(1)!r}")
    return ConfigError(f"{source}: key '{key}': {msg}")


def _allowed_keys(parent: str) -> list[str]:
    node: Any = OmegaConf.structured(JobConfig)
    for part in [p for p in parent.split(".") if p]:
        node = node.get(part) if isinstance(node, DictConfig) else None
    return sorted(str(k) for k in node.keys()) if isinstance(node, DictConfig) else []


def _merge(base: DictConfig, other: DictConfig, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, other)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        raise _friendly(e, source) from e


def load_config(job_file: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Load a job: schema < conf/defaults.yaml < job `defaults:` < job file < overrides."""
    cfg: DictConfig = OmegaConf.structured(JobConfig)
    defaults = conf_dir() / "defaults.yaml"
    if defaults.is_file():
        cfg = _merge(cfg, _load_yaml(defaults, "defaults file"), str(defaults))
    if job_file is not None:
        job_path = Path(job_file)
        job = _load_yaml(job_path, "job file")
        includes = job.pop("defaults", [])
        if not OmegaConf.is_list(includes) and not isinstance(includes, list):
            raise ConfigError(f"{job_path}: 'defaults' must be a list of conf/ names, e.g. [cluster/dgx-h100]")
        for name in includes:
            inc = conf_dir() / f"{name}.yaml"
            if not inc.is_file():
                choices = sorted(str(p.relative_to(conf_dir()))[:-5] for p in conf_dir().rglob("*.yaml"))
                raise ConfigError(f"{job_path}: defaults entry '{name}' not found in conf/; "
                                  f"available: {', '.join(choices)}")
            cfg = _merge(cfg, _load_yaml(inc, "defaults file"), str(inc))
        cfg = _merge(cfg, job, str(job_path))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}': expected key=value, e.g. train.max_steps=100")
        try:
            dot = OmegaConf.from_dotlist([item])
        except OmegaConfBaseException as e:
            raise ConfigError(f"override '{item}': {str(e).splitlines()[0]}") from e
        cfg = _merge(cfg, dot, f"override '{item}'")
    job_cfg: JobConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    validate(job_cfg)
    return job_cfg


def _auto_or_positive_int(value: Any, key: str) -> None:
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"key '{key}': expected 'auto' or a positive integer, got {value!r}")


def _positive(value: float, key: str, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"key '{key}': must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


_COMPILE_CHOICES = {True: "true", False: "false", "true": "true", "false": "false", "on": "true", "off": "false",
                    "auto": "auto"}


def _compile_choice(value: Any) -> str:
    """`train.compile` as one of auto, true, false (YAML reads bare on/off/yes/no as booleans)."""
    key = value.lower() if isinstance(value, str) else value
    if isinstance(key, (bool, str)) and key in _COMPILE_CHOICES:
        return _COMPILE_CHOICES[key]
    raise ConfigError(f"key 'train.compile': expected auto, true or false, got {value!r}")


def validate(cfg: JobConfig) -> None:
    """Cross-field invariants the schema's types cannot state."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    for key in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
        _positive(getattr(m, key), f"model.{key}")
    if m.n_embd % m.n_head:
        raise ConfigError(f"key 'model.n_embd': must be divisible by model.n_head ({m.n_head}), got {m.n_embd}")
    if not 0 <= m.dropout < 1:
        raise ConfigError(f"key 'model.dropout': must be in [0, 1), got {m.dropout}")
    if not 0 < cfg.data.val_fraction < 1:
        raise ConfigError(f"key 'data.val_fraction': must be in (0, 1), got {cfg.data.val_fraction}")
    for key in ("path", "val_path"):
        if getattr(cfg.data, key) is not None and not Path(getattr(cfg.data, key)).is_file():
            raise ConfigError(f"key 'data.{key}': no such file {getattr(cfg.data, key)}")
    from .data.tokenfiles import check_data  # numpy: loaded only when a job is checked

    check_data(cfg.data.path, cfg.data.val_path, m.vocab_size, m.block_size)
    _positive(t.max_steps, "train.max_steps")
    _positive(t.global_batch_size, "train.global_batch_size")
    _auto_or_positive_int(t.micro_batch_size, "train.micro_batch_size")
    _positive(t.lr, "train.lr")
    _positive(t.min_lr, "train.min_lr", allow_zero=True)
    _positive(t.warmup_steps, "train.warmup_steps", allow_zero=True)
    _positive(t.grad_clip, "train.grad_clip", allow_zero=True)
    _positive(t.eval_interval, "train.eval_interval")
    _positive(t.eval_iters, "train.eval_iters")
    _positive(t.max_failures, "train.max_failures", allow_zero=True)
    t.compile = _compile_choice(t.compile)
    _auto_or_positive_int(p.tp, "parallel.tp")
    _auto_or_positive_int(p.dp_shard, "parallel.dp_shard")
    _auto_or_positive_int(p.cp, "parallel.cp")
    _auto_or_positive_int(p.ep, "parallel.ep")
    if isinstance(p.cp, int) and (problem := sequence_split_problem(p.cp, m.block_size)):
        allowed = ", ".join(str(c) for c in allowed_cps(m.block_size))
        raise ConfigError(f"key 'parallel.cp': {problem}; allowed up to {ALLOWED_UP_TO}: {allowed}")
    _auto_or_positive_int(p.pp, "parallel.pp")
    _auto_or_positive_int(p.pp_microbatches, "parallel.pp_microbatches")
    if p.trial is False:  # YAML reads a bare `off` as false
        p.trial = "off"
    if p.trial not in ("auto", "off") and (isinstance(p.trial, (bool, str)) or p.trial < 2):
        raise ConfigError(f"key 'parallel.trial': expected 'auto', 'off' or a number of plans >= 2, got {p.trial!r}")
    _positive(p.trial_steps, "parallel.trial_steps")
    if not 0 < p.trial_budget < 1:
        raise ConfigError(f"key 'parallel.trial_budget': a share of the run in (0, 1), got {p.trial_budget!r}")
    if isinstance(p.pp, int) and p.pp > m.n_layer:
        raise ConfigError(f"key 'parallel.pp': at most model.n_layer ({m.n_layer}) stages, one block each at least, "
                          f"got {p.pp}")
    if p.bucket_mb != "auto" and (isinstance(p.bucket_mb, str) or p.bucket_mb <= 0):
        raise ConfigError(f"key 'parallel.bucket_mb': expected 'auto' or a positive number, got {p.bucket_mb!r}")
    if m.hf_config is not None and not Path(m.hf_config).is_file():
        raise ConfigError(f"key 'model.hf_config': no such file {m.hf_config}")
    if m.hf_weights is not None and (m.hf_config is None or not Path(m.hf_weights).exists()):
        raise ConfigError(f"key 'model.hf_weights': needs model.hf_config and an existing safetensors file or "
                          f"checkpoint directory, got {m.hf_weights}")
    if ":" not in m.factory:
        raise ConfigError(f"key 'model.factory': expected 'package.module:callable', got {m.factory!r}")
    if isinstance(p.tp, int) and m.factory == GPT_FACTORY and m.hf_config is None and m.n_head % p.tp:
        raise ConfigError(f"key 'parallel.tp': must divide model.n_head ({m.n_head}), got {p.tp}")
    if isinstance(p.ep, int) and p.ep > 1 and m.factory == GPT_FACTORY and m.hf_config is None:
        raise ConfigError(f"key 'parallel.ep': the built-in GPT is dense (no experts to split), so only ep=1 runs; "
                          f"got {p.ep}")
    _positive(cfg.cluster.num_workers, "cluster.num_workers")
    _positive(cfg.cluster.cpus_per_worker, "cluster.cpus_per_worker")
    _positive(cfg.cluster.placement_timeout_s, "cluster.placement_timeout_s")
    _positive(cfg.cluster.nodes, "cluster.nodes")
    _positive(cfg.checkpoint.interval, "checkpoint.interval", allow_zero=True)
    _positive(cfg.checkpoint.keep_last, "checkpoint.keep_last")
    if cfg.checkpoint.export and not cfg.checkpoint.enabled:
        raise ConfigError("key 'checkpoint.export': exports the final checkpoint, so it needs checkpoint.enabled=true")
    _positive(cfg.monitor.log_interval, "monitor.log_interval")
    unknown = [name for name in cfg.monitor.trackers if name not in TRACKERS]
    if unknown:
        raise ConfigError(f"key 'monitor.trackers': unknown tracker {unknown[0]!r}; each must be one of "
                          f"{', '.join(TRACKERS)}")
    _positive(cfg.elastic.min_workers, "elastic.min_workers")
    _positive(cfg.elastic.max_workers, "elastic.max_workers", allow_zero=True)
    _positive(cfg.elastic.leave_timeout_s, "elastic.leave_timeout_s")
    _positive(cfg.elastic.silent_after_s, "elastic.silent_after_s", allow_zero=True)
    if cfg.elastic.max_workers and cfg.elastic.max_workers < cfg.elastic.min_workers:
        raise ConfigError(
            f"key 'elastic.max_workers': must be 0 or >= elastic.min_workers ({cfg.elastic.min_workers}), "
            f"got {cfg.elastic.max_workers}"
        )
    if not cfg.name or any(c in cfg.name for c in "/\\ "):
        raise ConfigError(f"key 'name': a non-empty name without '/', '\\' or spaces, got {cfg.name!r}")


def to_yaml(cfg: JobConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: JobConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg))  # type: ignore[return-value]
