"""CheXpert (Irvin et al., AAAI 2019) from a folder in the layout Stanford ships it: ``CheXpert-v1.0``
or ``CheXpert-v1.0-small`` holding ``train.csv``, ``valid.csv`` and ``train/patientNNNNN/studyN/
viewN_frontal.jpg`` (``valid/...`` likewise).

The tables' columns: ``Path`` (``CheXpert-v1.0-small/train/patient00001/study1/view1_frontal.jpg``),
``Sex``, ``Age``, ``Frontal/Lateral``, ``AP/PA``, ``No Finding`` and the observations, each 1.0, 0.0,
-1.0 (uncertain) or blank (not mentioned). The targets are the 13 observations besides ``No Finding``
(the absence of the others, not a finding of its own; as torchxrayvision's CheXpert), under the policy
of ``shards.chexpert`` (``chexflow.data.tables``).

The split: the public test set is not released, so ``valid.csv`` (the 200 validation patients Stanford
labelled by radiologists' consensus) is the test split; validation is carved out of ``train.csv`` by
patient (``val_fraction``, seeded). A patient in both tables is refused. The patient is the path's
``patientNNNNN``. ``views: frontal`` leaves the lateral images out (a row whose ``Frontal/Lateral``
and file name disagree is refused); ``views: all`` keeps them, their view ``lateral`` in the audits.

The tables are downloaded (copied from the mirror, their sha256 recorded); the images are read from
the mirror folder itself (``datasets.chexpert.mirror``), each checked to lie inside it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pandas as pd

from chexflow.data import tables
from chexflow.data.config import ShardConfig
from chexflow.data.dataset import Dataset, DatasetInfo, RawSample, Report
from chexflow.data.sources import RemoteFile, Source

TRAIN_CSV, VALID_CSV = "train.csv", "valid.csv"
LABELS: tuple[str, ...] = (
    "Enlarged Cardiomediastinum", "Cardiomegaly", "Lung Opacity", "Lung Lesion", "Edema", "Consolidation",
    "Pneumonia", "Atelectasis", "Pneumothorax", "Pleural Effusion", "Pleural Other", "Fracture", "Support Devices",
)
NO_FINDING = "No Finding"
COLUMNS = ("Path", "Sex", "Age", "Frontal/Lateral", "AP/PA", NO_FINDING, *LABELS)
RELEASE_FOLDERS = ("CheXpert-v1.0", "CheXpert-v1.0-small")
# the path of an image under the release folder, as the tables give it (after the folder's name)
PATH = re.compile(r"^(?P<table>train|valid)/(?P<patient>patient\d+)/study\d+/view\d+_(?P<view>frontal|lateral)\.jpg$")
SPLIT_SOURCE = ("CheXpert: test = valid.csv (labelled by radiologists' consensus; the official test set is not "
                "public); train and val = train.csv, val carved out by patient (seeded)")
NOTES = ("No Finding is not a target: it is the absence of the 13 observations.",
         "The official CheXpert test set is not released: valid.csv is the test split.")
_HOW = ("CheXpert is distributed by the Stanford AIMI Center after registration "
        "(https://stanfordaimi.azurewebsites.net/datasets/8cbd9ed4-2eb9-4565-affc-111cf4f7ebe2). Unpack it and set "
        "datasets.chexpert.mirror to the CheXpert-v1.0-small (or CheXpert-v1.0) folder: train.csv, valid.csv, "
        "train/ and valid/.")


def read(path: Path | str, table: str) -> pd.DataFrame:
    """One of the two tables, checked: every column of the release, each row's path in the release's
    layout under ``table``/ (the patient and view taken from it, ``Frontal/Lateral`` agreeing), every
    observation (``No Finding`` included) 1, 0, -1 or blank. Adds ``image`` (the path under the
    release folder), ``patient``, ``sex``, ``age``, ``view`` (PA / AP / lateral / "" unknown) and
    ``_line``."""
    t = tables.read_table(path, COLUMNS, what=f"CheXpert {table}")
    t["image"] = t["Path"].map(_strip_release_folder)
    tables.refuse_paths(t.assign(Path=t["image"]), "Path", path)
    match = t["image"].str.extract(PATH)
    tables.refuse_rows(match["table"].isna(), t, path, "Path",
                       "{value!r} is not in the CheXpert layout (<release>/train|valid/patientN/studyN/viewN_frontal|"
                       "lateral.jpg)")
    tables.refuse_rows(match["table"] != table, t, path, "Path", f"{{value!r}} is not under {table}/")
    said = t["Frontal/Lateral"].str.lower()
    tables.refuse_rows(~said.isin(("frontal", "lateral")), t, path, "Frontal/Lateral",
                       "{value!r} is neither Frontal nor Lateral", "Path")
    tables.refuse_rows(said != match["view"], t, path, "Frontal/Lateral",
                       "{value!r} but the file name says otherwise: which view the image is cannot be told", "Path")
    tables.observations(t, {label: label for label in (NO_FINDING, *LABELS)}, path, "Path")
    t["patient"] = match["patient"]
    t["sex"] = tables.sexes(t["Sex"])
    t["age"] = tables.ages(t["Age"])
    t["view"] = np.where(said == "lateral", "lateral", tables.views(t["AP/PA"]).where(lambda v: v != "lateral", ""))
    return t


def _strip_release_folder(path: str) -> str:
    first, _, rest = path.partition("/")
    return rest if first in RELEASE_FOLDERS else path


def read_targets(path: Path | str, table: str, cfg: ShardConfig) -> pd.DataFrame:
    """The table (``read``) with the targets of the policy of ``cfg``: ``LABELS`` columns of float32."""
    t = read(path, table)
    obs = tables.observations(t, {label: label for label in LABELS}, path, "Path")
    values = tables.targets(obs, LABELS, cfg.uncertain, cfg.blank)
    return t.assign(**{label: values[:, j] for j, label in enumerate(LABELS)})


@dataclass(frozen=True)
class CheXpert(Dataset):
    """CheXpert from its release folder: one shard job per group of patients of train.csv
    (``train_parts``), one for valid.csv (the test split)."""
    name: str = "chexpert"
    stage: str = "finetune"
    split_roles: tuple[str, ...] = ("labels",)
    shard_options: tuple[str, ...] = ("train_parts", "max_member_mb", "max_image_megapixels", "uncertain",
                                      "blank", "views")
    folder: bool = True      # the images are read from the mirror folder (a local path), not downloaded

    def source(self, n_archives: int | None = None) -> Source:
        files = (RemoteFile(TRAIN_CSV, None, role="labels"), RemoteFile(VALID_CSV, None, role="labels"))
        return Source(name=self.name, title="CheXpert (Stanford ML Group)", files=files, how_to_obtain=_HOW)

    def parts(self, cfg: ShardConfig, n_archives: int | None = None) -> list[str]:
        """``train_parts`` jobs over train.csv's patients and one for valid.csv; an external test set
        (``test_only``): valid.csv's alone."""
        return [*([] if cfg.test_only else tables.part_names("train", cfg.train_parts)), "valid"]

    def part_files(self, source: Source, part: str) -> list[RemoteFile]:
        return [source.file(VALID_CSV if part == "valid" else TRAIN_CSV)]

    def check_settings(self, cfg: ShardConfig) -> list[str]:
        return tables.policy_problems(LABELS, cfg.uncertain, f"shards.{self.name}.uncertain")

    def labelling(self, cfg: ShardConfig) -> dict | None:
        return tables.labelling(LABELS, cfg, NOTES)

    def info(self, raw_dir: Path | None = None) -> DatasetInfo:
        return DatasetInfo(self.name, "CheXpert", "multilabel", LABELS, False, SPLIT_SOURCE)

    def split(self, raw_dir: Path, cfg: ShardConfig, *, expected: object = None) -> pd.DataFrame:
        raw_dir = Path(raw_dir)
        train, valid = read(raw_dir / TRAIN_CSV, "train"), read(raw_dir / VALID_CSV, "valid")
        val = tables.carve(train["patient"], cfg.val_fraction, cfg.split_seed)
        train["split"] = np.where(train["patient"].isin(val), "val", "train")
        valid["split"] = "test"
        shared = sorted(set(train["patient"]) & set(valid["patient"]))
        if shared:
            a, b = (t[t["patient"] == shared[0]].iloc[0] for t in (train, valid))
            raise tables.TableError(f"{raw_dir}: patient {shared[0]!r} is in {TRAIN_CSV} (line {a['_line']}, "
                                    f"{a['image']}) and in {VALID_CSV} (line {b['_line']}, {b['image']}), the test "
                                    f"split: a patient on both sides of the split ({len(shared)} such patient(s))")
        both = pd.concat([train, valid], ignore_index=True)
        dup = both["image"][both["image"].duplicated()]
        if len(dup):
            raise tables.TableError(f"{raw_dir}: image {dup.iloc[0]!r} is listed twice in train.csv/valid.csv "
                                    f"({len(dup)} such row(s))")
        for table, t in ((TRAIN_CSV, train), (VALID_CSV, valid)):
            line = tables.unread_ages(t["Age"], t["age"], t["_line"], raw_dir / table, "Age", self.name)
            if line:
                print(line)
        kept = tables.keep_views(both[both["split"] == "test"] if cfg.test_only else both, cfg)
        if cfg.test_only:
            print(f"{self.name}: an external test set (evaluate.external): {VALID_CSV} alone, {len(valid)} image(s)")
        lateral = (both["split"] == "test").sum() if cfg.test_only else len(both)
        if len(kept) < lateral:
            print(f"{self.name}: views: frontal leaves out {lateral - len(kept)} lateral image(s)")
        return tables.split_frame(kept, "image")

    def samples(self, raw_dir: Path, part: str, splits: pd.DataFrame, cfg: ShardConfig,
                report: Report) -> Iterator[RawSample]:
        """The part's rows of its table that the split table lists, in the table's order; the key of a
        sample is its path under the release folder."""
        name, table = (VALID_CSV, "valid") if part == "valid" else (TRAIN_CSV, "train")
        t = read_targets(Path(raw_dir) / name, table, cfg)
        if part != "valid":
            t = t[tables.part_of(t["patient"], cfg.train_parts) == tables.part_number(
                part, "train", cfg.train_parts, self.name)]
        t = t[t["image"].isin(set(splits["image"]))].merge(splits[["image", "split"]], on="image")
        target = dict(zip(t["image"], t[list(LABELS)].to_numpy(np.float32)))
        yield from tables.read_samples(t, cfg.images, Path(raw_dir) / name, cfg, report, target.__getitem__,
                                       f"datasets.{self.name}.mirror")

    def decode(self, data: bytes, key: str, cfg: ShardConfig) -> np.ndarray:
        return tables.decode_any(data, key, cfg)


ADAPTER = CheXpert()
