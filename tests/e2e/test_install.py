"""`pip install .` in a fresh venv: `import mpdiag`, the `mpdiag` command, and `mpdiag dashboard` serving the app
from where pip put it; `pip install -e .`; and the README's own install command followed by what a user then does in
their own project's directory (the watch example the README and docs/watch.md give). The dependencies come from
this environment through a .pth file (CI has no second copy of torch to install, and what is checked here is
mpdiag's own packaging)."""

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from browser_helpers import free_port, serving
from conftest import EXAMPLES, ROOT

pytestmark = pytest.mark.slow

NOT_COPIED = (".venv", ".git", "artifacts", "__pycache__", "*.db*", "build", "*.egg-info", ".pytest_cache")


def copy_checkout(destination: Path, *also_not: str) -> Path:
    """A copy of the checkout (so installing from it writes nothing into this one)."""
    shutil.copytree(ROOT, destination, ignore=shutil.ignore_patterns(*NOT_COPIED, *also_not))
    return destination


def copy_jit_cache(checkout: Path) -> None:
    """numba's cache of mpdiag's compiled CPU kernels (``*.nbi``/``*.nbc`` in ``__pycache__``, which
    :func:`copy_checkout` leaves out), copied from this checkout where a test has filled it: without it the copy's
    first run compiles them again, ~7 s of CPU. Valid in the copy: numba checks the source file's modification time
    and size, which the copy keeps. A cold cache's first run in an installed package is
    test_installed_package_command_and_run's (pip writes new files: no cache of this checkout's is valid there)."""
    for cached in [*ROOT.glob("mpdiag/**/__pycache__/*.nbi"), *ROOT.glob("mpdiag/**/__pycache__/*.nbc")]:
        target = checkout / cached.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(cached, target)


def fresh_venv(folder: Path) -> Path:
    """A new venv without mpdiag whose interpreter also imports from this one's site-packages folders (the
    dependencies, torch included, without a second copy); returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # only site-packages folders: sys.path here also holds the checkout (conftest), which would hide what pip did
    folders = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    Path(site, "dependencies.pth").write_text("".join(f"{p}\n" for p in folders))
    return python


def pip_into(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """This environment's pip (and setuptools, through the .pth) installing into the venv of ``python``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "pip", "--python", str(python), *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=600)


