"""Tests of the config-check executor.

    PYTHONPATH=/path/to/opservant/agent/python python -m pytest -q
    OPSERVANT_BIN=/path/to/target/release/opservant python -m pytest -q   # + the sandboxed test (root)
"""

import json
import os
import shutil
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
EXECUTOR_DIR = os.path.dirname(HERE)

try:
    import s4e_agent  # noqa: F401
except ImportError:  # running from the opservant repository without PYTHONPATH
    sys.path.insert(0, os.path.join(EXECUTOR_DIR, "..", "..", "agent", "python"))

from s4e_agent.testing import ExecutorTestHarness  # noqa: E402


def require_opservant_bin():
    """The sandboxed test runs only with OPSERVANT_BIN set; under CI=true its absence fails.
    Under `opservant executor test` (already inside a sandbox) it is skipped with the reason."""
    if os.environ.get("OPSERVANT_SANDBOXED_SKIP"):
        pytest.skip(os.environ["OPSERVANT_SANDBOXED_SKIP"])
    if not os.environ.get("OPSERVANT_BIN"):
        if os.environ.get("CI") in ("true", "1"):
            pytest.fail("CI=true but OPSERVANT_BIN is not set (e.g. OPSERVANT_BIN=target/release/opservant)")
        pytest.skip("set OPSERVANT_BIN=/path/to/opservant to run the sandboxed test")


@pytest.fixture
def harness():
    return ExecutorTestHarness(os.path.join(EXECUTOR_DIR, "manifest.json"))


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


KEYVALUE = """\
# a comment
listen_address = 127.0.0.1
port=8080
log_level: info
tls_enabled = true
url = http://example.org:8080/x
data_dir = "/var/lib/app"
not a key value line
port = 8081
"""

INI = """\
[DEFAULT]
timeout = 30

[server]
Port = 8080
host = 0.0.0.0
path = %(home)s/data

[db.primary]
name = app
"""

SSHD = """\
# an sshd_config excerpt
Include /etc/ssh/sshd_config.d/*.conf
Port 2222
PermitRootLogin prohibit-password
passwordauthentication no
AcceptEnv LANG LC_*
Subsystem\tsftp\t/usr/lib/openssh/sftp-server
Banner "/etc/issue.net"
ClientAliveInterval=300
MaxAuthTries = 3
Port 22
UsePAM

Match User alice
    PasswordAuthentication yes
    X11Forwarding yes
"""

LOGIN_DEFS = """\
#
# an /etc/login.defs excerpt
#
MAIL_DIR        /var/mail
ENV_PATH\tPATH=/usr/local/bin:/usr/bin:/bin
UMASK\t\t022
PASS_MAX_DAYS\t99999
UID_MIN\t\t\t 1000
ENCRYPT_METHOD SHA512
"""

JSON = {"port": 8080, "debug": False, "server": {"host": "0.0.0.0", "tls": {"enabled": True}},
        "users": [{"name": "alice"}], "ratio": 0.5, "a.b": "flat"}


def test_keyvalue(harness, tmp_path):
    path = write(tmp_path, "app.conf", KEYVALUE)
    result = harness.run(params={"path": path, "expected": {
        "listen_address": "127.0.0.1",
        "port": 8081,                     # the last occurrence wins; a number matches its text
        "log_level": "info",
        "tls_enabled": True,              # true matches the text "true"
        "url": "http://example.org:8080/x",
        "data_dir": "/var/lib/app",       # surrounding quotes removed
    }})
    assert result.status == "completed", result
    assert result.output == {"path": path, "format": "keyvalue", "checked": 6, "differences": [], "missing": [],
                             "compliant": True}
    assert [r["msg"] for r in result.logs] == ["checking configuration", "configuration checked"]


def test_ini(harness, tmp_path):
    path = write(tmp_path, "app.cfg", INI)
    result = harness.run(params={"path": path, "format": "auto", "expected": {
        "server.port": "8080",            # option names are case-insensitive in ini
        "server.Port": 8080,
        "server.host": "0.0.0.0",
        "server.path": "%(home)s/data",   # no interpolation: the raw text
        "server.timeout": 30,             # inherited from [DEFAULT]
        "DEFAULT.timeout": "30",
        "db.primary.name": "app",         # dotted section name
    }})
    assert result.status == "completed", result
    assert result.output["format"] == "ini"
    assert result.output["checked"] == 7
    assert result.output["differences"] == [] and result.output["missing"] == []


def test_json(harness, tmp_path):
    path = write(tmp_path, "app.json", json.dumps(JSON))
    result = harness.run(params={"path": path, "expected": {
        "port": 8080.0,
        "debug": False,
        "server.host": "0.0.0.0",
        "server.tls.enabled": True,
        "server.tls": {"enabled": True},
        "users.0.name": "alice",
        "ratio": 0.5,
        "a.b": "flat",                    # a top-level key with a dot wins over the path
    }})
    assert result.status == "completed", result
    assert result.output["format"] == "json"
    assert result.output["checked"] == 8


