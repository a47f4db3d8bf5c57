"""The configuration of one `quietsync train` job (the strategy's own knobs live in its config class).

Every field is a command-line flag (see :mod:`quietsync.cli.flags`); the defaults are the embedded
default job: a small GPT-Neo on the King James Bible, 2 local workers, ZeRO-1, about five minutes on a
2-core CPU.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from ..data.corpus import DEFAULT_DATASET
from ..data.tokenizer import MIN_VOCAB
from ..link import parse_links
from ..validate import check_choice, check_float, check_int
from .budgets import Budgets
from .profile import parse_profile_steps
from .sinks import parse_log_with
from .slow_worker import SlowWorker, parse_slow_worker

DEFAULT_STRATEGY = "zero1"
"""Strategy of `quietsync train` when ``--strategy`` is not given."""

ModelName = Literal["tiny", "default", "10m"]


def _hub_offline() -> bool:
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _check_hub_model_name(name: str, presets: tuple[str, ...]) -> None:
    """Refuse (one line naming the model, not the tokenizer it would lend) a ``--model`` that is no folder here
    when it is a path, or when the hub that would look it up cannot be reached: the tokenizer, defaulting to the
    model's, was loaded first and failed as ``--tokenizer``, after a minute of the hub client's retries."""
    from ..data.sources import hub_unreachable, only_a_path

    if only_a_path(name):
        raise ValueError(f"model {name}: no such folder")

    unreachable = hub_unreachable()  # one request, no retries; asked once per process
    if unreachable is not None:
        raise ValueError(f"model must be one of {', '.join(presets)}, a Hugging Face model folder or a hub name; "
                         f"{name!r} is no folder here, and the Hugging Face hub, where such a name is looked up "
                         f"as a model, {unreachable}")


@dataclass
class TrainConfig:
    """One training job (rank-independent; every worker receives the same)."""

    strategy: str = DEFAULT_STRATEGY
    """Registered strategy name (quietsync.strategies.available())."""
    strategy_module: str | None = None
    """A strategy of your own: the .py file (or importable module) that registers it, imported before --strategy is
    looked up (e.g. examples/custom_strategy.py for --strategy signsgd)."""
    nproc: int = 2
    """Local worker processes to spawn when not under torchrun (1 = train in this process)."""
    nodes: int | None = None
    """Nodes for the topology; default: WORLD_SIZE/LOCAL_WORLD_SIZE under torchrun, and with local workers one node per
    worker (so --link inter=... applies between them)."""
    max_steps: int = 300
    """Committed optimizer steps to train for (the lr schedule spans them); with other budgets, the run stops at the
    first one reached."""
    max_tokens: int | None = None
    """Token budget: stop after the first committed step at which all workers together have fed N tokens (the fair
    budget for comparing strategies)."""
    max_time_s: float | None = None
    """Time budget: stop after the first committed step at which S seconds of training have passed (the slowest worker's
    clock)."""
    target_loss: float | None = None
    """Stop at the first evaluation (every --eval-every steps) whose held-out loss is at or below X."""
    micro_batch_size: int = 8
    """Sequences per micro-batch on each worker."""
    seq_len: int = 128
    """Tokens per sequence."""
    lr: float = 2e-3
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.1
    """AdamW weight decay (norms, biases and embeddings get none)."""
    warmup_steps: int | None = None
    """Linear warm-up steps; default: 5% of --max-steps."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine decay, as a fraction of --lr."""
    link: list[str] = field(default_factory=list, metadata={"flag": {"metavar": "NAME=BW[,LAT]"}})
    """Emulated link, repeatable: inter=100mbit,5ms (between nodes) or intra=10gbit,0.05ms (inside one); or a schedule
    inter=100mbit@0s,10mbit@60s,100mbit@120s (BW[,LAT]@TIME entries in training seconds, docs/train.md)."""
    slow_worker: str | None = field(default=None, metadata={"flag": {"metavar": "RANK:FACTOR"}})
    """Make worker RANK FACTOR times slower: after each micro-batch it sleeps (FACTOR-1)x its compute time."""
    out: str = "runs/train"
    """Output folder: metrics-rank{R}.jsonl, summary.json, loss.png, checkpoints/."""
    overwrite: bool = False
    """Let a new run replace an earlier run's outputs in --out (a non-empty --out is refused otherwise)."""
    dataset: str = DEFAULT_DATASET
    """Corpus: a folder made by quietsync prepare (used as it is), or what prepare reads, prepared once into
    --cache-dir: 'kjv' (embedded King James Bible), a text file or folder of .txt files, JSONL/Parquet/Arrow files or a
    folder of them, a datasets.save_to_disk folder, pre-tokenized .bin/.npy shards (with --tokenizer), or a hub
    dataset name."""
    text_column: str | None = None
    """Column holding the text (JSONL/Parquet/Arrow/datasets/hub); default: 'text', else the only string column."""
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    """dtype of pre-tokenized .bin files given as --dataset (nanoGPT's: uint16); .npy files say their own."""
    eval_fraction: float = 0.02
    """Fraction of the documents held out for evaluation (every k-th one)."""
    seed: int = 0
    """Seed of the model initialisation and of the data order."""
    model: str = "default"
    """Model: a size preset, tiny (~1M parameters), default (~2.6M), 10m (~10.6M); or a Hugging Face causal-LM folder
    (e.g. a previous run's OUT/model) or hub name (needs a network)."""
    tokenizer: str | None = None
    """Pretrained tokenizer: a folder with tokenizer.json (e.g. OUT/model) or a hub name; default: the --model folder's
    own, else a byte-level BPE of --vocab-size trained on the corpus."""
    vocab_size: int = 4096
    """Size of the byte-level BPE vocabulary trained on the corpus (at least 257: the 256 bytes and end-of-text)."""
    eval_every: int = 50
    """Evaluate the held-out loss every N steps (and before the first and after the last); 0 = only at the end."""
    eval_windows: int = 48
    """Held-out sequences per evaluation."""
    save_every: int = 0
    """Save a checkpoint every N steps under OUT/checkpoints (0 = never)."""
    resume: str | None = field(default=None, metadata={"flag": {"nargs": "?", "const": "latest", "metavar": "DIR"}})
    """Resume from a checkpoint folder; bare --resume takes the latest complete one under OUT/checkpoints."""
    elastic: bool = False
    """Under torchrun --nnodes MIN:MAX --max-restarts K: every (re)start of the workers resumes from the newest complete
    checkpoint under --out (a fresh run when there is none), on whatever workers the rendezvous admitted; checkpoints
    every outer sync (diloco, localsgd) or 10 steps unless --save-every; --out must be on a file system every node
    sees."""
    fault_tolerance: Literal["none", "torchft"] = "none"
    """torchft: a per-step quorum over the replica groups (the --nodes nodes, each a torchft replica): when one dies
    the others go on at their next step without a restart, and when it returns it heals from a live peer and joins
    (ddp, zero1, localsgd, diloco, demo, flexdemo; docs/faults.md). Needs pip install 'quietsync[ft]'."""
    lighthouse: str | None = field(default=None, metadata={"flag": {"metavar": "HOST:PORT"}})
    """With --fault-tolerance torchft: the address of the job's Lighthouse (quietsync lighthouse, or torchft's
    torchft_lighthouse); default: the local launcher starts one on this machine."""
    replica_group: int | None = field(default=None, metadata={"flag": {"metavar": "K"}})
    """With --fault-tolerance torchft and --lighthouse: run only replica group K of the --nodes (this machine's
    share of the job: --nproc workers, or torchrun's); default: the local launcher starts every replica group."""
    standby: str | None = field(default=None, metadata={"flag": {"metavar": "PATH"}})
    """With --fault-tolerance torchft and --replica-group K (one worker): a standby for replica group K -- it imports,
    opens the data, builds and warms the model and the strategy, then waits until the file PATH exists (whoever saw
    K's replica die creates it) and only then joins the Lighthouse and heals (docs/faults.md)."""
    async_join: bool = True
    """With --fault-tolerance torchft and ddp: a replica that heals takes its first step without data of its own
    (counted out of that step's gradient average, its windows dealt again), so the others do not wait for its first
    forward and backward (docs/faults.md); --no-async-join: it computes its first step like the others."""
    replica_restarts: int = 3
    """With --fault-tolerance torchft and the local launcher: how many times a replica group that died is started
    again (it heals from a live peer and rejoins; the others never restart)."""
    batch_policy: Literal["global", "worker"] = "global"
    """What a step holds after a resume on another number of workers: global = the run's first tokens per step (each
    worker's micro-batches rescaled, rounded up), worker = the same micro-batches per worker; the lr schedule and
    --max-steps follow tokens either way."""
    cache_dir: str | None = None
    """Cache folder of the datasets train prepares itself (default: ~/.cache/quietsync)."""
    threads: int = 0
    """torch threads per worker (0 = CPU cores / local workers)."""
    timeout_s: float = 300.0
    """Seconds a collective may wait for its peers before the job fails."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Mixed precision: fp32; bf16 (forward under autocast, fp32 master weights and optimizer state); fp16 (the same
    plus dynamic loss scaling: a round whose gradient overflows is skipped on every worker). Not fp16 with cdp."""
    max_grad_norm: float | None = None
    """Clip the gradient each step commits to this global L2 norm (which gradient, per strategy: docs/train.md); 0 or
    none = no clipping."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations during backward instead of keeping them (less activation memory,
    one more block forward per backward)."""
    compile: bool = False
    """torch.compile each transformer block of the model (needs a C compiler on CPU; the first steps include
    compiling)."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A non-finite loss or gradient: stop the job, naming the step and rank (nothing of it is committed; localsgd and
    diloco check each inner step on its own worker, no added round trip) or skip the round on every worker (ddp,
    zero1, fsdp, demo, flexdemo, localsgd, diloco; the workers agree on every round, for localsgd and diloco a
    round trip per inner step)."""
    nonfinite_skip_limit: int = 10
    """With --on-nonfinite skip: the most non-finite rounds skipped in a row; the next one stops the job."""
    check_replicas_every: int = 0
    """Every N committed steps, check that every worker holds the same committed parameters, bit for bit (a
    fingerprint of each worker's, in one agreement on the control group; under torchft, in the next unit's vote;
    docs/train.md): a difference is printed once and kept in the step's record. 0: at the run's end only, as every
    run does."""
    on_replicas_differ: Literal["warn", "stop", "heal"] = "warn"
    """Workers whose committed parameters differ (a replica check, periodic or at the end): ``warn`` (one line, and
    the run goes on), ``stop`` every worker, naming the ranks, the last check where all agreed and the newest
    checkpoint (nothing is exported; every checkpoint is checked before it is written, so none holds parameters the
    workers do not share), or, under --fault-tolerance torchft with --check-replicas-every, ``heal``: the replica
    groups outside the largest group of equal ones leave and, started again, heal from a live peer while the others
    go on."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    plot: bool = True
    """Draw loss.png at the end."""
    trace: bool = False
    """Write trace.json (one Chrome/Perfetto trace of every worker's compute, comm and idle spans) and timeline.png."""
    profile_steps: str | None = field(default=None, metadata={"flag": {"metavar": "A:B"}})
    """Run torch.profiler over committed steps A to B and write profile-rank{R}.json (Chrome trace with quietsync's
    record_function labels)."""
    export: bool = True
    """Write OUT/model/ at the end: the committed model (safetensors) and its tokenizer, for AutoModelForCausalLM /
    AutoTokenizer.from_pretrained."""
    log_with: str | None = field(default=None, metadata={"flag": {"metavar": "LIST"}})
    """Metrics outputs besides the JSONL, comma-separated: tensorboard (rank 0, OUT/tensorboard), csv
    (OUT/metrics-rank{R}.csv), wandb (rank 0); default: none."""

    def __post_init__(self) -> None:
        for name in ("nproc", "max_steps", "micro_batch_size", "eval_windows"):
            check_int(name, getattr(self, name), 1)
        for name in ("eval_every", "save_every", "threads"):
            check_int(name, getattr(self, name), 0)
        check_int("nodes", self.nodes, 1, allow_none=True)
        check_int("max_tokens", self.max_tokens, 1, allow_none=True)
        check_float("max_time_s", self.max_time_s, 0, low_open=True, allow_none=True)
        check_float("target_loss", self.target_loss, 0, low_open=True, allow_none=True)
        if self.target_loss is not None and not self.eval_every:
            raise ValueError("target_loss needs --eval-every N > 0: the held-out loss is only measured at evaluations, "
                             f"got eval_every {self.eval_every}")
        check_int("seq_len", self.seq_len, 2)
        check_int("vocab_size", self.vocab_size, MIN_VOCAB)
        check_int("warmup_steps", self.warmup_steps, 0, allow_none=True)
        # the schedule warms up over steps the run never takes: the lr would stay below its peak the whole run (a
        # run stopped early by another budget still follows the --max-steps schedule, so no use is lost)
        if self.warmup_steps is not None and self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps must be <= max_steps ({self.max_steps}), got {self.warmup_steps}: the "
                             "learning rate would never reach its peak")
        check_int("seed", self.seed, 0, 2**32 - 1)  # the data order seeds torch with seed * 1_000_003 + epoch (int64)
        check_int("nonfinite_skip_limit", self.nonfinite_skip_limit, 1)
        check_int("check_replicas_every", self.check_replicas_every, 0)
        check_choice("on_replicas_differ", self.on_replicas_differ, ("warn", "stop", "heal"))
        check_choice("on_nonfinite", self.on_nonfinite, ("stop", "skip"))
        check_choice("precision", self.precision, ("fp32", "bf16", "fp16"))
        if self.max_grad_norm is not None:
            v = self.max_grad_norm
            # bool is an int subclass: True is no norm
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"max_grad_norm must be a finite number > 0, or 0 for no clipping, got {v!r}")
        check_choice("batch_policy", self.batch_policy, ("global", "worker"))
        check_choice("fault_tolerance", self.fault_tolerance, ("none", "torchft"))
        check_int("replica_group", self.replica_group, 0, allow_none=True)
        check_int("replica_restarts", self.replica_restarts, 0)
        if self.lighthouse is not None:
            host, _, port = self.lighthouse.rpartition("://")[2].rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"lighthouse must be HOST:PORT (or http://HOST:PORT) with a port in [1, 65535], got "
                                 f"{self.lighthouse!r}")
        check_choice("token_dtype", self.token_dtype, ("uint16", "uint32"))
        if self.elastic and self.overwrite:
            raise ValueError("overwrite cannot be combined with --elastic: every restart would delete the "
                             "checkpoints it resumes from (start an elastic run in a fresh --out)")
        check_float("lr", self.lr, 0, low_open=True)
        check_float("weight_decay", self.weight_decay, 0)
        check_float("min_lr_ratio", self.min_lr_ratio, 0, 1)
        check_float("eval_fraction", self.eval_fraction, 0, 0.5, low_open=True, high_open=True)
        check_float("timeout_s", self.timeout_s, 0, low_open=True)
        presets = get_args(ModelName)
        if self.model not in presets:
            folder = Path(self.model)
            if folder.exists():
                if not (folder / "config.json").is_file():
                    raise ValueError(f"model must be one of {', '.join(presets)} or a Hugging Face model folder "
                                     f"(with config.json), got {self.model!r}")
                if self.tokenizer is None and not (folder / "tokenizer.json").is_file():
                    raise ValueError(f"tokenizer is needed with model {self.model!r} (it has no tokenizer.json): "
                                     "a folder with tokenizer.json or a hub name")
            elif _hub_offline():
                raise ValueError(f"model must be one of {', '.join(presets)}, a Hugging Face model folder or a hub "
                                 f"name (the hub is offline here), got {self.model!r}")
            else:
                _check_hub_model_name(self.model, presets)
            if self.tokenizer is None:  # the model's own: its folder's tokenizer.json, or the hub repo's
                self.tokenizer = self.model
        try:
            links = parse_links(self.link)
        except ValueError as e:
            msg = str(e)
            # "<field> ...": the CLI rewrites a field's name to its flag
            raise ValueError(msg if msg.startswith("--link") else f"link {msg}") from None
        if self.fault_tolerance == "torchft" and any(lk.scheduled for lk in links.values()):
            raise ValueError("--link with a schedule (BW@TIME,...) cannot be combined with --fault-tolerance torchft: "
                             "its replicas start and restart on their own, with no clock they all share")
        if self.slow_worker is not None:
            parse_slow_worker(self.slow_worker)
        if self.profile_steps is not None:
            _, last = parse_profile_steps(self.profile_steps)
            if last > self.max_steps:
                raise ValueError(f"profile_steps must end by max_steps ({self.max_steps}), got {self.profile_steps!r}")
        if self.log_with is not None:
            self.log_with = ",".join(parse_log_with(self.log_with)) or None

    @property
    def clip_norm(self) -> float | None:
        """``max_grad_norm`` as the strategies take it: None for no clipping (0 on the command line)."""
        return None if not self.max_grad_norm else float(self.max_grad_norm)

    @property
    def warmup(self) -> int:
        """Warm-up steps in effect."""
        return self.warmup_steps if self.warmup_steps is not None else max(1, self.max_steps // 20)

    def budgets(self) -> Budgets:
        """The run's budgets (--max-steps, --max-tokens, --max-time-s, --target-loss)."""
        return Budgets(self.max_steps, self.max_tokens, self.max_time_s, self.target_loss)

    def slow(self) -> SlowWorker | None:
        """The parsed --slow-worker, if any."""
        return parse_slow_worker(self.slow_worker) if self.slow_worker else None
