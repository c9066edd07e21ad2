"""What a testbed node's system looks like, as a Chameleon node booted from a CC image: its sshd's configuration
(OpenSSH's limits, as the distribution ships them), the image's default login user as cloud-init makes it, and the
root home a non-root user needs to reach this machine's Python. Used by netns.py as it starts a node."""

from __future__ import annotations

import os
import shlex
import shutil
import stat
from pathlib import Path

from ..errors import ApplianceError


def sshd_config(node) -> str:
    d = node.dir
    return "\n".join([
        "ListenAddress 0.0.0.0",  # every address of the node: its fixed IP and a floating IP
        "Port 22",
        f"HostKey {d}/etc-ssh/ssh_host_ed25519_key",
        f"PidFile {d}/sshd.pid",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "AuthorizedKeysFile .ssh/authorized_keys",
        # A Chameleon node's sshd limits, as OpenSSH ships them: ChameleonCloud/CC-Images leaves sshd_config to the
        # distribution, whose file keeps OpenSSH's defaults (sshd_config(5): MaxStartups 10:30:100, MaxSessions 10).
        # (This testbed had 200:30:400 and 100, under which a launcher that needs more would pass here and fail there.)
        "MaxStartups 10:30:100",
        "MaxSessions 10",
        "ClientAliveInterval 5",
        "ClientAliveCountMax 3",
        "Subsystem sftp internal-sftp",
        "",
    ])


DEFAULT_UID = 1000  # CC images' cc (ChameleonCloud/CC-Images elements/cc-common/.../92_chi_default_user.cfg)
# cloud-init's DISABLE_USER_OPTS (cloudinit/ssh_util.py), put before root's keys when disable_root is true (the
# default: cloudinit/config/cc_ssh.py apply_credentials): a login as root prints this, waits and exits 142
DISABLE_ROOT_OPTS = ("no-port-forwarding,no-agent-forwarding,no-X11-forwarding,command=\"echo 'Please login as the "
                     "user \\\"{user}\\\" rather than the user \\\"root\\\".';echo;sleep 10;exit 142\"")


def default_user(d: Path, user: str, authorized_keys: str) -> str:
    """Make ``user`` on a node as cloud-init makes a CC image's default user (92_chi_default_user.cfg: uid 1000,
    sudo ``ALL=(ALL) NOPASSWD:ALL``, shell bash, password locked) and puts the key pair in its authorized_keys,
    root's keys behind DISABLE_ROOT_OPTS. Nodes share this machine's /etc, so the node gets its own copies of
    passwd, group, shadow and sudoers.d and its own /home, bind-mounted in its mount namespace; returns the mount
    commands for the node's boot script. The host's users with the default user's uid or gid are left out of the
    node's copies (another machine's users). Password field ``*`` rather than cloud-init's ``!``: the testbed's sshd
    runs without PAM, and OpenSSH then refuses any login to an account whose password starts with ``!``."""
    if not shutil.which("sudo"):
        raise ApplianceError(f"testbed: a node with login user {user} needs sudo, and this machine has none",
                             "install it: `apt-get install sudo` (make install does)")
    uid = gid = DEFAULT_UID
    etc = d / "etc"
    etc.mkdir(exist_ok=True)

    def keep(line: str, idx: int) -> bool:
        f = line.split(":")
        return bool(line.strip()) and f[0] != user and not (len(f) > idx and f[idx] == str(uid))

    passwd = [x for x in Path("/etc/passwd").read_text().splitlines() if keep(x, 2)]
    group = [x for x in Path("/etc/group").read_text().splitlines() if keep(x, 2)]
    names = {x.split(":")[0] for x in passwd}
    shadow = [x for x in Path("/etc/shadow").read_text().splitlines() if x.split(":")[0] in names]
    gecos = "Chameleon Cloud User"
    (etc / "passwd").write_text("\n".join(passwd + [f"{user}:x:{uid}:{gid}:{gecos}:/home/{user}:/bin/bash"]) + "\n")
    (etc / "group").write_text("\n".join(group + [f"{user}:x:{gid}:"]) + "\n")
    (etc / "shadow").write_text("\n".join(shadow + [f"{user}:*:19000:0:99999:7:::"]) + "\n")
    os.chmod(etc / "shadow", 0o640)
    sudoers = etc / "sudoers.d"
    if sudoers.exists():
        shutil.rmtree(sudoers)
    if Path("/etc/sudoers.d").is_dir():
        shutil.copytree("/etc/sudoers.d", sudoers)
    else:
        sudoers.mkdir()
    # cloud-init's distros/__init__.py write_sudo_rules: /etc/sudoers.d/90-cloud-init-users, mode 0440
    rules = sudoers / "90-cloud-init-users"
    rules.write_text(f"# Created by cloud-init\n\n# User rules for {user}\n{user} ALL=(ALL) NOPASSWD:ALL\n")
    os.chmod(rules, 0o440)
    home = d / "home" / user
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    (home / ".ssh" / "authorized_keys").write_text(authorized_keys)
    for p, mode in ((home, 0o750), (home / ".ssh", 0o700), (home / ".ssh" / "authorized_keys", 0o600)):
        os.chown(p, uid, gid)
        os.chmod(p, mode)
    opts = DISABLE_ROOT_OPTS.format(user=user)
    (d / "ssh" / "authorized_keys").write_text(
        "".join(f"{opts} {k}\n" for k in authorized_keys.splitlines() if k.strip()))
    return "".join(f"mount --bind {etc}/{f} /etc/{f} && " for f in ("passwd", "group", "shadow", "sudoers.d")) + \
        f"mount --bind {d}/home /home && "


