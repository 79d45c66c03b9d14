"""chexflow.data.registry: the one list of datasets, and what each adapter plans from its source."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from chexflow import config as C
from chexflow.data import registry, shards, sources
from chexflow.data.config import ShardConfig
from chexflow.data.dataset import Dataset, DatasetInfo
from chexflow.data.sources import RemoteFile, Source
from conftest import REPO, cli_env


def _source(name: str) -> Source:
    return registry.get(name).source(n_archives=3 if name in ("nih_demo", "nih_demo_pretrain") else None)


def test_config_schema_datasets_are_the_registry():
    schema = C.study_schema()
    # a downloaded dataset has a datasets: entry (its mirror), a generated release its own section
    downloaded = [n for n, d in registry.DATASETS.items() if not d.generated]
    assert list(schema["properties"]["datasets"]["properties"]) == downloaded == ["fashion_mnist", "nih", "imagenet",
                                                                                  "chexpert"]
    assert {"demo_release", "demo_pretrain_release"} <= set(schema["properties"])
    assert list(schema["properties"]["shards"]["properties"]) == list(registry.NAMES)
    study = schema["properties"]["study"]["properties"]
    assert study["pretrain_dataset"]["anyOf"] == [{"enum": ["fashion_mnist", "nih_demo_pretrain", "imagenet"]}]
    # fine-tuning: the known datasets, or a CSV-described folder declared under datasets: (any other name)
    assert study["finetune_dataset"]["anyOf"][0]["enum"] == ["nih_demo", "nih", "chexpert"]
    assert study["finetune_dataset"]["anyOf"][1]["pattern"] == "^[A-Za-z][A-Za-z0-9_]*$"
    # dataset-specific keys come from the adapters: the NIH pilot subset, ImageNet's train parts
    assert "archives" in schema["properties"]["datasets"]["properties"]["nih"]["properties"]
    shard_keys = {n: set(s["properties"]) for n, s in schema["properties"]["shards"]["properties"].items()}
    assert "train_parts" in shard_keys["imagenet"] and "train_parts" not in shard_keys["nih"]


def test_unknown_dataset_names_the_known_ones():
    with pytest.raises(sources.UnknownSourceError, match="known datasets: fashion_mnist, nih_demo, nih_demo_pretrain, "
                                                         "nih, imagenet, chexpert"):
        registry.get("mimic")


@pytest.mark.parametrize("name", registry.NAMES)
def test_every_part_and_split_reads_files_of_its_source(name):
    adapter = registry.get(name)
    src = _source(name)
    assert src.name == name
    parts = adapter.parts(ShardConfig(dataset=name, train_parts=3), n_archives=3)
    assert parts and len(set(parts)) == len(parts)
    for part in parts:
        files = adapter.part_files(src, part)
        assert files and all(f in src.files for f in files), part
        # one image archive per shard job; a folder dataset's jobs read its label table (the images: its folder)
        assert [f.role for f in files].count("archive" if not adapter.folder else "labels") == 1, part
    split = adapter.split_files(src)
    assert split and all(f in src.files and f.role in adapter.split_roles for f in split)


def test_part_inputs_as_before():
    """The files each job reads, derived from roles, are the ones the rules named by hand before."""
    nih = registry.get("nih")
    assert [f.name for f in nih.part_files(_source("nih"), "images_007")] == \
        ["images_007.tar.gz", "Data_Entry_2017_v2020.csv"]
    assert [f.name for f in nih.split_files(_source("nih"))] == \
        ["Data_Entry_2017_v2020.csv", "train_val_list.txt", "test_list.txt"]
    inet = registry.get("imagenet")
    assert [f.name for f in inet.part_files(_source("imagenet"), "train_002")] == \
        ["ILSVRC2012_img_train.tar", "ILSVRC2012_devkit_t12.tar.gz"]
    assert [f.name for f in inet.part_files(_source("imagenet"), "val")] == \
        ["ILSVRC2012_img_val.tar", "ILSVRC2012_devkit_t12.tar.gz"]
    assert [f.name for f in inet.split_files(_source("imagenet"))] == ["ILSVRC2012_devkit_t12.tar.gz"]
    fm = registry.get("fashion_mnist")
    assert [f.name for f in fm.part_files(_source("fashion_mnist"), "t10k")] == \
        ["t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"]
    assert len(fm.split_files(_source("fashion_mnist"))) == 4
    assert nih.parts(ShardConfig(archives=(3, 1))) == ["images_001", "images_003"]
    assert registry.get("nih_demo").parts(ShardConfig(), n_archives=2) == ["images_001", "images_002"]


def test_registry_import_is_cheap_for_the_snakefile():
    """The Snakefile imports the registry for every DAG: no torch or webdataset."""
    code = "import sys, chexflow.data.registry; print(sorted(m for m in ('torch', 'webdataset') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@dataclasses.dataclass(frozen=True)
class _Toy(Dataset):
    """A dataset that exists only in this test: two zip archives and a label CSV."""
    name: str = "toy"
    stage: str = "finetune"
    split_roles: tuple[str, ...] = ("labels",)

    def source(self, n_archives: int | None = None) -> Source:
        files = (RemoteFile("a.zip", None, role="archive"), RemoteFile("b.zip", None, role="archive"),
                 RemoteFile("labels.csv", None, role="labels"))
        return Source("toy", "Toy", files)

    def parts(self, cfg: ShardConfig, n_archives: int | None = None) -> list[str]:
        return [f.name.removesuffix(".zip") for f in self.source().files if f.role == "archive"]

    def part_files(self, source: Source, part: str) -> list[RemoteFile]:
        return [source.file(f"{part}.zip"), *(f for f in source.files if f.role == "labels")]

    def info(self, raw_dir: Path | None = None) -> DatasetInfo:
        return DatasetInfo(self.name, "Toy", "multilabel", ("x",), True)


def test_a_new_dataset_is_one_adapter_and_one_registry_entry(monkeypatch):
    """Registering an adapter is all the planning side needs: schema, parts, inputs, dataset info."""
    monkeypatch.setitem(registry.DATASETS, "toy", _Toy())
    monkeypatch.setattr(registry, "NAMES", tuple(registry.DATASETS))
    schema = C.study_schema()
    assert "toy" in schema["properties"]["study"]["properties"]["finetune_dataset"]["anyOf"][0]["enum"]
    for section in ("datasets", "shards"):
        assert "toy" in schema["properties"][section]["properties"]
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["study"]["finetune_dataset"] = "toy"
    cfg["datasets"]["toy"] = {"mirror": "/somewhere"}
    cfg["shards"]["toy"] = {"image_size": 32}
    import jsonschema
    jsonschema.validate(cfg, schema)
    assert C.check_study(cfg).shards["toy"].image_size == 32      # ranges and relations too
    src = registry.get_source("toy")
    assert shards.parts_of("toy", ShardConfig(dataset="toy")) == ["a", "b"]
    assert [f.name for f in registry.get("toy").part_files(src, "b")] == ["b.zip", "labels.csv"]
    assert [f.name for f in registry.get("toy").split_files(src)] == ["labels.csv"]
    assert shards.dataset_info("toy").labels == ("x",)
