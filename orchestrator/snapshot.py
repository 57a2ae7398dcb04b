"""The code a chain runs: the git work tree as it was at submission, frozen into the run dir.

A chain runs for days; without a snapshot, a job that starts on day three runs whatever the
checkout holds that day. When ``auto_launch`` runs inside a git work tree (the one holding the
current directory), the tree's tracked files as they are on disk (uncommitted changes included)
and its untracked files that git does not ignore (each up to ``UNTRACKED_FILE_LIMIT``; larger
ones, and those whose names say they hold credentials, are left out and named) are copied into
``RUN_DIR/code`` once per launch. Every job of the chain starts in the snapshot's copy of the
current directory, with the snapshot first on ``PYTHONPATH`` (and its ``src/`` where there is
one), so a package installed in editable mode from that tree, the toolkit's own checkout
included, is imported from the snapshot.

What git ignores (data, run dirs, virtual environments, build outputs) is not copied: each
ignored entry is linked from the snapshot to the live tree, so that relative paths to data keep
working. The manifest records the commit, whether the tree was dirty, and the diff
(``RUN_DIR/code.diff``). ``--code live`` runs the live tree; ``--code DIR`` runs from DIR.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from contract import job_env
from contract.run_dir import CODE_DIFF, CODE_SNAPSHOT_DIR
from orchestrator.errors import UsageError

SNAPSHOT = "snapshot"  # the default: freeze the work tree holding the current directory
LIVE = "live"  # run the live tree, as it is when each job starts
DIRECTORY = "dir"  # run from a directory the user gives (--code DIR)
DEFAULT_LIMIT_MB = 200  # a snapshot larger than this is refused (--code-limit-mb)
UNTRACKED_FILE_LIMIT = 10 * 2**20  # untracked files larger than this are left out
NOT_LINKED = ("__pycache__",)  # ignored entries no job needs
# Untracked files that hold credentials are never copied into a run dir (often on a shared
# filesystem); tracked ones are copied as git already holds them.
CREDENTIAL_FILES = (".env", ".env.*", "*.pem", "*.key", ".netrc", "id_rsa*", "id_ed25519*")
CREDENTIAL_WORDS = ("secret", "credential", "token", "password")
GIT_TIMEOUT_S = 30


@dataclass(frozen=True)
class CodeSource:
    """Where a chain's jobs run from, and the record of what that code was."""

    mode: str  # SNAPSHOT, LIVE or DIRECTORY
    root: Path | None  # ORCH_CODE_DIR: the snapshot or the given directory (None: live)
    workdir: Path  # where each job starts
    commit: str | None = None
    dirty: bool | None = None
    tree: Path | None = None  # the live work tree a snapshot is taken of
    files: tuple[str, ...] = ()  # relative to the tree: what the snapshot copies
    links: tuple[str, ...] = ()  # ignored entries the snapshot links to the live tree
    left_out: tuple[str, ...] = ()  # untracked files over the size limit
    size: int = 0  # bytes the snapshot copies
    diff: str = ""  # uncommitted changes of tracked files against the commit

    @property
    def diff_path(self) -> Path | None:
        if self.mode != SNAPSHOT or self.root is None:
            return None
        return self.root.parent / CODE_DIFF

    def env(self, inherited: str | None) -> dict[str, str]:
        """ORCH_CODE_DIR and PYTHONPATH of each job (``inherited``: the PYTHONPATH at launch)."""
        if self.root is None:
            return {}
        return code_env(str(self.root), inherited)

    def describe(self) -> str:
        """One line for the launch's output."""
        commit = (self.commit or "no commit")[:12] + (" (dirty)" if self.dirty else "")
        if self.mode == LIVE:
            return f"code: live tree, {commit}"
        if self.mode == DIRECTORY:
            return f"code: {self.root}, {commit}"
        left = ""
        if self.left_out:
            left = "; left out (untracked: over 10 MiB, or credentials): "
            left += ", ".join(self.left_out)
        return (
            f"code: snapshot of {self.tree} at {commit}: {len(self.files)} files, "
            f"{self.size / 2**20:.1f} MiB -> {self.root}{left}"
        )


def code_env(root: str, inherited: str | None) -> dict[str, str]:
    """The snapshot (and its ``src/``) first on PYTHONPATH, then what the launch had."""
    paths = [root]
    if Path(root, "src").is_dir():
        paths.append(str(Path(root, "src")))
    if inherited:
        paths.append(inherited)
    return {job_env.CODE_DIR: root, "PYTHONPATH": os.pathsep.join(paths)}


def _git(tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", *args], cwd=tree, capture_output=True, text=True, timeout=GIT_TIMEOUT_S
    )


def work_tree(directory: Path) -> Path | None:
    """The root of the git work tree holding ``directory``, or None (no git, no tree)."""
    try:
        done = _git(directory, "rev-parse", "--show-toplevel")
    except (OSError, subprocess.TimeoutExpired):
        return None
    return Path(done.stdout.strip()) if done.returncode == 0 else None


