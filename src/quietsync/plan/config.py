"""The inputs of a plan (``quietsync plan`` flags, ``quietsync.plan.plan(...)`` arguments), checked at once.

Every field is validated in ``__post_init__`` with an error naming the field and what is allowed, so a bad
value fails before any worker starts (the CLI prints it as one line and exits 2): an unknown model, a topology
that cannot be (``nproc`` not divisible by ``nodes``), a link that does not parse.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..link import parse_links
from ..validate import check_float, check_int
from .cluster import BYTES_UNITS, FLOPS_UNITS, RATE_UNITS, Device, parse_quantity

PILOT_MIN_STEPS = 4
"""The fewest steps a pilot budget (``pilot_tokens``) may hold: the baseline's pilot evaluates at most once per step,
and its loss curve is fitted to at least 4 evaluations (``pilot_plan.MIN_FIT_EVALS``)."""

WHAT_IF_MODELS = {
    "1b": {"hidden": 2048, "layers": 18, "vocab": 50257},
    "7b": {"hidden": 4096, "layers": 32, "vocab": 32000},
}
"""Described GPT-style sizes for ``--what-if`` (parameters: 1b ≈ 1.01 B at sequence length 2048, 7b ≈ 6.7 B)."""

_TRANSFORMER = re.compile(r"transformer:(.*)")


@dataclass
class PlanConfig:
    """What to plan for."""

    model: str = "default"
    """A preset (tiny, default, 10m), a Hugging Face model folder, a described size for --what-if (1b, 7b), or
    transformer:hidden=H,layers=L,vocab=V."""
    nproc: int = 2
    """Workers (measured: local processes when not under torchrun; --what-if: nodes x workers_per_node)."""
    nodes: int | None = None
    """Nodes; must divide nproc (default: one node per worker, as quietsync train's local workers)."""
    link: list[str] = field(default_factory=list, metadata={"flag": {"metavar": "NAME=BANDWIDTH[,LATENCY]"}})
    """Links NAME=BANDWIDTH[,LATENCY], NAME in inter, intra (e.g. inter=1gbit,20ms); measured by the probe where
    not given. A link that varies during the run is a schedule (inter=100mbit,5ms@0s,10mbit@60s): each stretch is
    costed, and --adapt settings are ranked too."""
    micro_batch_size: int = 8
    """Sequences per micro-batch per worker."""
    seq_len: int = 128
    """Tokens per sequence."""
    vocab_size: int = 4096
    """Vocabulary of a preset model (the tokenizer's size in quietsync train)."""
    strategies: list[str] = field(default_factory=list, metadata={"flag": {
        "action": "extend", "nargs": "+", "metavar": "NAME[:FIELD=VALUE,...]"}})
    """Extra rows NAME[:FIELD=VALUE,...] (as quietsync compare takes them); the defaults are always evaluated."""
    only: bool = False
    """Evaluate only --strategies (no grid rows)."""
    strategy_module: str | None = None
    """A strategy of your own: the .py file (or importable module) that registers it, imported first (its pilots
    import it too), e.g. examples/custom_strategy.py for --strategies signsgd."""
    target_loss: float | None = None
    """Held-out loss to reach: settings are ranked by predicted time to it (measured plans need --pilot-tokens; with
    what_if the Chinchilla law gives the baseline's tokens to it)."""
    target_tokens: int | None = None
    """what_if without target_loss: tokens the synchronous baseline trains for (default: 20 per parameter,
    Chinchilla-optimal); the target is its loss then."""
    budget_s: float | None = None
    """Rank by the held-out loss predicted after this many seconds of training instead of by time to target."""
    pilot_tokens: int | None = None
    """Pilot runs: each promising setting trains up to N tokens (all workers) on this model and data, and its
    held-out curve replaces the priors (successive halving stops the losing ones early)."""
    pilot_candidates: int = 6
    """Settings of the grid besides the baseline that may run a pilot in the first round (the most promising by prior
    time to target; a setting --strategies adds to the grid runs one beyond them unless clearly losing); up to five
    more confirm, after it, the best settings, those to try first and those ranked above them that still rest on
    their priors (``pilot_plan.CONFIRM``)."""
    train_args: str = ""
    """quietsync train flags for the pilots (the run being planned), e.g. '--max-steps 2000 --lr 1e-3'."""
    pilot_out: str | None = None
    """Folder for the pilot runs (default: OUT/pilots with --out, else a temporary folder)."""
    reuse_pilots: bool = False
    """Replay the pilots an earlier plan ran to their end in the pilot folder with the same job and strategy flags
    (their recorded curves and cost) instead of running them again; others run."""
    what_if: bool = False
    """Describe the cluster instead of measuring: no workers are started."""
    workers_per_node: int | None = None
    """--what-if: workers per node (default: nproc / nodes)."""
    device_flops: str = "989tflops"
    """--what-if: peak FLOP/s of each worker's device (e.g. 989tflops for an H100 in bf16)."""
    mfu: float = 0.4
    """--what-if: fraction of peak FLOP/s training reaches."""
    memory_bandwidth: str = "3.35tb/s"
    """--what-if: device memory bandwidth (bytes/s)."""
    device_memory: str | None = None
    """--what-if: device memory (e.g. 80GB), to flag plans that do not fit."""
    probe: bool = True
    """Measure the real links between the workers (the floor under emulated links; the link where none is given)."""
    slow_worker: list[str] = field(default_factory=list, metadata={"flag": {"metavar": "RANK:FACTOR"}})
    """RANK:FACTOR: predict as if worker RANK computed FACTOR times slower (as quietsync train --slow-worker; the
    pilots run with it); an uneven cluster ranks adaptive inner steps too."""
    threads: int = 0
    """torch threads per worker (0: CPU cores / workers on this machine)."""
    repeats: int = 5
    """Timed repetitions of each calibration measurement (after a warm-up)."""
    timeout_s: float = 300.0
    """How long a worker waits for its peers."""
    out: str | None = None
    """Folder for plan.json, plan.md and the plots (none: print only)."""
    plot: bool = True
    """Draw the plots (needs matplotlib) when --out is given."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a preset, a model folder or a described size, got {self.model!r}")
        self.model_kind = _model_kind(self.model, self.what_if)
        check_int("nproc", self.nproc, 1)
        check_int("nodes", self.nodes, 1, allow_none=True)
        # what_if with workers_per_node: the world is nodes × workers_per_node, nproc is not used
        if self.nodes is not None and self.nproc % self.nodes and not (self.what_if and self.workers_per_node):
            raise ValueError(f"nodes must divide nproc ({self.nproc} workers cannot sit on {self.nodes} nodes)")
        check_int("workers_per_node", self.workers_per_node, 1, allow_none=True)
        if self.workers_per_node is not None and not self.what_if:
            raise ValueError("workers_per_node is only used with what_if (measured runs use nproc and nodes)")
        if isinstance(self.link, str):  # one link given from Python: a list of one, not its characters
            self.link = [self.link]
        if isinstance(self.strategies, str):
            self.strategies = [self.strategies]
        try:
            self.links = parse_links(self.link)
        except ValueError as e:
            text = str(e)
            # name the field, unless the parser's message already names the flag
            raise ValueError(text if text.startswith("--link") else f"link {text}") from None
        if self.what_if:
            wpn = self.world // self.node_count
            needed = (["inter"] if self.node_count > 1 else []) + (["intra"] if wpn > 1 else [])
            missing = [k for k in needed if k not in self.links]
            if missing:
                raise ValueError(f"link must be given for {', '.join(missing)} with what_if (e.g. --link "
                                 "inter=100gbit,10us --link intra=900gbit,2us): nothing is measured")
        for what, v in (("micro_batch_size", self.micro_batch_size), ("seq_len", self.seq_len),
                        ("vocab_size", self.vocab_size), ("repeats", self.repeats)):
            check_int(what, v, 1)
        check_int("threads", self.threads, 0)
        check_float("target_loss", self.target_loss, 0, low_open=True, allow_none=True)
        check_int("target_tokens", self.target_tokens, 1, allow_none=True)
        check_float("budget_s", self.budget_s, 0, low_open=True, allow_none=True)
        check_int("pilot_tokens", self.pilot_tokens, 1, allow_none=True)
        check_int("pilot_candidates", self.pilot_candidates, 0)
        if self.target_loss is not None and self.budget_s is not None:
            raise ValueError("target_loss and budget_s are two objectives: give one")
        if self.only and not self.strategies:
            raise ValueError("only needs strategies: it ranks the settings they name and nothing else")
        if self.out is not None and Path(self.out).exists() and not Path(self.out).is_dir():
            raise ValueError(f"out {self.out!r} is a file: give a folder (plan.md, plan.json and the plots go in it)")
        if self.target_tokens is not None and not self.what_if:
            raise ValueError("target_tokens is only used with what_if (measured plans take target_loss and pilots)")
        if self.pilot_tokens is not None:
            if self.what_if:
                raise ValueError("pilot_tokens runs pilots on this machine: not with what_if")
            if self.target_loss is None and self.budget_s is None:
                raise ValueError("pilot_tokens needs target_loss (or budget_s): the pilots are judged by time to it")
            step = self.nproc * self.micro_batch_size * self.seq_len  # a step's tokens, without accumulation
            if self.pilot_tokens < PILOT_MIN_STEPS * step:  # refused here, before any probe or pilot runs
                raise ValueError(f"pilot_tokens must be >= {PILOT_MIN_STEPS * step} ({PILOT_MIN_STEPS} steps of "
                                 f"{self.nproc} workers x micro_batch_size {self.micro_batch_size} x seq_len "
                                 f"{self.seq_len} tokens: the baseline's pilot fits its loss curve to one evaluation "
                                 f"per step at least), got {self.pilot_tokens}")
        else:
            for name in ("reuse_pilots", "pilot_out"):
                if getattr(self, name):
                    raise ValueError(f"{name} is about pilot runs: it needs pilot_tokens N (and target_loss)")
        if self.pilot_tokens is None and not self.what_if and (self.target_loss is not None or
                                                               self.budget_s is not None):
            which = "target_loss" if self.target_loss is not None else "budget_s"
            raise ValueError(f"{which} needs pilot_tokens N in a measured plan (the baseline's loss curve comes from "
                             "its pilot run), or what_if")
        self.pilot_args = _pilot_args(self)
        check_float("mfu", self.mfu, 0, 1, low_open=True)
        check_float("timeout_s", self.timeout_s, 0, low_open=True)
        self.device = Device(
            flops=parse_quantity(self.device_flops, "device_flops", FLOPS_UNITS, "989tflops, 82.6tflops"),
            mfu=self.mfu,
            memory_bandwidth=parse_quantity(self.memory_bandwidth, "memory_bandwidth", RATE_UNITS, "3.35tb/s, 900gb/s"),
            memory_bytes=(parse_quantity(self.device_memory, "device_memory", BYTES_UNITS, "80GB, 24GiB")
                          if self.device_memory else None))
        self.slow = _parse_slow(self.slow_worker, self.world)
        if self.strategy_module is not None:  # it registers the user's strategy before --strategies names it
            from ..strategies.registry import load_module

            load_module(self.strategy_module)
        from .strategies_spec import parse_specs

        self.extra = parse_specs(self.strategies)

    def __getstate__(self) -> dict:
        """Only the fields travel to the workers (what ``__post_init__`` derives is rebuilt there)."""
        import dataclasses

        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    @property
    def world(self) -> int:
        if self.what_if and self.workers_per_node is not None:
            return (self.nodes or 1) * self.workers_per_node
        return self.nproc

    @property
    def node_count(self) -> int:
        if self.nodes is not None:
            return self.nodes
        return 1 if self.what_if and self.workers_per_node is not None else self.world

    def threads_per_worker(self) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // max(1, self.world))


def _pilot_args(cfg: PlanConfig) -> list[str]:
    """``train_args`` as argv, checked by ``quietsync train``'s own parser (one line naming the flag)."""
    import contextlib
    import io
    import shlex

    try:
        argv = shlex.split(cfg.train_args)
    except ValueError as e:
        raise ValueError(f"train_args: {e}") from None
    if not argv:
        return []
    owned = {"--strategy", "--out", "--max-tokens", "--target-loss", "--resume", "--link", "--nproc",
             "--nodes", "--model", "--micro-batch-size", "--seq-len", "--vocab-size"}
    # "--flag=value" as well as "--flag value"
    clash = [a.split("=")[0] for a in argv if a.split("=")[0] in owned]
    if clash:
        raise ValueError(f"train_args must not set {', '.join(clash)} (the plan sets them for every pilot)")
    from ..train.args import parse_train_args

    err = io.StringIO()
    try:
        # argparse prints a bad flag's error on stderr and exits: its last line becomes ours
        with contextlib.redirect_stderr(err):
            train = parse_train_args(argv)[0]
    except SystemExit:
        line = err.getvalue().strip().splitlines()[-1:] or ["bad flags"]
        raise ValueError(f"train_args: {line[0].removeprefix('quietsync train: error: ')}") from None
    if train.max_steps < PILOT_MIN_STEPS:  # every pilot stops there, before the curve has its evaluations
        raise ValueError(f"train_args: --max-steps {train.max_steps} stops every pilot before the {PILOT_MIN_STEPS} "
                         "evaluations the baseline's loss curve is fitted to")
    return argv


class PlanError(ValueError):
    """A plan that cannot be made from what its pilots or its settings gave (one line, naming the flags)."""


def _parse_slow(specs: list[str], world: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for spec in specs:
        rank, sep, factor = str(spec).partition(":")
        try:
            r, f = int(rank), float(factor)
        except ValueError:
            r, f = -1, 0.0  # fails the check below, which gives the one message
        # "not f >= 1" refuses NaN too
        if not sep or not 0 <= r < world or not f >= 1:
            raise ValueError(f"slow_worker must look like RANK:FACTOR with RANK in [0, {world}) and FACTOR >= 1, "
                             f"got {spec!r}")
        out[r] = f
    return out


def _model_kind(model: str, what_if: bool) -> str:
    """``preset``, ``folder``, ``described``; raises for anything else."""
    from pathlib import Path

    from ..models.causal_lm import PRESETS

    if model in PRESETS:
        return "preset"
    if model in WHAT_IF_MODELS or _TRANSFORMER.fullmatch(model):
        if not what_if:
            raise ValueError(f"model {model!r} is a described size, only for what_if (it is not built); presets: "
                             f"{', '.join(PRESETS)}")
        transformer_shape(model)
        return "described"
    folder = Path(model)
    if folder.is_dir() and (folder / "config.json").is_file():
        return "folder"
    raise ValueError(f"model must be a preset ({', '.join(PRESETS)}), a Hugging Face model folder (with config.json)"
                     f"{', or with what_if ' + ', '.join(WHAT_IF_MODELS) + ' or transformer:hidden=H,layers=L,vocab=V'}"
                     f", got {model!r}")


def transformer_shape(model: str) -> dict[str, int]:
    """``{"hidden", "layers", "vocab"}`` of a described size (``1b`` or ``transformer:hidden=...``)."""
    if model in WHAT_IF_MODELS:
        return dict(WHAT_IF_MODELS[model])
    m = _TRANSFORMER.fullmatch(model)
    if not m:
        raise ValueError(f"model must be {', '.join(WHAT_IF_MODELS)} or transformer:hidden=H,layers=L,vocab=V, "
                         f"got {model!r}")
    out: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in m.group(1).split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in ("hidden", "layers", "vocab") or not value.isdigit() or int(value) < 1:
            raise ValueError("model transformer:... takes hidden=H,layers=L,vocab=V (positive integers), "
                             f"got {model!r}")
        out[key] = int(value)
    if set(out) != {"hidden", "layers", "vocab"}:
        raise ValueError(f"model transformer:... needs hidden, layers and vocab, got {model!r}")
    return out
