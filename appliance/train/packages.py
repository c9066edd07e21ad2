"""The script's own packages (``train.requirements``): installed on every node before the job, beside the training
stack, never over it.

pip installs them with ``--prefix`` into the run's directory on each node's local disk, so that the stack (a venv
that may be root's, as the appliance image's is) is not written; the packages the stack has count as installed
(pip's resolver sees them), and every one of them is a constraint at its installed version, so a requirement that
would change TensorFlow, Horovod or numpy fails with pip's own words instead of breaking the job. The ranks find the
packages through PYTHONPATH. A job that starts again on the same nodes finds them installed and pip does nothing."""

from __future__ import annotations

import shlex

from ..errors import ApplianceError
from ..remote import Session

# $1 code directory, $2 requirements file (relative to it), $3 prefix, $4 the stack's Python. Prints the directory
# the ranks import from. pip runs in the code directory, so a requirements file's relative paths (a wheel shipped
# with the code, --find-links .) are the code's.
SCRIPT = r"""
set -e
cd "$1"
site=$("$4" -c 'import sys, sysconfig; print(sysconfig.get_path("purelib", vars={"base": sys.argv[1], "platbase": sys.argv[1]}))' "$3")
keep="$3.constraints"
mkdir -p "$3"
"$4" -m pip list --format=freeze --disable-pip-version-check > "$keep"
PYTHONPATH="$site" "$4" -m pip install --quiet --disable-pip-version-check --no-input --prefix "$3" -c "$keep" -r "$2" 1>&2
echo "$site"
"""


def install(session: Session, python: str, code_dir: str, requirements: str, prefix: str, say) -> str:
    """Install ``requirements`` on every node of the session; the site directory the ranks import them from (the
    same path on every node). Raises ApplianceError naming the node and pip's last line."""
    cmd = "sh -c " + " ".join(shlex.quote(a) for a in (SCRIPT, "install", code_dir, requirements, prefix, python))
    sites = {}

    def one(remote):
        r = remote.run(cmd, timeout=3600)
        if r.rc != 0:
            lines = r.err.strip().splitlines() or ["pip failed"]
            last = next((x for x in lines if x.startswith("ERROR:")), lines[-1])[:300]  # pip's first word of it
            raise ApplianceError(f"train.requirements: {requirements} did not install on {remote.node.name}: {last}",
                                 "fix the requirements file; a package that would change the stack (TensorFlow, "
                                 "Horovod, numpy: requirements.lock) cannot be installed beside it")
        sites[remote.node.name] = r.out.strip().splitlines()[-1]

    session.each(one)
    site = next(iter(sites.values()))
    say(f"[appliance] installed the packages of {requirements} on {len(sites)} node(s), into {prefix}")
    return site
