"""The code sandbox's isolation by the operating system: bubblewrap (``bwrap``) namespaces around each run.

Why bubblewrap: it is the small, maintained setuid-free tool that Flatpak and several agent CLIs run untrusted
code under; it takes the kernel's namespaces as plain command-line flags (no daemon, no image, no root needed
where unprivileged user namespaces are enabled), it exists as a distribution package everywhere
(``apt-get install bubblewrap``, ``dnf install bubblewrap``), and each run costs a few milliseconds. A
home-made ``unshare`` + ``mount`` sequence would be ours to get right; containers need a daemon.

Each run gets (``wrap``):

- its own PID namespace: the code cannot name the trainer's processes (its parent is the namespace's init),
  and when the run ends (or is killed, ``--die-with-parent``) the kernel kills every process in it, ``setsid``
  or not;
- its own network namespace (loopback only: nothing outside it answers), IPC, UTS and cgroup namespaces;
- a mount namespace built from an allow-list, read-only: ``/usr`` (and the ``/bin``, ``/lib*`` links), the
  Python installation it runs, the loader's cache; a minimal ``/etc/passwd``; a new ``/proc`` and ``/dev``; a
  size-capped tmpfs at ``/tmp`` as its working directory, gone when the run ends. Nothing else of the host
  exists there: not the run directory, the data, the model, ``$HOME``, ``/root`` or ``/work``;
- an unprivileged user: run by root, the code's process switches (before any of it runs) to a uid and gid
  drawn at random from a range no account uses, with no capabilities and ``no_new_privs`` set by bwrap
  (setuid programs cannot raise it again), so its process limit counts its processes only; run by another
  user, a user namespace maps it to ``nobody`` inside.

``probe()`` runs one trivial sandboxed interpreter and caches whether this host can do all of that, and if
not, what is missing and how to get it.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora/RHEL: dnf install bubblewrap; "
    "Arch: pacman -S bubblewrap)"
)
WORKDIR = "/tmp"  # the run's working directory inside the sandbox: a tmpfs of its own
# Where a run by root switches to: uids far above any account's, one per run (RLIMIT_NPROC counts per uid).
_UID_RANGE = (1_900_000_000, 2_000_000_000)
_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives")


@dataclass(frozen=True)
class Isolation:
    """Whether this host can isolate a run, the ``bwrap`` it uses, and why not when it cannot."""

    available: bool
    bwrap: str | None = None
    problem: str = ""  # one line: what is missing and how to get it (when not available)


@dataclass(frozen=True)
class Wrapped:
    """A command to start: its argv, the uid the child switches to (-1: none) and the data for its fds."""

    argv: list[str]
    uid: int
    files: dict[str, bytes]  # sandbox path -> contents, passed through pipes (``--ro-bind-data``)


def python_roots() -> list[str]:
    """The directories of the running Python (prefixes, the executable's home), outermost first, deduplicated."""
    paths = {
        os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)
    }
    paths.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    kept: list[str] = []
    for path in sorted(paths, key=len):  # a directory inside one already kept comes with it
        if path not in ("/", "") and not any(path == k or path.startswith(k + "/") for k in kept):
            kept.append(path)
    return kept


def _ancestors(path: str) -> list[str]:
    """``/a/b/c`` -> ``["/a", "/a/b"]``: the directories bwrap must create (readable) before binding ``path``."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _mounts() -> list[str]:
    """bwrap's file-system arguments: the read-only allow-list (see the module doc)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for link in _LINKS:
        if os.path.islink(link):
            args += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            args += ["--ro-bind", link, link]
    args += [
        "--perms",
        "0755",
        "--dir",
        "/etc",
    ]  # made 0700 otherwise, and the uid the code runs as is not root
    for path in _ETC:
        args += ["--ro-bind-try", path, path]
    made: set[str] = set()
    for root in python_roots():
        if root == "/usr" or root.startswith("/usr/"):
            continue
        for parent in _ancestors(root):
            if parent not in made:  # created with the host's modes otherwise: /root is 0700
                args += ["--perms", "0755", "--dir", parent]
                made.add(parent)
        args += ["--ro-bind", root, root]
    return args


