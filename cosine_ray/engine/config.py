"""Engine configuration: one tree, each part read by the owner that uses it (vLLM's VllmConfig).

``EngineConfig`` holds what is served and where (model, drafters, stages, device) and five
parts: ``scheduler`` (what a step batches), ``speculation`` (what and how it drafts),
``runtime`` (how stages and drafters run and fail), ``cluster`` (Ray placement) and
``experiments`` (ablations). A YAML file or Serve ``args`` has the same shape
(``config_from_dict``); docs/configuration.md is generated from the docstrings here.

A default that depends on the device or on where the stages run is None until
``EngineConfig.resolved`` fills it in, once, when an engine is built (with the model's context).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field, fields
from typing import Any

from cosine_ray.engine.drafters.spec import (DEFAULT_DRAFTERS, DRAFTER_KINDS, DrafterSpec,  # noqa: F401 (re-exported)
                                            parse_drafters)
from cosine_ray.models.device import RUNNER_MODES, check_device_name, check_dtype_name
from cosine_ray.models.weights.native import check_weights_mode

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


def _on_off(value: Any) -> Any:
    """YAML booleans for a mode that is off | on | auto."""
    return ("on" if value else "off") if isinstance(value, bool) else value


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """What a step batches (``BatchScheduler``, ``RequestPool``, ``KVBlocks``, the lanes of
    ``EngineLoop``): how many requests and tokens, the LP's bounds (eq. 5-8) and the KV it may use."""

    max_num_seqs: int | None = None
    """Requests running at once, at most; fewer when their KV does not fit the pool (continuous
    batching admits new ones as others finish). None: 8 on CPU, 64 on CUDA."""
    max_num_batched_tokens: int | None = None
    """Tokens one step computes at most: decodes and draft trees first, then prompt chunks, so a
    long prompt is prefilled over several steps while the running requests keep streaming.
    None: 512 on CPU, 2048 on CUDA (and at least ``max_num_seqs``)."""
    max_model_len: int = 8192
    """Prompt + output tokens a request may reach (capped at the model's context)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of prompt prefixes already computed (multi-turn chats, shared system
    prompts); ``--no-prefix-caching`` turns it off."""
    num_lanes: int | None = None
    """Micro-batches in flight at once: running requests are split into this many lanes, each
    stepped by its own coroutine, so with S pipeline stages stage s can work on lane n while
    stage s+1 works on lane n-1. None: one per stage when the stages are actors (every stage
    has work), 1 when they run one after another in the engine's process (the in-process
    engine, ``cluster.stages_in_engine``), where one lane keeps the batch whole."""
    step_time_max_s: float = 5.0
    """T_max: the scheduler keeps a step's predicted time under this (eq. 7)."""
    total_gamma_max: int = 64
    """Γ_max: draft tokens per micro-batch (eq. 6; Algorithm 2 trims above it)."""
    kv_budget_bytes: float = float("inf")
    """M_max (eq. 7): KV bytes (all stages) that running requests may hold; the scheduler
    defers the prefill of a request that would exceed it. inf = no budget."""
    drain_pricing: bool = True
    """While the pool drains (nothing waits, fewer run than at the last admission), a token
    is worth what it shortens the drain: only the requests that will finish last draft at
    the full price (``engine.owners.scheduler``). False: every request at the full price always."""

    def __post_init__(self) -> None:
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if (self.max_num_seqs is not None and self.max_num_batched_tokens is not None
                and self.max_num_batched_tokens < self.max_num_seqs):
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                             f"max_num_seqs ({self.max_num_seqs}): every running request needs a token a step")
        if self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if self.num_lanes is not None and self.num_lanes < 1:
            raise ValueError("num_lanes must be >= 1")
        if self.total_gamma_max < 0 or self.step_time_max_s <= 0:
            raise ValueError("total_gamma_max must be >= 0 and step_time_max_s > 0")
        if not self.kv_budget_bytes >= 0:
            raise ValueError("kv_budget_bytes must be >= 0 (inf = no budget)")


