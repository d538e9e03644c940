"""The durable tier: whole-job checkpoints (every rank of one step) on a local disk or any
fsspec URL, written atomically, checksummed end to end, retained, and loaded with fallback
to the next good checkpoint.

One module per concept:

- :mod:`.format`: the on-disk format (the spec is its docstring), names, manifest and rank
  records, manifest encode / decode / validate;
- :mod:`.storage`: the :class:`Storage` contract and :func:`open_storage`; :mod:`.local`
  (:class:`LocalStorage`) and :mod:`.remote` (:class:`FsspecStorage`) implement it;
- :mod:`.catalog`: what a root holds (step directories, ``latest``, manifests) and applying
  retention, whose policy is the pure :mod:`.retention`;
- :mod:`.writer`: :class:`CheckpointWriter` (OPEN → COMMITTED | ABORTED);
- :mod:`.loader`: :class:`LoadedCheckpoint`, loading with fallback, verification;
- :mod:`.inspect`: the ``nonstop inspect`` report (:func:`format_inspect`);
- :mod:`.store`: :class:`DurableStore`, which composes them.

Everything below is imported from here (``from nonstop.snapshot.durable import X``).
"""

from nonstop.snapshot.durable.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    rank_file,
    step_dir,
)
from nonstop.snapshot.durable.inspect import format_inspect
from nonstop.snapshot.durable.loader import LoadedCheckpoint
from nonstop.snapshot.durable.local import LocalStorage
from nonstop.snapshot.durable.remote import FsspecStorage
from nonstop.snapshot.durable.storage import Storage, open_storage
from nonstop.snapshot.durable.store import DurableStore
from nonstop.snapshot.durable.writer import CheckpointWriter, WriterState

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LATEST",
    "MANIFEST",
    "CheckpointWriter",
    "DurableStore",
    "FsspecStorage",
    "LoadedCheckpoint",
    "LocalStorage",
    "Storage",
    "WriterState",
    "format_inspect",
    "open_storage",
    "rank_file",
    "step_dir",
]
