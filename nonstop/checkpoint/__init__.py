"""Checkpoints others can read: a job's durable checkpoint as plain state dicts
(:func:`load_checkpoint`, :mod:`.reader`) and written as safetensors, a
``torch.distributed.checkpoint`` directory or a ``torch.save`` file (:func:`export_checkpoint`,
:mod:`.export`; ``nonstop export``, :mod:`.cli`)."""

from nonstop.checkpoint.export import FORMATS, WHATS, ExportResult, export_checkpoint
from nonstop.checkpoint.reader import Checkpoint, load_checkpoint

__all__ = ["FORMATS", "WHATS", "Checkpoint", "ExportResult", "export_checkpoint", "load_checkpoint"]