def root_home_for(d: Path, root_home: Path) -> str:
    """A node whose login user is not root still runs this machine's Python (the launcher's interpreter, its venv,
    the local wheelhouse), and here that may live under root's home, which is 0700 (pyenv installs there). Such a
    node gets a root home of its own, 0711 rather than 0700, where the host's root-home directories are bind-mounted
    (the node's own .ssh goes on top): the login user can reach the shared software, as it reaches
    /opt/appliance/venv on the appliance image, and reads only what is world-readable there. Returns the mount
    commands (a recursive bind, so the directories bound into it come along)."""
    rh = d / "roothome"
    rh.mkdir(exist_ok=True)
    os.chmod(rh, 0o711)
    cmds = []
    for entry in sorted(root_home.iterdir()):
        if entry.is_dir() and not entry.is_symlink() and entry.name != ".ssh":
            (rh / entry.name).mkdir(exist_ok=True)
            cmds.append(f"mount --bind {shlex.quote(str(entry))} {shlex.quote(str(rh / entry.name))}")
    (rh / ".ssh").mkdir(exist_ok=True)
    cmds.append(f"mount --rbind {rh} {root_home}")
    return "".join(f"{c} && " for c in cmds)


# The Python of a CC image (ChameleonCloud/CC-Images builds CC-Ubuntu* on Ubuntu's cloud images): Ubuntu 24.04
# (noble) ships Python 3.12 as python3 and has no python3.11 package (packages.ubuntu.com/noble/python3.12; deadsnakes
# packages 3.11 for noble because Ubuntu does not). CC-Ubuntu22.04's python3.11 is 3.11.0~rc1 (jammy-updates); here
# a 22.04 node sees this machine's python3.11, a release (docs/localcloud.md says so).
NOBLE_HIDDEN = ("python3.11", "python3.11-config", "x86_64-linux-gnu-python3.11-config", "pydoc3.11", "python3-config")
PYTHON312_AT = ("/usr/bin/python3.12", "/usr/local/bin/python3.12", "~/.pyenv/versions/3.12*/bin/python3.12")


def python312() -> str | None:
    """A Python 3.12 interpreter on this machine (not a shim): what a 24.04 node runs as its python3."""
    import glob
    import subprocess

    for pattern in PYTHON312_AT:
        for p in sorted(glob.glob(os.path.expanduser(pattern)), reverse=True):
            try:
                out = subprocess.run([p, "-c", "import sys, venv; print(sys.version_info[:2] == (3, 12))"],
                                     capture_output=True, text=True, timeout=30).stdout.strip()
            except (OSError, subprocess.TimeoutExpired):
                continue
            if out == "True":
                return os.path.realpath(p)
    return None


def image_mounts(d: Path, image: str | None) -> str:
    """What a node booted from ``image`` (a CC image's name) differs in from this machine, as mount commands for
    its boot script: a CC-Ubuntu24.04* image's Python (noble_python); nothing for the others."""
    return noble_python(d) if image and image.startswith("CC-Ubuntu24.04") else ""


def noble_python(d: Path) -> str:
    """A node booted from a CC-Ubuntu24.04 image: its /usr/bin without python3.11 and with python3 -> python3.12, as
    a read-only overlay in the node's mount namespace (whiteouts in the upper layer hide this machine's 3.11; the
    same in /usr/local/bin where this machine has a python3.11 there). Returns the mount commands for the node's
    boot script."""
    py = python312()
    if py is None:
        raise ApplianceError("the local cloud cannot boot a CC-Ubuntu24.04 node: this machine has no Python 3.12 "
                             "(a 24.04 node's python3)", f"install one at one of {', '.join(PYTHON312_AT)}")
    cmds = []
    for bindir in ("/usr/bin", "/usr/local/bin"):
        hidden = [n for n in NOBLE_HIDDEN if os.path.lexists(f"{bindir}/{n}")]
        if bindir != "/usr/bin" and not hidden:
            continue
        layer = d / ("usr-bin-noble" if bindir == "/usr/bin" else "usr-local-bin-noble")
        if layer.exists():
            shutil.rmtree(layer)
        layer.mkdir()
        for name in hidden:
            os.mknod(layer / name, stat.S_IFCHR, os.makedev(0, 0))  # an overlayfs whiteout
        if bindir == "/usr/bin":
            os.symlink(py, layer / "python3.12")
            os.symlink("python3.12", layer / "python3")
        cmds.append(f"mount -t overlay overlay -o ro,lowerdir={layer}:{bindir} {bindir} && ")
    return "".join(cmds)
