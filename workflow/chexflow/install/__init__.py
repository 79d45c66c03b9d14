"""Installers for chexflow's native dependencies (``python -m chexflow.install.horovod``)."""