@dataclass(frozen=True, slots=True)
class SpeculationConfig:
    """What a step drafts and how (``Speculator``, ``DraftRouting``, ``Learner`` and the modes
    of ``engine.modes``): the draft budget, the drafters each request gets, PipeDec, PEARL and
    twins."""

    num_speculative_tokens: int = 8
    """γ_max: draft-token budget of one request's tree per step (0 = plain decoding)."""
    long_draft_tokens: int = 32
    """Largest draft budget of one request's tree per step. A request whose last tree reached
    depth d (its drafters matched long: a prediction, copied context, a repeated answer) gets
    a budget of 2·d, at least γ_max and at most this; the price then verifies as many nodes as
    their expected gains pay for. At most γ_max (or 0): every budget is γ_max."""
    drafters_per_request: int = 2
    """k: drafters routed to each request per step (adaptive: where participation starts)."""
    max_drafters_per_request: int = 3
    """Upper bound of k when the participation adapts."""
    shared_drafters: tuple[str, ...] = ("ngram", "head")
    """Domain-agnostic drafters every request uses besides its k routed ones (the context
    n-gram drafter costs a dictionary lookup and knows the request's own text better than any
    domain expert; a feature head is trained on every domain). Names not in the pool are
    ignored; with ``experiments.fusion: single`` they compete for the one slot like every other
    drafter."""
    twins: bool = True
    """Identical greedy requests in flight draft from each other: a follower takes the text
    its leader already wrote as its draft, and waits while the leader is less than a whole
    tree ahead (``engine.modes.twins``). Needs drafters and γ_max > 0. False: they run apart."""
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

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0 or self.long_draft_tokens < 0:
            raise ValueError("num_speculative_tokens and long_draft_tokens must be >= 0")
        if not 1 <= self.drafters_per_request <= self.max_drafters_per_request:
            raise ValueError("need 1 <= drafters_per_request <= max_drafters_per_request")
        if isinstance(self.shared_drafters, str) or not all(isinstance(n, str) for n in self.shared_drafters):
            raise ValueError("shared_drafters must be a list of drafter names")
        object.__setattr__(self, "shared_drafters", tuple(self.shared_drafters))
        if self.pipeline_mode not in PIPELINE_MODES:
            raise ValueError(f"pipeline_mode {self.pipeline_mode!r}: use one of {', '.join(PIPELINE_MODES)}")
        if self.pipedec_width < 1 or self.pipedec_depth < 0:
            raise ValueError("pipedec_width must be >= 1 and pipedec_depth >= 0")
        for name, allowed in (("pearl", PEARL_MODES), ("overlap_learning", OVERLAP_MODES)):
            object.__setattr__(self, name, _on_off(getattr(self, name)))
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} {getattr(self, name)!r}: use one of {', '.join(allowed)}")


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """How the stages and drafters run a step and what the engine does when one fails
    (``StepRunner``, the drafter clients, ``RecoveringTarget``, ``RequestPool``)."""

    runner: str = "auto"
    """How stages run a step (``models.runner``): ``auto`` (CUDA graphs on CUDA, eager on CPU),
    ``eager`` (``--enforce-eager``: never capture), ``graph``, or ``static`` (the graphs'
    fixed-shape step run eagerly, on any device: how CPU tests check the graph path)."""
    drafter_deadline_s: float = 2.0
    """A drafter's answer later than this is dropped for the step."""
    stage_recovery_s: float = 60.0
    """How long a lost stage may take to come back before its requests fail."""
    max_restores: int = 3
    """Re-prefills one request may go through before it fails (a bug must not loop)."""
    suffix_index_tokens: int = 1_000_000
    """Tokens each suffix drafter's global index keeps: past it, the oldest whole requests are
    evicted first (about 60 MB a drafter at the default)."""
    log_stats_interval_s: float = 5.0
    """The Serve engine replica logs one line of serving figures this often while it has work
    (throughput, running and waiting requests, KV use, acceptance; ``cosine-ray serve
    --disable-log-stats``: 0, none)."""

    def __post_init__(self) -> None:
        if self.runner not in RUNNER_MODES:
            raise ValueError(f"runner {self.runner!r}: use {', '.join(RUNNER_MODES)}")
        if self.drafter_deadline_s <= 0:
            raise ValueError("drafter_deadline_s must be > 0")
        if self.stage_recovery_s <= 0 or self.max_restores < 0:
            raise ValueError("stage_recovery_s must be > 0 and max_restores >= 0")
        if isinstance(self.suffix_index_tokens, bool) or not isinstance(self.suffix_index_tokens, int) \
                or self.suffix_index_tokens < 1:
            raise ValueError(f"suffix_index_tokens must be an integer >= 1, got {self.suffix_index_tokens!r}")
        if not self.log_stats_interval_s >= 0:
            raise ValueError(f"log_stats_interval_s must be >= 0 (0: no stats line), got {self.log_stats_interval_s!r}")


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """How the Ray runtime places and supervises actors (ignored by the in-process engine)."""

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
    """Ray restarts of a stage actor (-1 = unlimited)."""
    stages_in_engine: bool = False
    """The target's stages run inside the engine replica, one after another, instead of one
    actor each (vLLM's single-process executor): on a machine of a few cores this saves a
    process that imports torch per stage (CPU-seconds at start, memory) and the Ray calls of
    every step. A feature head then drafts in the engine too. Stage actors are what spreads the
    target over devices and nodes, and what a lost stage restarts: in the engine there is no
    stage to lose, ``stage_deadline_s``, ``stage_max_restarts`` and ``runtime.stage_recovery_s``
    do not apply, and a forward that fails fails its requests (CLI ``--stages-in-engine``). Where
    neither its file nor a flag says, ``cosine-ray serve`` sets it when it starts a local cluster
    on CPU without ``use_resources`` (one machine), and leaves it false otherwise."""
    drafters_in_engine: tuple[str, ...] = ("ngram", "retrieval", "suffix")
    """Drafter kinds that run inside the engine process instead of an actor of their own: the
    n-gram, retrieval and suffix drafters are table lookups (no model, no GPU) that take micro-
    seconds, while a round trip to another process costs a millisecond or more per fusion
    round. ``()`` (CLI ``--drafters-in-engine none``) gives every drafter its own actor."""
    engine_replicas: int | str = 1
    """Engine replicas of the Serve deployment, each a whole pipeline with its own stages and
    drafters (CLI ``--engine-replicas``): an integer N >= 1, or ``"MIN,MAX"`` or ``auto``
    (``"1,4"``) for Serve's autoscaling on the requests each replica holds (docs/scaling.md).
    With more than one, requests that share a prompt prefix go to the same replica and a
    request whose replica dies continues on another from the tokens it already produced."""

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
        object.__setattr__(self, "engine_replicas", _replicas_setting(self.engine_replicas))

    @property
    def engine_replica_range(self) -> tuple[int, int]:
        """(fewest, most) engine replicas: equal unless ``engine_replicas`` autoscales."""
        if isinstance(self.engine_replicas, int):
            return self.engine_replicas, self.engine_replicas
        low, high = self.engine_replicas.split(",")
        return int(low), int(high)


