"""The object store, at the bottom of the layers: stores by URL (Swift, S3, file), their credentials, and the
checkpoint layout with its commit protocol. Imports nothing of the appliance but `errors`."""

from .checkpoints import (  # noqa: F401
    MANIFEST, CheckpointStore, Committed, StoreUnavailable, ckpt_name, manifest_digest, open_run, retrying)
from .objects import (  # noqa: F401
    FileStore, ObjectInfo, S3Store, Store, StoreCreds, SwiftStore, md5_file, open_store, parse_url, swift_fallback)
