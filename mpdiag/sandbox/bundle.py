"""Training code uploaded in the app: a script with the files it imports, kept whole so its run can be repeated.

A :class:`Bundle` is a set of files by relative path, made from several uploaded files or one ``.zip``
(:func:`bundle_from_uploads`). The server only unpacks and validates it, executing and compiling nothing: every
path must be relative and stay inside the bundle, and every bundle, however it was uploaded, holds at most
MAX_BUNDLE_FILES files of MAX_BUNDLE_BYTES together (a zip's declared sizes are not trusted: reading stops at
the limit), names of at most MAX_NAME_BYTES, paths of at most MAX_PATH_BYTES and MAX_DEPTH folders, and no path
that is both a file and a folder - so that writing it out for a child cannot fail. A single folder holding
everything (a zipped project directory) is taken as the bundle's root. Its canonical zip (sorted names, fixed timestamps) is
what the store keeps, under its SHA-256, and what a child gets, unpacked into its scratch directory, which is
then the script's working directory.

Checking a bundle (:func:`check_bundle`) happens in a child like a model script's check: every ``.py`` file is
compiled, the entry point must exist, the entry's AMP mistakes are read from its syntax tree, and imports that
neither the bundle nor this Python provides are named. Running one is ``mpdiag watch`` in a supervised child
(:mod:`mpdiag.sandbox.launch`).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import io
import os
import posixpath
import shlex
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from mpdiag.sandbox.check import CheckReport, report_of, static_warnings
from mpdiag.sandbox.child import run_task
from mpdiag.sandbox.supervisor import Limits, cuda_present

MAX_BUNDLE_BYTES = 20 * 2**20  # unpacked, all files together; also server.maxUploadSize in .streamlit/config.toml
MAX_BUNDLE_FILES = 2000
MAX_NAME_BYTES = 255  # a file or folder name, UTF-8: what Linux file systems take
MAX_PATH_BYTES = 1024  # a whole relative path: well inside PATH_MAX (4096) once under a scratch directory
MAX_DEPTH = 32  # folders in a path
#: what a zipped project carries that is not its code: left out of the bundle
_LEFT_OUT_PARTS = {"__pycache__", "__MACOSX", ".git", ".ipynb_checkpoints"}
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)


class BundleRefused(ValueError):
    """Uploaded files that cannot make a bundle; the message says which file and why."""


def _clean_path(name: str) -> str | None:
    """The bundle path of an uploaded or zipped file name (POSIX, relative), None for what is left out.
    Raises BundleRefused for a path that would leave the bundle."""
    path = name.replace("\\", "/")
    if path.startswith("/") or (len(path) > 1 and path[1] == ":"):
        raise BundleRefused(f"{name}: an absolute path; a bundle holds relative paths only.")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise BundleRefused(f"{name}: a path that leaves the bundle ('..').")
    if not parts or path.endswith("/") or _LEFT_OUT_PARTS & set(parts) or parts[-1].endswith(".pyc"):
        return None
    if any(ord(c) < 32 for c in path):
        raise BundleRefused(f"{name!r}: a file name with control characters.")
    return "/".join(parts)


@dataclass(frozen=True)
class Bundle:
    """Files by relative POSIX path (sorted), their contents as bytes."""

    name: str
    files: tuple[tuple[str, bytes], ...]

    @classmethod
    def of(cls, name: str, files: dict[str, bytes]) -> Bundle:
        """A bundle of ``files``, with a single top folder holding everything taken as its root."""
        if not files:
            raise BundleRefused(f"{name}: no files (folders such as __pycache__ and .git are left out).")
        _check_paths(name, files)
        tops = {path.split("/", 1)[0] for path in files}
        if len(tops) == 1 and all("/" in path for path in files):
            top = tops.pop()
            files = {path[len(top) + 1:]: data for path, data in files.items()}
        if not any(path.endswith(".py") for path in files):
            raise BundleRefused(f"{name}: no Python file to run.")
        return cls(name=name, files=tuple(sorted(files.items())))

    @property
    def size(self) -> int:
        return sum(len(data) for _, data in self.files)

    def to_zip(self) -> bytes:
        """The canonical zip: the same files give the same bytes, so the same SHA-256."""
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
            for path, data in self.files:
                archive.writestr(zipfile.ZipInfo(path, date_time=_FIXED_TIME), data)
        return out.getvalue()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_zip()).hexdigest()

    def python_files(self) -> list[str]:
        return [path for path, _ in self.files if path.endswith(".py")]

    def entry_points(self) -> list[str]:
        """The Python files, likeliest entry first: those with an ``if __name__ == "__main__"`` block or named
        like a training script, then shallower paths (read as text; nothing is parsed or run)."""
        def likely(path: str) -> tuple:
            text = dict(self.files)[path]
            main = b"__name__" in text and b"__main__" in text
            return (not main, not posixpath.basename(path).startswith("train"), path.count("/"), path)

        return sorted(self.python_files(), key=likely)


def _check_paths(name: str, files: dict[str, bytes]) -> None:
    """Refuse, naming the file, what could not be written out as it is: too many files, a name or path too
    long, too deep, a path that is a file and a folder."""
    if len(files) > MAX_BUNDLE_FILES:
        raise BundleRefused(f"{name}: {len(files):,} files; a bundle holds at most {MAX_BUNDLE_FILES:,}.")
    folders = set()
    for path in files:
        parts = path.split("/")
        folders.update("/".join(parts[:k]) for k in range(1, len(parts)))
        if len(path.encode()) > MAX_PATH_BYTES:
            raise BundleRefused(f"{path[:80]}...: a path of {len(path.encode()):,} bytes; at most {MAX_PATH_BYTES:,}.")
        if len(parts) - 1 > MAX_DEPTH:
            raise BundleRefused(f"{path[:80]}: {len(parts) - 1} folders deep; at most {MAX_DEPTH}.")
        long = next((part for part in parts if len(part.encode()) > MAX_NAME_BYTES), None)
        if long is not None:
            raise BundleRefused(f"{long[:80]}...: a name of {len(long.encode()):,} bytes; at most {MAX_NAME_BYTES}.")
    both = sorted(folders & set(files))
    if both:
        raise BundleRefused(f"{both[0]} is both a file and a folder of the upload.")


def _read_zip(name: str, data: bytes) -> dict[str, bytes]:
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        raise BundleRefused(f"{name} is not a zip file.") from None
    files, total = {}, 0
    with archive:
        for info in archive.infolist():
            path = _clean_path(info.filename)
            if path is None or info.is_dir():
                continue
            if len(files) >= MAX_BUNDLE_FILES:
                raise BundleRefused(f"{name} holds more than {MAX_BUNDLE_FILES} files.")
            try:
                with archive.open(info) as member:
                    content = member.read(MAX_BUNDLE_BYTES - total + 1)  # never trust the declared size
            except (zipfile.BadZipFile, NotImplementedError, RuntimeError, OSError) as exc:
                raise BundleRefused(f"{name}: {path} cannot be unpacked ({exc}).") from None
            total += len(content)
            if total > MAX_BUNDLE_BYTES:
                raise BundleRefused(f"{name} unpacks to more than {MAX_BUNDLE_BYTES // 2**20} MiB.")
            if path in files:
                raise BundleRefused(f"{name} holds {path} twice.")
            files[path] = content
    return files


def bundle_from_uploads(uploads: list[tuple[str, bytes]]) -> Bundle:
    """A bundle from uploaded files: one ``.zip`` (unpacked), or several files kept by their names. Raises
    BundleRefused saying what is wrong. Nothing is executed."""
    if not uploads:
        raise BundleRefused("No files uploaded.")
    if len(uploads) == 1 and uploads[0][0].lower().endswith(".zip"):
        name, data = uploads[0]
        return Bundle.of(posixpath.basename(name.replace("\\", "/")), _read_zip(name, data))
    zips = [name for name, _ in uploads if name.lower().endswith(".zip")]
    if zips:
        raise BundleRefused(f"{zips[0]}: upload a .zip on its own, or the files themselves (not both).")
    if len(uploads) > MAX_BUNDLE_FILES:
        raise BundleRefused(f"{len(uploads):,} files uploaded; a bundle holds at most {MAX_BUNDLE_FILES:,}.")
    files = {}
    for name, data in uploads:
        path = _clean_path(name)
        if path is None:
            continue
        if path in files:
            raise BundleRefused(f"{path} was uploaded twice.")
        files[path] = data
    if sum(len(d) for d in files.values()) > MAX_BUNDLE_BYTES:
        raise BundleRefused(f"The files come to more than {MAX_BUNDLE_BYTES // 2**20} MiB.")
    first = next(iter(sorted(files)), "files")
    return Bundle.of(f"{posixpath.splitext(posixpath.basename(first))[0]} and {len(files) - 1} more"
                     if len(files) > 1 else posixpath.basename(first), files)


def bundle_from_zip(name: str, data: bytes) -> Bundle:
    """A stored bundle (its canonical zip) back as a Bundle."""
    return Bundle.of(name, _read_zip(name, data))


def module_name(path: str) -> str:
    """The module ``python -m`` runs for a file of the bundle: ``pkg/train.py`` -> ``pkg.train``."""
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def command_line(entry: str, args: list[str], as_module: bool = False) -> str:
    """The command a watched run of ``entry`` runs, as a shell would read it: ``python pkg/train.py ARGS`` (or
    ``python -m pkg.train ARGS``), each word quoted where a shell needs it."""
    words = ["python", *(["-m", module_name(entry)] if as_module else [entry]), *args]
    return " ".join(shlex.quote(word) for word in words)


# -- the check, in a child -------------------------------------------------------------------------------------
def check_bundle(bundle: Bundle, entry: str, args: list[str], module: bool = False,
                 limits: Limits | None = None) -> CheckReport:
    """Compile every Python file of ``bundle`` and read its entry point, in a supervised child; a report the
    Upload page shows. Nothing of the bundle is executed."""
    run = "-m " + module_name(entry) if module else entry
    label = run if run == bundle.name else f"{bundle.name}: {run}"  # one uploaded file is named once
    if entry not in bundle.python_files():
        return CheckReport(label, False, problems=[f"{entry} is not a Python file of the bundle."])
    result = run_task("check-bundle", {"entry": entry, "module": module, "args": list(args)},
                      limits or Limits.for_checks(), files=dict(bundle.files))
    return report_of(label, result)


def _absolute_imports(tree: ast.AST) -> dict[str, int]:
    """Top-level names of the modules a syntax tree imports absolutely, with the first line of each."""
    names: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names.setdefault(alias.name.split(".")[0], node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.setdefault(node.module.split(".")[0], node.lineno)
    return names


def check_bundle_in_child(payload: dict, channel) -> dict:
    """In the child, whose directory holds the bundle: compile, find the entry's warnings and missing imports."""
    entry, problems, warnings, missing = payload["entry"], [], [], set()
    here = Path.cwd()
    python_files = sorted(str(p.relative_to(here)).replace(os.sep, "/") for p in here.rglob("*.py"))
    local = {p.split("/")[0].removesuffix(".py") for p in python_files}
    local |= {p.split("/")[1].removesuffix(".py") for p in python_files if p.count("/") >= 1}  # src/ layouts
    for path in python_files:
        try:
            source = (here / path).read_bytes().decode("utf-8")
            tree = ast.parse(source, filename=path)
            compile(tree, path, "exec")
        except UnicodeDecodeError:
            problems.append(f"{path} is not UTF-8 text.")
            continue
        except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
            where = f"{path}, line {exc.lineno}" if getattr(exc, "lineno", None) else path
            problems.append(f"{where}: {type(exc).__name__}: {getattr(exc, 'msg', exc)}")
            continue
        for name, line in sorted(_absolute_imports(tree).items()):
            if name in local or name in missing or name in sys.builtin_module_names:
                continue
            if importlib.util.find_spec(name) is None:  # a top-level name: found on sys.path, nothing is run
                missing.add(name)
                warnings.append((line, f"imports {name}, which neither the bundle nor this Python provides (fine "
                                       "if the script guards that import)", path))
        if path == entry:
            warnings += [(w.line, w.message, path) for w in static_warnings(source, cuda_present())]
    command = ["python", *(["-m", module_name(entry)] if payload["module"] else [entry]), *payload["args"]]
    summary = {"files": len(list(p for p in here.rglob("*") if p.is_file())), "Python files": len(python_files),
               "command": " ".join(command), "working directory": "the bundle's root"}
    return {"ready": not problems, "problems": problems, "warnings": warnings, "summary": summary}
