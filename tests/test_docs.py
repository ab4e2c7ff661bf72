"""docs/ is for users: every setting and every CLI command must be documented there."""

import re
from pathlib import Path

import typer.main

from memory_server.cli import app
from memory_server.config import Settings

DOCS = Path(__file__).resolve().parents[1] / "docs"
README = Path(__file__).resolve().parents[1] / "README.md"


def all_docs() -> str:
    return "\n".join(p.read_text() for p in DOCS.rglob("*.md"))


def test_every_setting_is_documented_in_configuration_md():
    text = (DOCS / "configuration.md").read_text()
    missing = [name for name in Settings.model_fields if f"MEMORY_SERVER_{name.upper()}" not in text]
    assert missing == []


def _commands(group, prefix=""):
    command = typer.main.get_command(group)
    for name, sub in command.commands.items():
        if hasattr(sub, "commands"):
            for child in sub.commands:
                yield f"{prefix}{name} {child}"
        else:
            yield f"{prefix}{name}"


def test_every_cli_command_is_documented():
    text = all_docs()
    missing = [cmd for cmd in _commands(app) if f"memory-server {cmd}" not in text]
    assert missing == []


def test_readme_has_two_setup_commands_and_ci_runs_the_readme_test_command():
    readme = README.read_text()
    assert "./scripts/serve.sh" in readme and "./scripts/test.sh" in readme
    ci = (README.parent / ".ci" / "run").read_text()
    assert re.search(r"^\./scripts/test\.sh\b", ci, re.M)
