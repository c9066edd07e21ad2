"""horovodrun without its per-launch build probe: ``python -m appliance.node.hvdrun ARGS`` is ``horovodrun ARGS``.

At every launch with ``--gloo``, horovodrun asks whether Horovod was built with Gloo (horovod/runner/launch.py
``run_controller`` -> horovod/common/util.py ``gloo_built``, cached only for its own process) by importing
``horovod.tensorflow``, and so TensorFlow, in a forked process: 4 s of every job's start and every resume's downtime
on this 2-core machine, before any rank starts. `appliance doctor` checks the build once per node (its "horovod
build" and "allreduce (2 ranks)" checks, the latter through the real horovodrun); the launch takes that answer.
Everything else is horovodrun's own code: ``run_commandline``, its console entry point (horovod's setup.py), with
the same arguments. If a Horovod release no longer has ``launch.gloo_built``, horovodrun runs as it is.

A rank that exits non-zero ends horovodrun with a RuntimeError (horovod/runner/gloo_run.py ``launch_gloo``: "Horovod
detected that one or more processes exited with non-zero status ..."), which Python prints as a traceback under the
job's output, also when the rank ended on purpose (75: stopped with its checkpoint committed). The launcher reads
the ranks' own exit lines for its verdict; that error is said here as its lines, without the traceback, and
horovodrun's exit status stays 1.
"""

import sys


def main() -> None:
    from horovod.runner import launch

    if "--gloo" in sys.argv[1:] and callable(getattr(launch, "gloo_built", None)):
        launch.gloo_built = lambda verbose=False: True  # the node's doctor checked the build
    sys.argv[0] = "horovodrun"  # its usage and error lines, as the user knows the command
    try:
        launch.run_commandline()
    except RuntimeError as e:
        if not str(e).startswith(RANK_FAILED):
            raise
        print(str(e).rstrip(), file=sys.stderr, flush=True)
        sys.exit(1)


RANK_FAILED = "Horovod detected that one or more processes exited with non-zero status"


if __name__ == "__main__":  # not when multiprocessing's spawn imports this module again as __mp_main__
    main()
