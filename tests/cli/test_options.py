"""The one road for every flag (dsgpt2.settings.options, dsgpt2.settings.argtypes): dataclass fields
become flags with their help, type, default and check written once; parsed flags come back as a
checked object; a range reads a flag's text and checks a value with one-line messages naming it."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsgpt2.errors import ConfigError
from dsgpt2.settings.argtypes import (
    OneLineErrorParser,
    accept_hyphen_spellings,
    comma_list,
    non_negative_int,
    part_of,
    positive_float,
    positive_int,
    ratio,
)
from dsgpt2.settings.options import (
    MISSING,
    NON_NEGATIVE_INT,
    PORT,
    POSITIVE_INT,
    POSITIVE_NUMBER,
    RATIO,
    ActionHelp,
    Checked,
    OneOf,
    Range,
    action_groups,
    action_of,
    actions,
    add_options,
    check_choice,
    check_fields,
    check_number,
    check_ratio,
    command_names,
    describe,
    flag_strings,
    from_namespace,
    is_switch,
    listed_flags,
    option,
    settable_actions,
    subcommands,
    takes_many,
)

SOURCE = OneOf(required=True)


@dataclass(frozen=True, kw_only=True)
class Sample:
    """A settings dataclass with one field of each kind."""

    config: str = option(help="connection config", metavar="JSON")
    verbose: bool = option(False, "log debug details", short="-v")
    inputs: tuple[str, ...] = option((), "input files", positional=True, metavar="FILE")
    batch_size: int = option(1000, "documents per insert", check=POSITIVE_INT)
    share: float | None = option(None, "a share", check=RATIO)
    out: Path = option(Path("runs/x"), "output directory")
    split: str = option("line", "how to split", choices=["line", "paragraph"])
    collections: tuple[str, ...] | None = option(
        None, "a collection (repeatable)", flag="collection", repeat=True
    )
    threshold: tuple[str, ...] = option((), "NAME=VALUE (repeatable)", repeat=True, metavar="NAME=VALUE")
    rules: tuple[str, ...] = option(("a", "b"), "rule sets", type=comma_list, metavar="A,B")
    doc_mask: bool | None = option(None, "attention within documents only")
    hook: int = option(0, "a test hook", hidden=True)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, kw_only=True)
class Action:
    action: str = option(help="what to do", positional=True, choices=("status", "stop"))
    database: str | None = option(None, "the database", positional=True, metavar="local://DIR")


@dataclass(frozen=True, kw_only=True)
class Source:
    input: Path | None = option(None, "shard directory", metavar="DIR", one_of=SOURCE)
    from_mongo: bool = option(False, "stream from the collections", one_of=SOURCE)


def _parser(cls: type = Sample, **kwargs: object) -> OneLineErrorParser:
    p = OneLineErrorParser(prog="t")
    add_options(p, cls, **kwargs)  # type: ignore[arg-type]
    return p


def _parse(argv: list[str], cls: type = Sample) -> Sample:
    return from_namespace(cls, _parser(cls).parse_args(argv))


def test_fields_become_flags_and_come_back_as_the_object() -> None:
    s = _parse(["--config", "c.json", "-v", "a.txt", "b.txt", "--batch_size", "5", "--share", "0.5"])
    assert s == Sample(config="c.json", verbose=True, inputs=("a.txt", "b.txt"), batch_size=5, share=0.5)
    assert isinstance(s.out, Path) and s.inputs == ("a.txt", "b.txt")
    assert _parse(["--config", "c.json"]) == Sample(config="c.json")  # every default is the field's
    # A renamed flag lands in its field; a repeated one as a tuple.
    s = _parse(["--config", "c", "--collection", "a", "--collection", "b", "--threshold", "x=1"])
    assert s.collections == ("a", "b") and s.threshold == ("x=1",)
    assert _parse(["--config", "c", "--rules", "x, y,"]).rules == ("x", "y")
    # override replaces what was parsed.
    args = _parser().parse_args(["--config", "c", "--batch_size", "5"])
    assert from_namespace(Sample, args, batch_size=7).batch_size == 7


def test_a_repeated_flag_with_a_default_adds_to_a_copy() -> None:
    p = _parser()
    first = p.parse_args(["--config", "c", "--threshold", "x=1"])
    second = p.parse_args(["--config", "c"])
    assert first.threshold == ["x=1"] and second.threshold == [] and Sample(config="c").threshold == ()


def test_help_states_each_default_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "documents per insert (default: 1000)" in out
    assert "output directory (default: runs/x)" in out and "rule sets (default: a,b)" in out
    assert "-v, --verbose log debug details" in out and "--config JSON" in out
    # Not for "not given": None, off, empty.
    for plain in ("a share", "input files", "NAME=VALUE (repeatable)", "log debug details"):
        assert f"{plain} (default" not in out
    assert "--hook" not in out  # hidden
    assert "--doc_mask" in out and "--no_doc_mask" in out and "the opposite of --doc_mask" in out


def test_a_field_without_default_is_required_and_defaults_can_change_per_parser() -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args([])
    p = _parser(defaults={"config": "here.json", "batch_size": 3})
    assert from_namespace(Sample, p.parse_args([])) == Sample(config="here.json", batch_size=3)
    p = _parser(defaults={"split": MISSING})
    with pytest.raises(SystemExit):
        p.parse_args(["--config", "c"])


def test_only_a_subset_in_its_order_and_help_reworded(capsys: pytest.CaptureFixture[str]) -> None:
    p = _parser(only=["split", "batch_size"], helps={"split": "another sense"})
    assert [a.dest for a in settable_actions(p)] == ["split", "batch_size"]
    with pytest.raises(SystemExit):
        p.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "another sense (default: line)" in out and "how to split" not in out


def test_bool_pairs_and_switches() -> None:
    assert [_parse(["--config", "c", *m]).doc_mask for m in ([], ["--doc_mask"], ["--no_doc_mask"])] == [
        None,
        True,
        False,
    ]
    with pytest.raises(SystemExit):
        _parser().parse_args(["--config", "c", "--doc_mask", "--no_doc_mask"])
    p = _parser()
    switches = {a.dest for a in settable_actions(p) if is_switch(a)}
    assert switches == {"verbose", "doc_mask"}
    many = {a.dest for a in settable_actions(p) if takes_many(a)}
    assert many == {"inputs", "collection", "threshold"}  # a renamed flag parses into its own name


def test_positional_arguments() -> None:
    assert _parse(["--config", "c"]).inputs == ()
    p = _parser(Action)
    assert from_namespace(Action, p.parse_args(["stop"])) == Action(action="stop")
    assert from_namespace(Action, p.parse_args(["status", "local://d"])).database == "local://d"
    for bad in ([], ["start"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    assert "usage: t [-h] {status,stop} [local://DIR]" in p.format_usage()


def test_mutually_exclusive_options(capsys: pytest.CaptureFixture[str]) -> None:
    p = _parser(Source)
    assert from_namespace(Source, p.parse_args(["--input", "d"])) == Source(input=Path("d"))
    assert from_namespace(Source, p.parse_args(["--from_mongo"])).from_mongo
    assert "(--input DIR | --from_mongo)" in p.format_usage()
    for bad, says in (([], "one of the arguments --input --from_mongo is required"),
                      (["--input", "d", "--from_mongo"], "not allowed with argument")):  # fmt: skip
        with pytest.raises(SystemExit) as exited:
            p.parse_args(bad)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and says in err and err.count("\n") == 1


def test_a_checked_field_is_refused_as_parsed_and_checked_on_construction(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The range is written once: the flag refuses a value outside it as argparse reads it (one line,
    where to look), and the object checks it when made in code, naming the flag."""
    for text, says in (
        ("x", "expected a positive integer, got 'x'"),
        ("-3", "must be a positive integer, got '-3'"),
    ):
        with pytest.raises(SystemExit) as exited:
            _parser().parse_args(["--config", "c", "--batch_size", text])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.count("\n") == 1
        assert f"t: error: argument --batch_size: {says} (see `t --help`)" in err
    with pytest.raises(SystemExit):
        _parser().parse_args(["--config", "c", "--share", "2"])
    assert "argument --share: must be in (0, 1], got '2'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"^--batch_size must be a positive integer, got 0$"):
        Sample(config="c", batch_size=0)
    with pytest.raises(ConfigError, match=r"^--share must be in \(0, 1\], got 2$"):
        Sample(config="c", share=2)
    with pytest.raises(ConfigError, match=r"^--split 'word' is not one of line, paragraph$"):
        Sample(config="c", split="word")
    Sample(config="c", share=None)  # None: not given, where the field may be None


