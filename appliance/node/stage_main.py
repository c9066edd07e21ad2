"""Runs on a node: stage one node's part of a dataset. Driven by `appliance stage` over SSH.

The job (URL, destination, shard, and the scoped credentials) arrives as JSON on stdin, so the
credentials are never on a command line, in the environment or on the node's disk. Progress goes
to stdout as `APPLIANCE_PROGRESS {json}` lines, the result as `APPLIANCE_STAGED {json}`, a failure
as `APPLIANCE_ERROR {json}` with exit code 1.
"""

import json
import sys

# swiftclient imports python-keystoneclient whenever it is installed (python-swiftclient 4.x, swiftclient/client.py:
# the try at its top; requirements.lock has it for python-openstackclient), 0.15 s of CPU on every node's start, for
# Keystone password auth (auth_version 2 or 3) that this process never asks for: SwiftStore authenticates with v1
# auth or with a keystoneauth1 session (an application credential). A None in sys.modules fails that import, which
# swiftclient expects (ImportError: those auth versions then say "require python-keystoneclient").
sys.modules.setdefault("keystoneclient", None)

from .. import report  # noqa: E402
from ..errors import ApplianceError, Unavailable  # noqa: E402
from ..protocol import Line, emit  # noqa: E402
from ..store.objects import StoreCreds, StoreRefused, open_store, swift_fallback, unreachable  # noqa: E402
from .stage import stage  # noqa: E402


def main() -> int:
    with report.to(lambda m: emit(Line.NOTE, m)):  # the store's notes (a listing asked again) to the launcher
        return _main()


def _main() -> int:
    job = json.loads(sys.stdin.read())
    creds = StoreCreds(**job["creds"]) if job.get("creds") else None

    def progress(p):
        emit(Line.PROGRESS, p)

    store = None
    try:
        store, prefix = open_store(job["url"], creds)
        try:
            res = stage(store, prefix, job["dest"], mode=job["mode"], rank=job["rank"], nodes=job["nodes"],
                        concurrency=job.get("concurrency", 16), progress=progress,
                        keep_names=job.get("keep_names", False), keep_extra=job.get("keep_extra", False))
        except Exception as e:
            # S3 that fails (a refusal of its keys included) falls back to Swift, where the same data is; our own
            # refusals (names, disk space) do not
            ours = isinstance(e, ApplianceError) and not isinstance(e, StoreRefused)
            fb = swift_fallback(job["url"], creds) if creds and not ours else None
            if fb is None:
                raise
            emit(Line.NOTE, f"S3 failed ({type(e).__name__}: {e}); falling back to Swift")
            store = fb[0]
            res = stage(fb[0], fb[1], job["dest"], mode=job["mode"], rank=job["rank"], nodes=job["nodes"],
                        concurrency=job.get("concurrency", 16), progress=progress,
                        keep_names=job.get("keep_names", False), keep_extra=job.get("keep_extra", False))
    except ApplianceError as e:  # "unavailable": the store did not answer (the same staging later may work)
        emit(Line.ERROR, {"message": e.message, "fix": e.fix, "unavailable": isinstance(e, Unavailable)})
        return 1
    except Exception as e:
        said = unreachable(store, e) if store is not None else None
        emit(Line.ERROR, {"message": said.message, "fix": said.fix, "unavailable": True} if said else
             {"message": f"{type(e).__name__}: {e}", "fix": None})
        return 1
    emit(Line.STAGED, res.as_dict())
    return 0


if __name__ == "__main__":
    sys.exit(main())
