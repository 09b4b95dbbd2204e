"""The docs as a new user reads them: every `fv ...` command parses with fv's own argument parser, every
card id they name is registered, every relative link resolves, and README.md's Python blocks that run on
embedded cards run as written (a `# ConfigError: ...` comment: that statement raises it)."""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

import fv_core
from fv_core.cli import build_parser
from fv_core.plugins import load_plugins

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted(ROOT.glob("plugins/*/README.md"))]
USER_DOCS = [d for d in DOCS if d.name == "README.md"]  # CONTRIBUTING names its example plugin's card
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
INLINE = re.compile(r"(?<!`)`(fv [^`]+)`(?!`)")
CARD_ID = re.compile(r"^(?:wan2\.[12]|fastwan|ltx|bagel)[\w.-]*[a-z0-9]$")


def text(doc: Path) -> str:
    return doc.read_text()


def prose(doc: Path) -> str:
    """The doc without its fenced blocks."""
    return BLOCK.sub("", text(doc))


def words(command: str) -> list[str]:
    """A command's words after `fv`: `[...]` marks an optional part, a bare `...` an elided one, `"..."`
    a value left to the reader; leading env assignments are dropped."""
    command = command.replace('"..."', "VALUE").replace("[", "").replace("]", "")
    found = [w for w in shlex.split(command, comments=True) if w != "..."]
    while found and re.fullmatch(r"[A-Z_]+=\S*", found[0]):
        found.pop(0)
    return found[1:] if found[:1] == ["fv"] else []


def run_lines(doc: Path) -> list[str]:
    """Every `fv ...` line of the doc's shell blocks (each `&&` part), as a user would run it."""
    found = []
    for lang, body in BLOCK.findall(text(doc)):
        if lang in ("bash", "sh"):
            for line in body.replace("\\\n", " ").splitlines():  # continued lines joined
                found += [shlex.join(w) for part in line.split("&&") if (w := words(part))]
    return found


def mentions(doc: Path) -> list[str]:
    """Every `fv ...` code span of the doc's prose (a command, or a subcommand and some of its flags)."""
    return [shlex.join(w) for span in INLINE.findall(prose(doc)) if (w := words(" ".join(span.split())))]


def cases(of) -> list[tuple[str, str]]:
    return sorted({(doc.relative_to(ROOT).as_posix(), c) for doc in DOCS for c in of(doc)})


RUN_LINES, MENTIONS = cases(run_lines), cases(mentions)


def test_the_docs_have_commands():
    first = "generate --model wan2.1-t2v-shapes --prompt 'a red circle moving left' -o out.mp4"
    assert ("README.md", first) in RUN_LINES and len(RUN_LINES) > 40 and len(MENTIONS) > 40
    assert runnable_blocks()


@pytest.mark.parametrize(
    ("doc", "command"), RUN_LINES + MENTIONS, ids=[f"{d}: fv {c}" for d, c in RUN_LINES + MENTIONS]
)
def test_every_repository_file_a_command_names_exists(doc, command):
    named = [w for w in shlex.split(command) if re.match(r"(configs|examples|bench|plugins)/", w)]
    missing = [w for w in named if not (ROOT / w).exists()]
    assert not missing, f"{doc}: `fv {command}` names {missing}, which the repository does not have"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_every_repository_file_the_prose_names_exists(doc):
    named = [w for span in re.findall(r"`([^`]+)`", prose(doc)) for w in span.split()]
    files = [w for w in named if re.match(r"(configs|examples|bench)/", w)]
    missing = [w for w in files if not list(ROOT.glob(w))]  # `configs/shapes/nft*.yaml`: a glob
    assert not missing, f"{doc.relative_to(ROOT)} names {missing}, which the repository does not have"