AUTO_ENGINE_REPLICAS = "1,4"
"""What ``engine_replicas: auto`` scales between."""


def _replicas_setting(value: Any) -> int | str:
    """``engine_replicas`` as an integer >= 1 or ``"MIN,MAX"`` (1 <= MIN <= MAX, MIN < MAX)."""
    text = str(value).strip().lower()
    if text == "auto":
        text = AUTO_ENGINE_REPLICAS
    parts = text.split(",")
    try:
        if isinstance(value, bool) or len(parts) > 2:
            raise ValueError
        numbers = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"engine_replicas must be an integer >= 1, auto or MIN,MAX, got {value!r}") from None
    if min(numbers) < 1 or numbers != sorted(numbers):
        raise ValueError(f"engine_replicas must be >= 1 (MIN <= MAX), got {value!r}")
    if len(numbers) == 1 or numbers[0] == numbers[1]:
        return numbers[0]
    return f"{numbers[0]},{numbers[1]}"


@dataclass(frozen=True, slots=True)
class ExperimentsConfig:
    """The paper's ablations and research modes. The defaults are CoSine as it measures best; a
    user serving a model needs none of them."""

    routing: str = "expertise"
    """expertise (CoSine eq. 1-3) | random (ablation: routing off, k drafters at random)."""
    fusion: str = "confidence"
    """confidence (eq. 4, round by round) | single (ablation: the best routed drafter alone) |
    union (every routed drafter's whole paths merged)."""
    scheduler: str = "lp"
    """lp (eq. 5-8 with scipy HiGHS) | fcfs (ablation: first come, fixed size, fixed cut)."""
    adaptive: bool = True
    """False (ablation): fixed γ and fixed drafter participation."""
    min_tree_confidence: float = 0.25
    """With ``scheduler: fcfs`` (LP off): draft nodes whose cumulative confidence (product
    along their path) is below this are not verified. The LP decides γ_i itself."""
    layer_parallel_drafting: bool = False
    """Distilled domain drafters draft EasySpec's way: after a step's first draft token, every
    layer's attention reads the hidden state entering the first layer, and the inexact KV is
    recomputed with the next step's bonus token. Off: on the trained two-layer drafters it
    lowers tokens a step by 0.4-18 % for a 4-10 % faster draft forward (docs/drafters.md)."""

    def __post_init__(self) -> None:
        for name, value, allowed in (("routing", self.routing, ROUTING_MODES), ("fusion", self.fusion, FUSION_MODES),
                                     ("scheduler", self.scheduler, SCHEDULERS)):
            if value not in allowed:
                raise ValueError(f"{name} {value!r}: use one of {', '.join(allowed)}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be true or false, got {self.adaptive!r}")


