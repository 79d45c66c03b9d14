"""chexflow_install.slurm_plugin (envs/): the patch of snakemake-executor-plugin-slurm 2.8.0's node-failure
exclusion (issue 18.3). Its behaviour on a real node failure is tested on the local SLURM cluster
(test_slurm_cluster.py) and through a whole workflow run (test_slurm_workflow.py)."""
from __future__ import annotations

import importlib.metadata

import pytest

from chexflow_install import slurm_plugin as P


def installed_text() -> str:
    return P.plugin_file().read_text(encoding="utf-8")


def test_installed_plugin_is_the_pinned_release_and_patched():
    """envs/setup.sh applies the patch; without it one node failure stops the workflow."""
    assert importlib.metadata.version(P.DIST) == P.VERSION
    assert P.is_patched(installed_text()), "run `bash envs/setup.sh` (it runs chexflow_install.slurm_plugin)"
    assert P.main(["--check"]) == 0
    import snakemake_executor_plugin_slurm as plugin
    assert callable(plugin._chexflow_failed_nodes)


def test_patch_is_exact_and_idempotent():
    """Undone, the installed file is 2.8.0's text: patching that gives the installed file again, and
    patching twice changes nothing."""
    patched = installed_text()
    original = patched.replace(P.HELPER, "\n").replace(P.REPLACEMENT, P.ORIGINAL)
    assert not P.is_patched(original) and original.count(P.ORIGINAL) == 1
    assert P.patch_text(original) == patched
    assert P.patch_text(patched) == patched
    assert "None assigned" not in P.REPLACEMENT and "nodelist%-256" in P.ORIGINAL


def test_changed_plugin_code_fails_loudly_and_is_left_alone(tmp_path):
    original = installed_text().replace(P.HELPER, "\n").replace(P.REPLACEMENT, P.ORIGINAL)
    changed = tmp_path / "__init__.py"
    changed.write_text(original.replace("nodelist%-256", "nodelist%-512"))
    before = changed.read_text()
    with pytest.raises(P.PatchError, match=rf"{changed}: the NODE_FAIL node lookup .* the plugin's code changed"):
        P.apply_to(changed, P.VERSION)
    assert changed.read_text() == before


def test_other_release_is_refused_with_what_to_do(tmp_path):
    path = tmp_path / "__init__.py"
    path.write_text(installed_text().replace(P.HELPER, "\n").replace(P.REPLACEMENT, P.ORIGINAL))
    with pytest.raises(P.PatchError, match=r"2\.9\.0 is installed; .* written for 2\.8\.0 .* issue #485"):
        P.apply_to(path, "2.9.0")
    assert not P.is_patched(path.read_text())
    assert "patched" in P.apply_to(path, P.VERSION) and P.is_patched(path.read_text())
    assert "is patched" in P.apply_to(path, P.VERSION)                       # second run: nothing to do
    compile(path.read_text(), str(path), "exec")
