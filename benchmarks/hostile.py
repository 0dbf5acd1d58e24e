"""Hostile trials (issue 17), run by ``python benchmarks/reliability.py hostile``.

attacks
    Another user (uid 54321, through ``setpriv``) prepares what an ordinary ``%%resilient`` cell
    will use, in each of these ways in turn, ``--attacks`` trials in all: the run root is theirs (in a
    sticky shared folder, like /tmp); the root is ours but writable by all; the cell's run folder
    is theirs; and, inside a root of ours (planted while it was writable), the run folder, its
    ``lock``, its ``journal.json``, its ``checkpoints`` folder or that folder's ``blobs`` is a
    symbolic link to a folder or file of ours (a victim folder with a 15-byte file). Each cell
    must be refused in one line, its body must not run, and the victim folder must keep every
    mode, size and byte. A refusal is "clean" when all three hold.

journals
    ``--journals`` times: a pending run whose set-up cell would create a canary file; either its
    journal is copied over another run's (moved), or an older generation of it (random, among
    2..6 writes) is put back over the newest (rolled back). The run's cell must be refused in one
    line and the canary never created; the newest journal put back must be accepted again.

full disk
    A store on a tmpfs of ``--disk-mb`` MiB (mounted here; needs root) holds one checkpoint; then
    ``--full-saves`` saves that do not fit (up to 6 small new blobs, then one of a random size from
    just over the free space, which fails part way through its write, to 1.5 times the disk) each
    must fail with one line, keep that checkpoint, and leave the descriptors of the
    process and the free space of the file system exactly as before (no unlinked-but-open
    temporary file holding space); a save that fits then succeeds and loads back bit for bit.

many names
    ``--names`` top-level names (small tensors, NumPy arrays and ints, a blob each) in one save,
    under this process's own open-file limit: the first save, an unchanged one and a load are
    timed, and the most descriptors open at once during the saves is sampled.

The first two run in this process's IPython shell (``InteractiveShell``), the extension loaded,
all four under a throw-away ``COLAB_RESILIENCE_HOME``.
"""

from __future__ import annotations

import os
import random
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

OTHER_UID = 54321
BODY = "ran_body = True\n"
ATTACKS = ["root is theirs", "root writable by all", "run folder is theirs", "run folder is a link",
           "lock is a link", "journal is a link", "checkpoints is a link", "blobs is a link"]


def _as_other_user(script: str) -> None:
    subprocess.run(["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups",
                    "sh", "-ec", script], check=True, capture_output=True, text=True)


def _snapshot(folder: Path) -> dict:
    out = {".": stat.S_IMODE(folder.stat().st_mode)}
    for p in sorted(folder.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(folder))] = (stat.S_IMODE(st.st_mode), st.st_size,
                                           p.read_bytes() if p.is_file() and not p.is_symlink() else None)
    return out


def _shell():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    if "ResilienceMagics" not in shell.magics_manager.registry:
        shell.run_line_magic("load_ext", "colab_resilience")
    return shell


def _cell(shell, runs: Path, body: str = BODY) -> str | None:
    """Run the %%resilient cell with runs in ``runs``; its one-line refusal, or None if it ran."""
    from IPython.core.error import UsageError

    shell.magics_manager.registry["ResilienceMagics"].run_dir = str(runs)
    shell.user_ns.pop("ran_body", None)
    try:
        shell.run_cell_magic("resilient", "", body)
    except UsageError as e:
        return str(e)
    return None


def _run_id(body: str = BODY) -> str:
    from colab_resilience import replay
    from colab_resilience.run import run_id_for
    from colab_resilience.session import notebook

    return run_id_for(replay.source_key("%%resilient\n" + body), notebook=notebook())