@pytest.mark.parametrize(("doc", "command"), RUN_LINES, ids=[f"{d}: fv {c}" for d, c in RUN_LINES])
def test_every_fv_command_line_parses(doc, command):
    argv, err = shlex.split(command), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser(argv).parse_args(argv)  # fv's parser is built for the command it runs
        except SystemExit as exc:  # --help exits 0; a bad command exits 2 with argparse's reason
            assert exc.code == 0, f"{doc}: `fv {command}` does not parse: {err.getvalue().strip()}"


@pytest.mark.parametrize(("doc", "command"), MENTIONS, ids=[f"{d}: fv {c}" for d, c in MENTIONS])
def test_every_fv_command_mentioned_exists_with_its_flags(doc, command):
    name, *rest = shlex.split(command)
    if name.isupper():  # a template: `fv NAME`
        return
    parser = build_parser(shlex.split(command))
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert name in subcommands, f"{doc}: `fv {command}`: fv has no command {name!r}"
    flags = subcommands[name]._option_string_actions
    unknown = [w for w in rest if w.startswith("-") and not w.lstrip("-").isupper() and w not in flags]
    assert not unknown, f"{doc}: `fv {command}`: `fv {name}` has no {unknown}"


def card_ids(doc: Path) -> set[str]:
    """Card ids a doc names: `--model X`, `card: X`, `fv serve X`, load("X") / model="X", and code spans."""
    body = text(doc)
    named = set(re.findall(r"--model[ =]([\w.-]+)", body))
    named |= set(re.findall(r"^\s*- card: ([\w.-]+)", body, re.MULTILINE))  # deploy files' models
    named |= {n for n in re.findall(r"fv serve ([\w.-]+)", body) if CARD_ID.match(n)}
    named |= set(re.findall(r"""(?:load\(|model=)"([\w.-]+)\"""", body))
    named |= {span for span in re.findall(r"`([^`\s]+)`", body) if CARD_ID.match(span)}
    return {n for n in named if not n.isupper() and not n.endswith((".yaml", ".py", ".json", ".mp4"))}


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_every_card_named_is_registered(doc):
    from fv_core.deploy import load_deploy

    registered = set(load_plugins().registries.cards)
    # a workflow id of the shipped example deploy files runs like a model (fv generate --model WORKFLOW)
    workflows = {w for f in ROOT.glob("examples/deploy/*.yaml") for w in load_deploy(f).workflows}
    unknown = sorted(card_ids(doc) - registered - workflows)
    assert not unknown, f"{doc.relative_to(ROOT)} names cards no plugin registers: {unknown}"


def anchors(doc: Path) -> set[str]:
    """The doc's headings as GitHub anchors them."""
    headings = re.findall(r"^#+ (.+)$", prose(doc), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(doc):
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(doc)):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        assert linked.exists(), f"{doc.relative_to(ROOT)} links to a missing {target}"
        if anchor:
            assert anchor in anchors(linked), f"{doc.relative_to(ROOT)} links to {target}: no such heading"


def runnable_blocks() -> list[str]:
    """README.md's Python blocks that run here: they load a card and reach no server or folder."""
    blocks = [body for lang, body in BLOCK.findall(text(ROOT / "README.md")) if lang == "python"]
    return [b for b in blocks if "fv_core.load(" in b and not re.search(r"http|/models/", b)]


@pytest.mark.parametrize("block", runnable_blocks())
def test_readme_python_runs(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what a block saves lands here
    lines = block.splitlines()
    scope: dict = {}
    for statement in ast.parse(block).body:
        source = ast.get_source_segment(block, statement)
        comment = lines[statement.end_lineno - 1].partition("  # ")[2]
        if comment.startswith("ConfigError"):
            with pytest.raises(fv_core.ConfigError) as info:
                exec(source, scope)
            said = comment.removeprefix("ConfigError: ").split(" ...")[0]
            assert said in str(info.value), f"`{source}` raised {info.value}, not {said!r}"
        elif isinstance(statement, ast.Expr) and comment.startswith("("):
            shown = comment[: comment.index(")") + 1]
            assert eval(source, scope) == ast.literal_eval(shown), f"`{source}` is not {shown}"
        else:
            exec(source, scope)
