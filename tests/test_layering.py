"""Every import of the package points down its layers (docs/design.md "Layering"):

    utilities (units, file_modes, console, launch_check) < profiles (pure data) < planner (pure)
    < models, engine < profiler (torch measurement) < runtime < integrations, demo_data < cli, rank_errors,
    parent_death

Imports inside functions count too (they are how a module reaches another lazily). The runtime
core imports no front end: no ``transformers.Trainer`` / ``TrainingArguments``, no TRL, no
``hf_cephalo.integrations``; profiles and the planner import no torch.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hf_cephalo")
LAYERS = {
    "units": 0, "file_modes": 0, "console": 0, "launch_check": 0, "environment": 0, "lazy": 0,
    "profiles": 1, "planner": 2, "models": 3, "engine": 3, "profiler": 4, "runtime": 5,
    "integrations": 6, "demo_data": 6, "cli": 7, "rank_errors": 7, "parent_death": 7, "__init__": 7,
}


def _modules():
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)[:-3].split(os.sep)
                yield rel, path


def _imports(rel: list[str], path: str):
    """(imported module as a dotted name, line) for every import in the file."""
    tree = ast.parse(open(path).read(), path)
    package = ["hf_cephalo", *rel[:-1]]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                yield ".".join(base + ([node.module] if node.module else [])), node.lineno
            else:
                yield node.module, node.lineno


def _layer(dotted: str) -> int | None:
    parts = dotted.split(".")
    if parts[0] != "hf_cephalo":
        return None
    return LAYERS[parts[1]] if len(parts) > 1 else LAYERS["__init__"]


def test_every_import_points_down():
    up = []
    for rel, path in _modules():
        own = LAYERS[rel[0]] if rel[0] in LAYERS else LAYERS[rel[0].removesuffix(".py")]
        for dotted, line in _imports(rel, path):
            theirs = _layer(dotted)
            if theirs is not None and theirs > own:
                up.append(f"hf_cephalo/{'/'.join(rel)}.py:{line} imports {dotted}")
    assert not up, "imports that point up a layer:\n" + "\n".join(up)


@pytest.mark.parametrize("package, banned", [
    ("runtime", ("transformers.Trainer", "transformers.TrainingArguments", "trl",
                 "transformers.trainer", "hf_cephalo.integrations")),
    ("profiles", ("torch",)),
    ("planner", ("torch",)),
    # the doors only translate: they reach the engine and the process group through the runtime
    ("integrations", ("hf_cephalo.engine", "torch.distributed")),
])
def test_layer_does_not_import(package, banned):
    found = []
    for rel, path in _modules():
        if rel[0] != package:
            continue
        tree = ast.parse(open(path).read(), path)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                if any(name == b or name.startswith(b + ".") for b in banned):
                    found.append(f"hf_cephalo/{'/'.join(rel)}.py:{node.lineno} imports {name}")
    assert not found, "\n".join(found)


def test_no_module_imports_another_modules_private_name():
    """A name another module needs is public (in its ``__all__`` or at least without the
    leading underscore): importing ``_name`` from elsewhere couples to an implementation."""
    found = []
    for rel, path in _modules():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(
                    "hf_cephalo")):
                found += [f"hf_cephalo/{'/'.join(rel)}.py:{node.lineno} imports {a.name}"
                          for a in node.names if a.name.startswith("_")
                          and not a.name.startswith("__")]
    assert not found, "\n".join(found)


# [Note: the runtime's face] in hf_cephalo/runtime/__init__.py: a door takes every name from below
# it from ``hf_cephalo.runtime`` itself; only these stdlib-level utility modules stay direct
DOOR_UTILITIES = ("hf_cephalo.lazy", "hf_cephalo.console", "hf_cephalo.environment",
                  "hf_cephalo.units", "hf_cephalo.launch_check")
# door -> rank: a door imports only itself and doors of a lower rank (trl -> trainer -> loop ->
# shared); the package's own __init__ re-exports every door (by name, lazily)
DOOR_ORDER = {"shared": 0, "quiet": 0, "loop": 1, "trainer": 2, "trl": 3, "__init__": 4}


def door_import_problems(root: str = ROOT) -> tuple[list[str], list[str]]:
    """(imports below the face, door imports against the chain) of the modules under
    ``root``/integrations, one ``file:line ...`` each."""
    import importlib

    face = set(importlib.import_module("hf_cephalo.runtime").__all__)
    below, against = [], []
    for folder, _, files in os.walk(os.path.join(root, "integrations")):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)[:-3].split(os.sep)
            where = f"hf_cephalo/{'/'.join(rel)}.py"
            door = rel[1] if len(rel) > 1 else "__init__"
            for node in ast.walk(ast.parse(open(path).read(), path)):
                for dotted, names in _imported_names(rel, node):
                    parts = dotted.split(".")
                    if parts[0] != "hf_cephalo" or dotted in DOOR_UTILITIES:
                        continue
                    if len(parts) > 2 and parts[1] == "integrations":
                        if DOOR_ORDER[parts[2]] > DOOR_ORDER[door] or (
                                parts[2] != door and DOOR_ORDER[parts[2]] == DOOR_ORDER[door]):
                            against.append(f"{where}:{node.lineno} imports {dotted} "
                                           f"({door} -> {parts[2]})")
                    elif len(parts) == 2 and parts[1] == "integrations":
                        if door != "__init__":
                            against.append(f"{where}:{node.lineno} imports {dotted}")
                    elif dotted != "hf_cephalo.runtime":
                        below += [f"{where}:{node.lineno} imports {n} from {dotted}" for n in names]
                    else:
                        below += [f"{where}:{node.lineno} imports {n} from {dotted}, which "
                                  f"its __all__ does not export" for n in names if n not in face]
    return below, against


def _imported_names(rel: list[str], node):
    """(dotted module, [names]) an import node brings in (``import a.b``: ``a.b``, [``a.b``])."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name, [alias.name]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            package = ["hf_cephalo", *rel[:-1]]
            base = package[:len(package) - node.level + 1]
            yield ".".join(base + ([node.module] if node.module else [])), [
                a.name for a in node.names]
        else:
            yield node.module, [a.name for a in node.names]