SECTIONS = {"scheduler": SchedulerConfig, "speculation": SpeculationConfig, "runtime": RuntimeConfig,
            "cluster": ClusterConfig, "experiments": ExperimentsConfig}
"""The parts of ``EngineConfig``, by key."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What is served and where: the model and its drafters, the pipeline stages, the device.
    What a step batches is in ``scheduler``, what it drafts in ``speculation``, how stages and
    drafters run and fail in ``runtime``, Ray placement in ``cluster``, the ablations in
    ``experiments``."""

    model: str = "smollm2-135m"
    """Target model: embedded name, Hugging Face directory, .gguf file, or Hugging Face Hub id
    (``org/name``, or ``org/name/FILE.gguf``: one GGUF file of a repository), fetched into
    huggingface_hub's cache (``HF_HOME``, ``HF_TOKEN``, ``HF_HUB_OFFLINE``)."""
    revision: str | None = None
    """Branch, tag or commit of a Hub model (None: ``main``); refused for other models."""
    tokenizer: str | None = None
    """Where the tokenizer comes from, when not from the model (any form ``model`` takes; a
    Hub repository gives its tokenizer files alone)."""
    download_dir: str | None = None
    """Where Hub models are fetched to, instead of huggingface_hub's cache."""
    seed: int | None = None
    """Seed of the sampling keys of requests that give none: with it, the same requests in the
    same order give the same texts (a request's own ``seed`` always does). None: each such
    request draws a fresh random key."""
    drafters: tuple[DrafterSpec, ...] = field(default_factory=lambda: parse_drafters(DEFAULT_DRAFTERS))
    """Speculation sources; () = plain decoding."""
    num_stages: int = 1
    """Contiguous layer slices of the target (pipeline stages)."""
    weights: str = "dense"
    """How a GGUF model's weights are held (``models.weights.native``): dense (dequantized to ``dtype``:
    fp32 output is identical to Hugging Face transformers) | native (its Q4_0/Q4_1/Q5_0/Q5_1/Q8_0
    and Q4_K/Q5_K/Q6_K blocks kept quantized: on CPU our own kernel with activations rounded to 8
    bits a group of 32, on CUDA PyTorch's int4 kernel with bf16 ones, the 5- and 6-bit formats
    dequantized there; faster, lossless against our own decode on that path, not against HF fp32) |
    auto (native for GGUF models except fp32 on CUDA)."""
    device: str = "cpu"
    """cpu | cuda | cuda:N. Stage and drafter actors ask Ray for one GPU each on CUDA."""
    dtype: str = "float32"
    """float32 | bfloat16 | float16 (the half types pay on CUDA; on CPU they run, slowly)."""
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
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """What a step batches: requests, tokens, lanes and the LP's bounds."""
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    """What a step drafts: the draft budget, the drafters per request, PipeDec, PEARL, twins."""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """How stages and drafters run a step, their deadlines, and recovery from a lost stage."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """How the Ray runtime places and supervises actors."""
    experiments: ExperimentsConfig = field(default_factory=ExperimentsConfig)
    """The paper's ablations and research modes."""

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"{name} must be a {cls.__name__}, got {getattr(self, name)!r}")
        if self.runtime.runner == "graph" and not str(self.device).startswith("cuda"):
            raise ValueError("runner 'graph' (CUDA graphs) needs device cuda")
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory, "kv_cache_memory"))
        if self.num_stages < 1:
            raise ValueError("num_stages must be >= 1")
        check_dtype_name(self.dtype)
        check_device_name(self.device)
        check_weights_mode(self.weights)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in ("revision", "tokenizer", "download_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")

    @property
    def checkpoint_args(self) -> dict[str, str | None]:
        """What ``models.loader.resolve_checkpoint`` takes besides ``model``."""
        return {"revision": self.revision, "tokenizer": self.tokenizer, "download_dir": self.download_dir}

    @property
    def is_resolved(self) -> bool:
        """Every default that depends on the device or on where the stages run is filled in."""
        s = self.scheduler
        return None not in (s.max_num_seqs, s.max_num_batched_tokens, s.num_lanes)

    def resolved(self, *, context_len: int | None = None, stages_in_process: bool = True) -> "EngineConfig":
        """This config with its defaults for this device and deployment filled in: the batch
        and token budget of the device, the lanes (``SchedulerConfig.num_lanes``: one per stage
        actor, 1 when ``stages_in_process``), and ``max_model_len`` capped at the model's
        ``context_len``. An engine is built from a resolved config (``engine.build``); what is
        set already stays."""
        s = self.scheduler
        on_cuda = str(self.device).startswith("cuda")
        seqs = s.max_num_seqs or (CUDA_MAX_NUM_SEQS if on_cuda else CPU_MAX_NUM_SEQS)
        tokens = s.max_num_batched_tokens or (CUDA_MAX_NUM_BATCHED_TOKENS if on_cuda else CPU_MAX_NUM_BATCHED_TOKENS)
        lanes = s.num_lanes or (1 if stages_in_process else self.num_stages)
        model_len = min(s.max_model_len, context_len) if context_len else s.max_model_len
        return dataclasses.replace(self, scheduler=dataclasses.replace(
            s, max_num_seqs=seqs, max_num_batched_tokens=max(tokens, seqs), num_lanes=lanes, max_model_len=model_len))

    def replace(self, **changes: Any) -> "EngineConfig":
        """A copy with ``changes``, each key a setting's own name: a plain field of this class or
        of one of its parts (``max_num_seqs=16``, ``routing="random"``, ``runner="eager"``;
        the names do not overlap). A whole part is replaced with ``dataclasses.replace``."""
        plain = {f.name for f in fields(EngineConfig)} - set(SECTIONS)
        unknown = sorted(k for k in changes if k not in plain and k not in SETTING_PATHS)
        if unknown:
            raise ValueError(f"unknown setting(s) {', '.join(unknown)}")
        parts = {}
        for section in SECTIONS:
            mine = {k: v for k, v in changes.items() if k not in plain and SETTING_PATHS[k].startswith(section + ".")}
            if mine:
                parts[section] = dataclasses.replace(getattr(self, section), **mine)
        return dataclasses.replace(self, **parts, **{k: v for k, v in changes.items() if k in plain})


