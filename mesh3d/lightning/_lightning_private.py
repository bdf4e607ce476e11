"""Every private Lightning API mesh3d.lightning touches, in one place (tested with Lightning 2.6).

A custom strategy cannot avoid them: Lightning's own ``ModelParallelStrategy`` uses the same ones
to start processes, join the process group and run collectives the way the Trainer expects. If a
Lightning release moves one, this is the only file to change.
"""

from lightning.fabric.utilities.distributed import (  # noqa: F401 - re-exported
    _all_gather_ddp_if_available as all_gather_if_available,
    _get_default_process_group_backend_for_device as default_backend_for_device,
    _init_dist_connection as init_dist_connection,
    _sync_ddp_if_available as sync_if_available,
)
from lightning.pytorch.strategies.launchers.subprocess_script import (  # noqa: F401 - re-exported
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)

__all__ = [
    "SubprocessScriptLauncher",
    "set_module_device_mesh",
    "all_gather_if_available",
    "default_backend_for_device",
    "init_dist_connection",
    "sync_if_available",
]


def set_module_device_mesh(module, mesh) -> None:
    """What ``LightningModule.device_mesh`` returns: Lightning offers no setter, its strategies set this."""
    module._device_mesh = mesh
