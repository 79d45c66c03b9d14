"""Every stage that reads shards keeps and uses the verification stamps (``$CHEXFLOW_VERIFIED_DIR``):
a sweep trial hashes the train and val shards once, a scale point on the same data then hashes
none, evaluation checks every split (its leak check reads the training splits' patients) but hashes
only the test shards no stage checked before, and evaluation again (a requeue) hashes nothing: the
bytes it reads fall by exactly the test shards' bytes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from chexflow.data import manifest as MF
from chexflow.data import manifest as M
from chexflow.data.stamps import StampStore
from chexflow.evaluate import run as evaluate
from chexflow.evaluate.config import EvaluateConfig
from chexflow.train import checkpoint as ckpt
from chexflow.train.models import build_model
from conftest import cli_env
from test_distributed import train_cfg
from test_stamps import SLACK, rchar
from test_weights_check import _record

pytestmark = pytest.mark.slow


def checked(n: int, hashed: int, mib: float) -> str:
    return (f"{n} shards checked against the manifest's sha256: {hashed} hashed ({mib:.1f} MiB, each by one rank), "
            f"{n - hashed} unchanged since their stamps")


def chexflow(*args: str, env: dict) -> str:
    proc = subprocess.run([sys.executable, "-m", "chexflow", *args], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc.stdout + proc.stderr


def test_a_sweep_trial_a_scale_point_and_evaluation_share_the_stamps(demo_manifest, tmp_path, capsys):
    verified = tmp_path / "verified"
    env = {**cli_env(), "CHEXFLOW_VERIFIED_DIR": str(verified)}
    split = {name: MF.split_shards(demo_manifest, name) for name in ("train", "val", "test")}
    size = {name: sum(os.path.getsize(s.path) for s in refs) for name, refs in split.items()}
    n_train_val = len(split["train"]) + len(split["val"])

    trial = train_cfg("single", epochs=1, max_steps=1)
    out = chexflow("sweep-trial", "--config-json", json.dumps(trial), "--params-json", "{}", "--trial", "t000",
                   "--launcher", "chexflow launch", "-n", "1", "--manifest", str(demo_manifest),
                   "--out-dir", str(tmp_path / "trial"), env=env)
    assert checked(n_train_val, n_train_val, (size["train"] + size["val"]) / 2**20) in out

    scaling = {"world_sizes": [1], "steps_per_rank": 1, "epochs": 2, "batch_size": 8, "arch": "resnet18", "crop": 32}
    out = chexflow("launch", "--backend", "single", "-n", "1", "--", "chexflow", "scale-point", "--config-json",
                   json.dumps(train_cfg("single")), "--scaling-json", json.dumps(scaling), "--world", "1",
                   "--manifest", str(demo_manifest), "--out-dir", str(tmp_path / "scale"), env=env)
    assert checked(n_train_val, 0, 0.0) in out

    model = tmp_path / "model.pt"
    ckpt.save_atomic(_record(build_model("resnet18", in_channels=1, num_outputs=14).state_dict()), model)

    def evaluation(store) -> int:
        M.forget_verified()          # as a new process: nothing checked yet
        before = rchar()
        evaluate.run(EvaluateConfig(batch_size=64, bootstrap_resamples=10), model_path=model, manifest=demo_manifest,
                     out_dir=tmp_path / "evaluate", heatmaps=False, verified=store)
        return rchar() - before

    evaluation(None)                 # what a first evaluation in this process imports, read before counting
    n_all = n_train_val + len(split["test"])     # train's too: the leak check reads its patients
    capsys.readouterr()
    first = evaluation(verified)
    assert checked(n_all, len(split["test"]), size["test"] / 2**20) in capsys.readouterr().out
    stamps = StampStore(verified, demo_manifest).path.stat().st_size
    requeue = evaluation(verified)
    assert checked(n_all, 0, 0.0) in capsys.readouterr().out
    # the same evaluation but for hashing the test shards (and a smaller stamp file read at its start)
    assert size["test"] - stamps <= first - requeue <= size["test"] + SLACK
    assert json.loads((tmp_path / "evaluate" / "metrics.json").read_text())["n_images"] == \
        sum(s.count for s in split["test"])
