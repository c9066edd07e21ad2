"""Bad credentials and unreachable endpoints, as a user meets them: the `appliance` command, one line on stderr
with the fix and a non-zero exit (fast tier: nothing listens where the clouds.yaml points)."""

import os
import socket
import subprocess
import sys


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_an_unreachable_keystone_is_one_short_line(tmp_path):
    """keystoneauth's own warning ("Failed to discover available identity versions ...") came first, and the
    error carried urllib3's whole chain (HTTPConnectionPool ... Max retries exceeded ... NewConnectionError)."""
    url = f"http://127.0.0.1:{_closed_port()}/v3"
    (tmp_path / "clouds.yaml").write_text(f"""clouds:
  dead:
    auth: {{auth_url: "{url}", username: u, password: p, project_name: x, user_domain_name: Default,
            project_domain_name: Default}}
    region_name: CHI@UC
    identity_api_version: 3
""")
    env = {**os.environ, "OS_CLIENT_CONFIG_FILE": str(tmp_path / "clouds.yaml"), "OS_CLOUD": "dead",
           "APPLIANCE_HOME": str(tmp_path / "home")}
    r = subprocess.run([sys.executable, "-m", "appliance.cli", "lease", "list", "--cloud", "chameleon"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: cannot reach Keystone at {url} for clouds.yaml entry 'dead' "
                               "(Connection refused)"), lines[0]
    assert "fix: check auth_url" in lines[0] and len(lines[0]) < 200, lines[0]
