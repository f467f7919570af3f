"""The code blocks of README.md and docs/*.rst, and how each one runs as the page shows it.

A marker right before a block says how it runs: an RST comment ``.. pipedialect-example: SPEC``
in the docs, an HTML comment ``<!-- pipedialect-example: SPEC -->`` in the README (blank lines
may separate it from the block). SPEC is one of:

``plain``
    a Python program, run with ``python`` in an empty directory.
``torchrun N``
    a Python program, run with ``torchrun --nproc_per_node N`` in an empty directory.
``continues``
    Python that goes on from the page's previous Python block: the two (or more) run together,
    as the first one runs.
``shell``
    a console block: every ``$`` command runs in ``bash`` from the repository root, with the
    virtual environment's ``bin`` first on ``PATH``.
``file PATH``
    the file ``PATH`` of the package the page builds (``tests/contract/test_write_a_dialect.py``
    builds
    it, installs it apart and runs the conformance suite on it).
``skip: REASON``
    not run; the page's own text must say ``REASON``, so a reader sees why.

Every Python and console block needs a marker; a new page is covered as soon as it exists.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "pipedialect-example:"

#: Languages whose blocks must carry a marker.
MARKED_LANGUAGES = frozenset(
    {"python", "py", "python3", "pycon", "console", "shell", "shell-session", "bash", "sh"}
)
_PYTHON = frozenset({"python", "py", "python3"})

_RST_MARKER = re.compile(r"^\s*\.\. " + re.escape(MARKER) + r"\s*(.*?)\s*$")
_MD_MARKER = re.compile(r"^\s*<!--\s*" + re.escape(MARKER) + r"\s*(.*?)\s*-->\s*$")
_RST_CODE = re.compile(r"^(\s*)\.\. (?:code-block|code|sourcecode)::\s*(\S*)\s*$")
_RST_INCLUDE = re.compile(r"^(\s*)\.\. literalinclude::\s*(\S+)\s*$")
_MD_FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)\s*$")


@dataclass
class Block:
    """One code block of a page."""

    page: Path
    #: 1-based line of the directive or fence.
    line: int
    language: str
    code: str
    #: The marker's SPEC, or None when the block has none.
    spec: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


@dataclass
class Example:
    """Something to run: a Python program (one or more blocks) or a console block."""

    #: ``plain``, ``torchrun`` or ``shell``.
    mode: str
    code: str
    blocks: list[Block]
    nproc: int = 1

    @property
    def id(self) -> str:
        return "+".join(b.where for b in self.blocks)


@dataclass
class Pages:
    """Everything found in the pages."""

    blocks: list[Block] = field(default_factory=list)
    examples: list[Example] = field(default_factory=list)
    #: ``{page: {path: code}}`` of the ``file PATH`` blocks.
    files: dict[Path, dict[str, str]] = field(default_factory=dict)
    #: What is wrong with the markers, one line each.
    problems: list[str] = field(default_factory=list)


def pages() -> list[Path]:
    """README.md and every docs/*.rst, in a fixed order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.rst"))]


def visible_text(page: Path) -> str:
    """The page's text without its markers, whitespace collapsed, lower case."""
    lines = [
        line
        for line in page.read_text().splitlines()
        if not (_RST_MARKER.match(line) or _MD_MARKER.match(line))
    ]
    return " ".join(" ".join(lines).split()).lower()


def _marker_before(lines: list[str], index: int, pattern: re.Pattern[str]) -> str | None:
    """The SPEC of the marker on the last non-blank line before ``lines[index]``."""
    j = index - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    if j < 0:
        return None
    match = pattern.match(lines[j])
    return match.group(1) if match else None


def _rst_body(lines: list[str], start: int, indent: int) -> tuple[dict[str, str], str, int]:
    """Options and content of the directive on ``lines[start]``; the index after it."""
    options: dict[str, str] = {}
    i = start + 1
    while i < len(lines) and lines[i].strip().startswith(":") and _indent(lines[i]) > indent:
        key, _, value = lines[i].strip()[1:].partition(":")
        options[key.strip()] = value.strip()
        i += 1
    body: list[str] = []
    while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > indent):
        body.append(lines[i])
        i += 1
    return options, textwrap.dedent("\n".join(body)).strip("\n") + "\n", i


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def rst_blocks(page: Path) -> list[Block]:
    """The code blocks of an RST page (literal ``::`` blocks are text: docs/conf.py says so)."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    for i, line in enumerate(lines):
        code = _RST_CODE.match(line)
        include = _RST_INCLUDE.match(line)
        spec = _marker_before(lines, i, _RST_MARKER)
        if code:
            _, content, _ = _rst_body(lines, i, len(code.group(1)))
            blocks.append(Block(page, i + 1, code.group(2) or "text", content, spec))
        elif include:
            options, _, _ = _rst_body(lines, i, len(include.group(1)))
            source = (page.parent / include.group(2)).resolve()
            language = options.get("language", "text")
            blocks.append(Block(page, i + 1, language, source.read_text(), spec))
    return blocks


def md_blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _MD_FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        content = textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
        spec = _marker_before(lines, i, _MD_MARKER)
        blocks.append(Block(page, i + 1, fence.group(2) or "text", content, spec))
        i = end + 1
    return blocks


def collect() -> Pages:
    """Parse every page; turn its marked blocks into examples, files and problems."""
    found = Pages()
    for page in pages():
        blocks = md_blocks(page) if page.suffix == ".md" else rst_blocks(page)
        previous: Example | None = None
        for block in blocks:
            found.blocks.append(block)
            previous = _add(found, block, previous)
    found.examples = _deduplicated(found.examples)
    return found


def _add(found: Pages, block: Block, previous: Example | None) -> Example | None:
    """File ``block`` where its marker says; return the page's latest Python example."""
    spec = block.spec
    python = block.language in _PYTHON
    if spec is None:
        if block.language in MARKED_LANGUAGES:
            found.problems.append(
                f"{block.where}: a {block.language} block without a marker; put "
                f"'.. {MARKER} plain' (or torchrun N, continues, shell, file PATH, "
                f"skip: REASON) before it ('<!-- {MARKER} ... -->' in Markdown)"
            )
        return previous
    word, _, rest = spec.partition(" ")
    if spec.startswith("skip:"):
        reason = spec[len("skip:") :].strip()
        if not reason:
            found.problems.append(f"{block.where}: 'skip:' needs a reason shown on the page")
        elif " ".join(reason.split()).lower() not in visible_text(block.page):
            found.problems.append(
                f"{block.where}: the page's text does not say why the block is not run "
                f"({reason!r} appears only in the marker)"
            )
        return previous
    if word == "file" and rest.strip():
        found.files.setdefault(block.page, {})[rest.strip()] = block.code
        return previous
    if word == "shell" and not rest and block.language in MARKED_LANGUAGES - _PYTHON:
        if not commands(block.code):
            found.problems.append(f"{block.where}: a shell block without '$ ' commands")
        found.examples.append(Example("shell", block.code, [block]))
        return previous
    if python and word == "plain" and not rest:
        example = Example("plain", block.code, [block])
    elif python and word == "torchrun" and rest.strip().isdigit():
        example = Example("torchrun", block.code, [block], nproc=int(rest))
    elif python and word == "continues" and not rest:
        if previous is None:
            found.problems.append(f"{block.where}: 'continues' with no Python block before it")
            return previous
        previous.code += "\n" + block.code
        previous.blocks.append(block)
        return previous
    else:
        found.problems.append(
            f"{block.where}: marker {spec!r} does not fit a {block.language} block"
        )
        return previous
    found.examples.append(example)
    return example


_TORCHRUN_FILE = re.compile(r"^torchrun --nproc_per_node[ =](\d+) (\S+\.py)$")


def _deduplicated(examples: list[Example]) -> list[Example]:
    """One example per distinct program (the README quotes the quickstart, say).

    A console block whose one command is ``torchrun --nproc_per_node N FILE`` runs the same
    program as a ``torchrun N`` block holding FILE's text, so it joins that example.
    """
    seen: dict[tuple[str, int, str], Example] = {}
    for example in examples:
        key = (example.mode, example.nproc, example.code)
        launched = _TORCHRUN_FILE.match(" ".join(commands(example.code)))
        if example.mode == "shell" and launched and (ROOT / launched.group(2)).is_file():
            same = ("torchrun", int(launched.group(1)), (ROOT / launched.group(2)).read_text())
            key = same if same in seen else key
        if key in seen:
            seen[key].blocks += example.blocks
        else:
            seen[key] = example
    return list(seen.values())


def commands(console: str) -> list[str]:
    """The ``$`` commands of a console block, continuation lines joined."""
    out: list[str] = []
    lines = console.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if not line.startswith("$ "):
            continue
        command = line[2:]
        while command.endswith("\\") and i < len(lines):
            command = command[:-1] + " " + lines[i].strip()
            i += 1
        out.append(command)
    return out


_LAUNCHERS = ("torchrun", "deepspeed")
_PORT_OPTION = re.compile(r"(--master[_-]port[ =])\d+")


def with_port(command: str, port: int) -> str:
    """``command`` with a launcher's rendezvous port set to ``port`` (tests share the machine)."""
    if _PORT_OPTION.search(command):
        return _PORT_OPTION.sub(lambda m: f"{m.group(1)}{port}", command)
    words = command.split(" ")
    for i, word in enumerate(words):
        if "=" in word and not word.startswith("-"):
            continue  # an environment assignment before the program
        if word in _LAUNCHERS:
            return " ".join([*words[: i + 1], f"--master_port {port}", *words[i + 1 :]])
        break
    return command
