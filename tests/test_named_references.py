"""Every flag, environment variable, file and module a user message or a doc names exists.

A message that tells a user to pass a flag that does not exist sends them to an argparse error
(or, for a setting, to nothing at all). Scans the package's source (its messages), README.md,
docs/, examples/ and accelerate_configs/ for
- ``--cephalo_<name>``: must be a field of ``CephaloTrainingArguments``;
- ``HF_CEPHALO_<NAME>``: must be a setting's environment variable or one of the process-level
  variables ``hf_cephalo.environment.PROCESS_ENV`` declares;
- ``hf-cephalo <command> ... --<option>`` on one line: ``<option>`` must be an option of that
  subcommand's parser;
- a repository path (``hf_cephalo/...py``, ``docs/...md``, ``tests/...py``; a path under the
  package may omit ``hf_cephalo/``) must exist;
- a dotted ``hf_cephalo.x.y`` name must import (its longest module prefix), and what follows
  must be an attribute of it.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCANNED = ["hf_cephalo", "docs", "examples", "accelerate_configs", "README.md"]
PEER_PATHS = {"examples/nlp_example.py", "examples/complete_nlp_example.py"}  # Accelerate's own


def _texts():
    for name in SCANNED:
        path = ROOT / name
        files = [path] if path.is_file() else sorted(
            p for p in path.rglob("*") if p.suffix in (".py", ".md", ".yaml", ".sh"))
        for f in files:
            yield f.relative_to(ROOT), f.read_text(encoding="utf-8")


def _named(pattern: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for rel, text in _texts():
        for m in re.finditer(pattern, text):
            found.setdefault(m.group(1), []).append(str(rel))
    return found


def test_every_cephalo_flag_named_is_a_training_argument():
    from hf_cephalo.integrations.trainer.training_args import CephaloTrainingArguments

    fields = {f.name for f in dataclasses.fields(CephaloTrainingArguments)}
    named = _named(r"--(cephalo_[a-z0-9_]*[a-z0-9])")
    assert len(named) >= 10, named  # the scan itself works
    missing = {flag: files for flag, files in named.items() if flag not in fields}
    assert not missing, f"flags named but not CephaloTrainingArguments fields: {missing}"


def test_every_environment_variable_named_is_read():
    from hf_cephalo.environment import PROCESS_ENV
    from hf_cephalo.runtime.settings import CephaloSettings, env_name

    known = {env_name(f.name) for f in dataclasses.fields(CephaloSettings)} | set(PROCESS_ENV)
    named = _named(r"\b(HF_CEPHALO_[A-Z0-9_]*[A-Z0-9])\b")
    assert len(named) >= 10, named
    missing = {var: files for var, files in named.items() if var not in known}
    assert not missing, f"environment variables named but never read: {missing}"


def test_every_cli_option_named_exists():
    from hf_cephalo.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    options = {name: {o for a in p._actions for o in a.option_strings}
               for name, p in sub.choices.items()}
    checked, missing = 0, []
    for rel, text in _texts():
        for line in text.splitlines():
            for m in re.finditer(r"hf-cephalo (" + "|".join(options) + r")\b([^`|#]*)", line):
                for opt in re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*)", m.group(2)):
                    if "_" in opt:  # a Trainer flag of the script the line also names
                        continue
                    checked += 1
                    if opt not in options[m.group(1)]:
                        missing.append(f"{rel}: hf-cephalo {m.group(1)} {opt}")
    assert checked >= 10
    assert not missing, "\n".join(missing)


def test_every_path_named_exists():
    package_dirs = {p.name for p in (ROOT / "hf_cephalo").iterdir() if p.is_dir()}
    pattern = (r"(?<![\w/.])((?:hf_cephalo|tests|docs|examples|benchmarks|scripts|"
               + "|".join(sorted(package_dirs)) + r")/[\w/]*\w\.(?:py|md|yaml|sh))\b")
    named = _named(pattern)
    assert len(named) >= 20, named
    missing = {path: files for path, files in named.items() if path not in PEER_PATHS
               and not (ROOT / path).exists() and not (ROOT / "hf_cephalo" / path).exists()}
    assert not missing, f"paths named but missing: {missing}"


def test_every_module_named_imports():
    import importlib

    named = _named(r"\b(hf_cephalo(?:\.[A-Za-z_]\w*)+)(?![\w/])")  # not a format: hf_cephalo.plan/1
    assert len(named) >= 20, named
    missing = {}
    for dotted, files in named.items():
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ModuleNotFoundError:
                continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            missing[dotted] = files
    assert not missing, f"modules or names named but missing: {missing}"