def wrap(bwrap: str, scratch_bytes: int, as_root: bool | None = None) -> Wrapped:
    """The bwrap command line (the program to run goes after it) that isolates a run as the module doc says,
    with ``scratch_bytes`` of tmpfs as its working directory."""
    as_root = os.geteuid() == 0 if as_root is None else as_root
    argv = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    argv += ["--die-with-parent", "--new-session", "--hostname", "sandbox"]
    if as_root:
        # No user namespace: the child drops to an unused uid itself, first thing (it needs these two
        # capabilities for that, and no other).
        uid = random.randrange(*_UID_RANGE)
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        uid = -1
        argv += ["--unshare-user", "--uid", "65534", "--gid", "65534", "--disable-userns"]
    shown_uid = uid if as_root else 65534
    files = {
        "/etc/passwd": f"sandbox:x:{shown_uid}:{shown_uid}:sandbox:{WORKDIR}:/usr/sbin/nologin\n".encode(),
        "/etc/group": f"sandbox:x:{shown_uid}:\n".encode(),
    }
    argv += _mounts()
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--perms", "1777", "--size", str(max(int(scratch_bytes), 1 << 20)), "--tmpfs", WORKDIR]
    argv += ["--chdir", WORKDIR]
    return Wrapped(argv, uid, files)


def with_data_fds(wrapped: Wrapped) -> tuple[list[str], list[int]]:
    """``wrapped``'s argv with one ``--ro-bind-data FD PATH`` per file, and the read ends to pass to the child
    (close them in the parent once it started). Each pipe holds its whole file before the child starts."""
    argv, fds = list(wrapped.argv), []
    for path, data in wrapped.files.items():
        read, write = os.pipe()
        os.write(write, data)  # a few dozen bytes: far below the pipe's buffer
        os.close(write)
        fds.append(read)
        argv += ["--perms", "0644", "--ro-bind-data", str(read), path]
    return argv, fds


def _trial(bwrap: str) -> str:
    """Run an empty program in the sandbox this host would give: '' when it works, else the reason."""
    wrapped = wrap(bwrap, 1 << 20)
    argv, fds = with_data_fds(wrapped)
    drop = f"import os; os.setgroups([]); os.setresgid(*[{wrapped.uid}]*3); os.setresuid(*[{wrapped.uid}]*3)"
    program = drop if wrapped.uid >= 0 else "pass"
    try:
        done = subprocess.run(
            [*argv, sys.executable, "-I", "-c", program + "; import encodings, json"],
            pass_fds=fds, stdin=subprocess.DEVNULL, capture_output=True, timeout=30, text=True,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{bwrap} could not be run ({exc})"
    finally:
        for fd in fds:
            os.close(fd)
    if done.returncode == 0:
        return ""
    lines = [line for line in (done.stderr or "").splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"exit status {done.returncode}"


@functools.lru_cache(maxsize=4)
def _probe(path: str) -> Isolation:
    bwrap = shutil.which("bwrap", path=path)
    if bwrap is None:
        return Isolation(False, None, f"bubblewrap (bwrap) is not installed or not on PATH; {INSTALL_HINT}")
    reason = _trial(bwrap)
    if reason:
        fix = (
            "the host must allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
            "user.max_user_namespaces > 0) or, in a container, run it with --security-opt seccomp=unconfined "
            "or as a privileged container"
        )
        return Isolation(False, bwrap, f"{bwrap} cannot isolate a process here ({reason}); {fix}")
    return Isolation(True, bwrap)


def probe() -> Isolation:
    """Whether code can run isolated on this host (cached per PATH): bwrap found and a trial run passing."""
    return _probe(os.environ.get("PATH", os.defpath))
