"""A folder of radiographs described by one CSV table (``datasets.<name>`` with ``format: csv``): as
many such datasets as a config names, each an adapter made from its declaration (``TableSpec``,
``chexflow.data.registry.declare``).

The declaration names the table, the image folder, which column holds the image path (relative to
the folder) and the patient, one column per finding (1, 0, -1 uncertain, blank: the policy of
``shards.<name>``, ``chexflow.data.tables``), and optionally sex, age, view and split columns. The
images are PNG, JPEG or DICOM, read as ``chexflow predict`` reads them. Without a split column the
patients are carved: ``test_fraction`` of them for test, then ``val_fraction`` of the rest for
validation (seeded); with one, its values must be train, val or test and a patient's rows all in one.
A split column with train rows and no val (a hospital export rarely has one) gets its validation
patients carved out of train (``val_fraction``, seeded), counted in the split log (the manifest's notes
state the rule). A dataset only ``evaluate.external`` uses (``test_only``) keeps its test rows, one shard job.
Messages name the table as the declaration gives it (not its copy under ``data/raw/<name>/``).
``views: frontal`` needs the view column (a row without a view is refused: it could be a lateral
image) and leaves the lateral rows out; ``views: all`` keeps every row.
"""
from __future__ import annotations

import dataclasses
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Iterator

import numpy as np
import pandas as pd

from chexflow.data import tables
from chexflow.data.config import ShardConfig, TableSpec
from chexflow.data.dataset import Dataset, DatasetInfo, RawSample, Report
from chexflow.data.sources import RemoteFile, Source
from chexflow.fsutil import file_kind

SPLIT_VALUES = ("train", "val", "test")


def table_name(spec: TableSpec) -> str:
    """The table's file name under ``data/raw/<name>/`` (its name in the folder it comes from)."""
    return PurePosixPath(str(spec.table).replace("\\", "/")).name


def spec_problems(spec: TableSpec, key: str) -> list[str]:
    """What a declaration lacks or repeats, each naming its dotted key."""
    out = [f"{key}.{k}: required (the {what})" for k, what in (("table", "CSV file"), ("images", "image folder"))
           if not getattr(spec, k)]
    if not spec.findings:
        out.append(f"{key}.findings: name at least one finding and its column, e.g. {{Effusion: effusion}}")
    used = [v for v in dataclasses.asdict(spec.columns).values() if v] + list(spec.findings.values())
    twice = sorted({c for c in used if used.count(c) > 1})
    if twice:
        out.append(f"{key}: column(s) {twice} named for more than one use")
    if spec.table and table_name(spec) in ("", ".", ".."):
        out.append(f"{key}.table: {spec.table!r} is not a file")
    return out + file_problems(spec, key)


def file_problems(spec: TableSpec, key: str) -> list[str]:
    """The declared table must be a regular file and the image folder a folder, checked before any job
    (``stat`` only: nothing is opened, so a FIFO cannot block), each problem naming the key and the path
    as the user set them."""
    out = []
    for name, want, fits in (("table", "not a regular file", stat.S_ISREG), ("images", "not a folder", stat.S_ISDIR)):
        value = getattr(spec, name)
        if not value:
            continue
        try:
            mode = os.stat(value).st_mode
        except OSError as exc:
            out.append(f"{key}.{name}: {value}: {exc.strerror or 'cannot be read'}")
            continue
        if not fits(mode):
            out.append(f"{key}.{name}: {value}: {file_kind(mode)}, {want}")
    return out


