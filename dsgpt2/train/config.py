"""The training run's configuration: one dataclass per concern, each field a ``ds_trainer.py`` flag.

Defaults live here and nowhere else; ``ds_trainer.py``'s parser (and ``dsgpt2 tokenize``'s data
flags) are derived from these classes (:mod:`dsgpt2.settings.options`), and every value is checked on
construction with a message that names the flag, whether it came from the command line or from code.
The files the options name are read when a run is built (:meth:`TrainConfig.check_files`, called by
the trainer's ``build``), so that a configuration is plain data until then.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsgpt2.accelerator import prepare_deepspeed_environment
from dsgpt2.checkpoints.options import CheckpointOptions
from dsgpt2.data.order import ORDERS
from dsgpt2.data.packing import PACKINGS
from dsgpt2.data.split import DEFAULT_CHUNK_DOCS, DEFAULT_SEED, DEFAULT_TR_RATIO
from dsgpt2.errors import ConfigError
from dsgpt2.files import check_room, check_writable_dir, not_a_file
from dsgpt2.model.gpt2 import DEFAULT_LOSS_CHUNK, PRESETS, read_model_config
from dsgpt2.optim.optimizers import OPTIMIZERS, OptimizerOptions
from dsgpt2.optim.schedule import ScheduleOptions, check_warmup
from dsgpt2.settings.argtypes import OneLineErrorParser, accept_hyphen_spellings
from dsgpt2.settings.options import (
    ABOVE_ZERO,
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    RATIO,
    SEED,
    STEPS_OR_SHARE,
    Checked,
    Freezable,
    Range,
    add_options,
    as_path,
    from_namespace,
    option,
)
from dsgpt2.settings.shipped import shipped_path

if TYPE_CHECKING:
    from dsgpt2.data.sources import DataSpec

DEFAULT_VOCAB_DIR = Path("runs/tokenizer")
# The run's resolved configuration (flags, experiment file and defaults), in the run directory and in
# every checkpoint: `ds_trainer.py --config` runs it again.
# A learning rate, a device's peak throughput.
# A field declared with ``type=int`` or ``type=float`` beside its ``check=`` has a flag that takes any
# number: an out-of-range one is refused by the check on construction, in the words a setting made in
# code gets (these flags always answered so), not by the parser.

# A block longer than a million tokens: no GPT-2 trains at it, and its position table is allocated
# whole before the first step.
MAX_CONTEXT = 1 << 20


@dataclass
class ModelOptions(Checked):
    """Which network to train, and on what objective."""

    model_select: str = option("112m", "model size preset", choices=list(PRESETS))
    model_config: Path | None = option(None, "a GPT-2 config JSON instead of a preset")
    loss_type: str = option("lm_loss", "training objective", choices=["lm_loss"])
    # At least 2: a block of one token holds no next token to learn (the loss was 0 at every step).
    context_length: int | None = option(
        None, "tokens per block (default: the preset's)", check=Range(int, 2, MAX_CONTEXT)
    )
    init_from: Path | None = option(
        None,
        "start from these weights (an export or a checkpoint directory): finetuning; the model "
        "config comes with them and --model_select is ignored",
    )
    task: str = option(
        "lm",
        "lm: next-token loss on every token; conversation: the documents' turns with speaker "
        "tokens, loss on the replies only",
        choices=["lm", "conversation"],
    )
    reply_speakers: str = option(
        "bot", "conversation task: speakers whose turns the loss covers, comma-separated"
    )

    def convert(self) -> None:
        self.model_config, self.init_from = as_path(self.model_config), as_path(self.init_from)

    def check_files(self) -> None:
        """The model config file reads as one and the weights to start from are there.

        Raises:
            ConfigError: naming the flag.
        """
        if self.model_config is not None:
            read_model_config(self.model_config)
        if self.init_from is not None and not self.init_from.exists():
            from dsgpt2.checkpoints.format import CHECKPOINTS
            from dsgpt2.stores.base import split_location

            if split_location(self.init_from, CHECKPOINTS) is not None:
                raise ConfigError(
                    f"--init_from {self.init_from}: a run starts from a model on this machine (an exported "
                    f"one or a checkpoint directory), not from a stored run; export it here first: dsgpt2 "
                    f"export --ckpt_dir {self.init_from} --config C.json --out runs/init_model, then "
                    "--init_from runs/init_model"
                )
            raise ConfigError(
                f"--init_from {self.init_from}: not found (an exported model or a checkpoint dir)"
            )


@dataclass
class DataOptions(Checked):
    """Where the documents come from and how they become blocks; the data fingerprint's inputs."""

    # None: the connection config is handed to the trainer's build in code (the demo's).
    config_train: Path | None = option(metavar="JSON", help="MongoDB connection config JSON")
    vocab_dir: Path | None = option(
        None,
        f"tokenizer directory, or gridfs:NAME for one stored in the database (default: the --init_from "
        f"model's, else {DEFAULT_VOCAB_DIR})",
    )
    tr_ratio: float = option(DEFAULT_TR_RATIO, "share of documents that train", check=RATIO)
    seed: int = option(DEFAULT_SEED, "seed of init, split and data order", check=SEED)
    data_mode: str = option(
        "streaming",
        "streaming: read MongoDB on the fly; cached: memory-mapped token files",
        choices=["streaming", "cached"],
    )
    cache_dir: Path | None = option(None, "token cache (default: WORKSPACE/cache)")
    chunk_docs: int = option(DEFAULT_CHUNK_DOCS, "documents per chunk", check=POSITIVE_INT)
    read_order: str = option(
        "spread",
        "which documents a training chunk holds: spread (each epoch, documents drawn from all over the "
        "corpus by a keyed permutation: one $in query per collection per chunk) or ranges (consecutive "
        "documents, one range query: the order of runs saved before spread reading)",
        choices=list(ORDERS),
    )
    packing: str = option(
        "end_to_end",
        "how training blocks are packed: end_to_end (documents one after the other, cut into blocks) or bos "
        "(every block starts at a document's first token; short documents fitted best-first into the room "
        "left, padding the rest; validation stays end to end)",
        choices=list(PACKINGS),
    )
    num_workers: int = option(2, "DataLoader workers per rank", check=NON_NEGATIVE_INT)
    allow_corpus_problems: bool = option(False, "train even if the corpus check finds problems")
    check_corpus: bool = option(
        False,
        "at start, examine every document as `dsgpt2 validate` does (minutes on tens of millions); "
        "by default the start reads only what the idx index and meta_info answer",
    )
    follow: int = option(
        0,
        "every N steps, take in the documents ingested since (whole chunks), at once; 0: a resumed "
        "run takes them in from its next epoch",
        check=NON_NEGATIVE_INT,
        metavar="N",
    )
    mixture: str | None = option(
        None,
        'token shares per collection, with stages: "news=0.7,wiki=0.3; 5000: news=0.5,wiki=0.5" '
        "(default: the config's weights, else shares follow sizes)",
        metavar="WEIGHTS",
    )

    def convert(self) -> None:
        self.config_train, self.vocab_dir = shipped_path(self.config_train), as_path(self.vocab_dir)
        self.cache_dir = as_path(self.cache_dir)

    def check_files(self) -> None:
        """The connection config and the tokenizer named are there (a tokenizer left to the run's
        default is :meth:`TrainConfig.check_files`'s).

        Raises:
            ConfigError: naming the flag.
        """
        why = None if self.config_train is None else not_a_file(self.config_train)
        if why is not None:
            raise ConfigError(f"--config_train {self.config_train}: {why}")
        from dsgpt2.tokenizer.stored import stored_tokenizer

        if self.vocab_dir is None or stored_tokenizer(self.vocab_dir) is not None:
            return  # one in the database is fetched once the run has its connection
        if not (self.vocab_dir / "tokenizer.json").is_file():
            raise ConfigError(
                f"--vocab_dir {self.vocab_dir}: no tokenizer.json; train one first (dsgpt2 vocab train)"
            )


