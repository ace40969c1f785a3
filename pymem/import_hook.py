"""Code run around a module's first import, without importing it: torch-free, so that the startup
hook can wait for the program's own ``import torch`` (``pymem._startup``) and pymem's modules that
need torch can bring it in first (``pymem/__init__.py``).

Both are ``sys.meta_path`` entries that find nothing themselves: they ask the other finders and
act on the answer. Two rules keep them out of the import system's way:
- a lookup is not an import (``importlib.util.find_spec("torch")``, as libraries probe for torch):
  ``when_imported`` acts when the module's body runs, and stays armed until then;
- a module must never run twice: when importing torch first has imported the very module asked
  for (pymem's own modules do, through ``pymem.enable``), the spec returned hands that module back.
"""
import sys
from typing import Callable, Dict, FrozenSet, List


def when_imported(name: str, then: Callable[[], None]) -> None:
    """``then()`` right after module ``name`` (loaded from a file) has run its body the first time
    it is imported, or at once when it already is. Callbacks for one module run in the order given."""
    if name in sys.modules:
        then()
        return
    hook = _AfterImport.pending.get(name)
    if hook is None:
        hook = _AfterImport.pending[name] = _AfterImport(name)
        sys.meta_path.insert(0, hook)
    hook.callbacks.append(then)


def cancel(name: str, then: Callable[[], None]) -> None:
    """Take back a ``when_imported(name, then)`` that has not run yet."""
    hook = _AfterImport.pending.get(name)
    if hook is not None and then in hook.callbacks:
        hook.callbacks.remove(then)
        if not hook.callbacks:
            hook._disarm()


class _AfterImport:
    """Wraps ``exec_module`` on the loader instance the other finders return (not a proxy loader:
    the module's ``__spec__.loader`` stays the real one), for every lookup until one of them runs
    the body; the wrapper deletes itself first and runs the callbacks after the body."""

    pending: Dict[str, "_AfterImport"] = {}

    def __init__(self, name: str):
        self.name = name
        self.callbacks: List[Callable[[], None]] = []
        self._searching = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self._searching:
            return None
        import importlib.util  # here: start-up never pays for it

        self._searching = True  # the search below walks sys.meta_path again
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._searching = False
        if spec is None or spec.loader is None or "exec_module" in vars(spec.loader):
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then(module):
            del loader.exec_module
            exec_module(module)
            self._disarm()
            for then in self.callbacks:
                then()

        loader.exec_module = exec_then
        return spec

    def _disarm(self) -> None:
        _AfterImport.pending.pop(self.name, None)
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass

    def __repr__(self) -> str:
        return f"<pymem: after import {self.name}>"


def import_first(package: str, first: str, exempt: FrozenSet[str]) -> None:
    """Import module ``first`` before any submodule of ``package`` (but those in ``exempt`` and
    their own submodules) is looked for, so that no module of ``package`` is half-run when
    ``first``'s import runs code of its own (the startup hook enabling pymem at ``import torch``)."""
    sys.meta_path.insert(0, _ImportFirst(package, first, exempt))


class _ImportFirst:
    def __init__(self, package: str, first: str, exempt: FrozenSet[str]):
        self.prefix, self.first, self.exempt = package + ".", first, exempt

    def find_spec(self, fullname, path=None, target=None):
        if self.first in sys.modules:
            sys.meta_path.remove(self)  # its work is done for good
            return None
        if not fullname.startswith(self.prefix) or fullname in self.exempt or \
                any(fullname.startswith(e + ".") for e in self.exempt):
            return None
        __import__(self.first)
        module = sys.modules.get(fullname)
        if module is None:
            return None  # the other finders find it, as ever
        return _existing_spec(module)


class _Existing:
    """The loader of a module that is imported already: hands it back, runs nothing, and gives it
    its own spec back."""

    def __init__(self, module, spec):
        self.module, self.spec = module, spec

    def create_module(self, spec):
        return self.module

    def exec_module(self, module) -> None:
        module.__spec__ = self.spec


def _existing_spec(module):
    """A spec that loads ``module`` as it is. The import system, finding the module already in
    sys.modules, goes on with the module's own ``__spec__`` (and would run its body again): so that
    is this spec until the load, which puts the real one back."""
    import copy

    real = module.__spec__
    spec = copy.copy(real)
    spec.loader = _Existing(module, real)
    module.__spec__ = spec
    return spec
