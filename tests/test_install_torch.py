"""chexflow_install.torch_dynamo (envs/) and the trainer's deterministic flag: a rank that does not compile never
imports TorchDynamo or Inductor. What it saves is measured by bench/rank_start.py (docs/benchmarks-log.md); here:
the patch is applied and exact, an optimizer does what it did, eager and compiled, and the flags are set."""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys

from chexflow_install import torch_dynamo as P
from conftest import cli_env

# a process as a rank makes it: chexflow's deterministic flag, a DDP model (one rank of gloo), an optimizer of each
# kind stepped, zeroed, saved, restored and scheduled; prints what it imported and the flags torch reports
PROBE = """
import sys, tempfile, torch, torch.distributed as dist
from chexflow.train.trainer import deterministic_kernels
deterministic_kernels(compiled=False)
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
assert not model._use_python_reducer
x = torch.randn(8, 4)
for cls, kw in ((torch.optim.SGD, {"momentum": 0.9}), (torch.optim.Adam, {"fused": True}), (torch.optim.AdamW, {})):
    opt = cls(model.parameters(), lr=0.1, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        sched.step()
    opt.load_state_dict(opt.state_dict())
print(sorted({"torch._dynamo", "torch._inductor"} & set(sys.modules)), torch.are_deterministic_algorithms_enabled(),
      torch.is_deterministic_algorithms_warn_only_enabled(), float(model.module.weight.sum()))
"""

# the same optimizer step, eager and inside torch.compile: the compiled one breaks the graph where torch's does
COMPILED = """
import torch, torch._dynamo
from torch._dynamo.utils import counters
from chexflow.train.trainer import deterministic_kernels
import torch._inductor.config as inductor_config
deterministic_kernels(compiled=True)
weights = []
for compiled in (False, True):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 4)).sum().backward()
    step = torch.compile(opt.step, backend="eager") if compiled else opt.step
    step(); step()
    weights.append(model.weight.detach().clone())
user_breaks = sum(n for reason, n in counters["graph_break"].items() if "torch._dynamo.graph_break()" in reason)
print(user_breaks > 0, torch.equal(*weights), inductor_config.deterministic,
      torch.are_deterministic_algorithms_enabled())
"""


def _run(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def test_installed_torch_is_patched_and_an_eager_rank_imports_no_compiler():
    """envs/setup.sh applies the edits; a process that wraps a model in DDP and steps, zeroes, saves, restores and
    schedules SGD, fused Adam and AdamW with chexflow's deterministic flag imports neither TorchDynamo nor
    Inductor, DDP keeps its C++ reducer, and torch reports deterministic algorithms on, warn-only (what
    torch.use_deterministic_algorithms(True, warn_only=True) sets)."""
    assert importlib.metadata.version(P.DIST) == P.VERSION
    for patch in P.PATCHES:
        assert patch.is_patched(patch.module_file().read_text(encoding="utf-8")), \
            f"{patch.module}: run `bash envs/setup.sh` (it runs chexflow_install.torch_dynamo)"
    assert P.main(["--check"]) == 0
    imported, deterministic, warn_only, _ = _run(PROBE)
    assert (imported, deterministic, warn_only) == ("[]", "True", "True")


def test_the_optimizer_steps_as_before_eager_and_compiled():
    """Eager, the patched wrappers give the weights torch's own give (the same step with dynamo loaded first: the
    unpatched path), and DDP built with dynamo loaded takes the python reducer its configuration asks for;
    compiled, the wrapper finds dynamo loaded and breaks the graph (`graph_break()`, as torch's wrapper does)
    and the step ends where the eager step ends; a compiled run's flag reaches Inductor's configuration too."""
    *_, eager = _run(PROBE)
    *_, loaded_first = _run("import torch._dynamo\n" + PROBE)
    assert eager == loaded_first
    # DDP with dynamo loaded reads its configuration as torch does: the python reducer when it is asked for
    reducer = _run("import torch._dynamo\ntorch._dynamo.config.optimize_ddp = 'python_reducer'\n"
                   + PROBE.replace("assert not model._use_python_reducer", "print(model._use_python_reducer)"))
    assert reducer[0] == "True"
    breaks, same, inductor_deterministic, deterministic = _run(COMPILED)
    assert (breaks, same, inductor_deterministic, deterministic) == ("True", "True", "True", "True")


def test_patch_is_exact_and_idempotent_and_another_release_is_left_alone(tmp_path):
    """Undone, each installed file is 2.14.1's text: patching it gives the installed file again, twice changes
    nothing; another release or changed code is left as it is and never fails the installation."""
    for patch in P.PATCHES:
        patched = patch.module_file().read_text(encoding="utf-8")
        original = patched.replace(patch.replacement, patch.original)
        assert not patch.is_patched(original) and original.count(patch.original) == 1
        assert patch.patch_text(original) == patched and patch.patch_text(patched) == patched
        path = tmp_path / f"{patch.module}.py"
        path.write_text(original)
        done, said = patch.apply_to(path, "2.15.0")
        assert done and said == ("torch 2.15.0: left as it is (the patch is written for 2.14.1; "
                                 "envs/patches/torch-dynamo-import.md)") and path.read_text() == original
        changed = original.replace(patch.original, patch.original.replace("torch._dynamo", "torch._x"))
        path.write_text(changed)
        done, said = patch.apply_to(path, P.VERSION)
        assert done and "torch's code changed; left as it is" in said and path.read_text() == changed
