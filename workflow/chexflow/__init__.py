"""chexflow: Horovod pretraining, ChestX-ray14 fine-tuning, evaluation and report, as a Snakemake workflow.

The package holds all logic; the Snakemake rules under ``rules/`` only call its CLI (``chexflow <stage>``).
Importing the package is cheap: torch is imported only by the modules that train.
"""

__version__ = "0.1.0"