def clean_env(**extra: str) -> dict:
    return {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MPDIAG_STORE")}, **extra}


def readme_section(heading: str, page: str = "README.md") -> tuple[str, list[list[str]]]:
    """The ``#``/``##`` ``heading`` section of README.md (or of another markdown page, e.g. docs/watch.md): its
    prose before the first ```bash block, and that block's commands."""
    lines = (ROOT / page).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line in (f"# {heading}", f"## {heading}")) + 1
    in_code, end = False, len(lines)
    for i in range(start, len(lines)):  # up to the next heading of level 1 or 2 (a `# comment` in code is none)
        in_code ^= lines[i].startswith("```")
        if not in_code and lines[i].startswith(("# ", "## ")):
            end = i
            break
    section = "\n".join(lines[start:end]) + "\n"
    prose, rest = section.split("```bash\n", 1)
    commands = [shlex.split(line, comments=True) for line in rest.split("```", 1)[0].splitlines()]
    return prose, [command for command in commands if command]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv holding mpdiag installed from a copy of the checkout (so nothing is written into it)."""
    base = tmp_path_factory.mktemp("install")
    source = copy_checkout(base / "source")
    venv = base / "venv"
    done = pip_into(fresh_venv(venv), "install", "-q", "--no-deps", "--no-build-isolation", str(source), cwd=base)
    assert done.returncode == 0, done.stderr[-3000:]
    shutil.rmtree(source)  # the installed copy must not need the checkout
    return venv


def test_installed_package_command_and_run(installed, tmp_path):
    env = clean_env()
    where = subprocess.run([str(installed / "bin" / "python"), "-c", "import mpdiag; print(mpdiag.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env=env, check=True).stdout
    assert where.startswith(str(installed))
    mpdiag = str(installed / "bin" / "mpdiag")
    assert "dashboard" in subprocess.run([mpdiag, "--help"], capture_output=True, text=True, env=env).stdout
    done = subprocess.run([mpdiag, "run", str(EXAMPLES / "mlp_digits.py"), "--steps", "2", "--device", "cpu",
                           "--store", "runs.db"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0 and "finished, 2 steps" in done.stdout, done.stderr[-2000:]


def dashboard_output(mpdiag: Path, cwd: Path, env: dict, *args: str) -> str:
    """Start ``mpdiag dashboard`` on a free port in ``cwd``, wait for it to answer over HTTP, stop it with a SIGTERM
    to the command alone (as a service manager or ``kill PID`` does): the server must stop with it (it outlived the
    command, serving on). Its output."""
    port = free_port()
    server = subprocess.Popen([str(mpdiag), "dashboard", "--port", str(port), *args], cwd=cwd, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        if not serving(f"http://127.0.0.1:{port}", 90):
            pytest.fail("mpdiag dashboard did not start")
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).status == 200
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/host-config", timeout=5).status == 200
        server.send_signal(signal.SIGTERM)
        output = server.communicate(timeout=30)[0]
        with pytest.raises(OSError):  # nothing answers on the port once the command has stopped
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)  # whatever is left of its session
        server.wait()
    return output


def test_installed_dashboard_serves_the_app_on_the_callers_store(installed, tmp_path):
    output = dashboard_output(installed / "bin" / "mpdiag", tmp_path, clean_env(), "--store", "my.db")
    assert f"store {tmp_path / 'my.db'}" in output  # resolved in the caller's directory, not the app's
    assert f"app {installed / 'share' / 'mpdiag'}" in output  # the files pip installed, not a checkout
    # the reference the code's comments point to ships beside the app
    assert {p.name for p in (installed / "share" / "mpdiag" / "docs").glob("*.md")} == \
        {p.name for p in (ROOT / "docs").glob("*.md")}


def test_editable_install_runs_the_checkout_it_points_at(tmp_path):
    """`pip install -e .`: import mpdiag and the `mpdiag` command resolve to the source tree (an edit there is
    what runs), and `mpdiag dashboard` serves that tree's app.py and pages/."""
    source = copy_checkout(tmp_path / "source", "bench")
    venv = tmp_path / "venv"
    python = fresh_venv(venv)
    done = pip_into(python, "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(source), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    env = clean_env()
    where = subprocess.run([str(python), "-c", "import mpdiag; print(mpdiag.__file__)"], capture_output=True,
                           text=True, cwd=tmp_path, env=env, check=True).stdout.strip()
    assert where == str(source / "mpdiag" / "__init__.py")
    (source / "mpdiag" / "cli.py").write_text((source / "mpdiag" / "cli.py").read_text().replace(
        'help="run an unmodified training script', 'help="EDITED run an unmodified training script'))
    assert "EDITED" in subprocess.run([str(venv / "bin" / "mpdiag"), "--help"], capture_output=True, text=True,
                                      env=env).stdout  # the edit is what runs
    output = dashboard_output(venv / "bin" / "mpdiag", tmp_path, env, "--store", "e.db")
    assert f"app {source}" in output  # the checkout's app.py and pages/, not a copy


TRAIN = """\
import argparse

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--batch-size", type=int, default=8)
args = parser.parse_args()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
for step in range(3):
    x = torch.randn(args.batch_size, 8)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(f"trained with lr {args.lr} and batch size {args.batch_size}")
"""


def test_readme_install_then_mpdiag_in_another_directory(tmp_path):
    """What a user does (issue 32): the Quick start's install command, as README.md writes it, in a fresh venv
    from the checkout; then, in their own project's directory outside the checkout, the watch section's commands
    (README.md's, which docs/watch.md repeats) on their training script, `mpdiag diagnose` and `mpdiag dashboard`
    (same store, the checkout's app)."""
    _, quick_start = readme_section("Quick start")
    first = quick_start[0]
    install = first[:first.index("&&")] if "&&" in first else first  # the first command's first part
    assert install[:2] == ["pip", "install"], quick_start[0]
    watch_prose, watch_section = readme_section("Diagnose your own training script")
    assert f"`{shlex.join(install)}`" in watch_prose  # the watch section says what must be installed
    watch_line = next(c for c in watch_section if c[:4] == ["python", "-m", "mpdiag", "watch"])
    diagnose_line = next(c for c in watch_section if c[:4] == ["python", "-m", "mpdiag", "diagnose"])
    assert watch_line[4] == "train.py" and diagnose_line[4:] == ["1"], (watch_line, diagnose_line)
    # the reference (docs/watch.md) says the same: the same install first, and the README's commands among its own
    docs_prose, docs_section = readme_section("Diagnose your own training script", "docs/watch.md")
    assert f"`{shlex.join(install)}`" in docs_prose
    assert watch_line in docs_section and diagnose_line in docs_section, docs_section

    source = copy_checkout(tmp_path / "checkout")
    copy_jit_cache(source)
    venv = tmp_path / "venv"
    python = fresh_venv(venv)
    # `pip install ...` as written, run by this environment's pip for the new venv (which has no pip of its own)
    done = pip_into(python, *install[1:], cwd=source)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]

    project = tmp_path / "myproject"  # the user's own project, outside the checkout
    project.mkdir()
    (project / "train.py").write_text(TRAIN)
    env = clean_env(PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", VIRTUAL_ENV=str(venv))

    def run(command: list[str]) -> subprocess.CompletedProcess:
        executable = shutil.which(command[0], path=env["PATH"])
        assert executable and Path(executable).parent == venv / "bin", command  # the venv's python and mpdiag
        return subprocess.run([executable, *command[1:]], capture_output=True, text=True, cwd=project, env=env,
                              timeout=300)

    imported = run(["python", "-c", "import mpdiag; from mpdiag import Recorder; print(mpdiag.__file__)"])
    assert imported.stdout.strip() == str(source / "mpdiag" / "__init__.py"), imported.stderr[-2000:]
    store = project / "mpdiag_runs.db"  # the store's default: ./mpdiag_runs.db where the command runs
    for run_id, command in ((1, watch_line), (2, ["mpdiag", *watch_line[3:]])):  # python -m mpdiag, then mpdiag
        watched = run(command)
        assert watched.returncode == 0, watched.stdout[-2000:] + watched.stderr[-3000:]
        assert "trained with lr 0.0003 and batch size 32" in watched.stdout  # the script's own arguments
        assert f"run {run_id} (" in watched.stderr and f"finished, 3 steps, 0 skipped, into {store}" in watched.stderr
    for command in (diagnose_line, ["mpdiag", "diagnose", "2"]):
        diagnosed = run(command)
        assert diagnosed.returncode == 0 and diagnosed.stdout.strip(), diagnosed.stderr[-3000:]

    output = dashboard_output(venv / "bin" / "mpdiag", project, env)
    assert f"store {store}" in output and f"app {source}" in output  # the watched runs, the checkout's app
