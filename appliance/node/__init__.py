"""Node-side code: what runs on the training nodes, never on the launcher. It imports only `appliance.protocol`
and `appliance.store` (and `appliance.errors`), so a node needs nothing of the launcher's side.

- `stage` / `stage_main`: the per-node stager (`python -m appliance.node.stage_main`, driven by `appliance stage`);
- `checkpointer`: rank 0's checkpoints and the collective stop (users import it as `appliance.checkpoint.keras`);
- `watchdog` / `vendordata`: the node's own lease-end watchdog (`appliance watchdog --node`);
- `doctor`: the node's readiness checks (`python -m appliance.node.doctor`); `gpudoctor`, `gpujobs`, `linkage` and
  `doctor_report`: its `--gpu` checks, the jobs they run, Horovod's NCCL linkage (`python -m appliance.node.linkage`)
  and the report;
- `lockbeat`: on the head node, renews the run's lock in the store while the job runs (`python -m appliance.node.lockbeat`);
- `shim/sitecustomize.py`: first on the ranks' PYTHONPATH (`keras` means tf_keras).
"""
