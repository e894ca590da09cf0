"""A package's public names imported from their modules on first use (PEP 562), so that importing the package, and
parsing a run config, does not load torch."""

import importlib
import sys


def lazy_exports(package: str, exports: dict[str, str]):
    """A module `__getattr__` (PEP 562) for `package`: each public name of `exports` ({name: relative module}) is
    imported from its module on first use and kept, so that importing the package (and parsing a run config)
    does not load torch."""
    def __getattr__(name: str):
        if name not in exports:  # a submodule, as `import package.name` would have bound it
            try:
                value = importlib.import_module(f".{name}", package)
            except ModuleNotFoundError:
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
            setattr(sys.modules[package], name, value)
            return value
        value = getattr(importlib.import_module(exports[name], package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
