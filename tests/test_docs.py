"""The documentation stays true to the code.

- every `tiersep ...` command in README.md, docs/*.md and config/README.md (fenced code blocks and
  inline code) names a subcommand and only flags that `tiersep.cli.build_parser()` has;
- every relative Markdown link in those files points at an existing file, and a `#anchor` into a
  Markdown file at one of its headings (GitHub's slugs);
- config/README.md is exactly what workflow/scripts/config_reference.py renders from the schemas
  now, and lists every key of both schemas.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import yaml

from conftest import load_script
from tiersep.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
CONFIG_REFERENCE = REPO / "config" / "README.md"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), CONFIG_REFERENCE]
STAGES = ("prepare", "estimate", "fit", "train", "evaluate", "report")

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)  # `code`, ``co`de``
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SEGMENT_SPLIT = re.compile(r"\s*(?:;|&&|\|\|)\s*|\s+\|\s+")  # a|b inside [--m a|b] is not a pipe
FLAG = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*)")
PROGRAM = re.compile(r"^(?:[A-Za-z_]\w*=\S*\s+)*(?:\S*/)?tiersep(?:\s+|$)")


# ---------------------------------------------------------------------------- Markdown pieces
def split_fences(text: str) -> tuple[list[tuple[int, list[str]]], list[str]]:
    """([(first line number, lines of a fenced block)], the text's lines with fenced lines blanked)."""
    blocks, prose, current, start = [], [], None, 0
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            if current is None:
                current, start = [], number + 1
            else:
                blocks.append((start, current))
                current = None
            prose.append("")
        elif current is not None:
            current.append(line)
            prose.append("")
        else:
            prose.append(line)
    return blocks, prose


def block_commands(start: int, lines: list[str]) -> list[tuple[int, str]]:
    """Logical command lines of a code block: `\\` continuations joined, and an indented line
    starting with `[` or `--` taken as the continuation of the command above it."""
    out: list[tuple[int, str]] = []
    pending = None
    for offset, raw in enumerate(lines):
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()  # shell comments
        if pending is not None:
            pending = (pending[0], pending[1] + " " + line.strip())
        elif out and re.match(r"^\s+(\[|--)", line):
            out[-1] = (out[-1][0], out[-1][1] + " " + line.strip())
            continue
        else:
            pending = (start + offset, line)
        if pending[1].endswith("\\"):
            pending = (pending[0], pending[1][:-1])
            continue
        out.append(pending)
        pending = None
    if pending is not None:
        out.append(pending)
    return out


def tiersep_commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) of every tiersep invocation in code blocks and inline code. Inline
    code also quotes messages (`tiersep needs these system packages: ffmpeg`), so there a span
    counts as a command only when it has a --flag or names a real subcommand."""
    blocks, prose = split_fences(text)
    found = []
    for start, lines in blocks:
        for number, line in block_commands(start, lines):
            found += [(number, seg) for seg in SEGMENT_SPLIT.split(line.strip().removeprefix("$ "))
                      if PROGRAM.match(seg)]
    prose_text = "\n".join(prose)
    subcommands = cli_options()[1]
    for match in INLINE_CODE.finditer(prose_text):
        number = prose_text.count("\n", 0, match.start()) + 1
        for seg in SEGMENT_SPLIT.split(" ".join(match.group(2).split())):
            words = PROGRAM.sub("", seg, count=1).split()
            if PROGRAM.match(seg) and (FLAG.search(seg) or (words and words[0] in subcommands)):
                found.append((number, seg))
    return found


def cli_options() -> tuple[set[str], dict[str, set[str]]]:
    """(top-level flags, {subcommand: its flags}) of the real parser."""
    parser = build_parser()
    top = {opt for action in parser._actions for opt in action.option_strings}
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return top, {name: {opt for action in sub._actions for opt in action.option_strings}
                 for name, sub in subs.choices.items()}


def command_problems(command: str, top: set[str], subcommands: dict[str, set[str]]) -> list[str]:
    """What in one `tiersep ...` command the CLI does not have (empty: it is fine)."""
    words = PROGRAM.sub("", command, count=1).split()
    if not words or words[0].startswith("-"):
        return [f"unknown option {flag}" for flag in FLAG.findall(" ".join(words)) if flag not in top]
    names = words[0].split("|")   # `tiersep estimate|fit ...` names several
    if all(re.fullmatch(r"<[^>]+>", name) for name in names):
        return []                 # `tiersep <stage> --help`: a placeholder, not a command
    problems = [f"unknown subcommand {name!r}" for name in names if name not in subcommands]
    rest = " ".join(words[1:])
    for name in names:
        problems += [f"{name}: unknown option {flag}" for flag in FLAG.findall(rest)
                     if name in subcommands and flag not in subcommands[name]]
    return problems


# ---------------------------------------------------------------------------- links and anchors
def github_slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file (a repeated heading gets -1, -2, ...)."""
    _, prose = split_fences(path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for line in prose:
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = github_slug(match.group(1))
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def link_problems(path: Path) -> list[str]:
    """Relative links of one Markdown file that point nowhere (file or #anchor)."""
    _, prose = split_fences(path.read_text())
    text = INLINE_CODE.sub(lambda m: " " * len(m.group(0)), "\n".join(prose))
    problems = []
    for match in LINK.finditer(text):
        target = match.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
            continue
        line = text.count("\n", 0, match.start()) + 1
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            problems.append(f"{path.relative_to(REPO)}:{line}: link {target} -> no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{path.relative_to(REPO)}:{line}: link {target} -> no heading #{anchor}")
    return problems


def load_reference_script():
    return load_script(REPO / "workflow" / "scripts" / "config_reference.py")


def schema_keys(node: dict, prefix: str = "") -> list[str]:
    """Every dotted key of a schema, objects inside oneOf/anyOf included."""
    keys = []
    options = [node] + node.get("oneOf", []) + node.get("anyOf", [])
    for option in options:
        for name, child in option.get("properties", {}).items():
            keys.append(prefix + name)
            keys += schema_keys(child, f"{prefix}{name}.")
    return keys


# ---------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_tiersep_command_exists(doc):
    top, subcommands = cli_options()
    problems = [f"{doc.relative_to(REPO)}:{line}: {problem}: {command}"
                for line, command in tiersep_commands(doc.read_text())
                for problem in command_problems(command, top, subcommands)]
    assert not problems, "\n".join(problems)


def test_docs_show_every_stage_command():
    """Guards the extraction itself: a regex that matched nothing would pass the test above."""
    used = {command.split()[1] for doc in DOCS for _, command in tiersep_commands(doc.read_text())
            if len(command.split()) > 1}
    assert set(STAGES) <= used, f"no documented command for {sorted(set(STAGES) - used)}"


def test_command_check_catches_unknown_flags_and_subcommands():
    top, subcommands = cli_options()
    text = ("```bash\ntiersep train --config c.yaml --preset p \\\n    --data d --out o --no-such-flag\n"
            "tiersep estimate --config c.yaml --preset p --out x.json\n"
            "                 [--device cuda] [--bogus N]\n"
            "make run && tiersep evalute --preset p  # typo\n```\n"
            "Prose `tiersep fit --preset p --budget 4\n--nope` and `tiersep <stage> --help`.\n")
    problems = [p for _, command in tiersep_commands(text) for p in command_problems(command, top, subcommands)]
    assert problems == ["train: unknown option --no-such-flag", "estimate: unknown option --bogus",
                        "unknown subcommand 'evalute'", "fit: unknown option --nope"]


def test_link_check_catches_missing_files_and_anchors(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    (tmp_path / "other.md").write_text("# Other page\n\n## Step 2: run (`make`)\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#step-2-run-make) [self](#title) [web](https://example.org/x)\n"
                    "# Title\n[gone](missing.md) [bad anchor](other.md#step-3)\n"
                    "```\n[in code](nowhere.md)\n```\n`[inline](nowhere.md)`\n")
    assert link_problems(page) == ["page.md:3: link missing.md -> no such file",
                                   "page.md:3: link other.md#step-3 -> no heading #step-3"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc):
    problems = link_problems(doc)
    assert not problems, "\n".join(problems)


def test_config_reference_matches_the_schemas():
    rendered = load_reference_script().render()
    current = CONFIG_REFERENCE.read_text() if CONFIG_REFERENCE.is_file() else ""
    if current != rendered:
        old, new = current.splitlines(), rendered.splitlines()
        first = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        pytest.fail(f"config/README.md:{first + 1}: out of date with workflow/schemas (expected "
                    f"{new[first] if first < len(new) else '<end>'!r}); run "
                    ".venv/bin/python workflow/scripts/config_reference.py")


@pytest.mark.parametrize("kind", ["config", "preset"])
def test_config_reference_lists_every_schema_key(kind):
    schema = yaml.safe_load((REPO / "workflow" / "schemas" / f"{kind}.schema.yaml").read_text())
    text = CONFIG_REFERENCE.read_text()
    section = text.split("## Preset keys")[1] if kind == "preset" else text.split("## Preset keys")[0]
    missing = [key for key in schema_keys(schema) if f"| `{key}` |" not in section]
    assert schema_keys(schema) and not missing, f"config/README.md: {kind} keys missing: {missing}"


def test_extra_descriptions_are_for_undescribed_keys():
    """EXTRA_DESCRIPTIONS fills gaps in the schemas; an entry for a key that is gone, or that the
    schema now describes itself, is stale text to delete."""
    script = load_reference_script()
    schemas = {kind: yaml.safe_load((REPO / "workflow" / "schemas" / name).read_text())
               for kind, name in script.SCHEMA_FILES.items()}

    def node(kind, key):
        current = schemas[kind]
        for part in key.split("."):
            props = script.object_properties(current)[0]
            if part not in props:
                return None
            current = props[part]
        return current

    stale = [f"{kind}:{key}" for kind, key in script.EXTRA_DESCRIPTIONS
             if node(kind, key) is None or node(kind, key).get("description")]
    assert not stale, ("workflow/scripts/config_reference.py: EXTRA_DESCRIPTIONS entries to delete "
                       f"(key gone or described in the schema): {stale}")