@dataclass
class RunOptions(Checked):
    """How long to train, and what to measure and log."""

    train_iters: int = option(1000, "optimizer steps", check=POSITIVE_INT)
    workspace: Path = option(Path("runs/train"), "run directory: metrics, plot, wandb")
    eval_interval: int = option(100, "validate every N steps", check=POSITIVE_INT)
    eval_iters: int = option(10, "validation batches per evaluation", check=POSITIVE_INT)
    eval_batch_size: int | None = option(
        None, "validation micro-batch (default: training's)", check=POSITIVE_INT
    )
    ema_tail: float = option(
        0,
        "over the last N steps (N in (0, 1): that share of --train_iters), an exponential moving average "
        "of the weights (span N): the run's last validation, its export and evaluation use it; training "
        "steps the raw weights; 0: none",
        check=STEPS_OR_SHARE,
        metavar="N",
    )
    log_interval: int = option(10, "log metrics every N steps", check=POSITIVE_INT)
    log_block_ids: bool = option(False, "record every batch's block ids in metrics")
    max_nonfinite: int = option(5, "abort after this many non-finite losses in a row", check=POSITIVE_INT)
    wandb: str = option("offline", "wandb mode", choices=["offline", "online", "off"])
    wandb_dir: Path | None = option(None, "wandb directory (default: WORKSPACE)")
    early_stopping: bool = option(
        False,
        "stop after --patience evaluations without improvement of --monitor; the best checkpoint is "
        "saved when it is measured, tagged `best` (--ckpt_id best) and never pruned by --keep_last",
    )
    patience: int = option(
        5,
        "evaluations without improvement before --early_stopping stops the run",
        type=int,
        check=POSITIVE_INT,
    )
    monitor: str = option(
        "val_loss", "what --early_stopping watches (lower is better)", choices=["val_loss", "val_ppl"]
    )
    min_delta: float = option(
        0.0,
        "the least decrease of --monitor that counts as an improvement",
        type=float,
        check=Range(float, 0.0),
    )
    hellaswag: Path | None = option(
        None,
        "also score HellaSwag at each evaluation (llm.c's hellaswag_val.jsonl layout: ctx, four endings, "
        "label), the examples shared among the ranks; logged in the eval record",
        metavar="FILE",
    )
    hellaswag_limit: int | None = option(
        None, "only the first N HellaSwag examples at each evaluation", check=POSITIVE_INT
    )

    def convert(self) -> None:
        self.workspace, self.wandb_dir = Path(self.workspace), as_path(self.wandb_dir)
        self.hellaswag = as_path(self.hellaswag)

    def check_files(self) -> None:
        """The workspace and wandb's directory can be written, and the HellaSwag file reads as one: a bad
        file stops the run before it starts.

        Raises:
            ConfigError: naming the flag (and the line).
            NoRoomError: the workspace's disk is full.
        """
        check_writable_dir(self.workspace, "--workspace")
        if self.wandb != "off" and self.wandb_dir is not None:  # wandb's own failure there only warns
            check_writable_dir(self.wandb_dir, "--wandb_dir")
        # Its files are small (a config, a line a step); the checkpoints' disk is checked as they are saved.
        check_room(self.workspace, "--workspace", needed=2**16)
        if self.hellaswag is not None:
            from dsgpt2.model.hellaswag import read_examples

            read_examples(self.hellaswag, self.hellaswag_limit)


