"""Reproducible build of Horovod 0.28.1 (PyTorch frontend only) against the installed torch.

Horovod 0.28.1 (the last release) does not build against torch 2.x as shipped. This package takes
the PyPI sdist, patches it (C++ standard, CUDA detection guard, missing standard includes), builds a
wheel with ``pip wheel --no-build-isolation`` against the torch of the running interpreter, keeps
the wheel in a cache keyed by everything that makes it binary-incompatible, installs it with
``sys.executable -m pip`` and checks that ``hvd.init()`` works.

Usage::

    python -m chexflow_install.horovod [--with-mpi auto|yes|no] [--with-nccl auto|yes|no]
        [--cxx-std 17|20] [--sdist PATH] [--cache-dir DIR] [--jobs N]
        [--force] [--reinstall] [--no-install] [--dry-run] [--keep-build-dir]

Decisions (one line each, prefixed ``horovod-install:``):

* C++ standard: 17 for torch <= 2.13, 20 for torch >= 2.14 (``--cxx-std`` overrides).
* MPI ops (``--with-mpi auto``): built when an MPI C++ compiler is found: ``$MPICXX``, the first
  word of ``$HOROVOD_MPICXX_SHOW``, or ``mpicxx``/``mpic++``/``mpiCC`` on ``PATH``.
* NCCL/CUDA ops (``--with-nccl auto``): built only when ``torch.cuda.is_available()``; otherwise
  CUDA detection is switched off so that a stray ``nvcc`` does not pull CUDA kernels into a CPU
  build. ``HOROVOD_CUDA_HOME``, ``HOROVOD_NCCL_HOME/_INCLUDE/_LIB/_LINK``, ``CC``/``CXX``,
  ``HOROVOD_BUILD_CUDA_CC_LIST`` are passed through; without ``HOROVOD_NCCL_*`` the NCCL of the
  ``nvidia-nccl-*`` wheel that CUDA builds of torch depend on is used when present.
* Gloo is always built; TensorFlow and MXNet frontends never.

Cache: ``--cache-dir`` > ``$CHEXFLOW_WHEEL_CACHE`` > ``~/.cache/chexflow/wheels``; one sub-directory
per :class:`BuildKey` (horovod version, torch version with local tag, python tag, machine, C++
standard, MPI, NCCL) holding the wheel, and ``logs/`` holding the build logs. The key is also baked
into the wheel's local version (``0.28.1+chexflow...``) so that an installed Horovod can be matched
against it: when the installed one has the same key and its torch ops work, nothing is done
(``--force`` rebuilds, ``--reinstall`` reinstalls from the cache).

Modules: :mod:`.decide` (pure decisions and the cache key), :mod:`.patch` (the sdist and its patches),
:mod:`.probe` (questions to the target interpreter), :mod:`.wheel` (cache, build, install), :mod:`.cli`
(the command: ``python -m chexflow_install.horovod``, with ``envs/`` on ``PYTHONPATH``).
"""