def _plant(attack: str, base: Path, victim: Path, body: str) -> Path:
    """Prepare ``attack`` under ``base``; return the run root the cell is pointed at."""
    run_id = _run_id(body)
    if attack == "root is theirs":
        shared = base / "shared"
        shared.mkdir()
        os.chmod(shared, 0o1777)
        runs = shared / "runs"
        _as_other_user(f"mkdir -m 777 {runs} && ln -s {victim} {runs}/run-{run_id}")
        return runs
    runs = base / "runs"
    runs.mkdir(mode=0o700)
    os.chmod(runs, 0o777)  # the window in which the other user came by
    run_dir = runs / f"run-{run_id}"
    if attack == "root writable by all":
        return runs
    if attack == "run folder is theirs":
        _as_other_user(f"mkdir -m 700 {run_dir}")
    elif attack == "run folder is a link":
        _as_other_user(f"ln -s {victim} {run_dir}")
    else:
        run_dir.mkdir(mode=0o700)
        os.chmod(run_dir, 0o777)
        if attack == "lock is a link":
            _as_other_user(f"ln -s {victim}/notes.txt {run_dir}/lock")
        elif attack == "journal is a link":
            _as_other_user(f"ln -s {victim}/notes.txt {run_dir}/journal.json")
        elif attack == "checkpoints is a link":
            _as_other_user(f"ln -s {victim} {run_dir}/checkpoints")
        elif attack == "blobs is a link":
            (run_dir / "checkpoints").mkdir()
            os.chmod(run_dir / "checkpoints", 0o777)
            _as_other_user(f"ln -s {victim} {run_dir}/checkpoints/blobs")
            os.chmod(run_dir / "checkpoints", 0o700)
        os.chmod(run_dir, 0o700)
    os.chmod(runs, 0o700)
    return runs


def attack_trials(n: int) -> dict:
    shell = _shell()
    per: dict[str, list[int]] = {a: [0, 0] for a in ATTACKS}  # attack -> [trials, clean refusals]
    failures: list[str] = []
    examples: dict[str, str] = {}
    start = time.perf_counter()
    for i in range(n):
        attack = ATTACKS[i % len(ATTACKS)]  # each kind as often as the others
        body = f"ran_body = True  # trial {i}\n"
        base = Path(tempfile.mkdtemp(prefix="cr-hostile-"))
        try:
            os.chmod(base, 0o755)
            victim = base / "mine"
            victim.mkdir(mode=0o755)
            os.chmod(victim, 0o755)
            (victim / "notes.txt").write_bytes(b"fifteen bytes!\n")
            runs = _plant(attack, base, victim, body)
            before = _snapshot(victim)
            said = _cell(shell, runs, body)
            ok = (said is not None and "\n" not in said.strip() and "ran_body" not in shell.user_ns
                  and _snapshot(victim) == before)
            per[attack][0] += 1
            per[attack][1] += ok
            examples.setdefault(attack, said or "(ran)")
            if not ok:
                failures.append(f"{attack}: {said!r}")
        finally:
            shutil.rmtree(base, ignore_errors=True)
    return {"trials": n, "per": per, "failures": failures, "examples": examples,
            "seconds": time.perf_counter() - start}


def journal_trials(n: int, seed: int = 0) -> dict:
    from colab_resilience.journal import Journal, ReplayCell

    rng = random.Random(seed)
    shell = _shell()
    counts = {"moved": [0, 0], "rolled back": [0, 0]}
    failures: list[str] = []
    examples: dict[str, str] = {}
    start = time.perf_counter()
    for i in range(n):
        kind = "moved" if i % 2 == 0 else "rolled back"
        body = f"ran_body = True  # journal trial {i}\n"
        base = Path(tempfile.mkdtemp(prefix="cr-hostile-"))
        try:
            runs, canary = base / "runs", base / "canary"
            evil = f"%%replay\nopen({str(canary)!r}, 'w').close()"
            run_id = _run_id(body)
            if kind == "moved":
                other = Journal.create(runs / "run-0ther000", "0ther000", save=False, kernel_pid=1, counted_pid=1)
                other.replay_cells = [ReplayCell(f"s{i}", evil)]
                other.save()
                mine = Journal.create(runs / f"run-{run_id}", run_id, save=False, kernel_pid=1, counted_pid=1)
                mine.replay_cells = [ReplayCell(f"s{i}", "%%replay\nsetup_ran = True")]
                mine.save()
                newest = mine.path.read_bytes()
                shutil.copyfile(other.path, mine.path)
            else:
                mine = Journal.create(runs / f"run-{run_id}", run_id, save=False, kernel_pid=1, counted_pid=1)
                mine.replay_cells = [ReplayCell(f"s{i}", evil)]
                writes = rng.randint(2, 6)
                old_at = rng.randint(1, writes - 1)
                old = None
                for w in range(1, writes + 1):
                    if w == old_at + 1:
                        mine.replay_cells = [ReplayCell(f"s{i}", "%%replay\nsetup_ran = True")]
                    mine.save()
                    if w == old_at:
                        old = mine.path.read_bytes()
                newest = mine.path.read_bytes()
                mine.path.write_bytes(old)
            said = _cell(shell, runs, body)
            refused = said is not None and "\n" not in said.strip() and not canary.exists()
            mine.path.write_bytes(newest)
            shell.user_ns.pop("setup_ran", None)
            accepted = _cell(shell, runs, body) is None and shell.user_ns.get("setup_ran") is True
            counts[kind][0] += 1
            counts[kind][1] += refused and accepted and not canary.exists()
            examples.setdefault(kind, said or "(ran)")
            if not (refused and accepted):
                failures.append(f"{kind}: refused={refused} accepted-after={accepted}: {said!r}")
        finally:
            shutil.rmtree(base, ignore_errors=True)
    return {"trials": n, "per": counts, "failures": failures, "examples": examples,
            "seconds": time.perf_counter() - start}


