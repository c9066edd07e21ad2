"""Launching Horovod jobs on a cluster: environment scrubbing, the horovodrun command, streaming output."""
