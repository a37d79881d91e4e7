"""Package names imported on first use (stdlib only).

A package face (``hf_cephalo``, ``hf_cephalo.integrations`` and each door) maps each public name
to the module that defines it; ``lazy_exports`` gives the package its ``__getattr__`` /
``__dir__``, so importing the package imports nothing heavy and ``from package import Name``
imports only Name's module (an optional extra such as trl is needed only when its names are).
"""

from __future__ import annotations

import sys
from importlib import import_module
from typing import Any, Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: dict[str, str]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose names live in the modules ``exports``
    maps them to: a dotted ``hf_cephalo.`` path, or a submodule of ``package``.

    ``__getattr__`` raises AttributeError for a name not in ``exports``."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            where = exports[name]
            module = where if where.startswith("hf_cephalo.") else f"{package}.{where}"
            return getattr(import_module(module), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
