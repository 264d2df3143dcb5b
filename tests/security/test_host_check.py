"""Host check: a session whose request Host is not loopback or a name in MPDIAG_ALLOWED_HOSTS gets no data.

The rule is tested directly, then on every page under AppTest with the session's Host replaced (AppTest sends
no request headers, so frame.request_host is patched); tests/e2e/test_browser.py checks a real browser that reaches
the server under a foreign name (DNS rebinding).
"""

import pytest
from conftest import ROOT
from streamlit.testing.v1 import AppTest

from mpdiag.dashboard import frame
from mpdiag.dashboard.untrusted import host_allowed

PAGES = ["app.py", "pages/1_Gradients.py", "pages/2_Loss_scale.py", "pages/3_Compare.py", "pages/4_Upload.py",
         "pages/5_Findings.py", "pages/6_FP8.py"]


@pytest.mark.parametrize("host", ["localhost", "localhost:8501", "127.0.0.1:8501", "[::1]:8501", "LOCALHOST."])
def test_loopback_hosts_are_allowed(host, monkeypatch):
    monkeypatch.delenv("MPDIAG_ALLOWED_HOSTS", raising=False)
    assert host_allowed(host)


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8501", "localhost.evil.example", "127.0.0.1.nip.io",
                                  "user@localhost", "localhost:notaport", "localhost/path", ""])
def test_other_hosts_are_refused(host, monkeypatch):
    monkeypatch.delenv("MPDIAG_ALLOWED_HOSTS", raising=False)
    assert not host_allowed(host)


def test_configured_names_and_subdomain_patterns_are_allowed(monkeypatch):
    monkeypatch.setenv("MPDIAG_ALLOWED_HOSTS", "mpdiag.lab.example, *.corp.example")
    assert host_allowed("mpdiag.lab.example:443") and host_allowed("gpu1.corp.example")
    assert not host_allowed("lab.example") and not host_allowed("corp.example.evil")


@pytest.mark.parametrize("page", PAGES)
def test_a_session_under_a_foreign_host_gets_no_data(page, tmp_path, monkeypatch):
    monkeypatch.delenv("MPDIAG_ALLOWED_HOSTS", raising=False)
    monkeypatch.setenv("MPDIAG_STORE", str(tmp_path / "runs.db"))
    monkeypatch.setattr(frame, "request_host", lambda: "evil.example:8501")
    at = AppTest.from_file(str(ROOT / page), default_timeout=30).run()
    assert not at.exception
    assert [e.value for e in at.error] == [at.error[0].value] and "not served under this host name" in at.error[0].value
    assert not at.sidebar.selectbox and not at.dataframe and not at.button  # no store, no runs, no actions
    assert not (tmp_path / "runs.db").exists()  # not even the store was opened
