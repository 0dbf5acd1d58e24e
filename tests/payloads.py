"""Values the security and checkpoint tests save: one definition, importable wherever a pickle of
them may be loaded (this process; a child process or kernel through ``harness.child_env``)."""

from __future__ import annotations


class EvilPayload:
    """Unpickling it creates ``path`` (the canary): it must never be unpickled without the key."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class Opaque:
    """A plain custom class: saved by pickle (only loadable because the manifest is signed)."""

    def __init__(self, v):
        self.v = v
