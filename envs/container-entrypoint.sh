#!/bin/sh
# The image's entry point (`apptainer run chexflow.sif ...`, `docker run chexflow ...`): a command
# (chexflow, snakemake, horovodrun, bash, ...) runs as given; options alone go to chexflow.
# `apptainer exec` bypasses it, and needs nothing from it: PATH already holds the image's .venv.
case "${1:-}" in
  "") exec chexflow --help ;;
  -*) exec chexflow "$@" ;;
  *) exec "$@" ;;
esac
