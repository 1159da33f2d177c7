"""What allocbox's startup (`_allocbox_startup`) and its package share, with nothing of
the package imported: the variable `allocbox run` sets for its children, and a finder
that runs code once a module's import has run. A module of its own, below both, so
that neither imports the other for it.
"""

import sys

# Set by `allocbox run` for its children (see `allocbox.children`).
CHILD = "ALLOCBOX_RUN_CHILD"


class AfterImport:
    """A finder on `sys.meta_path` that finds nothing itself: when the module `name` is
    imported, it lets the other finders find it and calls `then()` once the module's
    own code has run. Used once, then it leaves `sys.meta_path`."""

    def __init__(self, name, then):
        self.name = name
        self.then = then

    def find_spec(self, name, path=None, target=None):
        if name != self.name or self not in sys.meta_path:
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader_runs = spec.loader.exec_module

        def exec_module(module):
            loader_runs(module)
            self.then()

        spec.loader.exec_module = exec_module
        return spec

    def arm(self):
        """Call `then()` after the module's next import."""
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def disarm(self):
        if self in sys.meta_path:
            sys.meta_path.remove(self)