def test_doors_take_the_runtime_face_and_import_down_the_door_chain():
    """Issue 49 item 6: (a) a door (hf_cephalo/integrations) imports from below it only
    ``hf_cephalo.runtime`` (names in its ``__all__``) and the utility modules above; (b) door
    imports follow the chain trl -> trainer -> loop -> shared (as TRL's trainers build on the
    Trainer, and the Trainer on Accelerate), none against it."""
    below, against = door_import_problems()
    print(f"names the doors import from below the runtime's face: {len(below)}; "
          f"door imports against the chain trl -> trainer -> loop -> shared: {len(against)}")
    assert not below, ("import these from hf_cephalo.runtime (export them there):\n"
                       + "\n".join(below))
    assert not against, "door imports against trl -> trainer -> loop -> shared:\n" + "\n".join(
        against)


# Issue 49 item 6: a checkpoint's steps are composed once, in runtime/checkpointing.py
# (``save_checkpoint``, ``Resume``), and the doors reach them only through the Session
# (``Session.save_checkpoint`` / ``resume`` / ``load_checkpoint_weights`` / ``save_model_files``),
# each adding only its own files; of checkpointing's names a door uses only these, which find
# a checkpoint without reading or writing its state
CHECKPOINT_LOOKUPS = {"resolve_resume", "is_complete"}


def test_doors_compose_checkpoints_only_through_the_session():
    """No door imports a checkpointing step (the staging folder, shards, run record, model
    files, the resume's checks and loads) to compose a checkpoint itself: the runtime's face
    exports none of them, and no module under hf_cephalo/integrations imports one by name."""
    import importlib

    steps = set(importlib.import_module("hf_cephalo.runtime.checkpointing").__all__) \
        - CHECKPOINT_LOOKUPS
    exported = sorted(steps & set(importlib.import_module("hf_cephalo.runtime").__all__))
    found = []
    for rel, path in _modules():
        if rel[0] != "integrations":
            continue
        for node in ast.walk(ast.parse(open(path).read(), path)):
            for dotted, names in _imported_names(rel, node):
                found += [f"hf_cephalo/{'/'.join(rel)}.py:{node.lineno} imports {n} from "
                          f"{dotted}" for n in names
                          if n in steps and dotted.startswith("hf_cephalo.runtime")]
    print(f"checkpointing steps: {len(steps)}; exported by the face: {len(exported)}; "
          f"imported by a door: {len(found)}")
    assert not exported, f"the runtime's face exports checkpointing steps: {exported}"
    assert not found, ("save and resume through the Session (save_checkpoint, resume):\n"
                       + "\n".join(found))


def test_no_module_is_over_800_lines():
    """Issue 38's limit: a module over 800 lines holds several concepts; split it by concept
    (two had grown past it, unnoticed, before this test)."""
    long = {}
    for _, path in _modules():
        with open(path) as f:
            count = sum(1 for _ in f)
        if count > 800:
            long[os.path.relpath(path, ROOT)] = count
    assert not long, long


def test_no_function_over_60_code_lines():
    """Issue 38's limit: a function's code (after its docstring; blank and comment lines not
    counted) fits in 60 lines; split a longer one by step."""
    long = []
    for _, path in _modules():
        with open(path) as f:
            source = f.read()
        lines = source.split("\n")
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            first = node.body[0]
            docstring = isinstance(first, ast.Expr) and isinstance(
                getattr(first, "value", None), ast.Constant) \
                and isinstance(first.value.value, str)
            start = first.end_lineno if docstring else first.lineno - 1
            code = [line for line in lines[start:node.end_lineno]
                    if line.strip() and not line.strip().startswith("#")]
            if len(code) > 60:
                long.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} "
                            f"({len(code)} lines)")
    assert not long, long
