"""Run code right after a module is first imported, without importing it: torch-free, so that the
startup hook can wait for the program's own ``import torch`` (``pymem._startup``) and ``pymem._C``
can bring torch in first (``pymem/__init__.py``)."""
import sys
from typing import Callable, Optional


def when_imported(name: str, then: Callable[[], None], before: Optional[Callable[[], None]] = None) -> None:
    """``then()`` right after module ``name`` (loaded from a file) has run its body the first time it
    is imported, or at once when it already is; ``before()`` just before it is looked for. One shot."""
    if name in sys.modules:
        then()
        return
    sys.meta_path.insert(0, _AfterImport(name, then, before))


class _AfterImport:
    """A ``sys.meta_path`` entry that lets the other finders find ``name`` and wraps the loader's
    ``exec_module`` for that one import. The wrapper is an attribute of the loader instance (not a
    proxy loader), so the module's ``__spec__.loader`` stays the real one (resource readers and
    reloads keep working) and the wrapper deletes itself before running the body."""

    def __init__(self, name: str, then: Callable[[], None], before: Optional[Callable[[], None]]):
        self.name, self.then, self.before = name, then, before

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot; and the search below must not find this entry again
        if self.before is not None:
            self.before()
        import importlib.util  # here: start-up never pays for it

        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec  # not installed: the import fails as it would without this entry
        loader = spec.loader  # a file loader made for this one module (torch, pymem._C)
        exec_module = loader.exec_module

        def exec_then(module):
            del loader.exec_module
            exec_module(module)
            self.then()

        loader.exec_module = exec_then
        return spec

    def __repr__(self) -> str:
        return f"<pymem: after import {self.name}>"