def git_state(directory: Path) -> tuple[str | None, bool | None]:
    """(commit sha, whether tracked files differ from it) of the tree holding ``directory``,
    or (None, None)."""
    try:
        sha = _git(directory, "rev-parse", "HEAD")
        if sha.returncode != 0:
            return None, None
        dirty = _git(directory, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    return sha.stdout.strip(), bool(dirty.stdout.strip())


def _listed(tree: Path, *args: str) -> list[str]:
    done = _git(tree, "ls-files", "-z", *args)
    if done.returncode != 0:
        raise UsageError(f"code snapshot: git ls-files failed in {tree}: {done.stderr.strip()}")
    return [name for name in done.stdout.split("\0") if name]


def holds_credentials(name: str) -> bool:
    """Whether a file's name says it holds credentials (``.env``, keys, ``*secret*``)."""
    base = Path(name).name.lower()
    return any(fnmatch(base, pattern) for pattern in CREDENTIAL_FILES) or any(
        word in base for word in CREDENTIAL_WORDS
    )


def plan_code(code: str, cwd: Path, run_dir: Path, limit_mb: float) -> CodeSource:
    """Decide what the jobs run (nothing is copied yet; ``freeze`` copies). A snapshot over
    ``limit_mb``, or a ``--code DIR`` that is not a directory, is a UsageError."""
    if code == LIVE:
        return CodeSource(LIVE, None, cwd, *git_state(cwd))
    if code != SNAPSHOT:
        given = Path(code).expanduser().resolve()
        if not given.is_dir():
            raise UsageError(
                f"--code {code}: no such directory; give a checkout to run from, "
                f"'{SNAPSHOT}' (the default) or '{LIVE}'"
            )
        return CodeSource(DIRECTORY, given, given, *git_state(given))
    tree = work_tree(cwd)
    if tree is None:  # not in a git work tree: nothing to freeze, the jobs run it as it is
        return CodeSource(LIVE, None, cwd)
    return _snapshot_plan(tree, cwd, run_dir / CODE_SNAPSHOT_DIR, limit_mb)


def _snapshot_plan(tree: Path, cwd: Path, root: Path, limit_mb: float) -> CodeSource:
    try:
        tracked = _listed(tree, "--cached")
        untracked = _listed(tree, "--others", "--exclude-standard")
        ignored = _listed(tree, "--others", "--ignored", "--exclude-standard", "--directory")
        head = _git(tree, "rev-parse", "HEAD")  # the dirty flag comes from the diff below
        commit = head.stdout.strip() if head.returncode == 0 else None
        diff = _git(tree, "diff", "HEAD", "--binary").stdout if commit else ""
    except (OSError, subprocess.TimeoutExpired) as error:
        raise UsageError(f"code snapshot: git failed in {tree}: {error}") from error
    files, submodules, left_out = [], [], []
    sizes: dict[str, int] = {}
    not_tracked = set(untracked)
    for name in [*tracked, *untracked]:
        path = tree / name
        if not os.path.lexists(path):
            continue  # deleted from the work tree
        if path.is_dir() and not path.is_symlink():
            submodules.append(name)  # linked to the live tree, as ignored entries are
            continue
        size = path.lstat().st_size
        if name in not_tracked and (size > UNTRACKED_FILE_LIMIT or holds_credentials(name)):
            left_out.append(name)
            continue
        files.append(name)
        sizes[name] = size
    total = sum(sizes.values())
    if total > limit_mb * 2**20:
        largest = sorted(sizes, key=sizes.__getitem__, reverse=True)[:3]
        named = ", ".join(f"{name} ({sizes[name] / 2**20:.1f} MiB)" for name in largest)
        raise UsageError(
            f"the code snapshot of {tree} would copy {total / 2**20:.0f} MiB in {len(files)} "
            f"files, over the limit of {limit_mb:g} MiB (largest: {named}); let git ignore "
            "data and build outputs, raise --code-limit-mb, or run with --code live or "
            "--code DIR. Nothing was queued"
        )
    links = [
        name.rstrip("/")
        for name in [*ignored, *submodules]
        if not any(part in NOT_LINKED for part in Path(name).parts)
        and not _holds(tree / name.rstrip("/"), root)
    ]
    return CodeSource(
        SNAPSHOT,
        root,
        root / cwd.resolve().relative_to(tree),
        commit=commit,
        dirty=bool(diff.strip()) or bool(untracked),
        tree=tree,
        files=tuple(files),
        links=tuple(links),
        left_out=tuple(left_out),
        size=total,
        diff=diff,
    )


def _holds(directory: Path, root: Path) -> bool:
    """Whether the snapshot's ``root`` lies inside ``directory`` (a run dir under ``runs/``):
    such a link would put a cycle in the snapshot (``runs/<run>/code/runs`` -> ``runs``), one
    that every tool following links walks without end (``pip install -e .``'s file scan)."""
    return root.resolve().is_relative_to(directory.resolve())


# Snapshots this process has frozen: the members of a sweep share one, copied once.
_FROZEN: set[Path] = set()


def freeze(code: CodeSource) -> None:
    """Copy the snapshot into the run dir and link what git ignores; a failure removes what
    was copied and is one UsageError."""
    if code.mode != SNAPSHOT or code.root is None or code.tree is None or code.root in _FROZEN:
        return
    try:
        for name in code.files:
            target = code.root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(code.tree / name, target, follow_symlinks=False)
        for name in code.links:
            target = code.root / name
            if os.path.lexists(target):
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(code.tree / name)
        code.workdir.mkdir(parents=True, exist_ok=True)
        if code.diff_path is not None:
            code.diff_path.write_text(code.diff)
        _FROZEN.add(code.root)
    except OSError as error:
        shutil.rmtree(code.root, ignore_errors=True)
        raise UsageError(
            f"code snapshot into {code.root} failed: {error}. Nothing was queued"
        ) from error