ATTENTION = ("sdpa", "eager", "flash_attention_2")


@dataclass
class ComputeOptions(Checked):
    """How the model computes: attention kernel, compilation, activation memory, document masks."""

    attn_implementation: str = option(
        "sdpa", "attention kernel (flash_attention_2: the flash-attn package and a GPU)", choices=ATTENTION
    )
    compile: bool | None = option(
        None,
        "torch.compile the model (the first steps compile it); default: on where CUDA is the device "
        "(--no_compile turns it off), off on a CPU",
    )
    activation_checkpointing: bool = option(
        False, "recompute each layer's activations in the backward pass: less memory, ~a third more compute"
    )
    doc_mask: bool = option(
        False,
        "attention stops at <|endoftext|>: a token sees only its own document inside a packed block "
        "(training and validation)",
    )
    loss_chunk: int = option(
        DEFAULT_LOSS_CHUNK,
        "cross-entropy over the LM head in chunks of this many tokens, so the micro-batch's whole float32 "
        "logits never exist at once (0: transformers' loss over the whole logits)",
        check=NON_NEGATIVE_INT,
    )
    peak_tflops: float | None = option(
        None,
        "the device's peak TFLOP/s for MFU (default: known GPUs at the run's precision; none on CPU)",
        type=float,
        check=ABOVE_ZERO,
    )