def test_a_plain_type_leaves_the_range_to_construction() -> None:
    @dataclass(frozen=True)
    class Draw:
        fraction: float | None = option(None, "a share", type=float, check=RATIO)

        def __post_init__(self) -> None:
            check_fields(self)

    args = _parser(Draw).parse_args(["--fraction", "0"])
    with pytest.raises(ConfigError, match=r"^--fraction must be in \(0, 1\], got 0.0$"):
        from_namespace(Draw, args)


def test_check_fields_names_settings_as_given() -> None:
    @dataclass(frozen=True)
    class Request:
        top_k: int = option(50, "k", check=NON_NEGATIVE_INT)
        limit: int = option(8, "limit", check=POSITIVE_INT, flag="max_limit")

        def __post_init__(self) -> None:
            check_fields(self, prefix="")

    with pytest.raises(ConfigError, match=r"^top_k must be an integer at least 0, got -1$"):
        Request(top_k=-1)
    with pytest.raises(ConfigError, match=r"^max_limit must be a positive integer, got 0$"):
        Request(limit=0)


@pytest.mark.parametrize(
    ("check", "value", "message"),
    [
        (lambda v: Range(int, 1).check("n", v), 0, "n must be an integer at least 1, got 0"),
        (lambda v: Range(int, 1).check("n", v), True, "n must be an integer at least 1, got True"),
        (lambda v: Range(int, 1).check("n", v), 2.5, "n must be an integer at least 1, got 2.5"),
        (lambda v: Range(int, 1, 16).check("n", v), 17, "n must be an integer between 1 and 16, got 17"),
        (
            lambda v: check_number("t", v, 0.01, 100.0, or_zero=True),
            -1,
            "t must be 0 or a number in [0.01, 100.0], got -1",
        ),
        (
            lambda v: check_number("p", v, 0.0, 1.0, low_open=True),
            7,
            "p must be a number in (0.0, 1.0], got 7",
        ),
        (lambda v: check_number("x", v, 0, low_open=True), math.nan, "x must be a number above 0, got nan"),
        (lambda v: check_number("x", v, 0), "3", "x must be a number at least 0, got '3'"),
        (lambda v: POSITIVE_INT.check("--n", v), 0, "--n must be a positive integer, got 0"),
        (lambda v: NON_NEGATIVE_INT.check("--n", v), -1, "--n must be an integer at least 0, got -1"),
        (lambda v: check_ratio("--f", v), 0, "--f must be in (0, 1], got 0"),
        (lambda v: check_ratio("--f", v), "x", "--f must be a number in (0, 1], got 'x'"),
        (lambda v: check_choice("--c", v, ["a", "b"]), "z", "--c 'z' is not one of a, b"),
    ],
)
def test_the_checks_say_one_line_naming_the_setting(check: object, value: object, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        check(value)  # type: ignore[operator]
    assert str(raised.value) == message


def test_the_checks_let_good_and_absent_values_through() -> None:
    Range(int, 1).check("n", 1)
    Range(int, 1).check("n", None, optional=True)
    check_number("t", 0, 0.01, 100.0, or_zero=True)
    check_number("x", 3, 0)  # an int is a number
    POSITIVE_INT.check("--n", None, optional=True)
    NON_NEGATIVE_INT.check("--n", 0)
    check_ratio("--f", 1)
    check_choice("--c", None, ["a"])
    with pytest.raises(ConfigError):
        Range(int, 1).check("n", None)  # None only where it may be absent


def test_ranges_in_words() -> None:
    assert POSITIVE_INT.words == "a positive integer" and NON_NEGATIVE_INT.words == "an integer at least 0"
    assert POSITIVE_NUMBER.words == "a positive number" and RATIO.words == "a number in (0, 1]"
    assert PORT.words == "an integer between 0 and 65535"
    assert Range(float, 0.01, 100.0, or_zero=True).words == "0 or a number in [0.01, 100.0]"
    assert Range(int, 1, 16).holds(16) and not Range(int, 1, 16).holds(17) and not POSITIVE_INT.holds(True)
    assert RATIO.holds(1) and not RATIO.holds(0) and not POSITIVE_NUMBER.holds(math.inf)


@pytest.mark.parametrize(
    ("convert", "text", "message"),
    [
        (positive_int, "abc", "expected a positive integer, got 'abc'"),
        (positive_int, "2.5", "expected a positive integer, got '2.5'"),
        (positive_int, "0", "must be a positive integer, got '0'"),
        (non_negative_int, "x", "expected an integer at least 0, got 'x'"),
        (non_negative_int, "-1", "must be an integer at least 0, got '-1'"),
        (positive_float, "x", "expected a positive number, got 'x'"),
        (positive_float, "0", "must be a positive number, got '0'"),
        (positive_float, "inf", "must be a positive number, got 'inf'"),
        (ratio, "x", "expected a number in (0, 1], got 'x'"),
        (ratio, "1.5", "must be in (0, 1], got '1.5'"),
        (ratio, "nan", "must be in (0, 1], got 'nan'"),
        (part_of, "3/2", "expected R/M with 1 <= R <= M (e.g. 2/4), got '3/2'"),
        (part_of, "2", "expected R/M with 1 <= R <= M (e.g. 2/4), got '2'"),
    ],
)
def test_the_converters_refuse_with_the_ranges_words(convert: object, text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as raised:
        convert(text)  # type: ignore[operator]
    assert str(raised.value) == message


def test_the_converters_read_good_text() -> None:
    assert (positive_int("3"), non_negative_int("0"), positive_float("0.5"), ratio("1")) == (3, 0, 0.5, 1.0)
    assert part_of("2/4") == (2, 4) and comma_list(" user, ,bot ") == ("user", "bot")
    assert POSITIVE_INT.parse("-3") == -3  # the kind only


def test_errors_are_one_line_with_where_to_look(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        _parser().parse_args(["--config", "c", "--split", "word"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1
    assert err.startswith("t: error: argument --split: invalid choice") and err.endswith("(see `t --help`)\n")


def _tree() -> OneLineErrorParser:
    root = OneLineErrorParser(prog="t")
    sub = root.add_subparsers(dest="command")
    vocab = sub.add_parser("vocab").add_subparsers(dest="step")
    add_options(vocab.add_parser("train"), Sample)
    add_options(sub.add_parser("info"), Source)
    return accept_hyphen_spellings(root)


def test_hyphen_spellings_are_accepted_unlisted_everywhere() -> None:
    root = _tree()
    train = subcommands(subcommands(root)["vocab"])["train"]
    old = root.parse_args(["vocab", "train", "--config", "c", "--batch-size", "5", "--no-doc-mask"])
    new = root.parse_args(["vocab", "train", "--config", "c", "--batch_size", "5", "--no_doc_mask"])
    earlier = root.parse_args(["vocab", "train", "--config", "c", "--batch_size", "5", "--no-doc_mask"])
    assert vars(old) == vars(new) == vars(earlier) and new.batch_size == 5 and new.doc_mask is False
    assert root.parse_args(["info", "--from-mongo"]).from_mongo
    assert {"--batch-size", "--no-doc_mask", "--no-doc-mask"} <= flag_strings(train)
    assert "--batch-size" not in train.format_help()
    with pytest.raises(SystemExit):
        root.parse_args(["vocab", "train", "--config", "c", "--batch", "5"])  # no abbreviations


def test_reading_a_parser_back() -> None:
    root = _tree()
    assert set(subcommands(root)) == {"vocab", "info"} and subcommands(subcommands(root)["info"]) == {}
    assert command_names(root) == {"vocab", "train", "info"}
    dests = [a.dest for a in settable_actions(subcommands(root)["info"])]
    assert dests == ["input", "from_mongo"]  # not --help


def test_reading_flags_and_their_help_back() -> None:
    root = _tree()
    train = subcommands(subcommands(root)["vocab"])["train"]
    assert [a.dest for a in actions(root)] == ["help"]  # not the subcommands
    assert [a.dest for a in actions(subcommands(root)["info"])] == ["help", "input", "from_mongo"]
    listed = listed_flags(train)
    assert listed[:6] == ["-h", "--help", "--config", "-v", "--verbose", "--batch_size"]
    assert listed[-3:] == ["--doc_mask", "--no_doc_mask", "--hook"]
    assert "--batch-size" not in listed and "--batch-size" in flag_strings(train)  # unlisted spelling

    shown = {(a.option_strings or [a.dest])[-1]: describe(train, a) for a in actions(train)}
    assert shown["--batch_size"] == ActionHelp(
        flags=("--batch_size",),
        value="BATCH_SIZE",
        help="documents per insert (default: 1000)",
        hidden=False,
        default=1000,
        choices=None,
        required=False,
    )
    assert (shown["--config"].value, shown["--config"].required, shown["--config"].default) == (
        "JSON",
        True,
        None,
    )
    assert (shown["--verbose"].flags, shown["--verbose"].value, shown["--verbose"].default) == (
        ("-v", "--verbose"),
        "",
        False,
    )
    assert (shown["inputs"].flags, shown["inputs"].value, shown["inputs"].default) == ((), "[FILE ...]", ())
    assert (shown["--split"].value, shown["--split"].choices) == ("SPLIT", ("line", "paragraph"))  # apart
    assert (shown["--hook"].hidden, shown["--hook"].help) == (True, "")
    assert shown["--help"].default is None  # argparse's SUPPRESS: none

    plain = argparse.ArgumentParser(prog="t")
    n = plain.add_argument("--n", type=int, default=3, help="how many (at most %(default)s)")
    assert describe(plain, n).help == "how many (at most 3)"


def test_argument_groups_are_read_back_with_their_titles() -> None:
    p = OneLineErrorParser(prog="t")
    add_options(p.add_argument_group("source"), Source)  # a mutually exclusive pair inside a group
    p.add_subparsers(dest="command").add_parser("x")
    groups = {title: [a.dest for a in group] for title, group in action_groups(p)}
    assert groups == {"positional arguments": [], "options": ["help"], "source": ["input", "from_mongo"]}


def test_an_experiment_file_value_is_refused_naming_its_key(tmp_path: Path) -> None:
    from dsgpt2.settings.runfile import apply_run_file

    run = tmp_path / "run.yaml"
    with pytest.raises(ConfigError, match=r"key 'batch_size': must be a positive integer, got '-3'$"):
        apply_run_file(_parser(), {"batch_size": -3}, run)
    p = _parser()
    apply_run_file(p, {"batch_size": 7, "inputs": ["a", "b"], "collection": "x", "doc_mask": False}, run)
    s = from_namespace(Sample, p.parse_args(["--config", "c"]))
    assert (s.batch_size, s.inputs, s.collections, s.doc_mask) == (7, ("a", "b"), ("x",), False)


@dataclass(frozen=True)
class _Window(Checked):
    low: int = option(0, "first", check=NON_NEGATIVE_INT)
    high: int = option(10, "end", check=POSITIVE_INT)

    def check(self) -> None:
        if self.low >= self.high:
            raise ConfigError(f"--low {self.low} must be below --high {self.high}")


def test_a_settings_class_is_checked_by_its_base_field_by_field_then_across_fields() -> None:
    """One base checks every settings class: each field's range first (naming its flag), then the class's
    own check across fields; the package keeps no hand-copied __post_init__ that only calls check_fields."""
    import re

    from conftest import ROOT

    assert _Window(1, 2).high == 2
    with pytest.raises(ConfigError, match=r"--high must be a positive integer, got 0"):
        _Window(5, 0)  # the field's range, before the check across fields
    with pytest.raises(ConfigError, match=r"--low 3 must be below --high 2"):
        _Window(3, 2)
    copies = re.compile(r"def __post_init__\(self\) -> None:\n        check_fields\(self\)\n\n")
    assert [p.name for p in (ROOT / "dsgpt2").rglob("*.py") if copies.search(p.read_text())] == []


def test_the_input_formats_are_named_once() -> None:
    """`dsgpt2 ingest --format`'s choices are what the readers dispatch on, from one registry."""
    from dsgpt2.cli.main import build_parser
    from dsgpt2.corpus import formats
    from dsgpt2.errors import IngestError

    ingest = subcommands(build_parser())["ingest"]
    action = action_of(ingest, "--format")
    assert action is not None
    assert tuple(action.choices) == tuple(formats.FORMATS) == ("auto", *formats.READERS)
    assert list(formats.READERS) == ["text", "jsonl", "csv", "conversation", "parquet", "arrow", "dataset"]
    with pytest.raises(IngestError, match="choose one of " + ", ".join(formats.FORMATS)):
        formats.file_source(__file__, "nope")


def test_a_range_open_at_its_top_is_declared_not_checked_by_hand() -> None:
    """[0, 1) is a Range: Muon's momentum refuses 1 as it is parsed; MinHash's permutations refuse 1 at
    the flag, not later in the pass."""
    from dsgpt2.cli.main import build_parser
    from dsgpt2.curation.minhash import LshParams

    momentum = Range(float, 0, 1, high_open=True)
    assert momentum.holds(0.0) and momentum.holds(0.99) and not momentum.holds(1.0)
    assert momentum.words == "a number in [0, 1)"
    with pytest.raises(argparse.ArgumentTypeError, match=r"must be a number in \[0, 1\), got '1'"):
        momentum.convert("1")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["dedup", "--config", "c.json", "--near", "--num_perm", "1"])
    with pytest.raises(ConfigError, match="--num_perm must be an integer between 2 and 8192, got 1"):
        LshParams(num_perm=1)
