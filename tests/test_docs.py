"""The documentation agrees with the code: the env table is the registry, links resolve, every
module path and CLI flag it names exists, and the README's test command is what CI runs."""

from __future__ import annotations

import argparse
import glob
import importlib
import os
import re

import pytest

from uccl_ep_megatron import cli
from uccl_ep_megatron.core.config import env_markdown, env_registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = sorted(
    [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "bench", "results", "README.md")]
    + glob.glob(os.path.join(ROOT, "docs", "*.md"))
)
CONFIGURATION = os.path.join(ROOT, "docs", "configuration.md")
CLI_DOC = os.path.join(ROOT, "docs", "cli.md")
TABLE = re.compile(r"<!-- BEGIN env table[^>]*-->\n(.*?)\n<!-- END env table -->", re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _env_table() -> str:
    match = TABLE.search(_read(CONFIGURATION))
    assert match, "docs/configuration.md has no generated env table between its markers"
    return match.group(1)


def test_env_table_lists_the_registry_with_its_types_and_defaults():
    rows = []
    for line in _env_table().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name, typ, default, doc = cells[0].strip("`"), cells[1], cells[2].strip("`"), cells[3]
        rows.append((name, typ, "" if default == "(empty)" else default, doc))
    expected = [(p["name"], p["type"], p["default"], p["doc"]) for p in env_registry()]
    assert rows == expected, (
        "docs/configuration.md's env table differs from the registry; regenerate it with "
        "`uccl-ep-megatron doctor --markdown`"
    )


def test_env_table_is_the_generators_output(capsys):
    assert cli.main(["doctor", "--markdown"]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    assert printed == env_markdown()
    assert _env_table() == printed, "regenerate docs/configuration.md's table (doctor --markdown)"


def _slug(heading: str) -> str:
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in _read(path).splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = _slug(line.lstrip("#"))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_resolves(doc):
    broken = []
    for target in LINK.findall(_read(doc)):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
        if not os.path.exists(full):
            broken.append(f"{target} (no such file)")
        elif anchor and full.endswith(".md") and anchor not in _anchors(full):
            broken.append(f"{target} (no heading #{anchor})")
    assert not broken, f"{os.path.relpath(doc, ROOT)}: {broken}"


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_module_path_in_the_docs_exists():
    names = set()
    for doc in DOCS:
        text = _read(doc)
        for module, imported in re.findall(r"from (uccl_ep_megatron[\w.]*) import ([\w, ]+)", text):
            names.update(f"{module}.{n.strip()}" for n in imported.split(",") if n.strip())
        names.update(re.findall(r"uccl_ep_megatron(?:\.\w+)+", text))
    # _bench_C exists in GPU builds only; NAME is a placeholder in prose.
    names = {n.rstrip(".") for n in names if "_bench_C" not in n and not n.endswith(".NAME")}
    assert len(names) > 20 and not _resolves("uccl_ep_megatron.api.no_such_module")
    missing = sorted(n for n in names if not _resolves(n))
    assert not missing, f"the docs name paths that do not import: {missing}"


def _setup_commands() -> list[str]:
    readme = _read(os.path.join(ROOT, "README.md"))
    section = readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README.md's Set-up section has no bash block"
    return [
        line.strip()
        for line in block.group(1).splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def test_readme_setup_is_two_commands_and_the_second_is_what_ci_runs():
    install, tests = _setup_commands()
    assert tests == "bash .ci/run"
    ci = _read(os.path.join(ROOT, ".ci", "run"))
    # The test command builds the package and runs the whole Python suite over tests/.
    assert re.search(r"pip install .*\.\[test,megatron\]", ci)
    assert re.search(r"pytest .*\btests\b", ci)
    assert install.startswith('pip install ".[megatron]"') and install.endswith(
        "uccl-ep-megatron train"
    )
    pyproject = _read(os.path.join(ROOT, "pyproject.toml"))
    assert re.search(r'^uccl-ep-megatron = "uccl_ep_megatron\.cli:main"', pyproject, re.M)
    assert "train" in _commands(cli.build_parser())


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _walk(parser: argparse.ArgumentParser, prefix: str):
    for name, sub in _commands(parser).items():
        command = f"{prefix} {name}".strip()
        yield command, None
        yield from _walk(sub, command)
    for action in parser._actions:
        for opt in action.option_strings:
            if opt.startswith("--") and opt != "--help":
                yield prefix, opt


def test_cli_reference_documents_every_command_and_flag():
    text = _read(CLI_DOC)
    missing = []
    for command, flag in _walk(cli.build_parser(), ""):
        if flag is None and not re.search(rf"uccl-ep-megatron {re.escape(command)}\b", text):
            missing.append(command)
        elif flag is not None and not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
            missing.append(f"{command} {flag}")
    assert not missing, f"docs/cli.md does not document: {missing}"