@dataclass
class EngineOptions(Checked):
    """The DeepSpeed engine and the process group."""

    deepspeed_config: Path | None = option(None, "DeepSpeed config JSON (configs/ds_config*.json)")
    batch_ramp: int | None = option(
        None,
        "a batch-size ramp: the first N steps take from 1 up to fewer than the DeepSpeed config's "
        "gradient_accumulation_steps micro-batches each, in equal stages, the full batch after (default: "
        "a resumed run's own, else 0: none)",
        check=NON_NEGATIVE_INT,
        metavar="N",
    )
    distributed_backend: str | None = option(
        None, "torch.distributed backend (default: nccl on GPU, gloo on CPU)"
    )
    local_rank: int = option(-1, "set by the deepspeed launcher")
    dist_timeout: int = option(
        600,
        "seconds a rank waits for the others (start-up included) before it gives them up: a rank or "
        "node that died or froze ends every other rank within this time, with the last whole "
        "checkpoint kept. Longer than the longest single wait of the run (a checkpoint's writing)",
        type=int,
        check=POSITIVE_INT,
    )

    def convert(self) -> None:
        self.deepspeed_config = shipped_path(self.deepspeed_config)


def data_spec(
    data: DataOptions, model: ModelOptions, context: int, vocab_dir: Path | None = None
) -> DataSpec:
    """The blocks a run of these options reads (the data fingerprint's settings): training's, and
    ``dsgpt2 tokenize``'s cache for it. ``vocab_dir``: the tokenizer as this node reads it (its copy of
    one kept in a store; default ``--vocab_dir``)."""
    from dsgpt2.data.sources import make_spec

    return make_spec(
        vocab_dir or data.vocab_dir,
        context=context,
        chunk_docs=data.chunk_docs,
        tr_ratio=data.tr_ratio,
        seed=data.seed,
        task=model.task,
        reply_speakers=model.reply_speakers,
        order=data.read_order,
        packing=data.packing,
    )


