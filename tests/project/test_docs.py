"""The documentation site stays true: it builds in strict mode, every command its pages show parses with
the real parsers, every path they name exists, and the generated reference names every flag of every
command and every connection-config key (checked as tests/project/test_readme.py checks the README,
with the functions of tests/doc_checks.py)."""

from __future__ import annotations

import argparse
import html
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from doc_checks import (
    blocks,
    check_dsgpt2_command,
    check_inline_options,
    check_pipeline_command,
    check_trainer_command,
    dsgpt2_commands,
    inline,
    missing_paths,
    named_paths,
    pipeline_commands,
    split,
    trainer_commands,
)

from conftest import ROOT
from dsgpt2.settings.options import actions, listed_flags, subcommands

DOCS = ROOT / "docs"
# Written from the code by docs/gen_reference.py (checked against it below): not prose to read through.
REFERENCE = {"reference/commands.md", "reference/trainer.md", "reference/connection-config.md"}
PAGES = sorted(p for p in DOCS.rglob("*.md") if p.relative_to(DOCS).as_posix() not in REFERENCE)
# A page a reader takes in at one sitting: long enough to stand alone, short enough to finish.
PAGE_LINES = (30, 250)


def _params(collect: object) -> list[object]:
    """``pytest.param(command)`` for every command ``collect(page)`` finds, named by page and command."""
    return [
        pytest.param(command, id=f"{page.relative_to(DOCS)}: {command[:80]}")
        for page in PAGES
        for command in collect(page)  # type: ignore[operator]
    ]


