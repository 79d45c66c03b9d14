"""Every number says where it was measured: chexflow.host's record, checked as an untrusted file's
content, and its one-line summary in the report and the model card."""
from __future__ import annotations

import json

import pytest
import torch

from chexflow import host
from chexflow.evaluate.record import MetricsRecordError, read_metrics
from chexflow.report.run_view import hosts_text
from chexflow.train.epochs import EpochsRecordError, read_epochs


def test_describe_is_a_valid_record_of_this_process():
    h = host.describe(backend="horovod", world_size=4)
    assert host.problems(h) == []
    assert h["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert h["torch_threads"] == torch.get_num_threads() and h["torch"] == torch.__version__
    assert (h["backend"], h["world_size"]) == ("horovod", 4)
    assert h["gpu_count"] == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert "backend" not in host.describe()
    text = host.summary(h)
    assert h["cpu_model"] in text and f"({h['cpu_capability']})" in text and "horovod, world 4" in text


def test_cpu_model_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13 64-Core Processor\n")
    assert host.cpu_model(info) == "AMD EPYC 7B13 64-Core Processor"
    info.write_text("model name\t: " + "x" * 5000 + "\n")
    assert len(host.cpu_model(info)) == 200                       # bounded
    assert host.cpu_model(tmp_path / "absent")                     # falls back to platform, never empty


def _gpu_host() -> dict:
    return {**host.describe(), "gpu_count": 8, "gpu_names": ["NVIDIA H100 80GB HBM3"], "cuda": "12.4", "cudnn": 90100,
            "backend": "ddp", "world_size": 64}


def test_summary_names_the_gpu_and_its_libraries():
    text = host.summary(_gpu_host())
    assert "8 x NVIDIA H100 80GB HBM3" in text and "CUDA 12.4, cuDNN 90100" in text and "ddp, world 64" in text
    assert host.summary(None) == "not recorded"


@pytest.mark.parametrize("change, why", [
    ({"cores": "2"}, "cores is a str"),
    ({"gpu_count": True}, "gpu_count is a bool"),
    ({"gpu_count": -1}, "gpu_count -1 is out of range"),
    ({"gpu_names": ["a", 3]}, "gpu_names is not a list of names"),
    ({"cpu_model": "<script>" * 40}, "cpu_model is longer than 200"),
    ({"shell": "rm -rf /"}, "unknown keys ['shell']"),
    ({"world_size": "8"}, "world_size is a str"),
])
def test_a_hostile_host_record_is_refused(change, why):
    assert any(why in p for p in host.problems({**host.describe(), **change}))


def test_a_host_record_missing_a_field_is_refused():
    h = host.describe()
    del h["cpu_capability"]
    assert host.problems(h) == ["no 'cpu_capability'"]
    assert host.problems(["not", "a", "dict"]) == ["not a host record (a list)"]


def test_hosts_text_shows_a_requeue_onto_another_host():
    a = host.describe(backend="horovod", world_size=2)
    b = {**a, "cpu_model": "Another CPU", "cpu_capability": "ZVECTOR"}
    epochs = [{"epoch": 1, "host": a}, {"epoch": 2, "host": a}, {"epoch": 3, "host": b}]
    text = hosts_text(epochs)
    assert text.startswith(f"epochs 1-2: {host.summary(a)}; epoch 3: ") and "Another CPU (ZVECTOR)" in text
    assert hosts_text(epochs[:2]) == host.summary(a)
    assert hosts_text([{"epoch": 1}]) == "not recorded"          # a record of an earlier chexflow


def test_readers_refuse_a_bad_host_naming_file_and_line(tmp_path):
    jsonl = tmp_path / "metrics.jsonl"
    good = {"epoch": 1, "train_loss": 0.5, "val_metric": 0.6, "host": host.describe()}
    bad = {**good, "epoch": 2, "host": {**host.describe(), "cores": "many"}}
    jsonl.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(EpochsRecordError, match=r"metrics.jsonl:2: host: cores is a str"):
        read_epochs(jsonl, "fine-tuning")
    metrics = tmp_path / "metrics.json"
    record = {"labels": {"A": {"auroc": 0.7, "ci": [0.6, 0.8]}}, "mean_auroc": 0.7, "n_images": 10, "n_patients": 5,
              "bootstrap": {"mean_auroc_ci": [0.6, 0.8]}, "host": host.describe(), "training_host": None}
    metrics.write_text(json.dumps(record))
    assert read_metrics(metrics)["host"] == host.describe()
    metrics.write_text(json.dumps({**record, "training_host": {"hostname": "x"}}))
    with pytest.raises(MetricsRecordError, match=r"metrics.json: training_host: no 'cpu_model'"):
        read_metrics(metrics)