@dataclass(frozen=True)
class CSVFolder(Dataset):
    """A CSV-described folder: one shard job per group of patients (``train_parts``)."""
    name: str = "csv"
    stage: str = "finetune"
    split_roles: tuple[str, ...] = ("labels",)
    shard_options: tuple[str, ...] = ("train_parts", "max_member_mb", "max_image_megapixels", "uncertain", "blank",
                                      "views", "test_fraction")
    folder: bool = True
    spec: TableSpec = field(default_factory=TableSpec)

    @property
    def findings(self) -> tuple[str, ...]:
        return tuple(self.spec.findings)

    def source(self, n_archives: int | None = None) -> Source:
        return Source(name=self.name, title=self.spec.title or self.name,
                      files=(RemoteFile(table_name(self.spec), None, role="labels"),),
                      how_to_obtain=f"datasets.{self.name}.table names the CSV file")

    def mirror(self) -> str:
        """Where the download finds the table: its folder."""
        return str(PurePosixPath(str(self.spec.table)).parent)

    def parts(self, cfg: ShardConfig, n_archives: int | None = None) -> list[str]:
        """``train_parts`` jobs by patient; one for an external test set (``test_only``: its test rows)."""
        return tables.part_names("part", self._n_parts(cfg))

    @staticmethod
    def _n_parts(cfg: ShardConfig) -> int:
        return 1 if cfg.test_only else cfg.train_parts

    def part_files(self, source: Source, part: str) -> list[RemoteFile]:
        return list(source.files)

    def check_settings(self, cfg: ShardConfig) -> list[str]:
        key = f"shards.{self.name}"
        out = tables.policy_problems(self.findings, cfg.uncertain, f"{key}.uncertain")
        if cfg.views == "frontal" and not self.spec.columns.view:
            out.append(f"{key}.views: frontal needs datasets.{self.name}.columns.view (which rows are lateral); "
                       "without a view column set views: all")
        if not self.spec.columns.split and cfg.test_fraction + cfg.val_fraction > 1.0 - 1e-9 and cfg.test_fraction < 1:
            out.append(f"{key}: test_fraction + val_fraction leave no patient for training")
        return out

    def labelling(self, cfg: ShardConfig) -> dict | None:
        cols = self.spec.columns
        notes = [f"finding {f!r}: column {c!r} of {table_name(self.spec)}" for f, c in self.spec.findings.items()]
        notes.append(f"split: column {cols.split!r} (without val rows: val_fraction {cfg.val_fraction:g} of the train "
                     f"patients carved out, seed {cfg.split_seed})" if cols.split else
                     f"split: carved by patient (test_fraction {cfg.test_fraction:g}, val_fraction "
                     f"{cfg.val_fraction:g}, seed {cfg.split_seed})")
        return tables.labelling(self.findings, cfg, notes)

    def info(self, raw_dir: Path | None = None) -> DatasetInfo:
        how = (f"column {self.spec.columns.split!r} of the table" if self.spec.columns.split else
               "carved by patient (test_fraction, then val_fraction of the rest; seeded)")
        return DatasetInfo(self.name, self.spec.title or self.name, "multilabel", self.findings, False,
                           f"{table_name(self.spec)}: {how}")

    def shown(self, path: Path | str) -> str:
        """The table as messages name it: the declaration's ``table`` (the user's file), else ``path``."""
        return str(self.spec.table or path)

    def read(self, path: Path | str) -> tuple[pd.DataFrame, np.ndarray]:
        """The table checked (columns, image paths, observations): its rows as ``image``, ``patient``,
        ``split`` ("" when carved), ``sex``, ``age`` (and ``age_cell``), ``view`` and ``_line``, and the
        findings' observations (``tables.observations``). Messages name the user's table (``shown``)."""
        cols = self.spec.columns
        optional = [c for c in (cols.sex, cols.age, cols.view, cols.split) if c]
        t = tables.read_table(path, [cols.image, cols.patient, *optional, *self.spec.findings.values()],
                              what=f"table of {self.name}", shown=self.shown(path))
        path = self.shown(path)
        obs = tables.observations(t, self.spec.findings, path, cols.image)
        image = tables.refuse_paths(t, cols.image, path)
        tables.refuse_rows(t[cols.patient] == "", t, path, cols.patient, "no patient", cols.image)
        tables.refuse_rows(image.duplicated(), t, path, cols.image, "{value!r} is listed twice")
        if cols.split:
            tables.refuse_rows(~t[cols.split].isin(SPLIT_VALUES), t, path, cols.split,
                               f"{{value!r}} is not one of {list(SPLIT_VALUES)}", cols.image)
        blank = pd.Series("", index=t.index)
        rows = pd.DataFrame({"image": image, "patient": t[cols.patient],
                             "split": t[cols.split] if cols.split else blank,
                             "sex": tables.sexes(t[cols.sex]) if cols.sex else blank,
                             "age": tables.ages(t[cols.age]) if cols.age else blank,
                             "view": tables.views(t[cols.view]) if cols.view else blank,
                             "view_cell": t[cols.view] if cols.view else blank, "_line": t["_line"],
                             "age_cell": t[cols.age] if cols.age else blank})
        return rows, obs

    def _with_views(self, t: pd.DataFrame, path: Path, cfg: ShardConfig) -> pd.DataFrame:
        if cfg.views == "frontal":
            tables.refuse_rows(t["view"] == "", t.rename(columns={"view_cell": self.spec.columns.view}),
                               self.shown(path),
                               self.spec.columns.view, "{value!r} is no view (PA, AP or lateral): with views: "
                               "frontal a row of unknown view could be a lateral image", "image")
        return tables.keep_views(t, cfg)

    def split(self, raw_dir: Path, cfg: ShardConfig, *, expected: object = None) -> pd.DataFrame:
        path = Path(raw_dir) / table_name(self.spec)
        t, _ = self.read(path)
        shown = self.shown(path)
        if self.spec.columns.age and (line := tables.unread_ages(t["age_cell"], t["age"], t["_line"], shown,
                                                                 self.spec.columns.age, self.name)):
            print(line)
        if self.spec.columns.split:
            tables.one_split_per_patient(t, shown, "image")
        else:
            test = tables.carve(t["patient"], cfg.test_fraction, cfg.split_seed, stream=1)
            val = tables.carve(sorted(set(t["patient"]) - test), cfg.val_fraction, cfg.split_seed)
            t["split"] = np.where(t["patient"].isin(test), "test", np.where(t["patient"].isin(val), "val", "train"))
        kept = self._with_views(t, path, cfg).copy()
        if self.spec.columns.split and not cfg.test_only:   # of the images kept: laterals validate nothing
            self._carve_val(kept, shown, cfg)
        if len(kept) < len(t):
            print(f"{self.name}: views: frontal leaves out {len(t) - len(kept)} lateral image(s)")
        if cfg.test_only and not (kept["split"] == "test").any():
            raise tables.TableError(f"{shown}: no test image (evaluate.external scores a dataset's test split)")
        if cfg.test_only:
            print(f"{self.name}: an external test set (evaluate.external): its {int((kept['split'] == 'test').sum())} "
                  f"test image(s) of {len(kept)} kept")
            kept = kept[kept["split"] == "test"]
        return tables.split_frame(kept, "image")

    def _carve_val(self, t: pd.DataFrame, shown: str, cfg: ShardConfig) -> None:
        """A split column with train rows and none for val: ``val_fraction`` of the train patients (seeded)
        become val, said in the split log; one train patient cannot be split so (a ``TableError``)."""
        if (t["split"] == "val").any() or not (t["split"] == "train").any():
            return
        train = sorted(set(t.loc[t["split"] == "train", "patient"]))
        val = tables.carve(train, cfg.val_fraction, cfg.split_seed)
        column = self.spec.columns.split
        if not val or len(val) == len(train):
            raise tables.TableError(f"{shown}: column {column!r} has no 'val' rows and its {len(train)} train "
                                    f"patient(s) leave none to carve for validation (val_fraction {cfg.val_fraction:g}"
                                    "): mark some patients val, or list more train patients")
        t.loc[t["patient"].isin(val), "split"] = "val"
        print(f"{self.name}: column {column!r} of {shown} has no 'val' rows: {len(val)} of {len(train)} train "
              f"patients carved out for validation by patient (val_fraction {cfg.val_fraction:g}, "
              f"split_seed {cfg.split_seed})")

    def samples(self, raw_dir: Path, part: str, splits: pd.DataFrame, cfg: ShardConfig,
                report: Report) -> Iterator[RawSample]:
        path = Path(raw_dir) / table_name(self.spec)
        t, obs = self.read(path)
        target = dict(zip(t["image"], tables.targets(obs, self.findings, cfg.uncertain, cfg.blank)))
        n = self._n_parts(cfg)
        t = t[tables.part_of(t["patient"], n) == tables.part_number(part, "part", n, self.name)]
        t = t[t["image"].isin(set(splits["image"]))].drop(columns="split").merge(splits[["image", "split"]], on="image")
        yield from tables.read_samples(t, cfg.images, self.shown(path), cfg, report, target.__getitem__,
                                       f"datasets.{self.name}.images")

    def decode(self, data: bytes, key: str, cfg: ShardConfig) -> np.ndarray:
        return tables.decode_any(data, key, cfg)


def adapter(name: str, spec: TableSpec) -> CSVFolder:
    return CSVFolder(name=name, spec=spec)
