"""Engine configuration: which target, which drafters, how to batch and speculate."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from cosine_ray.engine.drafters.spec import (DEFAULT_DRAFTERS, DRAFTER_KINDS, DrafterSpec,  # noqa: F401 (re-exported)
                                            parse_drafters)
from cosine_ray.models.device import RUNNER_MODES, check_device_name, check_dtype_name
from cosine_ray.models.native import check_weights_mode

if TYPE_CHECKING:
    from cosine_ray.models.loader import Checkpoint


CPU_MAX_NUM_SEQS = 8
CUDA_MAX_NUM_SEQS = 64
"""On CUDA: the largest batch whose graphs the step runner captured and measured (``models.runner``
follows ``max_num_seqs`` up to 256: a larger setting captures larger buckets at start)."""
CPU_MAX_NUM_BATCHED_TOKENS = 512
CUDA_MAX_NUM_BATCHED_TOKENS = 2048
ROUTING_MODES = ("expertise", "random")
FUSION_MODES = ("confidence", "single", "union")
SCHEDULERS = ("lp", "fcfs")
PIPELINE_MODES = ("lanes", "pipedec")
PEARL_MODES = ("off", "on", "auto")
OVERLAP_MODES = ("auto", "on", "off")


@dataclass(frozen=True, slots=True)
class ExperimentsConfig:
    """Research modes, ablations and tuning knobs (config key ``experiments``). The defaults are
    what measures best; a user serving a model needs none of them (docs/configuration.md)."""

    min_tree_confidence: float = 0.25
    """With ``scheduler="fcfs"`` (LP off): draft nodes whose cumulative confidence (product
    along their path) is below this are not verified. The LP decides γ_i itself."""
    routing: str = "expertise"
    """expertise (CoSine eq. 1-3) | random (ablation: routing off, k drafters at random)."""
    fusion: str = "confidence"
    """confidence (eq. 4, round by round) | single (ablation: the best routed drafter alone) |
    union (every routed drafter's whole paths merged)."""
    scheduler: str = "lp"
    """lp (eq. 5-8 with scipy HiGHS) | fcfs (ablation: first come, fixed size, fixed cut)."""
    adaptive: bool = True
    """False (ablation): fixed γ and fixed drafter participation."""
    drafters_per_request: int = 2
    """k: drafters routed to each request per step (adaptive: where participation starts)."""
    shared_drafters: tuple[str, ...] = ("ngram", "head")
    """Domain-agnostic drafters every request uses besides its k routed ones (the context
    n-gram drafter costs a dictionary lookup and knows the request's own text better than any
    domain expert; a feature head is trained on every domain). Names not in the pool are
    ignored; with ``fusion="single"`` they compete for the one slot like every other drafter."""
    max_drafters_per_request: int = 3
    total_gamma_max: int = 64
    """Γ_max: draft tokens per micro-batch (eq. 6; Algorithm 2 trims above it)."""
    step_time_max_s: float = 5.0
    """T_max: the scheduler keeps a step's predicted time under this (eq. 7)."""
    kv_budget_bytes: float = float("inf")
    """M_max (eq. 7): KV bytes (all stages) that running requests may hold; the scheduler
    defers the prefill of a request that would exceed it. inf = no budget."""
    drain_pricing: bool = True
    """While the pool drains (nothing waits, fewer run than at the last admission), a token
    is worth what it shortens the drain: only the requests that will finish last draft at
    the full price (``engine.owners.scheduler``). False: every request at the full price always."""
    twins: bool = True
    """Identical greedy requests in flight draft from each other: a follower takes the text
    its leader already wrote as its draft, and waits while the leader is less than a whole
    tree ahead (``engine.modes.twins``). Needs drafters and γ_max > 0. False: they run apart."""
    drafter_deadline_s: float = 2.0
    """A drafter's answer later than this is dropped for the step."""
    stage_recovery_s: float = 60.0
    """How long a lost stage may take to come back before its requests fail."""
    max_restores: int = 3
    """Re-prefills one request may go through before it fails (a bug must not loop)."""
    num_lanes: int = 1
    """Micro-batches in flight at once: running requests are split into this many lanes,
    each stepped by its own coroutine, so with S pipeline stages stage s can work on lane
    n while stage s+1 works on lane n-1. 1 for the in-process engine."""
    pipeline_mode: str = "lanes"
    """lanes: every step verifies whole speculation trees (micro-batches in lanes) | pipedec:
    a request alone in the pool runs PipeDec's timestep loop instead (``engine.modes.pipedec``:
    every stage works on another layer of one growing prediction tree; the request goes back
    to lanes when another request arrives)."""
    pipedec_width: int = 4
    """PipeDec: nodes per tree layer at most (the children with the highest cumulative
    confidence)."""
    pipedec_depth: int = 0
    """PipeDec: tree layers below the root at most (0: the number of stages, what one hit per
    timestep can use)."""
    pipedec_guard: bool = True
    """PipeDec: measure a request alone in PipeDec and in lanes and keep the faster mode,
    probing the other now and then (``engine.modes.pipedec.ModeGuard``); False: always PipeDec."""
    pearl: str = "off"
    """PEARL (``engine.modes.pearl``): each step verifies the tree the previous step drafted ahead
    while the drafters draft ahead of it (post-verify), so drafting and verification overlap.
    off | on: with nothing drafted ahead, a step verifies its root alone while the drafters
    draft (pre-verify, the paper's rule) | auto: it does so only while drafting measures at
    least as long as verification, and otherwise drafts first (drafting is cheap: a root-only
    step would waste a verification). For drafters whose drafting takes time (model drafters,
    drafter actors across a link). YAML booleans mean off and on."""
    overlap_learning: str = "auto"
    """What a step learns from its verification (calibration, routing scores, gains, drafter
    feedback, the latency fit, metrics) is done while the *next* step's forward runs, so that
    host work overlaps the GPU (``Learner.record``/``absorb``); a request's own counts and
    the guard's step time are still taken at once. on | off | auto: on when the target's
    forward runs asynchronously to the host (an in-process target on CUDA), off otherwise
    (on a CPU the forward holds the host, so deferring would only make learning a step
    late). YAML booleans mean off and on."""

    runner: str = "auto"
    """How stages run a step (``models.runner``): ``auto`` (CUDA graphs on CUDA, eager on CPU),
    ``eager`` (``--enforce-eager``: never capture), ``graph``, or ``static`` (the graphs'
    fixed-shape step run eagerly, on any device: how CPU tests check the graph path)."""
    suffix_index_tokens: int = 1_000_000
    """Tokens each suffix drafter's global index keeps: past it, the oldest whole requests are
    evicted first (about 60 MB a drafter at the default)."""
    layer_parallel_drafting: bool = False
    """Distilled domain drafters draft EasySpec's way: after a step's first draft token, every
    layer's attention reads the hidden state entering the first layer, and the inexact KV is
    recomputed with the next step's bonus token. Off: on the trained two-layer drafters it
    lowers tokens a step by 0.4-18 % for a 4-10 % faster draft forward (docs/drafters.md)."""

    def __post_init__(self) -> None:
        if self.runner not in RUNNER_MODES:
            raise ValueError(f"runner {self.runner!r}: use {', '.join(RUNNER_MODES)}")
        if isinstance(self.suffix_index_tokens, bool) or not isinstance(self.suffix_index_tokens, int) \
                or self.suffix_index_tokens < 1:
            raise ValueError(f"suffix_index_tokens must be an integer >= 1, got {self.suffix_index_tokens!r}")
        if self.drafter_deadline_s <= 0:
            raise ValueError("drafter_deadline_s must be > 0")
        if self.num_lanes < 1:
            raise ValueError("num_lanes must be >= 1")
        if self.pipeline_mode not in PIPELINE_MODES:
            raise ValueError(f"pipeline_mode {self.pipeline_mode!r}: use one of {', '.join(PIPELINE_MODES)}")
        if isinstance(self.pearl, bool):
            object.__setattr__(self, "pearl", "on" if self.pearl else "off")
        if self.pearl not in PEARL_MODES:
            raise ValueError(f"pearl {self.pearl!r}: use one of {', '.join(PEARL_MODES)}")
        if isinstance(self.overlap_learning, bool):
            object.__setattr__(self, "overlap_learning", "on" if self.overlap_learning else "off")
        if self.overlap_learning not in OVERLAP_MODES:
            raise ValueError(f"overlap_learning {self.overlap_learning!r}: use one of {', '.join(OVERLAP_MODES)}")
        if self.pipedec_width < 1 or self.pipedec_depth < 0:
            raise ValueError("pipedec_width must be >= 1 and pipedec_depth >= 0")
        if isinstance(self.shared_drafters, str) or not all(isinstance(n, str) for n in self.shared_drafters):
            raise ValueError("shared_drafters must be a list of drafter names")
        object.__setattr__(self, "shared_drafters", tuple(self.shared_drafters))
        for name, value, allowed in (("routing", self.routing, ROUTING_MODES), ("fusion", self.fusion, FUSION_MODES),
                                     ("scheduler", self.scheduler, SCHEDULERS)):
            if value not in allowed:
                raise ValueError(f"{name} {value!r}: use one of {', '.join(allowed)}")
        if not 1 <= self.drafters_per_request <= self.max_drafters_per_request:
            raise ValueError("need 1 <= drafters_per_request <= max_drafters_per_request")
        if self.total_gamma_max < 0 or self.step_time_max_s <= 0:
            raise ValueError("total_gamma_max must be >= 0 and step_time_max_s > 0")
        if not self.kv_budget_bytes >= 0:
            raise ValueError("kv_budget_bytes must be >= 0 (inf = no budget)")


@dataclass(frozen=True, slots=True)
class StepConfig(ExperimentsConfig):
    """What the engine core's owners read: the user's step settings (``EngineConfig``) and the
    experiments, flattened (``EngineConfig.step``; tests build it directly)."""

    max_num_seqs: int = 8
    """Requests running at once, at most (``EngineConfig.max_num_seqs``)."""
    num_speculative_tokens: int = 8
    """γ_max: draft-token budget of one request's tree per step (0 = plain decoding)."""
    max_model_len: int = 8192
    """Prompt + output tokens a request may reach."""
    max_num_batched_tokens: int = 512
    """Tokens one step computes at most (``EngineConfig.max_num_batched_tokens``)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of cached prompt prefixes (``EngineConfig.enable_prefix_caching``)."""

    def __post_init__(self) -> None:
        ExperimentsConfig.__post_init__(self)
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                             f"max_num_seqs ({self.max_num_seqs}): every running request needs a token a step")


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """How the Ray runtime places and supervises actors (ignored by the local engine)."""

    address: str | None = None
    """Ray cluster to join (``auto``, ``HOST:PORT``, ``ray://...``); None starts a local one."""
    use_resources: bool = False
    """Stages ask for the custom resource ``datacenter_gpu`` and drafters for
    ``consumer_gpu`` (advertise them with ``ray start --resources=...``)."""
    num_cpus_per_actor: float = 0.5
    """Ray CPU reservation of each stage/drafter actor (the engine replica reserves none, or a
    stage's with ``stages_in_engine``)."""
    threads_per_actor: int = 1
    """torch intra-op threads inside each actor, so actors do not fight over cores."""
    stage_deadline_s: float = 60.0
    """A stage-chain forward slower than this counts as a lost stage (re-prefill)."""
    drafter_max_restarts: int = -1
    """Ray restarts of a drafter actor (-1 = unlimited); a drafter killed for good is respawned."""
    stage_max_restarts: int = -1
    stages_in_engine: bool = False
    """The target's stages run inside the engine replica, one after another, instead of one
    actor each (vLLM's single-process executor): on a machine of a few cores this saves a
    process that imports torch per stage (CPU-seconds at start, memory) and the Ray calls of
    every step. A feature head then drafts in the engine too. Stage actors are what spreads the
    target over devices and nodes, and what a lost stage restarts: in the engine there is no
    stage to lose, ``stage_deadline_s``, ``stage_max_restarts`` and ``stage_recovery_s`` do not
    apply, and a forward that fails fails its requests (CLI ``--stages-in-engine``). Where
    neither its file nor a flag says, ``cosine-ray serve`` sets it when it starts a local cluster
    on CPU without ``use_resources`` (one machine), and leaves it false otherwise."""
    drafters_in_engine: tuple[str, ...] = ("ngram", "retrieval", "suffix")
    """Drafter kinds that run inside the engine process instead of an actor of their own: the
    n-gram, retrieval and suffix drafters are table lookups (no model, no GPU) that take micro-
    seconds, while a round trip to another process costs a millisecond or more per fusion
    round. ``()`` (CLI ``--drafters-in-engine none``) gives every drafter its own actor.
    (``drafters_in_router``, its name before the engine became a Serve deployment, is accepted.)"""

    def __post_init__(self) -> None:
        in_engine = self.drafters_in_engine
        if isinstance(in_engine, str):
            in_engine = () if in_engine.strip() in ("", "none") else [k.strip() for k in in_engine.split(",")]
        object.__setattr__(self, "drafters_in_engine", tuple(in_engine))
        known = DRAFTER_KINDS[1:]  # without "none"
        unknown = sorted(set(self.drafters_in_engine) - set(known))
        if unknown:
            raise ValueError(f"drafters_in_engine: unknown kind(s) {', '.join(unknown)}; "
                             f"use none or a comma list of {', '.join(known)}")
        if self.num_cpus_per_actor < 0 or self.threads_per_actor < 1:
            raise ValueError("num_cpus_per_actor must be >= 0 and threads_per_actor >= 1")
        if self.stage_deadline_s <= 0:
            raise ValueError("stage_deadline_s must be > 0")
        if not isinstance(self.stages_in_engine, bool):
            raise ValueError(f"stages_in_engine must be true or false, got {self.stages_in_engine!r}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What a user configures: the model, the drafters, where it runs and how much it batches.
    Deployment settings are in ``cluster``, research modes and tuning knobs in ``experiments``."""

    model: str = "smollm2-135m"
    """Target model: embedded name, Hugging Face directory or .gguf file."""
    drafters: tuple[DrafterSpec, ...] = field(default_factory=lambda: parse_drafters(DEFAULT_DRAFTERS))
    """Speculation sources; () = plain decoding."""
    num_stages: int = 1
    """Contiguous layer slices of the target (pipeline stages)."""
    weights: str = "dense"
    """How a GGUF model's weights are held (``models.native``): dense (dequantized to ``dtype``:
    fp32 output is identical to Hugging Face transformers) | native (its Q4_0/Q4_1/Q5_0/Q5_1/Q8_0
    and Q4_K/Q5_K/Q6_K blocks kept quantized: on CPU our own kernel with activations rounded to 8
    bits a group of 32, on CUDA PyTorch's int4 kernel with bf16 ones, the 5- and 6-bit formats
    dequantized there; faster, lossless against our own decode on that path, not against HF fp32) |
    auto (native for GGUF models except fp32 on CUDA)."""
    device: str = "cpu"
    """cpu | cuda | cuda:N. Stage and drafter actors ask Ray for one GPU each on CUDA."""
    dtype: str = "float32"
    """float32 | bfloat16 | float16 (the half types pay on CUDA; on CPU they run, slowly)."""
    max_num_seqs: int | None = None
    """Requests running at once, at most; fewer when their KV does not fit the pool (continuous
    batching admits new ones as others finish). None: 8 on CPU, 64 on CUDA."""
    max_num_batched_tokens: int | None = None
    """Tokens one step computes at most: decodes and draft trees first, then prompt chunks, so a
    long prompt is prefilled over several steps while the running requests keep streaming.
    None: 512 on CPU, 2048 on CUDA."""
    enable_prefix_caching: bool = True
    """Reuse the KV of prompt prefixes already computed (multi-turn chats, shared system
    prompts); ``--no-prefix-caching`` turns it off."""
    max_model_len: int = 8192
    """Prompt + output tokens a request may reach (capped at the model's context)."""
    num_speculative_tokens: int = 8
    """Draft-token budget of one request's tree per step (γ_max; 0 = plain decoding)."""
    kv_cache_memory: int | str | None = None
    """Bytes of each stage's paged KV pool (``models.kv_cache``), an integer or a size such as
    ``"2GiB"``, allocated at start and never grown. None: on CUDA 90 % of the device memory free
    after the weights (shared by the stages of one process on one device); on CPU the pools
    grow as blocks are first used, up to 20 % of the memory available at start for the whole
    model's KV (``engine.worker.target.CPU_KV_MEMORY_SHARE``); the prefix cache fills it."""
    num_threads: int | None = None
    """torch intra-op threads of the in-process engine; None leaves torch's default. Serve's
    engine replica runs 1, or with ``cluster.stages_in_engine`` this (None: the stage actors'
    threads together)."""
    datastore_dir: str | None = None
    """Where default retrieval datastores live; None = the packaged ones."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """How the Ray runtime places and supervises actors."""
    experiments: ExperimentsConfig = field(default_factory=ExperimentsConfig)
    """Research modes, ablations and tuning knobs."""

    def __post_init__(self) -> None:
        if self.experiments.runner == "graph" and not str(self.device).startswith("cuda"):
            raise ValueError("runner 'graph' (CUDA graphs) needs device cuda")
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory, "kv_cache_memory"))
        if self.num_stages < 1:
            raise ValueError("num_stages must be >= 1")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        check_dtype_name(self.dtype)
        check_device_name(self.device)
        check_weights_mode(self.weights)

    @property
    def step(self) -> StepConfig:
        """The step settings the engine core reads (the user's, with this device's defaults,
        and the experiments')."""
        on_cuda = str(self.device).startswith("cuda")
        seqs = self.max_num_seqs or (CUDA_MAX_NUM_SEQS if on_cuda else CPU_MAX_NUM_SEQS)
        tokens = self.max_num_batched_tokens or (CUDA_MAX_NUM_BATCHED_TOKENS if on_cuda else CPU_MAX_NUM_BATCHED_TOKENS)
        return StepConfig(max_num_seqs=seqs, num_speculative_tokens=self.num_speculative_tokens,
                          max_model_len=self.max_model_len, max_num_batched_tokens=max(tokens, seqs),
                          enable_prefix_caching=self.enable_prefix_caching,
                          **{f.name: getattr(self.experiments, f.name) for f in fields(ExperimentsConfig)})

    @property
    def runner(self) -> str:
        return self.experiments.runner

    def replace(self, **changes: Any) -> "EngineConfig":
        """A copy with ``changes``, each key a field of this class, of ``experiments`` or of
        ``cluster`` (one namespace: the names do not overlap)."""
        top = {f.name for f in fields(EngineConfig)}
        exp = {f.name for f in fields(ExperimentsConfig)}
        clu = {f.name for f in fields(ClusterConfig)}
        unknown = sorted(set(changes) - top - exp - clu)
        if unknown:
            raise ValueError(f"unknown setting(s) {', '.join(unknown)}")
        experiments = dataclasses.replace(self.experiments, **{k: v for k, v in changes.items() if k in exp})
        cluster = dataclasses.replace(self.cluster, **{k: v for k, v in changes.items() if k in clu})
        return dataclasses.replace(self, experiments=experiments, cluster=cluster,
                                   **{k: v for k, v in changes.items() if k in top})


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | str, name: str) -> int:
    """A byte count: an integer, or a number with a unit (``512MiB``, ``2GiB``, ``1.5GB``)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a byte count such as 2GiB, got {value!r}")
    if isinstance(value, int):
        number = value
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", str(value))
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{name} must be a byte count such as 2GiB, got {value!r}")
        number = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if number < 1:
        raise ValueError(f"{name} must be at least 1 byte, got {value!r}")
    return number


def _build(cls: type, data: dict[str, Any], where: str):
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)} in {where}; known: {', '.join(sorted(names))}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from None


STEP_KEYS = ("max_num_seqs", "max_model_len", "num_speculative_tokens", "max_num_batched_tokens",
             "enable_prefix_caching")
"""User keys that older configs gave under ``step`` (or ``router``)."""
LEGACY_KEYS = {"max_batch_size": "max_num_seqs"}
"""Old names still accepted in a config file."""


def config_from_dict(data: dict[str, Any] | None) -> EngineConfig:
    """EngineConfig from plain data (YAML file, Serve ``args``); ValueError names bad keys.

    ``drafters`` may be a string (``"ngram,retrieval"``) or a list of such names; ``cluster``
    and ``experiments`` are mappings of ClusterConfig / ExperimentsConfig fields. Configs
    written before the split keep working: a ``step`` (or ``router``) mapping is spread into
    the user keys and ``experiments``, and ``max_batch_size`` is ``max_num_seqs``."""
    data = dict(data or {})
    if not isinstance(data, dict):
        raise ValueError("the config must be a mapping")
    drafters = data.pop("drafters", None)
    if "router" in data and "step" in data:
        raise ValueError("give the step settings once: 'step' (or its old name 'router'), not both")
    legacy = data.pop("step", None) or data.pop("router", None) or {}
    cluster = data.pop("cluster", None) or {}
    experiments = data.pop("experiments", None) or {}
    if not isinstance(legacy, dict) or not isinstance(cluster, dict) or not isinstance(experiments, dict):
        raise ValueError("'step' and 'cluster' must be mappings (and 'experiments')")
    experiments = dict(experiments)
    known = set(STEP_KEYS) | set(LEGACY_KEYS) | {f.name for f in fields(ExperimentsConfig)}
    unknown = sorted(set(legacy) - known)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)} in step; known: {', '.join(sorted(known))}")
    for key, value in legacy.items():
        key = LEGACY_KEYS.get(key, key)
        target = data if key in STEP_KEYS else experiments
        if key in target:
            raise ValueError(f"{key} is given twice (once under 'step')")
        target[key] = value
    for key in ("suffix_index_tokens", "runner"):  # top-level keys before the split
        if key in data:
            if key in experiments:
                raise ValueError(f"{key} is given twice (top level and 'experiments')")
            experiments[key] = data.pop(key)
    if "drafters_in_router" in cluster:  # the name before the engine became a Serve deployment
        if "drafters_in_engine" in cluster:
            raise ValueError("give cluster.drafters_in_engine once (drafters_in_router is its old name)")
        cluster = {**cluster, "drafters_in_engine": cluster["drafters_in_router"]}
        del cluster["drafters_in_router"]
    if drafters is not None:
        if isinstance(drafters, (list, tuple)):
            drafters = ",".join(str(d) for d in drafters) or "none"
        data["drafters"] = parse_drafters(str(drafters))
    data["experiments"] = _build(ExperimentsConfig, experiments, "experiments")
    data["cluster"] = _build(ClusterConfig, cluster, "cluster")
    return _build(EngineConfig, data, "the config")


def config_to_dict(config: EngineConfig) -> dict[str, Any]:
    out = {f.name: getattr(config, f.name) for f in fields(config)}
    out["drafters"] = ",".join(s.kind + (f":{s.source}" if s.source else "") for s in config.drafters) or "none"
    out["experiments"] = {f.name: getattr(config.experiments, f.name) for f in fields(config.experiments)}
    out["cluster"] = {f.name: getattr(config.cluster, f.name) for f in fields(config.cluster)}
    return out


def step_config_for(config: EngineConfig, checkpoint: Checkpoint) -> StepConfig:
    """The configured step settings, capped at the model's context length."""
    return dataclasses.replace(config.step, max_model_len=min(
        config.step.max_model_len, checkpoint.config.max_position_embeddings))
