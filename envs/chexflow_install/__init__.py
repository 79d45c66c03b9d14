"""Installers of chexflow's native dependencies: build tooling, not part of the runtime package.

Run from the checkout with ``envs/`` on the module path (``envs/setup.sh`` does, after installing
chexflow, whose ``chexflow.fsutil`` they use for atomic writes)::

    PYTHONPATH=envs .venv/bin/python -m chexflow_install.horovod [--help]
    PYTHONPATH=envs .venv/bin/python -m chexflow_install.slurm_plugin [--check]
    PYTHONPATH=envs .venv/bin/python -m chexflow_install.torchvision_dynamo [--check]
    PYTHONPATH=envs .venv/bin/python -m chexflow_install.torch_dynamo [--check]

``horovod``: build Horovod 0.28.1 against the installed torch (cached wheel); ``slurm_plugin``: the
node-failure fix of snakemake-executor-plugin-slurm 2.8.0; ``torchvision_dynamo``: torchvision 0.29.1's
import without TorchDynamo (2.4 CPU-s and 140 MiB an evaluation, prediction or report job); ``torch_dynamo``:
torch 2.14.1's optimizers and DDP without TorchDynamo when nothing compiles (a training rank's start).
``source_patch``: the exact, idempotent source edit those two make.
"""
