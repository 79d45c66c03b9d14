"""``python -m chexflow_install.horovod`` (see :mod:`chexflow_install.horovod.cli`)."""
import sys

from chexflow_install.horovod.cli import main

sys.exit(main())
