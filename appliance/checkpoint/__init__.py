"""Checkpoints, the launcher's side: the job hook (job.py), the lease watchdog, run records, and the steps of
`appliance resume` (resume.py). The training side is appliance.node.checkpointer (`appliance.checkpoint.keras`)."""
