"""horovodrun without its per-launch build probe: ``python -m appliance.node.hvdrun ARGS`` is ``horovodrun ARGS``.

At every launch with ``--gloo``, horovodrun asks whether Horovod was built with Gloo (horovod/runner/launch.py
``run_controller`` -> horovod/common/util.py ``gloo_built``, cached only for its own process) by importing
``horovod.tensorflow``, and so TensorFlow, in a forked process: 4 s of every job's start and every resume's downtime
on this 2-core machine, before any rank starts. `appliance doctor` checks the build once per node (its "horovod
build" and "allreduce (2 ranks)" checks, the latter through the real horovodrun); the launch takes that answer.
Everything else is horovodrun's own code: ``run_commandline``, its console entry point (horovod's setup.py), with
the same arguments. If a Horovod release no longer has ``launch.gloo_built``, horovodrun runs as it is.
"""

import sys


def main() -> None:
    from horovod.runner import launch

    if "--gloo" in sys.argv[1:] and callable(getattr(launch, "gloo_built", None)):
        launch.gloo_built = lambda verbose=False: True  # the node's doctor checked the build
    sys.argv[0] = "horovodrun"  # its usage and error lines, as the user knows the command
    launch.run_commandline()


if __name__ == "__main__":  # not when multiprocessing's spawn imports this module again as __mp_main__
    main()