SETTING_PATHS = {f.name: f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in fields(cls)}
"""Where each setting of the parts lives (``max_num_seqs`` -> ``scheduler.max_num_seqs``)."""
RENAMED = {"max_batch_size": "max_num_seqs", "drafters_in_router": "drafters_in_engine"}
"""Old names of settings: a config that uses one gets an error naming the new key."""
SPLIT_SECTIONS = ("step", "router")
"""Sections of older configs whose keys now live in the parts: refused, naming the new key."""

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


def _old_key(key: str, where: str) -> str | None:
    """What to say of ``key`` found in ``where`` ("" = the top level) when it is no setting
    there: where it lives now (moved, or renamed), or None for a key that is nowhere."""
    path = f"{where}.{key}" if where else key
    new = RENAMED.get(key, key)
    if new not in SETTING_PATHS:
        return None
    return f"'{path}' {'was renamed' if new != key else 'moved'}: use '{SETTING_PATHS[new]}'"


def _check_keys(data: dict[str, Any], cls: type, where: str) -> None:
    """ValueError for keys ``cls`` does not have: one message naming each old key's new place,
    else the unknown keys and the known ones."""
    names = {f.name for f in fields(cls)}
    extra = [k for k in data if k not in names]
    old = []
    for key in extra:
        if where == "" and key in SPLIT_SECTIONS:
            inner = data[key] if isinstance(data[key], dict) else {}
            old += [_old_key(k, key) or f"'{key}.{k}' is no setting" for k in inner] or [
                f"'{key}' was split: its keys are under {', '.join(SECTIONS)}"]
        elif (message := _old_key(key, where)) is not None:
            old.append(message)
    if old:
        raise ValueError("; ".join(old) + " (docs/configuration.md)")
    if extra:
        raise ValueError(f"unknown key(s) {', '.join(sorted(extra))} in {where or 'the config'}; "
                         f"known: {', '.join(sorted(names))}")


