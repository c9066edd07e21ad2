"""The training scripts' API: ``from appliance.checkpoint.keras import Checkpointer, callback``.

The implementation is node-side code (`appliance/node/checkpointer.py`); these names stay for user scripts."""

from ..node.checkpointer import Checkpointer, callback, vendordata_lease_end  # noqa: F401
