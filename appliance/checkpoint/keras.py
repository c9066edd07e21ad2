"""The training scripts' API: ``from appliance.checkpoint.keras import Checkpointer``.

The implementation is node-side code (`appliance/node/checkpointer.py`); this name stays for user scripts."""

from ..node.checkpointer import Checkpointer, vendordata_lease_end  # noqa: F401
