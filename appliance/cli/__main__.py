"""`python -m appliance.cli`: the `appliance` command (the managed run's detached controller starts so)."""

from . import main

main()
