"""Patch torch 2.14.1 so that a process that never compiles never imports TorchDynamo (a training rank's start).

torch 2.14's optimizers import ``torch._dynamo`` on their first call: ``Optimizer.step`` is wrapped by
``_use_grad_for_differentiable``, whose wrapper imports it to call ``torch._dynamo.graph_break()`` around the
step, and ``zero_grad``, ``state_dict``, ``load_state_dict`` and ``add_param_group`` by ``torch._disable_dynamo``,
which imports it to build ``torch._dynamo.disable(fn)``. Both only matter while TorchDynamo traces the call,
and nothing traces unless ``torch._dynamo`` is loaded (``torch.compile`` loads it). ``DistributedDataParallel``
imports it to read one option of its configuration (``optimize_ddp``), which is its default when it is not
loaded. Every training rank that did not compile paid the import (TorchDynamo, Inductor's configuration, the
AOT compiler's modules) before its first step. Each patched place asks ``sys.modules`` first: not loaded, it
calls the function as it is (a graph break outside tracing and a disabled function outside tracing are that
call) and DDP takes the default's reducer; loaded, it does what torch does, so a compiled run, and a process
that compiled anything before, is unchanged. Upstream is moving the same way (pytorch/pytorch#173388: graph
break only if needed; #187513: remove these graph breaks). With the trainer's deterministic flag set without
Inductor (``chexflow.train.trainer.deterministic_kernels``), a rank saves about 2 CPU-s and 100 MiB at each start
(``bench/rank_start.py``).

Applied by ``envs/setup.sh`` (``python -m chexflow_install.torch_dynamo``) to torch 2.14.1 only, each file exactly
(``chexflow_install.source_patch``: idempotent, never fails an installation; ``--check`` only reports). A cluster's
own torch kept with ``CHEXFLOW_SKIP_TORCH=1`` is left as it is. Written up in envs/patches/torch-dynamo-import.md.
"""
from __future__ import annotations

import sys

from chexflow_install.source_patch import SourcePatch, main as _main

DIST = "torch"
VERSION = "2.14.1"                   # the release this patch is written for (envs/requirements.txt)
WRITEUP = "envs/patches/torch-dynamo-import.md"
MARKER = f"# chexflow patch: dynamo only when it is loaded ({WRITEUP})"

# torch/_compile.py: the wrapper torch._disable_dynamo puts around zero_grad, state_dict, load_state_dict, ...
DISABLE_ORIGINAL = """\
            if disable_fn is None:
                import torch._dynamo
"""
DISABLE_REPLACEMENT = f"""\
            if disable_fn is None:
                {MARKER}
                import sys

                if "torch._dynamo" not in sys.modules:  # not loaded: nothing traces this call, nothing to disable
                    return fn(*args, **kwargs)
                import torch._dynamo
"""

# torch/optim/optimizer.py: the wrapper _use_grad_for_differentiable puts around every optimizer's step
STEP_ORIGINAL = """\
    def _use_grad(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        import torch._dynamo

        self = cast(Optimizer, args[0])  # assume first positional arg is `self`
        prev_grad = torch.is_grad_enabled()
        try:
            # Note on graph break below:
            # we need to graph break to ensure that aot respects the no_grad annotation.
            # This is important for perf because without this, functionalization will generate an epilogue
            # which updates the mutated parameters of the optimizer which is *not* visible to inductor, as a result,
            # inductor will allocate for every parameter in the model, which is horrible.
            # With this, aot correctly sees that this is an inference graph, and functionalization will generate
            # an epilogue which is appended to the graph, which *is* visible to inductor, as a result, inductor sees that
            # step is in place and is able to avoid the extra allocation.
            # In the future, we will either 1) continue to graph break on backward, so this graph break does not matter
            # or 2) have a fully fused forward and backward graph, which will have no_grad by default, and we can remove this
            # graph break to allow the fully fused fwd-bwd-optimizer graph to be compiled.
            # see https://github.com/pytorch/pytorch/issues/104053
            torch.set_grad_enabled(self.defaults["differentiable"])
            torch._dynamo.graph_break()
            ret = func(*args, **kwargs)
        finally:
            torch._dynamo.graph_break()
            torch.set_grad_enabled(prev_grad)
        return ret
"""
# the same text with the import replaced by a look in sys.modules, and each graph break made conditional on it
STEP_REPLACEMENT = STEP_ORIGINAL.replace("""\
        import torch._dynamo
""", f"""\
        {MARKER}
        import sys

        dynamo = sys.modules.get("torch._dynamo")  # not loaded: nothing traces this call, a graph break is a no-op
""").replace("""\
            torch._dynamo.graph_break()
""", """\
            if dynamo is not None:
                dynamo.graph_break()
""")

# torch/nn/parallel/distributed.py: DistributedDataParallel asks dynamo's configuration which reducer to use
DDP_ORIGINAL = """\
        self._use_python_reducer = (
            torch._dynamo.utils.get_optimize_ddp_mode() == "python_reducer"
        )
"""
DDP_REPLACEMENT = f"""\
        {MARKER}
        # not loaded: its configuration is its default (optimize_ddp=True, "ddp_optimizer"), not the python reducer
        self._use_python_reducer = "torch._dynamo" in sys.modules and (
            torch._dynamo.utils.get_optimize_ddp_mode() == "python_reducer"
        )
"""

PATCHES = (
    SourcePatch(dist=DIST, version=VERSION, module="torch._compile", original=DISABLE_ORIGINAL,
                replacement=DISABLE_REPLACEMENT, marker=MARKER, writeup=WRITEUP),
    SourcePatch(dist=DIST, version=VERSION, module="torch.optim.optimizer", original=STEP_ORIGINAL,
                replacement=STEP_REPLACEMENT, marker=MARKER, writeup=WRITEUP),
    SourcePatch(dist=DIST, version=VERSION, module="torch.nn.parallel.distributed", original=DDP_ORIGINAL,
                replacement=DDP_REPLACEMENT, marker=MARKER, writeup=WRITEUP),
)


def main(argv: list[str] | None = None) -> int:
    return _main(PATCHES, "python -m chexflow_install.torch_dynamo", "torch-patch:", __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
