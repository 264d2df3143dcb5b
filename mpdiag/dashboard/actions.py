"""Everything the dashboard does besides reading: keep an uploaded script or uploaded training code, and start
runs, reruns, watched runs, checks and probes, each in a child process through :mod:`mpdiag.sandbox`.

Owns the one rule that makes a page safe to load: nothing here executes code unless a user clicked for it in
this browser session, twice. :func:`confirmed` is a button that only arms a :class:`Pending` action; the action
runs when the user then confirms a panel that names the script and its SHA-256 (so a click forged through a
frame, or a stale form, starts nothing the user did not see). Page loads, query parameters and refreshes never
reach :func:`start_run`, :func:`start_rerun`, :func:`start_watch`, :func:`start_verify`, :func:`check_upload`,
:func:`check_code` or :func:`probe`. What a person says about a run (:func:`rename_run`, :func:`set_tags`, :func:`set_note`) is
written only on a click in this session, and :func:`delete_run` only on a second click confirming a panel that
names the run (:func:`confirmed_delete`).
This module must not import torch or train in this process: children do that.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import streamlit as st

from mpdiag.dashboard import verify_job
from mpdiag.options import watch_settings
from mpdiag.sandbox.bundle import Bundle, bundle_from_uploads, bundle_from_zip, check_bundle
from mpdiag.sandbox.bundle import BundleRefused as BundleRefused  # the Upload page shows its message
from mpdiag.sandbox.check import CheckReport, check_script
from mpdiag.sandbox.launch import Launched, launch, rerun_job, run_job, watch_job
from mpdiag.sandbox.launch import last_output_line as last_output_line  # a stalled run's last line
from mpdiag.sandbox.launch import limits_text as limits_text  # the pages state the limits of what they start
from mpdiag.sandbox.probe import run_probe
from mpdiag.sandbox.supervisor import STOP_GRACE_S as STOP_GRACE_S  # the Stop button says how long a run has
from mpdiag.store import Store, StoreWriter

MAX_UPLOAD_BYTES = 1_000_000  # a single model script; server.maxUploadSize (20 MB) is for zips of training code
_LAUNCHED = "launched"  # session key: [(Launched, what)] started by this session


class UploadRefused(ValueError):
    """An uploaded file that is not a UTF-8 .py file within MAX_UPLOAD_BYTES; the message says which."""


@dataclass(frozen=True)
class Pending:
    """An action waiting for its confirmation: what it does, to which script, with which options."""

    what: str
    script_name: str
    script_sha256: str
    options: tuple[tuple[str, object], ...] = ()
    #: what runs, in lines, where it is not one stored script named by its hash (a watched run's command)
    source: tuple[str, ...] = ()
    #: whether confirming runs the code (False: an uploaded bundle's check, which compiles and reads it only; its
    #: confirmation said "this runs the script below as Python", and a user took the check for a run)
    runs_code: bool = True

    def text(self) -> str:
        lines = [self.what, *(self.source or (f"script: {self.script_name}", f"sha256: {self.script_sha256}"))]
        lines += [f"{k.replace('_', '-')}: {v}" for k, v in self.options if v is not None and v is not False and v != ""]
        return "\n".join(lines)


def pending(what: str, script_name: str, script_sha256: str, options: dict | None = None,
            runs_code: bool = True) -> Pending:
    return Pending(what, script_name, script_sha256, tuple(sorted((options or {}).items())), runs_code=runs_code)


def rerun_pending(what: str, run, options: dict | None = None) -> Pending:
    """The pending rerun of ``run`` (a Store.runs row) with ``options``: its stored script by name and hash; a
    watched run has none (its hash is empty), so the panel says what runs instead: the command as it was, from its
    folder, on the script file as it is now, or on the training code uploaded with it (that bundle's hash)."""
    watched = watch_settings(run["config"])
    sha = run["script_sha256"] if isinstance(run["script_sha256"], str) and run["script_sha256"] else None
    name = run["script_path"] if isinstance(run["script_path"], str) and run["script_path"] else str(run["name"])
    if watched is None or sha is not None:
        return Pending(what, name, sha or "none stored", tuple(sorted((options or {}).items())))
    command = "python " + " ".join(str(a) for a in watched.get("argv") or [])
    if watched.get("bundle"):
        source = (f"command: {command} (as it was watched)", "on: the training code uploaded with it",
                  f"sha256: {watched['bundle']}")
    else:
        source = (f"command: {command} (as it was watched)", f"from: {watched.get('cwd')}",
                  "script: the file as it is now (a watched run keeps no copy, so there is no hash to show)")
    return Pending(what, name, watched.get("bundle") or "", tuple(sorted((options or {}).items())), source)


def confirmed(label: str, key: str, action: Pending, **button_args) -> bool:
    """A button that arms ``action``; True only on the run where the user confirms it in the panel shown
    below the button (script name and hash included). Changing the form after arming drops the action."""
    armed_key = f"pending:{key}"
    if st.button(label, key=key, **button_args):
        st.session_state[armed_key] = action
    armed = st.session_state.get(armed_key)
    if armed is None:
        return False
    if armed != action:
        del st.session_state[armed_key]
        return False
    panel = st.empty()
    with panel.container(border=True):
        st.markdown("**Confirm:** this runs the script below as Python, in a child process." if armed.runs_code else
                    "**Confirm:** this compiles and reads the code below in a child process; nothing of it runs.")
        st.text(armed.text())
        yes, no = st.columns(2)
        go = yes.button("Confirm", key=f"{key}_confirm", type="primary")
        stop = no.button("Cancel", key=f"{key}_cancel")
    if go or stop:
        del st.session_state[armed_key]
        panel.empty()  # answered: gone at once, not left on the page while the action runs and after
    return go


def script_sha256(path: str | Path) -> str:
    """SHA-256 of a script file's text, as the store keys stored scripts."""
    return hashlib.sha256(Path(path).read_text(encoding="utf-8").encode()).hexdigest()


def safe_filename(name: str) -> str:
    """A display name for an uploaded file: its base name only, limited characters, ending in .py."""
    base = re.sub(r"[^A-Za-z0-9._-]", "_", name.replace("\\", "/").rsplit("/", 1)[-1])[:80] or "uploaded"
    return base if base.endswith(".py") else base + ".py"


def store_upload(store: Store, name: str, data: bytes) -> tuple[str, str]:
    """Keep an uploaded script in the store under its content hash: (safe file name, sha256). Raises
    UploadRefused for anything but a UTF-8 .py file of at most MAX_UPLOAD_BYTES. Nothing is executed."""
    filename = safe_filename(name)
    if not name.endswith(".py"):
        raise UploadRefused(f"{filename}: only .py files are accepted.")
    if len(data) > MAX_UPLOAD_BYTES:
        raise UploadRefused(f"{filename} is {len(data):,} bytes; the limit is {MAX_UPLOAD_BYTES:,}.")
    try:
        source = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UploadRefused(f"{filename} is not UTF-8 text.") from None
    with StoreWriter(store.path) as writer:
        return filename, writer.add_script(filename, source)


def store_code(store: Store, uploads: list[tuple[str, bytes]]) -> tuple[Bundle, str]:
    """Keep uploaded training code (several files, or one .zip) in the store: (the bundle, its sha256). Raises
    BundleRefused saying what is wrong. Nothing is executed."""
    bundle = bundle_from_uploads(uploads)
    with StoreWriter(store.path) as writer:
        return bundle, writer.add_bundle(bundle.name, bundle.to_zip())


def stored_code(store: Store, sha256: str) -> Bundle:
    """Stored uploaded training code, unpacked (in memory; nothing is executed)."""
    return bundle_from_zip(*store.bundle(sha256))


def check_code(bundle: Bundle, entry: str, args: list[str], module: bool) -> CheckReport:
    """Compile uploaded code and read its entry point, in a supervised child (blocks until it ends)."""
    return check_bundle(bundle, entry, args, module)


def start_watch(store: Store, sha256: str, entry: str, args: list[str], module: bool, options: dict,
                what: str) -> Launched:
    """A supervised, watched run of stored uploaded code: ``python [-m] ENTRY ARGS`` from its root."""
    return _started(launch(watch_job(sha256, entry, args, module, options), store.path), what)


def _started(proc: Launched, what: str) -> Launched:
    st.session_state.setdefault(_LAUNCHED, []).append((proc, what))
    return proc


def start_run(store: Store, script: str, options: dict, what: str) -> Launched:
    """A new supervised run of ``script`` (a path, or ``sha256:HASH`` of a stored script)."""
    return _started(launch(run_job(script, options), store.path), what)


def start_rerun(store: Store, run_id: int, options: dict, what: str) -> Launched:
    """A supervised rerun of a stored run's script with ``options`` overridden."""
    return _started(launch(rerun_job(int(run_id), options), store.path), what)


def start_verify(store: Store, run_id: int, first: int, first_modules: str, what: str) -> Launched:
    """The whole verification of a run's plan in the background (mpdiag.dashboard.verify_job): from round
    ``first`` (whose plan runs ``first_modules``), each round a supervised rerun, promotions in between."""
    return _started(verify_job.start(store.path, int(run_id), first, first_modules), what)


def verification(run_id: int) -> Launched | None:
    """The newest verification of run ``run_id``'s plan this browser session started, or None."""
    mine = [proc for proc, _ in launched() if proc.job.get("kind") == "verify" and proc.job.get("run_id") == int(run_id)]
    return mine[-1] if mine else None


def launched() -> list[tuple[Launched, str]]:
    """The processes this browser session started, oldest first, with what each is."""
    return list(st.session_state.get(_LAUNCHED, []))


def stop(proc: Launched) -> None:
    """Stop a process this session started (its Stop button): its run ends itself on a SIGTERM, the signal
    named, with what it recorded kept; a verification stops its rerun and starts no further round."""
    proc.request_stop()


def check_upload(filename: str, source: str) -> CheckReport:
    """Static warnings and a trial step of a script, in a supervised child (blocks until it ends)."""
    return check_script(filename, source, device="auto")


def _check_key(store: Store, subject: str) -> str:
    return f"check:{store.path}:{subject}"


def remember_check(store: Store, subject: str, report: CheckReport) -> None:
    """Keep a check verdict for this session: ``subject`` is a stored script's sha256 (the Upload page checks;
    the home page asks), or what names a command of uploaded code (sha256, entry, arguments)."""
    st.session_state[_check_key(store, subject)] = report


def check_verdict(store: Store, subject: str) -> CheckReport | None:
    """This session's check of ``subject``, or None when it was not checked in this session."""
    return st.session_state.get(_check_key(store, subject))


def probe(store: Store, run_id: int) -> dict:
    """The scale-linearity probe of a stored run, in a supervised child; its result is stored with the run."""
    return run_probe(store.path, int(run_id))


def rename_run(store: Store, run_id: int, name: str) -> str:
    """Rename a run (the store's rules: RunTextRefused says what is wrong); returns the name stored."""
    with StoreWriter(store.path) as writer:
        return writer.rename_run(int(run_id), name)


def set_tags(store: Store, run_id: int, tags: list[str]) -> list[str]:
    """Make a run's tags exactly ``tags``; returns them as stored."""
    with StoreWriter(store.path) as writer:
        return writer.set_tags(int(run_id), tags)


def set_note(store: Store, run_id: int, note: str) -> str:
    """Store a person's note with a run ("" clears it); returns it as stored."""
    with StoreWriter(store.path) as writer:
        return writer.set_user_note(int(run_id), note)


def delete_run(store: Store, run_id: int) -> dict[str, int]:
    """Delete a run's rows from every table (RunBusy while its process still runs); rows deleted per table."""
    with StoreWriter(store.path) as writer:
        return writer.delete_run(int(run_id))


def confirmed_delete(label: str, key: str, run_id: int, what: str, **button_args) -> bool:
    """A button that asks to delete run ``run_id``; True only on the run where the user then clicks Delete in
    the panel that names it (``what``, shown as text). Choosing another run drops the request."""
    armed_key = f"pending:{key}"
    if st.button(label, key=key, **button_args):
        st.session_state[armed_key] = int(run_id)
    if st.session_state.get(armed_key) is None:
        return False
    if st.session_state[armed_key] != int(run_id):
        del st.session_state[armed_key]
        return False
    panel = st.empty()
    with panel.container(border=True):
        st.markdown("**Delete this run?** Its steps, tensor statistics and every other row recorded for it are "
                    "removed from the store; stored scripts and other runs stay. This cannot be undone.")
        st.text(what)
        yes, no = st.columns(2)
        go = yes.button("Delete", key=f"{key}_confirm", type="primary")
        stop = no.button("Cancel", key=f"{key}_cancel")
    if go or stop:
        del st.session_state[armed_key]
        panel.empty()
    return go
