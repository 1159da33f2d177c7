"""What allocbox does as an interpreter starts, before allocbox itself is imported.

`allocbox-children.pth`, installed beside this module, calls `arm()` in every Python
process of this environment whose environment says it is a child of a program under
`allocbox run` (a `multiprocessing` spawn or forkserver worker, a `subprocess` running
Python). Importing allocbox costs tens of milliseconds, which a child that never
imports NumPy should not pay: `arm()` only puts a finder on `sys.meta_path`, and the
parent's policy is put in place (`allocbox.children.inherit`) once NumPy's own import
has run.
"""

from _allocbox_hooks import AfterImport


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
