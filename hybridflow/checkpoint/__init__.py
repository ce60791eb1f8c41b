"""Checkpoints: sharded save and resume through torch.distributed.checkpoint, HF export, the run directory."""

from hybridflow.checkpoint.export import export_hf, load_role_model, write_hf_config
from hybridflow.checkpoint.manager import RoleState, load, read_meta, save
from hybridflow.checkpoint.rundir import complete_checkpoints, find_latest, step_dir
from hybridflow.checkpoint.sharded import CheckpointError

__all__ = [
    "CheckpointError",
    "RoleState",
    "complete_checkpoints",
    "export_hf",
    "find_latest",
    "load",
    "load_role_model",
    "read_meta",
    "save",
    "step_dir",
    "write_hf_config",
]
