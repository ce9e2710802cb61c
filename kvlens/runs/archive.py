"""Runs in and out of the user's runs folder: export one as a zip, import a zip safely, delete one.

`export_run(path)` is the zip bytes of `NAME/run.json`, `NAME/tensors.safetensors` and
`NAME/decisions.parquet` (a valid run only). `import_run(zip, runs_dir, name)` unpacks into a hidden
temporary folder beside the runs, checks the result with the safe loader (`kvlens.runs.run.load_run`),
and renames it to a name no run has yet: it never overwrites a run. Before anything is written it
refuses, with one sentence, a file that is not a zip, entries with absolute or `..` names, links,
anything but those three files in at most one folder, a missing file and files over the run
format's size limits. `delete_run(path, runs_dir)` deletes only runs directly inside `runs_dir`.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import stat
import tempfile
import time
import zipfile
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from kvlens.errors import KvlensError
from kvlens.runs.run import DECISIONS, MAX_JSON_BYTES, MAX_TENSOR_BYTES, RUN_JSON, TENSORS, load_run

FILES = (RUN_JSON, TENSORS, DECISIONS)
LIMITS = {RUN_JSON: MAX_JSON_BYTES, TENSORS: MAX_TENSOR_BYTES, DECISIONS: MAX_TENSOR_BYTES}
CHUNK = 1 << 20


def export_run(path: str | Path) -> bytes:
    """The run at `path` as zip bytes (its folder name inside); a run that does not load is refused."""
    path = Path(path)
    load_run(path)  # refuses links out of the folder and anything that is not a complete, valid run
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in FILES:
            zf.write(path / name, f"{path.name}/{name}")
    return buffer.getvalue()


def safe_name(name: str) -> str:
    """A run folder name made of letters, digits, `_`, `.` and `-` (never hidden, never empty)."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip(".-")[:64]
    return cleaned or "imported-run"


def _members(zf: zipfile.ZipFile, label: str) -> tuple[str | None, dict[str, zipfile.ZipInfo]]:
    """The archive's one folder (None: files at the top) and its run files by name, or one sentence."""
    folders, files = set(), {}
    for info in zf.infolist():
        parts = PurePosixPath(info.filename.replace("\\", "/")).parts
        if info.filename.startswith(("/", "\\")) or ".." in parts or (parts and ":" in parts[0]):
            raise KvlensError(
                f"{label} names a file outside its folder ('{info.filename[:80]}'); refusing to unpack it."
            )
        if stat.S_ISLNK(info.external_attr >> 16):
            raise KvlensError(f"{label} holds a link ('{info.filename[:80]}'); refusing to unpack it.")
        if info.is_dir():
            continue
        if len(parts) > 2 or parts[-1] not in FILES:
            raise KvlensError(
                f"{label} holds '{info.filename[:80]}', which is not part of a kvlens run "
                f"({', '.join(FILES)})."
            )
        folders.add(parts[0] if len(parts) == 2 else None)
        if len(folders) > 1:
            raise KvlensError(f"{label} holds files in more than one folder; zip one run at a time.")
        if parts[-1] in files:
            raise KvlensError(f"{label} holds {parts[-1]} twice; zip one run at a time.")
        files[parts[-1]] = info
        if info.file_size > LIMITS[parts[-1]]:
            raise KvlensError(
                f"{label}: {parts[-1]} is larger than {LIMITS[parts[-1]] >> 20} MB; refusing to unpack it."
            )
    if RUN_JSON not in files:
        raise KvlensError(f"{label} holds no run.json, so it is not a kvlens run.")
    missing = [f for f in FILES if f not in files]
    if missing:
        raise KvlensError(f"{label} holds no {missing[0]}, so it is not a complete kvlens run.")
    return next(iter(folders), None), files


def _unpack(zf: zipfile.ZipFile, info: zipfile.ZipInfo, target: Path) -> None:
    """Copy one member (zipfile reads no more than the size its entry declares, checked above) and keep its
    date."""
    with zf.open(info) as src, target.open("wb") as dst:
        shutil.copyfileobj(src, dst, CHUNK)
    with contextlib.suppress(
        OverflowError, ValueError, OSError
    ):  # a date the platform cannot hold: keep today's
        stamp = time.mktime((*info.date_time, 0, 0, -1))
        os.utime(target, (stamp, stamp))


def _free_name(runs_dir: Path, name: str) -> Path:
    target, n = runs_dir / name, 2
    while target.exists() or target.is_symlink():
        target, n = runs_dir / f"{name}-{n}", n + 1
    return target


def import_run(archive: str | Path | BinaryIO, runs_dir: str | Path, name: str = "") -> Path:
    """Unpack the zip `archive` (a path or a binary file) as a new run in `runs_dir`; its path.

    The run is named after the zip's folder (else `name`, e.g. the uploaded file's stem), with `-2`,
    `-3`, ... appended when a run of that name exists."""
    label = name or (Path(archive).name if isinstance(archive, (str, Path)) else "The archive")
    try:
        zf = zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        raise KvlensError(f"{label} is not a zip archive (or it is damaged).") from err
    runs_dir = Path(runs_dir)
    with zf:
        folder, files = _members(zf, label)
        runs_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".import-", dir=runs_dir))
        try:
            try:
                for file_name, info in files.items():
                    _unpack(zf, info, tmp / file_name)
            except (
                zipfile.BadZipFile,
                EOFError,
                OSError,
                ValueError,
            ) as err:  # e.g. a CRC that does not match
                raise KvlensError(
                    f"{label} is damaged ({type(err).__name__}); nothing was imported."
                ) from err
            try:
                load_run(tmp)
            except KvlensError as err:
                reason = str(err).replace(f"{tmp}/", "").replace(str(tmp), "the run")
                raise KvlensError(f"{label} is not a valid kvlens run: {reason}") from err
            target = _free_name(runs_dir, safe_name(folder or Path(label).stem))
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def delete_run(path: str | Path, runs_dir: str | Path) -> None:
    """Delete the run folder `path`, which must be a run directly inside `runs_dir` (never a shipped run).

    It is renamed to a hidden name first, so a listing never shows a half-deleted run."""
    path, runs_dir = Path(path), Path(runs_dir)
    if path.is_symlink() or path.resolve().parent != runs_dir.resolve():
        raise KvlensError(f"{path.name} is not one of your runs in {runs_dir}; only those can be deleted.")
    if not (path / RUN_JSON).is_file():
        raise KvlensError(f"{path} is not a kvlens run; nothing was deleted.")
    hidden = Path(tempfile.mkdtemp(prefix=f".{path.name}.deleted-", dir=runs_dir))
    os.replace(path, hidden / "run")
    shutil.rmtree(hidden)