@pytest.mark.parametrize("name", ["sshd_config", "server.conf"])
def test_keyword_sshd_config(harness, tmp_path, name):
    """sshd_config: detected by its name or by its "Keyword value" lines."""
    path = write(tmp_path, name, SSHD)
    result = harness.run(params={"path": path, "expected": {
        "Port": 2222,                      # the first occurrence wins, as in sshd
        "PasswordAuthentication": "no",    # keywords are case-insensitive
        "permitrootlogin": "prohibit-password",
        "AcceptEnv": "LANG LC_*",
        "Subsystem": "sftp /usr/lib/openssh/sftp-server",  # whitespace runs collapsed
        "Banner": "/etc/issue.net",        # quotes removed
        "ClientAliveInterval": 300,        # Keyword=value
        "MaxAuthTries": "3",               # Keyword = value
        "Include": "/etc/ssh/sshd_config.d/*.conf",
    }})
    assert result.status == "completed", result
    assert result.output["format"] == "keyword"
    assert result.output["compliant"] is True
    assert result.output["checked"] == 9


def test_keyword_match_block_is_not_global(harness, tmp_path):
    path = write(tmp_path, "sshd_config", SSHD)
    result = harness.run(params={"path": path, "expected": {
        "PasswordAuthentication": "yes", "X11Forwarding": "yes", "UsePAM": "yes"}})
    assert result.status == "partial"
    assert result.output["differences"] == [{"key": "PasswordAuthentication", "expected": "yes", "actual": "no"}]
    assert result.output["missing"] == ["X11Forwarding", "UsePAM"]   # only under Match; no value
    assert result.output["compliant"] is False


def test_keyword_login_defs_detected_by_content(harness, tmp_path):
    path = write(tmp_path, "defaults", LOGIN_DEFS)
    result = harness.run(params={"path": path, "expected": {
        "ENV_PATH": "PATH=/usr/local/bin:/usr/bin:/bin",   # "=" inside the value
        "UMASK": "027",
        "PASS_MAX_DAYS": 99999,
        "UID_MIN": 1000,
    }})
    assert result.status == "partial"
    assert result.output == {
        "path": path,
        "format": "keyword",
        "checked": 4,
        "differences": [{"key": "UMASK", "expected": "027", "actual": "022"}],
        "missing": [],
        "compliant": False,
    }


def test_keyword_format_forced(harness, tmp_path):
    """A keyvalue-looking file read as keyword: the "=" after the key is sshd's optional one."""
    path = write(tmp_path, "app.conf", "port = 8080\nlog_level info\n")
    result = harness.run(params={"path": path, "format": "keyword", "expected": {"PORT": 8080, "log_level": "info"}})
    assert result.status == "completed", result
    assert result.output["format"] == "keyword"


def test_json_detected_by_content_and_types_are_kept(harness, tmp_path):
    path = write(tmp_path, "app.conf", json.dumps(JSON))
    result = harness.run(params={"path": path, "expected": {"debug": 0, "port": "8080", "ratio": "0.5"}})
    assert result.output["format"] == "json"
    # false is not 0; "8080" and "0.5" match the numbers as text.
    assert result.status == "partial"
    assert result.output["differences"] == [{"key": "debug", "expected": 0, "actual": False}]


def test_difference_and_missing_key(harness, tmp_path):
    path = write(tmp_path, "app.conf", KEYVALUE)
    result = harness.run(params={"path": path, "format": "keyvalue", "expected": {
        "log_level": "debug",
        "port": 8081,
        "max_connections": 100,
    }})
    assert result.status == "partial"
    assert result.error is None
    assert result.output == {
        "path": path,
        "format": "keyvalue",
        "checked": 3,
        "differences": [{"key": "log_level", "expected": "debug", "actual": "info"}],
        "missing": ["max_connections"],
        "compliant": False,
    }


def test_missing_key_alone_is_partial(harness, tmp_path):
    path = write(tmp_path, "app.ini", INI)
    result = harness.run(params={"path": path, "expected": {"server.port": 8080, "client.port": 1}})
    assert result.status == "partial"
    assert result.output["differences"] == []
    assert result.output["missing"] == ["client.port"]
    assert result.output["compliant"] is False


def test_forced_format_that_does_not_parse_fails(harness, tmp_path):
    path = write(tmp_path, "app.conf", KEYVALUE)
    result = harness.run(params={"path": path, "format": "json", "expected": {"port": 1}})
    assert result.status == "failed"
    assert result.error.startswith(f"cannot parse {path} as json: ")


def test_unreadable_file_fails_with_a_clear_error(harness, tmp_path):
    path = str(tmp_path / "does-not-exist.conf")
    result = harness.run(params={"path": path, "expected": {"port": 1}})
    assert result.status == "failed"
    assert result.error.startswith(f"cannot read {path}: No such file or directory (errno 2).")
    assert "permissions.filesystem.read" in result.error
    assert result.output == {"path": path}


def test_shipped_sample(harness):
    path = os.path.join(EXECUTOR_DIR, "sample", "app.conf")
    result = harness.run(params={"path": path, "expected": {"port": 8080, "log_level": "info"}})
    assert result.status == "completed", result
    assert result.output["format"] == "keyvalue"
    assert result.output["compliant"] is True


