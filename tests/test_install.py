"""`pip install .` in a fresh venv: `import mpdiag`, the `mpdiag` command, and `mpdiag dashboard` serving the app
from where pip put it. The dependencies come from this environment through a .pth file (CI has no second copy
of torch to install, and what is checked here is mpdiag's own packaging)."""

import os
import shutil
import subprocess
import sys
import sysconfig
import urllib.request
from pathlib import Path

import pytest
from conftest import EXAMPLES, ROOT
from test_browser import free_port, serving

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv holding mpdiag installed from a copy of the checkout (so nothing is written into it)."""
    base = tmp_path_factory.mktemp("install")
    source = base / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "artifacts", "__pycache__", "*.db*",
                                                                 "build", "*.egg-info", ".pytest_cache"))
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # this environment's pip and setuptools (through the .pth), run by the new venv's interpreter
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                           "--no-build-isolation", str(source)], capture_output=True, text=True, cwd=base)
    assert done.returncode == 0, done.stderr[-3000:]
    shutil.rmtree(source)  # the installed copy must not need the checkout
    return venv


def test_installed_package_command_and_run(installed, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MPDIAG_STORE")}
    where = subprocess.run([str(installed / "bin" / "python"), "-c", "import mpdiag; print(mpdiag.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env=env, check=True).stdout
    assert where.startswith(str(installed))
    mpdiag = str(installed / "bin" / "mpdiag")
    assert "dashboard" in subprocess.run([mpdiag, "--help"], capture_output=True, text=True, env=env).stdout
    done = subprocess.run([mpdiag, "run", str(EXAMPLES / "mlp_digits.py"), "--steps", "2", "--device", "cpu",
                           "--store", "runs.db"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0 and "finished, 2 steps" in done.stdout, done.stderr[-2000:]


def test_installed_dashboard_serves_the_app_on_the_callers_store(installed, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MPDIAG_STORE")}
    port = free_port()
    server = subprocess.Popen([str(installed / "bin" / "mpdiag"), "dashboard", "--port", str(port), "--store", "my.db"],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        if not serving(f"http://127.0.0.1:{port}", 90):
            pytest.fail("mpdiag dashboard did not start")
        pages = urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/host-config", timeout=5).status
        assert pages == 200
    finally:
        os.killpg(server.pid, 15)
        output = server.communicate(timeout=30)[0]
    assert f"store {tmp_path / 'my.db'}" in output  # resolved in the caller's directory, not the app's
    assert f"app {installed / 'share' / 'mpdiag'}" in output  # the files pip installed, not a checkout


def test_editable_install_runs_the_checkout_it_points_at(tmp_path):
    """`pip install -e .`: import mpdiag and the `mpdiag` command resolve to the source tree (an edit there is
    what runs), and `mpdiag dashboard` serves that tree's app.py and pages/."""
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "artifacts", "__pycache__", "*.db*",
                                                                "build", "*.egg-info", ".pytest_cache", "bench"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                           "--no-build-isolation", "-e", str(source)], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MPDIAG_STORE")}
    where = subprocess.run([str(python), "-c", "import mpdiag; print(mpdiag.__file__)"], capture_output=True,
                           text=True, cwd=tmp_path, env=env, check=True).stdout.strip()
    assert where == str(source / "mpdiag" / "__init__.py")
    (source / "mpdiag" / "cli.py").write_text((source / "mpdiag" / "cli.py").read_text().replace(
        'help="run an unmodified training script', 'help="EDITED run an unmodified training script'))
    assert "EDITED" in subprocess.run([str(venv / "bin" / "mpdiag"), "--help"], capture_output=True, text=True,
                                      env=env).stdout  # the edit is what runs
    port = free_port()
    server = subprocess.Popen([str(venv / "bin" / "mpdiag"), "dashboard", "--port", str(port), "--store", "e.db"],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        if not serving(f"http://127.0.0.1:{port}", 90):
            pytest.fail("mpdiag dashboard did not start")
    finally:
        os.killpg(server.pid, 15)
        output = server.communicate(timeout=30)[0]
    assert f"app {source}" in output  # the checkout's app.py and pages/, not a copy