def _open_fds() -> dict[int, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bfree * st.f_frsize


def full_disk_trials(saves: int, disk_mb: int) -> dict:
    import torch

    from colab_resilience.checkpoints import CheckpointStore
    from colab_resilience.errors import CheckpointError
    from colab_resilience.signing import load_or_create_key

    mount = Path(tempfile.mkdtemp(prefix="cr-hostile-disk-"))
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={disk_mb}m,mode=0700", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        mount.rmdir()
        return {"skipped": f"cannot mount a tmpfs: {proc.stderr.strip()}"}
    start = time.perf_counter()
    try:
        store = CheckpointStore(mount / "run", key=load_or_create_key())
        first = {"t": torch.arange(1000, dtype=torch.float32), "v": 1}
        store.save(first, ["t", "v"])
        store.wait()
        free, fds = _free(mount), _open_fds()
        ok, messages, failures = 0, set(), []
        rng = random.Random(0)
        for i in range(saves):
            # up to 6 small new blobs, then one that does not fit: from just over the free space
            # (it fails part way through its write) to 1.5 times the disk
            ns = {f"s{k}": torch.full((rng.randint(1, 50_000),), float(i * 10 + k)) for k in range(rng.randint(0, 6))}
            ns["big"] = torch.full((rng.randint(free // 4 + (1 << 16), (disk_mb << 18) * 3 // 2),), float(i))
            try:
                store.save(ns, list(ns))
                failures.append(f"save {i} did not fail")
                continue
            except CheckpointError as e:
                said = str(e)
            store.wait()
            clean = ("\n" not in said and "is intact" in said and _open_fds() == fds and _free(mount) == free
                     and store.checkpoint_ids() == ["ckpt-000001"])
            ok += clean
            messages.add(said.split(" (")[0])
            if not clean:
                failures.append(f"save {i}: fds {len(_open_fds())} vs {len(fds)}, free {_free(mount)} vs {free}: {said}")
        fits = {"t": torch.randn(disk_mb << 14, generator=torch.Generator().manual_seed(0)), "v": 2}
        try:
            store.save(fits, ["t", "v"])
            back: dict = {}
            CheckpointStore(store.run_dir, key=store.key).load().restore(back, rng=False)
            loaded = back["v"] == 2 and torch.equal(back["t"], fits["t"])
        except CheckpointError as e:  # the space the failed saves took is not back
            loaded = False
            failures.append(f"the save that fits failed: {e}")
        return {"saves": saves, "disk_mb": disk_mb, "clean": ok, "failures": failures, "loaded_after": loaded,
                "example": next(iter(messages), ""), "seconds": time.perf_counter() - start}
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)
        shutil.rmtree(mount, ignore_errors=True)


def many_names(n: int) -> dict:
    import resource
    import threading

    import numpy as np
    import torch

    from colab_resilience.checkpoints import CheckpointStore
    from colab_resilience.signing import load_or_create_key

    ns: dict = {}
    for i in range(n):
        ns[f"v{i}"] = (torch.full((16,), float(i)) if i % 3 == 0 else np.full(16, i, dtype=np.int64)
                       if i % 3 == 1 else i)
    folder = Path(tempfile.mkdtemp(prefix="cr-hostile-names-", dir=os.environ.get("TMPDIR", "/var/tmp")))
    peak, stop = [len(_open_fds())], threading.Event()

    def sample():
        while not stop.is_set():
            peak.append(len(os.listdir("/proc/self/fd")))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        store = CheckpointStore(folder / "run", key=load_or_create_key())
        t0 = time.perf_counter()
        store.save(ns, list(ns))
        store.wait()
        t1 = time.perf_counter()
        store.save(ns, list(ns))
        store.wait()
        t2 = time.perf_counter()
        back: dict = {}
        CheckpointStore(store.run_dir, key=store.key).load().restore(back, rng=False)
        t3 = time.perf_counter()
        same = all((torch.equal(back[k], v) if isinstance(v, torch.Tensor) else
                    np.array_equal(back[k], v) if isinstance(v, np.ndarray) else back[k] == v) for k, v in ns.items())
    finally:
        stop.set()
        sampler.join()
        shutil.rmtree(folder, ignore_errors=True)
    return {"names": n, "limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0], "peak_fds": max(peak),
            "first": t1 - t0, "unchanged": t2 - t1, "load": t3 - t2, "identical": same}


def hostile(attacks: int, journals: int, seed: int = 0, *, full_saves: int = 0, disk_mb: int = 64,
            names: int = 0) -> dict:
    """The trials under a throw-away installation home (full disk and many names when asked)."""
    home = Path(tempfile.mkdtemp(prefix="cr-hostile-home-"))
    old = os.environ.get("COLAB_RESILIENCE_HOME")
    os.environ["COLAB_RESILIENCE_HOME"] = str(home / "key-home")
    try:
        out = {"attacks": attack_trials(attacks), "journals": journal_trials(journals, seed)}
        if full_saves:
            out["full_disk"] = full_disk_trials(full_saves, disk_mb)
        if names:
            out["many_names"] = many_names(names)
        return out
    finally:
        if old is None:
            os.environ.pop("COLAB_RESILIENCE_HOME", None)
        else:
            os.environ["COLAB_RESILIENCE_HOME"] = old
        shutil.rmtree(home, ignore_errors=True)


def print_hostile(out: dict) -> None:
    for part, title in (("attacks", "folders and files another user prepared"),
                        ("journals", "journals moved between runs or rolled back")):
        r = out[part]
        print(f"\n  {title}: {r['trials']} trials in {r['seconds']:.1f} s")
        width = max(len(k) for k in r["per"])
        for kind, (trials, clean) in r["per"].items():
            print(f"    {kind:<{width}}  {clean}/{trials} refused cleanly   e.g. {r['examples'].get(kind, '')[:150]}")
        for f in r["failures"][:10]:
            print(f"    FAILURE {f}")
    d = out.get("full_disk")
    if d and "skipped" in d:
        print(f"\n  full disk: skipped ({d['skipped']})")
    elif d:
        print(f"\n  full disk: {d['saves']} saves too large for a {d['disk_mb']} MiB tmpfs in {d['seconds']:.1f} s: "
              f"{d['clean']}/{d['saves']} failed in one line with the checkpoint kept, every descriptor closed "
              f"and the free space back; then a save that fits loaded back exactly: {d['loaded_after']}")
        print(f"    e.g. {d['example'][:160]}")
        for f in d["failures"][:10]:
            print(f"    FAILURE {f}")
    m = out.get("many_names")
    if m:
        print(f"\n  many names: {m['names']} names in one save (open-file limit {m['limit']}): first save "
              f"{m['first']:.1f} s, unchanged save {m['unchanged']:.1f} s, load {m['load']:.1f} s; at most "
              f"{m['peak_fds']} descriptors open at once; loaded back identical: {m['identical']}")