@pytest.mark.parametrize("params, message", [
    ({"expected": {"a": 1}}, "Missing required parameter: path"),
    ({"path": "", "expected": {"a": 1}}, "Missing required parameter: path"),
    ({"path": "relative/app.conf", "expected": {"a": 1}}, "path must be absolute"),
    ({"path": 42, "expected": {"a": 1}}, "Missing required parameter: path"),
    ({"path": "/etc/app.conf"}, "Missing required parameter: expected"),
    ({"path": "/etc/app.conf", "expected": ["a"]}, "Missing required parameter: expected"),
    ({"path": "/etc/app.conf", "expected": {"a": 1}, "format": "yaml"}, "format must be one of"),
])
def test_bad_params_are_rejected(harness, params, message):
    result = harness.run(params=params)
    assert result.status == "rejected"
    assert result.error.startswith(message), result.error


@pytest.fixture
def shared_tmp():
    """A temporary directory the sandbox can reach: the executor runs as an unprivileged user,
    and pytest's tmp_path lies under a 0700 directory."""
    import pathlib
    import tempfile

    path = tempfile.mkdtemp(prefix="opservant-config-check-")
    os.chmod(path, 0o755)
    try:
        yield pathlib.Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_sandboxed_declared_and_undeclared_paths(shared_tmp):
    """In the sandbox the declared directory is readable and an undeclared one is invisible.
    The package is copied so its manifest can declare this test's directory."""
    require_opservant_bin()
    tmp_path = shared_tmp
    package = tmp_path / "config-check"
    shutil.copytree(EXECUTOR_DIR, package, ignore=shutil.ignore_patterns("__pycache__", "tests", ".pytest_cache"))
    declared = tmp_path / "declared"
    declared.mkdir()
    (declared / "app.conf").write_text(KEYVALUE)
    hidden = tmp_path / "undeclared"
    hidden.mkdir()
    (hidden / "app.conf").write_text(KEYVALUE)
    manifest = json.loads((package / "manifest.json").read_text())
    manifest["permissions"]["filesystem"]["read"] = [str(declared)]
    (package / "manifest.json").write_text(json.dumps(manifest))
    harness = ExecutorTestHarness(str(package))

    ok = harness.run(params={"path": str(declared / "app.conf"), "expected": {"port": 8081, "log_level": "info"}},
                     sandboxed=True, timeout=120)
    assert ok.status == "completed", ok.raw
    assert ok.output["differences"] == [] and ok.output["checked"] == 2
    assert ok.raw["exit_code"] == 0

    refused = harness.run(params={"path": str(hidden / "app.conf"), "expected": {"port": 8081}},
                          sandboxed=True, timeout=120)
    assert refused.status == "failed", refused.raw
    assert refused.error.startswith(f"cannot read {hidden / 'app.conf'}: No such file or directory"), refused.error


def host_os_release_id():
    with open("/etc/os-release") as f:
        for line in f:
            if line.startswith("ID="):
                return line.split("=", 1)[1].strip().strip("\"'")
    return None


def test_sandboxed_shipped_manifest(harness):
    """The shipped manifest declares /etc/os-release (a symlink to ../usr/lib/os-release on
    Debian) and /etc/login.defs: both are read in the sandbox and give what they give in
    process; an undeclared /etc file does not exist there."""
    require_opservant_bin()
    for declared in ("/etc/os-release", "/etc/login.defs"):
        if not os.path.exists(declared):
            pytest.skip(f"{declared} does not exist on this host (the shipped manifest declares it)")

    os_id = host_os_release_id()
    params = {"path": "/etc/os-release", "expected": {"ID": os_id}}
    sandboxed = harness.run(params=params, sandboxed=True, action="act-config-check", timeout=120)
    assert sandboxed.status == "completed", sandboxed.raw
    assert sandboxed.output == harness.run(params=params).output
    assert sandboxed.output["format"] == "keyvalue" and sandboxed.output["compliant"] is True

    params = {"path": "/etc/login.defs", "expected": {"PASS_MAX_DAYS": "not-a-number", "UMASK": "022"}}
    sandboxed = harness.run(params=params, sandboxed=True, action="act-config-check", timeout=120)
    in_process = harness.run(params=params)
    assert sandboxed.status == in_process.status == "partial", sandboxed.raw
    assert sandboxed.output == in_process.output
    assert sandboxed.output["format"] == "keyword" and sandboxed.output["compliant"] is False
    assert sandboxed.raw["exit_code"] == 0 and sandboxed.raw["sandbox"]["network"] == "none"

    undeclared = next((p for p in ("/etc/debian_version", "/etc/hostname", "/etc/fstab") if os.path.isfile(p)), None)
    if undeclared:
        refused = harness.run(params={"path": undeclared, "expected": {"x": 1}}, sandboxed=True, timeout=120)
        assert refused.status == "failed", refused.raw
        assert refused.error.startswith(f"cannot read {undeclared}: No such file or directory"), refused.error