@dataclass
class TrainConfig(Freezable):
    """Everything a training run is told."""

    data: DataOptions
    model: ModelOptions = field(default_factory=ModelOptions)
    run: RunOptions = field(default_factory=RunOptions)
    ckpt: CheckpointOptions = field(default_factory=CheckpointOptions)
    compute: ComputeOptions = field(default_factory=ComputeOptions)
    schedule: ScheduleOptions = field(default_factory=ScheduleOptions)
    optim: OptimizerOptions = field(default_factory=OptimizerOptions)
    engine: EngineOptions = field(default_factory=lambda: EngineOptions(Path("configs/ds_config.json")))

    def __post_init__(self) -> None:
        self.check()

    def parts(self) -> tuple[Freezable, ...]:
        """The sections, in the order the flags are listed and recorded."""
        return (
            self.model,
            self.data,
            self.run,
            self.ckpt,
            self.compute,
            self.schedule,
            self.optim,
            self.engine,
        )

    def freeze(self) -> None:
        """Freeze every section: the configuration :meth:`check_files` and :meth:`settle` resolved is the
        one the run records and uses, never assigned afterwards."""
        for part in self.parts():
            part.freeze()
        super().freeze()

    def check(self) -> None:
        """Refuse options that cannot train together (again once :meth:`settle` has filled them in).

        Raises:
            ConfigError: naming the flags and the fix.
        """
        s = self.schedule
        own = s.lr_schedule not in (None, "deepspeed")
        if own and s.warmup_iters:
            check_warmup(s.warmup_iters, self.run.train_iters)
        if self.run.early_stopping and self.data.tr_ratio >= 1:  # it would watch nothing, and stop never
            raise ConfigError(
                "--early_stopping watches the validation split, and --tr_ratio 1 leaves none: lower "
                "--tr_ratio (0.95, say), or leave --early_stopping out"
            )
        own_rates = OPTIMIZERS[self.optim.optimizer].own_rates if self.optim.optimizer else None
        if own_rates and s.lr_schedule == "deepspeed":
            raise ConfigError(
                f"--lr_schedule deepspeed gives every weight one learning rate, and this run trains with "
                f"{own_rates}: use --lr_schedule wsd (or cosine), or --optimizer adamw"
            )

    def check_files(self) -> None:
        """Check the files the options name, and fill in the tokenizer directory where none was given
        (the ``--init_from`` model's, else ``runs/tokenizer``): what a run does before anything else.

        Raises:
            ConfigError: a file that is not there or does not read as what its flag takes, naming
                the flag.
        """
        self.data.check_files()
        self.model.check_files()
        self.run.check_files()
        self.ckpt.check_files()
        self.ckpt.check_workspace(self.run.workspace)
        if self.data.data_mode == "cached" and not (self.cache_dir / "cache.json").is_file():
            check_writable_dir(self.cache_dir, "--cache_dir")  # the run builds it: refused now, not later
        # DeepSpeed's parser adds --deepspeed_config, as an optional flag: it is required here.
        if not self.engine.deepspeed_config:
            raise ConfigError("--deepspeed_config is required (the shipped ones are configs/ds_config*.json)")
        if self.data.vocab_dir is None:
            vocab = DEFAULT_VOCAB_DIR
            if self.model.init_from is not None:
                from dsgpt2.checkpoints.weights import init_tokenizer_dir

                vocab = init_tokenizer_dir(self.model.init_from)
            from dsgpt2.tokenizer.stored import stored_tokenizer

            # One in the database (the --init_from run's) is fetched once the run has its connection.
            if stored_tokenizer(vocab) is None and not (vocab / "tokenizer.json").is_file():
                raise ConfigError(
                    f"--vocab_dir {vocab}: no tokenizer.json; train one first (dsgpt2 vocab train)"
                )
            self.data.vocab_dir = vocab

    def settle(
        self,
        saved: dict[str, object] | None,
        unfit: str | None = None,
        ds_config: dict[str, Any] | None = None,
    ) -> list[str]:
        """Decide what the options leave to the run: with ``saved`` (the options of the checkpoint this
        run resumes), its optimizer and Muon settings where none are given, its schedule and its batch
        ramp; a new run trains with Muon under WSD, or AdamW under the DeepSpeed config's scheduler where
        Muon cannot train (``unfit``: why the default optimizer cannot); ``ds_config``, the DeepSpeed
        config file as read, gives the defaults taken from it. Returns what was decided, as lines for the log.

        Raises:
            ConfigError: the options so filled cannot train together.
        """
        o, s = self.optim, self.schedule
        taken = o.take_resumed(saved) if saved is not None else []
        if saved is not None and s.lr_schedule is None and saved.get("lr_schedule"):
            s.lr_schedule = str(saved["lr_schedule"])
            taken.append(f"--lr_schedule {s.lr_schedule}")
        if self.engine.batch_ramp is None:
            self.engine.batch_ramp = int((saved or {}).get("batch_ramp") or 0)
            taken += [f"--batch_ramp {self.engine.batch_ramp}"] * bool(self.engine.batch_ramp)
        said = [
            f"the checkpoint to resume was trained with {', '.join(taken)}: this run continues with it"
        ] * bool(taken)
        said += o.settle(unfit, ds_config)
        if s.lr_schedule is None:
            s.lr_schedule = "wsd" if o.chosen().own_rates else "deepspeed"
        self.check()
        return said

    def data_spec(self, context: int, vocab_dir: Path | None = None) -> DataSpec:
        """The blocks this run reads (the data fingerprint's settings), for a model of ``context``
        (``vocab_dir``: the tokenizer as this node reads it)."""
        return data_spec(self.data, self.model, context, vocab_dir)

    @property
    def cache_dir(self) -> Path:
        return self.data.cache_dir or self.run.workspace / "cache"

    def to_dict(self) -> dict[str, object]:
        """Every option by flag name, paths as strings (for metrics, wandb and checkpoints)."""
        from dataclasses import asdict

        out: dict[str, object] = {}
        for part in self.parts():
            for k, v in asdict(part).items():
                # One flag per name: two sections declaring one would record one of them only.
                assert k not in out, f"--{k} is declared by two sections of TrainConfig"
                out[k] = str(v) if isinstance(v, Path) else v
        return out

    def shared(self) -> dict[str, object]:
        """What every rank of a run must be started with alike: each option by flag name but the paths
        (one node may name a file otherwise than another) and a node's own (the launcher's --local_rank,
        loader workers sized to its cores, its GPUs' peak for MFU, wandb's mode)."""
        own = {"local_rank", "num_workers", "peak_tflops", "wandb"}
        return {k: v for part in self.parts() for k, v in vars(part).items()
                if not k.startswith("_") and k not in own and not isinstance(v, Path)}  # fmt: skip

    def resolved(self) -> str:
        """Every option as an experiment file (YAML) that runs this configuration again:
        ``ds_trainer.py --config THIS`` (the launcher's --local_rank left out)."""
        from dsgpt2.settings.runfile import dump_yaml

        values = {k: v for k, v in self.to_dict().items() if k != "local_rank"}
        return "# The resolved configuration of a dsgpt2 training run.\n" + dump_yaml(values)


