"""Values the security and checkpoint tests save: one definition, importable wherever a pickle of
them may be loaded (this process; a child process or kernel through ``harness.child_env``); and
how those tests compare what comes back (``raw``, ``roundtrip``)."""

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


def raw(t) -> bytes:
    """A tensor's bytes, exactly (what "bit for bit" compares)."""
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def roundtrip(store, value, name="x"):
    """``value`` saved to ``store`` and loaded back."""
    store.save({name: value}, [name])
    ns: dict = {}
    assert store.load().restore(ns, rng=False) == [name]
    return ns[name]
