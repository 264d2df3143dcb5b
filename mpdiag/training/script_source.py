"""A model script's source: reading the file, executing it as a fresh module, and turning the exceptions its code
raises into :class:`~mpdiag.options.ScriptError` messages that show the script's own lines.

Torch-free on purpose: a command that only reads a script and hands it to a child process (``mpdiag check``, which
runs the script in a sandboxed child) answers without importing torch (~2 s of CPU). Building the model and checking
the contract (:mod:`mpdiag.training.script`) needs torch and lives there.
"""

from __future__ import annotations

import hashlib
import linecache
import re
import sys
import traceback
import types
from dataclasses import dataclass
from pathlib import Path

from mpdiag.options import ScriptError


@dataclass(frozen=True)
class ModelScript:
    """A script's source with the name it is shown under (its path, or its stored file name)."""

    filename: str
    source: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()

    @classmethod
    def from_path(cls, path: str | Path) -> ModelScript:
        path = Path(path)
        if not path.is_file():
            raise ScriptError(f"{path}: no such file. Give the path of a model script (.py).")
        if path.suffix != ".py":
            raise ScriptError(f"{path}: a model script must be a .py file.")
        try:
            source = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ScriptError(f"{path}: not UTF-8 text ({exc}).") from exc
        return cls(filename=str(path), source=source)

    def load_module(self) -> types.ModuleType:
        """Execute the script as a fresh module. Tracebacks show its lines under ``filename``."""
        try:
            code = compile(self.source, self.filename, "exec")
        except SyntaxError as exc:
            raise ScriptError(
                f"{self.filename}, line {exc.lineno}: syntax error: {exc.msg}\n    {(exc.text or '').rstrip()}"
            ) from None
        module_name = "mpdiag_script_" + re.sub(r"\W", "_", Path(self.filename).stem)
        module = types.ModuleType(module_name)
        module.__file__ = self.filename
        linecache.cache[self.filename] = (len(self.source), None, self.source.splitlines(True), self.filename)
        sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
        with script_errors(self, "while importing"):
            exec(code, module.__dict__)
        return module


def script_traceback(exc: BaseException, filename: str) -> str:
    """The frames of ``exc``'s traceback that lie in the script, then the exception line."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == filename]
    lines = traceback.format_list(frames) if frames else []
    return "".join(lines) + "".join(traceback.format_exception_only(type(exc), exc))


class script_errors:
    """Context manager turning any exception from script code into a ScriptError with its traceback."""

    def __init__(self, script: ModelScript, where: str):
        self.script, self.where = script, where

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or isinstance(exc, ScriptError) or not isinstance(exc, Exception):
            return False
        raise ScriptError(
            f"{self.script.filename}: the script raised {exc_type.__name__} {self.where}:\n"
            + script_traceback(exc, self.script.filename)
        ) from exc
