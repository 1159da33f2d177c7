"""What allocbox does as an interpreter starts, before allocbox itself is imported.

`allocbox-children.pth`, installed beside this module, calls `arm()` in every Python
process of this environment whose environment says it is a child of a program under
`allocbox run` (a `multiprocessing` spawn or forkserver worker, a `subprocess` running
Python). Importing allocbox costs tens of milliseconds, which a child that never
imports NumPy should not pay: `arm()` only puts a finder on `sys.meta_path`, and the
parent's policy is put in place (`allocbox.children.inherit`) once NumPy's own import
has run.
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


def _inherit():
    from allocbox import children

    children.inherit()


_inherit_after_numpy = AfterImport("numpy", _inherit)


def arm():
    """In a child of a program under `allocbox run`: take its policy once NumPy is
    imported."""
    _inherit_after_numpy.arm()


def disarm():
    """`allocbox run` started as such a child runs its own policy, not its parent's."""
    _inherit_after_numpy.disarm()
