"""Small arithmetic every layer shares."""
from __future__ import annotations

import importlib
import sys


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of b hold a items."""
    return -(-a // b)


def lazy_exports(package: str, exports: dict[str, str]):
    """A package's PEP 562 `__getattr__` and `__dir__` for names imported when first used:
    `exports` maps each name to the module (relative to `package`) that defines it."""
    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})
    return __getattr__, __dir__