def _build(cls: type, data: dict[str, Any], where: str):
    _check_keys(data, cls, where)
    try:
        return cls(**data)
    except TypeError as exc:
        raise ValueError(f"{where or 'the config'}: {exc}") from None


def config_from_dict(data: dict[str, Any] | None) -> EngineConfig:
    """EngineConfig from plain data (YAML file, Serve ``args``); ValueError names bad keys, and
    a key of an older config the key that replaced it.

    ``drafters`` may be a string (``"ngram,retrieval"``) or a list of such names; each part
    (``scheduler``, ``speculation``, ``runtime``, ``cluster``, ``experiments``) is a mapping of
    its fields."""
    data = dict(data or {})
    if not isinstance(data, dict):
        raise ValueError("the config must be a mapping")
    _check_keys(data, EngineConfig, "")
    for section, cls in SECTIONS.items():
        part = data.get(section) or {}
        if not isinstance(part, dict):
            raise ValueError(f"'{section}' must be a mapping of {cls.__name__} keys")
        data[section] = _build(cls, part, section)
    drafters = data.pop("drafters", None)
    if drafters is not None:
        if isinstance(drafters, (list, tuple)):
            drafters = ",".join(str(d) for d in drafters) or "none"
        data["drafters"] = parse_drafters(str(drafters))
    return _build(EngineConfig, data, "")


def config_to_dict(config: EngineConfig) -> dict[str, Any]:
    """The plain data ``config_from_dict`` reads back to ``config``."""
    out = {f.name: getattr(config, f.name) for f in fields(config) if f.name not in SECTIONS}
    out["drafters"] = ",".join(s.kind + (f":{s.source}" if s.source else "") for s in config.drafters) or "none"
    for section in SECTIONS:
        part = getattr(config, section)
        out[section] = {f.name: getattr(part, f.name) for f in fields(part)}
    return out