def gen_reference() -> ModuleType:
    """docs/gen_reference.py, the MkDocs hook that writes the reference pages."""
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parsers(name: str, parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every (sub)command's parser by its full name, found apart from the generator's own walk."""
    out = {name: parser}
    for sub_name, sub in subcommands(parser).items():
        out.update(parsers(f"{name} {sub_name}", sub))
    return out


def sections(page: str) -> dict[str, str]:
    """A reference page's ``## NAME`` sections by NAME."""
    return {part.split("\n", 1)[0]: part for part in re.split(r"(?m)^## ", page)[1:]}


def missing_flags(section: str, parser: argparse.ArgumentParser) -> list[str]:
    """The option strings of ``parser`` that no row of ``section``'s flag tables shows in its first cell."""
    cells = [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| `")]
    shown = {flag for cell in cells for flag in re.findall(r"`(-{1,2}[A-Za-z0-9_-]+)", cell)}
    return [flag for flag in listed_flags(parser) if flag not in shown]


def expanded(page: Path) -> str:
    """A page's text with its ``--8<-- "FILE:N"`` snippets included, as the site shows it."""

    def include(match: re.Match[str]) -> str:
        path, _, start = match[1].partition(":")
        lines = (ROOT / path).read_text(encoding="utf-8").splitlines()
        return "\n".join(lines[int(start) - 1 if start else 0 :])

    return re.sub(r'^--8<-- "([^"]+)"$', include, page.read_text(encoding="utf-8"), flags=re.M)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as ``make docs`` builds it (strict: a warning fails), into a temporary directory."""
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert built.returncode == 0, (built.stdout + built.stderr)[-3000:]
    return out


def test_the_site_builds_in_strict_mode_with_the_generated_reference(site: Path) -> None:
    """Every page is built, the reference pages among them (made afresh by the hook), and the
    built commands page names every flag of every dsgpt2 command."""
    for page in PAGES:
        rel = page.relative_to(DOCS).with_suffix("")
        built = site / (rel.parent if rel.name == "index" else rel) / "index.html"
        assert built.is_file(), built
    commands = (site / "reference" / "commands" / "index.html").read_text(encoding="utf-8")
    from dsgpt2.cli.main import build_parser

    for name, parser in parsers("dsgpt2", build_parser()).items():
        assert html.escape(name) in commands, name
        for flag in listed_flags(parser):
            assert f"<code>{flag}" in commands, (name, flag)
    for name in ("trainer", "connection-config"):
        assert (site / "reference" / name / "index.html").is_file()


def test_commands_wrap_and_are_highlighted_as_commands(site: Path) -> None:
    """A long command wraps at the page's width (not sideways under the copy button), and `make test`
    is no `test` builtin in the home page's and Getting started's first block."""
    css = (site / "stylesheets" / "extra.css").read_text(encoding="utf-8")
    assert "white-space: pre-wrap" in css and "padding-right" in css
    for page in ("index.html", "getting-started/index.html"):
        text = (site / page).read_text(encoding="utf-8")
        assert "stylesheets/extra.css" in text, page
        assert "make test" in re.sub(r"<[^>]+>", "", text), page
        assert '<span class="nb">test</span>' not in text, page


def test_the_stored_reference_pages_are_what_the_code_makes() -> None:
    """The reference is stored (its links work in the repository) and cannot drift from the code: a
    flag added, removed or changed without `make reference` fails here."""
    module = gen_reference()
    assert set(module.PAGES) == REFERENCE
    for path in module.PAGES:
        stored = (DOCS / path).read_text(encoding="utf-8") if (DOCS / path).is_file() else ""
        assert stored == module.page(path), f"docs/{path} differs from the code: run `make reference`"


def test_every_link_of_the_docs_and_readme_works_in_the_repository() -> None:
    """A relative link (`[Trainer flags](../reference/trainer.md)`) names a file of the repository, so
    the docs read where they are stored as they do on the site."""
    broken = []
    for page in [*DOCS.rglob("*.md"), ROOT / "README.md", ROOT / "ARCHITECTURE.md"]:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def test_the_commands_reference_lists_every_flag_of_every_command() -> None:
    from dsgpt2.cli.main import build_parser

    page = sections(gen_reference().commands_page())
    for name, parser in parsers("dsgpt2", build_parser()).items():
        assert name in page, f"no section for {name}"
        assert missing_flags(page[name], parser) == [], name


def test_the_trainer_reference_lists_every_flag() -> None:
    from dsgpt2.train.config import trainer_parser

    page = gen_reference().trainer_page()
    assert missing_flags(page, trainer_parser()) == []


def test_the_config_reference_lists_every_key_with_its_default() -> None:
    from dsgpt2.db.config import _KEYS, MongoConfig

    page = gen_reference().config_page()
    rows = {m[1]: m[0] for m in re.finditer(r"^\| `([A-Z_]+)` \|.*$", page, flags=re.M)}
    assert set(rows) == set(_KEYS)
    assert "`5000`" in rows["SERVER_SELECTION_TIMEOUT_MS"] and MongoConfig.server_selection_timeout_ms == 5000
    assert '`"filt_text"`' in rows["TEXT_FIELD"]


def test_a_flag_missing_from_the_reference_is_found() -> None:
    """The completeness check fails where the page leaves a flag out."""
    parser = argparse.ArgumentParser(prog="dsgpt2 x")
    parser.add_argument("--kept", default=1, help="stays")
    parser.add_argument("--left_out", choices=["a", "b"], help="dropped below")
    module = gen_reference()
    whole = "\n".join(module._table(parser, actions(parser)))
    assert missing_flags(whole, parser) == []
    cut = "\n".join(line for line in whole.splitlines() if "--left_out" not in line)
    assert missing_flags(cut, parser) == ["--left_out"]
    assert "`a`, `b`" in whole and "| `1` |" in whole  # choices and defaults are shown


def test_pages_are_of_reading_length() -> None:
    """Each page's own text fits the range; a page that shows another document (architecture.md shows
    ARCHITECTURE.md) counts that document towards the least, not the most."""
    low, high = PAGE_LINES
    own = {str(p.relative_to(DOCS)): len(p.read_text(encoding="utf-8").splitlines()) for p in PAGES}
    shown = {str(p.relative_to(DOCS)): len(expanded(p).splitlines()) for p in PAGES}
    assert {p: n for p, n in own.items() if n > high} == {}
    assert {p: n for p, n in shown.items() if n < low} == {}


def test_the_docs_show_commands() -> None:
    """What test_readme once asked of the README, now asked of the docs as a whole."""
    found = [c for page in PAGES for c in dsgpt2_commands(page)]
    assert sum(c.startswith("dsgpt2 ") for c in found) >= 15
    assert any("pipelines/all.sh" in c for page in PAGES for c in pipeline_commands(page))
    assert any("deepspeed ds_trainer.py" in c for page in PAGES for c in trainer_commands(page))


@pytest.mark.parametrize("command", _params(dsgpt2_commands))
def test_dsgpt2_commands_parse(command: str) -> None:
    check_dsgpt2_command(command)


@pytest.mark.parametrize("command", _params(lambda p: [c for c in inline(p) if c.startswith("dsgpt2 ")]))
def test_inline_dsgpt2_commands_name_real_options(command: str) -> None:
    check_inline_options(command)


@pytest.mark.parametrize("command", _params(trainer_commands))
def test_trainer_commands_parse(command: str, tmp_path: Path) -> None:
    check_trainer_command(command, tmp_path)


@pytest.mark.parametrize("command", _params(pipeline_commands))
def test_pipeline_commands_use_documented_settings(command: str) -> None:
    check_pipeline_command(command)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_files_the_docs_name_in_the_repository_exist(page: Path) -> None:
    assert missing_paths(page) == [], page


def test_the_docs_name_files() -> None:
    assert sum(len(named_paths(page)) for page in PAGES) >= 20


def test_the_install_docs_say_how_to_take_torchs_cpu_build() -> None:
    """PyPI's Linux torch is the CUDA build (gigabytes of nvidia-* wheels): the README and Getting started
    name the CPU build's index for a machine without a GPU, for `make` and for a pip install of one's own,
    and that install brings the embedded database the tour runs on."""
    locked = re.search(r"(?m)^torch==(\S+)$", (ROOT / "requirements.lock").read_text(encoding="utf-8"))
    assert locked is not None
    cpu = f"torch=={locked[1]} --index-url https://download.pytorch.org/whl/cpu"
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    start = " ".join((DOCS / "getting-started.md").read_text(encoding="utf-8").split())
    for text in (readme, start):
        assert f"make demo TORCH_SPEC='{cpu}'" in text
        assert "installs the CPU build of PyTorch" not in text
    assert f"pip install {cpu}" in start and "pip install -c requirements.lock '.[local]'" in start


def _flags(command: str) -> dict[str, str]:
    """Each word of a command line by the word before it: a flag's value (a switch: the next flag)."""
    words = split(command)[1]
    return dict(zip(words, [*words[1:], ""], strict=True))


def test_the_serving_page_runs_in_order_after_the_tour() -> None:
    """Every model a command of the serving page reads (``--init_from``, ``--model``, an export's
    ``--ckpt_dir``) is one the tour or an earlier command of the page writes, and its chat requests go to a
    server of a conversation model (a text model answers them with a 400)."""
    import yaml

    recipe = yaml.safe_load((ROOT / "configs" / "recipes" / "demo.yaml").read_text(encoding="utf-8"))
    written, conversation, served = {recipe["ckpt_dir"]}, set(), None
    for command in blocks(DOCS / "serving.md"):
        words = split(command)[1]
        flags = _flags(command)
        for read in ("--init_from", "--model", "--ckpt_dir"):
            if read in flags and (read != "--ckpt_dir" or words[:2] == ["dsgpt2", "export"]):
                assert flags[read] in written, (read, command)
        if words[:2] == ["dsgpt2", "export"]:
            written.add(flags["--out"])
            if flags["--ckpt_dir"] in conversation:
                conversation.add(flags["--out"])
        elif "ds_trainer.py" in words:
            written.add(flags["--ckpt_dir"])
            if flags.get("--task") == "conversation":
                conversation.add(flags["--ckpt_dir"])
        elif words[:2] == ["dsgpt2", "serve"]:
            served = flags["--model"]
        if "/v1/chat/completions" in command:
            assert served in conversation, command
    assert served is not None


def _trainer_flags(command: str) -> dict[str, str]:
    """The flags of a training command that reach the trainer (a launcher's own, before the script or
    ``train``, left out), each by its value (a switch: the next flag, or "")."""
    words = split(command)[1]
    at = next(i for i, w in enumerate(words) if w in ("ds_trainer.py", "train"))
    flags = words[at + 1 :]
    return dict(zip(flags, [*flags[1:], ""], strict=True))


def test_the_demo_recipes_runs_beside_the_tours_train_in_folders_of_their_own() -> None:
    """After the tour the demo recipe's --ckpt_dir holds its run (Muon, packed end to end, 16 sequences a
    step, 300 steps): a command of the docs that runs the recipe with anything but a longer --train_iters
    (another optimizer, --muon_scale or packing is refused there, fewer steps train nothing, another batch
    or schedule would change the tour's run) names a --ckpt_dir and a --workspace of its own, and no two
    such commands share one."""
    import yaml

    recipe = yaml.safe_load((ROOT / "configs" / "recipes" / "demo.yaml").read_text(encoding="utf-8"))
    tour = [c for c in trainer_commands(ROOT / "README.md") if "configs/recipes/demo.yaml" in c]
    steps = int(_flags(tour[0])["--train_iters"])
    owners: dict[str, str] = {}
    for page in [ROOT / "README.md", *PAGES]:
        for command in trainer_commands(page) + [c for c in inline(page) if c.startswith("dsgpt2 train ")]:
            flags = _trainer_flags(command)
            if flags.get("--config") != "configs/recipes/demo.yaml":
                continue
            variant = {f for f in flags if f.startswith("--")} - {"--config", "--train_iters"}
            if variant or int(flags.get("--train_iters", recipe["train_iters"])) < steps:
                where = (page.name, command)
                assert flags.get("--ckpt_dir", recipe["ckpt_dir"]) != recipe["ckpt_dir"], where
                assert flags.get("--workspace", recipe["workspace"]) != recipe["workspace"], where
                assert owners.setdefault(flags["--ckpt_dir"], command) == command, where
    assert len(owners) >= 6


def test_the_docs_write_tokenizers_and_exports_where_the_tour_and_their_page_wrote_none() -> None:
    """`vocab train`, `vocab push` and `export` refuse an --out that holds a tokenizer or another
    checkpoint's export (without --overwrite): a page's command writes none where the tour, or an earlier
    command of its page, wrote one (the tour's runs/tokenizer is the one its runs trained with)."""
    tour = [c for c in blocks(ROOT / "README.md") if c.startswith("dsgpt2 ")]
    writers = (["dsgpt2", "vocab", "train"], ["dsgpt2", "vocab", "push"])

    def out(command: str) -> str | None:
        env, words = split(command)
        if "--overwrite" in words:
            return None
        if words[:3] in writers or words[:2] == ["dsgpt2", "export"]:
            return _flags(command)["--out"]
        if words[-1:] == ["pipelines/train_vocab.sh"]:
            return env.get("TOKENIZER", "runs/tokenizer")
        return None

    toured = {o for c in tour if (o := out(c))}
    checked = 0
    for page in PAGES:
        written = set(toured)
        for command in blocks(page):
            if command in tour or (there := out(command)) is None:
                continue
            checked += 1
            assert there not in written, (page.name, command)
            written.add(there)
    assert checked >= 10