GROUPS = (
    ("model", ModelOptions),
    ("data", DataOptions),
    ("run", RunOptions),
    ("checkpoints", CheckpointOptions),
    ("compute", ComputeOptions),
    ("learning-rate schedule", ScheduleOptions),
    ("optimizer", OptimizerOptions),
)


def trainer_parser(prog: str = "ds_trainer.py") -> OneLineErrorParser:
    p = OneLineErrorParser(
        prog=prog,
        description=(
            "Train GPT-2 with DeepSpeed on the MongoDB corpus named by --config_train. Runs under the "
            "`deepspeed` launcher (one or many GPUs and nodes) or as a single process "
            "(`python ds_trainer.py ...`, CPU or one GPU). Resumes from the latest checkpoint in "
            "--ckpt_dir; --no_resume refuses to instead. Ctrl-C or SIGTERM: a checkpoint after the "
            "current step, then exit."
        ),
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="an experiment file (.yaml, .yml or .toml) whose keys are these flags (flags given here "
        "override it); a .json file is the connection config, as --config_train",
    )
    for title, cls in GROUPS:
        add_options(p.add_argument_group(title), cls)
    add_options(p.add_argument_group("batch"), EngineOptions, only=["batch_ramp"])
    g = p.add_argument_group("distributed")
    add_options(g, EngineOptions, only=["distributed_backend", "local_rank", "dist_timeout"])
    prepare_deepspeed_environment()
    import deepspeed

    deepspeed.add_config_arguments(p)
    # --distributed-backend is the original toolkit's spelling of the backend flag.
    return accept_hyphen_spellings(p)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        data=from_namespace(DataOptions, args),
        model=from_namespace(ModelOptions, args),
        run=from_namespace(RunOptions, args),
        ckpt=from_namespace(CheckpointOptions, args),
        compute=from_namespace(ComputeOptions, args),
        schedule=from_namespace(ScheduleOptions, args),
        optim=from_namespace(OptimizerOptions, args),
        engine=from_namespace(EngineOptions, args),
    )


def parse(
    argv: Sequence[str] | None = None, prog: str = "ds_trainer.py", sections: Collection[str] | None = None
) -> TrainConfig:
    """Parse ``ds_trainer.py``'s flags (and an experiment file, ``--config run.yaml``) into a checked
    :class:`TrainConfig`; the files it names are checked as the run is built
    (:meth:`TrainConfig.check_files`).

    Raises:
        ConfigError: a value or a combination of flags that cannot work, naming the flags and the fix.
    """
    import sys

    from dsgpt2.settings.runfile import parse_args

    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(trainer_parser(prog), argv, command=["train"], sections=sections, aliases=TRAIN_ALIASES)
    return config_from_args(args)


# The connection config is --config_train here, --config in the other commands: an experiment file's
# `config` key (and --config FILE.json) means the same JSON for both.
TRAIN_ALIASES = {"config": "config_train"}
