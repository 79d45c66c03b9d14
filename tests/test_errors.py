"""One-line refusals (chexflow.errors, chexflow.cli.main): every exception class of the package has an
exit code and a line ``chexflow <command>: <message> (<what to do>)``; real refusals through real
``chexflow`` processes give that exact line on stderr, their documented exit status and no traceback
unless asked for (``--debug``, ``CHEXFLOW_DEBUG=1``)."""
from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import chexflow
from chexflow import cli, errors
from chexflow.data import nih, registry
from chexflow.data.images import DecodeError
from chexflow.settings import ConfigError
from conftest import REPO, cli_env, requires_horovod

TODO = {name: r.todo for name, r in errors.REFUSALS.items()}


def todo(name: str) -> str:
    return f" ({TODO[name]})"


def package_exception_classes() -> dict[str, type]:
    """Every public exception class defined in a module of the package (what ``chexflow <command>``
    can raise), by dotted name."""
    found = {}
    for info in pkgutil.walk_packages(chexflow.__path__, "chexflow."):
        if info.name.endswith("__main__") or info.name.startswith("chexflow.install"):   # their own entry points
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name
                    and not name.startswith("_")):
                found[f"{info.name}.{name}"] = obj
    return found


@pytest.fixture(scope="module")
def classes() -> dict[str, type]:
    return classes_by_name()


def classes_by_name() -> dict[str, type]:
    """The package's exception classes by name (and Python's OSError), each name once."""
    found = package_exception_classes()
    by_name = {cls.__name__: cls for cls in found.values()}
    assert len(by_name) == len(found), "two exception classes of the package share a name"
    return {**by_name, "OSError": OSError}


def _instance(cls: type) -> BaseException:
    """An instance of ``cls`` with a message of the usual form (its constructor's arguments)."""
    if issubclass(cls, DecodeError):
        return cls("scan.dcm", "what is wrong with it")
    if issubclass(cls, ConfigError):
        return cls(["a.b: 0 is not >= 1", "c: unknown key"])
    return cls("data/x.bin: what is wrong with it")


# --------------------------------------------------------------------------- the table

def test_every_exception_class_of_the_package_has_an_exit_code_and_every_entry_a_class(classes):
    assert len(classes) >= 35
    missing = sorted(name for name, cls in classes.items()
                     if errors.refusal_of(cls) is None and name not in errors.TRAINER_VERDICTS)
    assert not missing, f"add these to chexflow.errors.REFUSALS: {missing}"
    stale = sorted(set(errors.REFUSALS) - set(classes))
    assert not stale, f"entries naming no exception class of the package: {stale}"
    assert {r.code for r in errors.REFUSALS.values()} <= set(errors.CODES)
    assert all(r.todo and "(" not in r.todo for r in errors.REFUSALS.values())   # one pair of parentheses


def test_the_trainers_exit_codes_keep_their_numbers_and_are_not_ours():
    from chexflow.train import lease, trainer
    assert (trainer.EXIT_DIVERGED, trainer.EXIT_NO_VALID_EPOCH, lease.EXIT_LEASE_HELD, trainer.EXIT_PREEMPTED) \
        == (3, 4, 5, 143)
    assert not {3, 4, 5, 143} & set(errors.CODES)
    assert errors.refusal_of(trainer.NoValidEpoch("x")) is None and errors.refusal_of(lease.LeaseHeld("x")) is None
    training = (REPO / "docs/training.md").read_text()
    assert all(f"| {code} |" in training for code in (3, 4, 5, 143))
    assert "3, 4, 5 and 143" in (REPO / "docs/errors.md").read_text()


def test_the_documented_table_is_the_codes_table():
    text = (REPO / "docs/errors.md").read_text()
    rows = dict(re.findall(r"^\| (\d+) \| (.+?) \|$", text, re.M))
    assert {int(k): v for k, v in rows.items()} == errors.CODES


@pytest.mark.parametrize("name", sorted(errors.REFUSALS))
def test_each_class_ends_the_command_with_its_line_and_code(name, classes, monkeypatch, capsys):
    """In-process: cli.main with a command that raises an instance of the class."""
    cls = classes[name]
    exc = OSError(2, "No such file or directory", "data/x.bin") if cls is OSError else _instance(cls)

    def boom(args):
        raise exc

    monkeypatch.setattr(cli, "cmd_keep_log", boom)
    monkeypatch.delenv(errors.DEBUG_ENV, raising=False)
    with pytest.raises(SystemExit) as ended:
        cli.main(["keep-log", "x.log"])
    assert ended.value.code == errors.REFUSALS[name].code
    err = capsys.readouterr().err
    if cls is OSError:
        assert err == f"chexflow keep-log: data/x.bin: No such file or directory{todo(name)}\n"
    elif isinstance(exc, ConfigError):
        assert err == (f"chexflow keep-log: a.b: 0 is not >= 1{todo(name)}\n"
                       f"chexflow keep-log: c: unknown key{todo(name)}\n")
    elif isinstance(exc, DecodeError):
        assert err == f"chexflow keep-log: {exc}{todo(name)}\n" and "scan.dcm" in err
    else:
        assert err == f"chexflow keep-log: data/x.bin: what is wrong with it{todo(name)}\n"


def test_a_subclass_not_listed_takes_its_base_entry():
    from chexflow.data.dicom import NotARadiograph
    from chexflow.studies.sweep import SweepError
    assert errors.refusal_of(NotARadiograph("a.dcm", "x")) == errors.REFUSALS["DecodeError"]
    assert errors.refusal_of(SweepError("x")).code == 2
    assert errors.refusal_of(FileNotFoundError(2, "No such file", "f")).code == 11
    assert errors.refusal_of(RuntimeError("a bug")) is None and errors.refusal_of(KeyError("k")) is None
    foreign = type("ConfigError", (ValueError,), {"__module__": "somewhere.else"})     # not ours: a bug
    assert errors.refusal_of(foreign("x")) is None


def test_a_worker_re_raised_error_shows_its_own_message_not_the_workers_traceback():
    """torch's DataLoader re-raises a worker's exception as its class with the worker's traceback as
    the message: the line shows the original message."""
    from chexflow.data.shard_reader import ShardReadError
    text = ("Caught ShardReadError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
            '  File "x.py", line 1, in f\n    raise ShardReadError(msg)\n'
            "chexflow.data.shard_reader.ShardReadError: data/shards/a.tar: truncated shard\n")
    assert errors.message(ShardReadError(text)) == "data/shards/a.tar: truncated shard\n"


# --------------------------------------------------------------------------- the last tracebacks
FINETUNE_FROM_PRETRAINING = json.dumps({"stage": "finetune", "dataset": "nih_demo", "backend": "single",
                                        "init": "pretrained"})
LAST_TRACEBACKS = [
    (["launch", "-n", "0", "--backend", "single", "true"], {}, "chexflow launch: -n: 0 ranks; launch needs at least 1"),
    (["launch", "-n", "1", "true"], {"CHEXFLOW_BACKEND": "mpi"},
     "chexflow launch: CHEXFLOW_BACKEND: 'mpi' is none of horovod | ddp | single"),
    (["launch", "-n", "1", "--backend", "single", "true"], {"OMP_NUM_THREADS": "4,2"},
     "chexflow launch: OMP_NUM_THREADS: '4,2' is not a number of threads (a positive integer): chexflow launch "
     "shares the job's threads among its ranks"),
    (["evaluate", "--model", "m.pt", "--manifest", "manifest.json", "--out-dir", "ev", "--train-config-json",
      FINETUNE_FROM_PRETRAINING], {},
     "chexflow evaluate: finetune.init is pretrained: the pretraining model is needed to compute the expected run id "
     "of the model (--pretrained)"),
    (["evaluate", "--model", "m.pt", "--manifest", "manifest.json", "--out-dir", "ev", "--pretrained", "pre.pt",
      "--train-config-json", FINETUNE_FROM_PRETRAINING, "--trials-json", "[{\"optim.lr\": 0.1"], {},
     "chexflow evaluate: --trials-json is not valid JSON: Expecting ',' delimiter: line 1 column 18 (char 17)"),
]


@pytest.mark.parametrize("argv, env, line", LAST_TRACEBACKS, ids=["launch -n 0", "unknown CHEXFLOW_BACKEND",
                                                                 "OMP_NUM_THREADS a list", "evaluate without --pretrained",
                                                                 "invalid --trials-json"])
def test_what_ended_in_a_traceback_is_a_one_line_refusal(argv, env, line, monkeypatch, capsys):
    """In-process, the real commands: each ends with its line and exit status 2 before anything runs."""
    monkeypatch.delenv(errors.DEBUG_ENV, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as ended:
        cli.main(argv)
    assert ended.value.code == 2
    assert capsys.readouterr().err == line + todo("ConfigError") + "\n"


def test_training_from_pretraining_without_the_file_is_a_refusal(demo_manifest, tmp_path):
    """`chexflow train` with init: pretrained and no --pretrained: the trainer refuses as a setting (exit 2,
    one line), where it raised a plain ValueError."""
    from chexflow.settings import from_dict
    from chexflow.train.backends import Backend
    from chexflow.train.config import TrainConfig
    from chexflow.train.trainer import Trainer, TrainPaths
    cfg = from_dict(TrainConfig, json.loads(FINETUNE_FROM_PRETRAINING))
    with pytest.raises(ConfigError) as refused:
        Trainer(cfg, TrainPaths(manifest=demo_manifest, out_dir=tmp_path, ckpt_dir=tmp_path / "ck"), Backend())
    assert errors.refusal_of(refused.value).code == 2
    assert errors.refusal_lines("train", refused.value, errors.refusal_of(refused.value)) == [
        "chexflow train: finetune.init is pretrained: the run's identity needs the pretraining model file "
        "(--pretrained)" + todo("ConfigError")]


def test_the_study_config_a_rank_status_and_the_divergence_marker_are_read_as_untrusted_files(tmp_path, capsys,
                                                                                                monkeypatch):
    """A FIFO where a file is read never blocks: the report's study config is refused (exit 11), a bad
    one is a setting (exit 2); a rank's status file or the divergence marker that is not a regular
    file, or not JSON, is passed over."""
    import os
    from chexflow.train import run as train_run
    from chexflow.train.trainer import DIVERGED_MARKER
    monkeypatch.delenv(errors.DEBUG_ENV, raising=False)
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    argv = ["report", "--out", str(tmp_path / "r.html"), "--inputs-json", "{}", "--study-config"]
    with pytest.raises(SystemExit) as ended:
        cli.main([*argv, str(fifo)])
    assert ended.value.code == 11
    assert capsys.readouterr().err == (f"chexflow report: {fifo}: a FIFO (named pipe), not a regular file; not read"
                                       + todo("OSError") + "\n")
    (tmp_path / "bad.yaml").write_text("a: [1\n")
    with pytest.raises(SystemExit) as ended:
        cli.main([*argv, str(tmp_path / "bad.yaml")])
    assert ended.value.code == 2 and capsys.readouterr().err.startswith(
        f"chexflow report: {tmp_path / 'bad.yaml'}: not a study config (while parsing a flow sequence")
    status = tmp_path / "status"
    status.mkdir()
    os.mkfifo(status / "1.json")
    (status / "2.json").write_text("{")
    assert errors.first_recorded_exit(status) is None
    monkeypatch.setenv(errors.RANK_STATUS_ENV, str(status))
    errors.record_exit(7, ["chexflow x: y (z)"])
    assert errors.first_recorded_exit(status) == (7, ["chexflow x: y (z)"])
    os.mkfifo(tmp_path / DIVERGED_MARKER)
    assert train_run._divergence(tmp_path) == "non-finite training loss"


# --------------------------------------------------------------------------- real refusals, real processes

def chexflow_cli(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chexflow", *args], env={**cli_env(), **(env or {})}, cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def refused(proc: subprocess.CompletedProcess, code: int) -> str:
    """The refusal line: the last line of stderr (after any progress bar), the only one of its kind."""
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.rstrip("\n").split("\n")[-1].split("\r")[-1]
    assert proc.stderr.count("chexflow ") >= 1 and proc.stderr.endswith(last + "\n")
    return last


@pytest.fixture(scope="module")
def demo(demo_manifest) -> Path:
    """The demo dataset's root: release/ (the mirror), raw/ (downloaded), shards/."""
    return demo_manifest.parent.parent


def test_configuration_error(tmp_path):
    proc = chexflow_cli("split", "--config-json", '{"bogus": 1, "val_fraction": 2.5}', "--raw", str(tmp_path),
                        "--out", str(tmp_path / "s.csv"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("chexflow split: config: bogus: unknown key; known: archives, blank, dataset, ")
    assert lines[1] == "chexflow split: config: val_fraction: 2.5 is not in [0, 1)" + todo("ConfigError")


def test_unknown_dataset(tmp_path):
    proc = chexflow_cli("download", "--dataset", "mimic", "--file", "x", "--dest", str(tmp_path))
    assert refused(proc, 2) == (f"chexflow download: unknown dataset 'mimic'; known datasets: "
                                f"{', '.join(registry.NAMES)}" + todo("UnknownSourceError"))


def test_unknown_file_of_a_dataset(tmp_path):
    proc = chexflow_cli("download", "--dataset", "nih_demo", "--n-archives", "2", "--file", "images_003.tar.gz",
                        "--dest", str(tmp_path))
    assert refused(proc, 2) == ("chexflow download: dataset 'nih_demo' has no file 'images_003.tar.gz'; its files: "
                                "images_001.tar.gz, images_002.tar.gz, Data_Entry_2017_v2020.csv, "
                                "train_val_list.txt, test_list.txt, BBox_List_2017.csv" + todo("UnknownFileError"))
    assert not any(tmp_path.iterdir())


def test_missing_mirror_file(demo, tmp_path):
    mirror = tmp_path / "mirror"
    shutil.copytree(demo / "release", mirror)
    (mirror / "images_002.tar.gz").unlink()
    proc = chexflow_cli("download", "--dataset", "nih_demo", "--file", "images_002.tar.gz", "--dest",
                        str(tmp_path / "raw"), "--mirror", str(mirror), "--n-archives", "3")
    assert refused(proc, 8) == (f"chexflow download: {mirror}/images_002.tar.gz: no such file"
                                + todo("NotFoundError"))


def test_checksum_mismatch(demo, tmp_path):
    mirror = tmp_path / "mirror"
    shutil.copytree(demo / "release", mirror)
    data = bytearray((mirror / "images_002.tar.gz").read_bytes())
    data[1000] ^= 0xFF
    (mirror / "images_002.tar.gz").write_bytes(bytes(data))
    proc = chexflow_cli("download", "--dataset", "nih_demo", "--file", "images_002.tar.gz", "--dest",
                        str(tmp_path / "raw"), "--mirror", str(mirror), "--n-archives", "3")
    line = refused(proc, 9)
    assert line.startswith(f"chexflow download: sha256 mismatch for images_002.tar.gz from {mirror}/images_002.tar.gz: "
                           "expected ") and line.endswith(todo("ChecksumMismatch"))
    assert not (tmp_path / "raw" / "images_002.tar.gz").exists()


def _shard_args(demo: Path, raw: Path, out: Path, part: str = "images_001") -> list[str]:
    cfg = {"dataset": "nih_demo", "image_size": 32, "samples_per_shard": 20, "val_fraction": 0.2}
    return ["shards", "--config-json", json.dumps(cfg), "--part", part, "--raw", str(raw), "--splits",
            str(demo / "shards" / "splits.csv"), "--out", str(out), "--n-archives", "3"]


def test_corrupt_archive(demo, tmp_path):
    raw = tmp_path / "raw"
    shutil.copytree(demo / "raw", raw)
    with open(raw / "images_001.tar.gz", "r+b") as fh:
        fh.truncate(20_000)
    line = refused(chexflow_cli(*_shard_args(demo, raw, tmp_path / "out")), 7)
    assert line == (f"chexflow shards: {raw}/images_001.tar.gz: truncated or corrupt archive (EOFError: Compressed "
                    "file ended before the end-of-stream marker was reached)" + todo("ArchiveError"))


def test_no_such_shard_part(demo, tmp_path):
    line = refused(chexflow_cli(*_shard_args(demo, demo / "raw", tmp_path / "out", part="images_009")), 7)
    assert line == ("chexflow shards: nih_demo: no part 'images_009'; its parts are ['images_001', 'images_002', "
                    "'images_003']" + todo("ShardError"))


def test_unknown_finding_in_the_label_table(demo, tmp_path):
    raw = tmp_path / "raw"
    shutil.copytree(demo / "raw", raw)
    table = raw / "Data_Entry_2017_v2020.csv"
    lines = table.read_text().splitlines(keepends=True)
    image, findings = lines[6].split(",")[:2]
    lines[6] = lines[6].replace(f"{image},{findings},", f"{image},{findings}|Covid,", 1)
    table.write_text("".join(lines))
    proc = chexflow_cli("split", "--config-json", '{"dataset": "nih_demo"}', "--raw", str(raw), "--out",
                        str(tmp_path / "s.csv"))
    assert refused(proc, 7) == (f"chexflow split: {table}: line 7 (Image Index {image}): unknown finding(s) ['Covid']; "
                                f"known: {list(nih.LABELS)} + 'No Finding'"
                                + todo("NIHError"))


def test_missing_file_is_the_operating_systems_reason(tmp_path):
    proc = chexflow_cli("split", "--config-json", '{"dataset": "nih_demo"}', "--raw", str(tmp_path / "nowhere"),
                        "--out", str(tmp_path / "s.csv"))
    assert refused(proc, 11) == (f"chexflow split: {tmp_path}/nowhere/Data_Entry_2017_v2020.csv: NIH label file not "
                                 "found" + todo("OSError"))


def test_report_inputs_that_are_not_json(tmp_path):
    proc = chexflow_cli("report", "--out", str(tmp_path / "r.html"), "--inputs-json", "{evaluation")
    assert refused(proc, 7) == ("chexflow report: --inputs-json is not valid JSON: Expecting property name enclosed in "
                                "double quotes: line 1 column 2 (char 1)" + todo("ReportInputError"))


@pytest.mark.parametrize("how", ["--debug", "CHEXFLOW_DEBUG=1"])
def test_the_traceback_only_when_asked_for(tmp_path, how):
    args = ["split", "--config-json", '{"dataset": "nih_demo"}', "--raw", str(tmp_path), "--out", str(tmp_path / "s")]
    quiet = chexflow_cli(*args, env={errors.DEBUG_ENV: "0"})
    line = refused(quiet, 11)
    loud = chexflow_cli("--debug", *args) if how == "--debug" else chexflow_cli(*args, env={errors.DEBUG_ENV: "1"})
    assert loud.returncode == 11
    assert loud.stderr.startswith("Traceback (most recent call last):") and "FileNotFoundError" in loud.stderr
    assert loud.stderr.endswith(line + "\n")


def test_a_bug_keeps_its_traceback_and_exit_status_1(tmp_path):
    code = ("import sys; from chexflow import cli\n"
            "def boom(args): raise RuntimeError('an unexpected state')\n"
            "cli.cmd_keep_log = boom\ncli.main(['keep-log', 'x.log'])\n")
    proc = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and proc.stderr.rstrip().endswith("RuntimeError: an unexpected state")
    assert "chexflow keep-log:" not in proc.stderr


def test_a_command_line_mistake_is_argparses_status_2():
    proc = chexflow_cli("evaluate", "--manifest", "m.json")
    assert proc.returncode == 2 and "the following arguments are required: --model, --out-dir" in proc.stderr


RANK_REFUSES = ("import sys\nfrom chexflow import cli\nfrom chexflow.data.nih import NIHError\n"
                "def boom(args): raise NIHError(\"data/raw/x.csv: line 3 (Image Index a.png): unknown finding(s)\")\n"
                "cli.cmd_keep_log = boom\ncli.main(['keep-log', 'x.log'])\n")
RANK_EXITS_3 = "import sys\nfrom chexflow import cli\ncli.cmd_keep_log = lambda args: sys.exit(3)\ncli.main(['keep-log', 'x'])\n"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["single", "ddp", pytest.param("horovod", marks=requires_horovod)])
def test_chexflow_launch_exits_with_its_ranks_status_and_ends_with_the_refusal(backend):
    """horovodrun and torchrun exit 1 whatever their ranks did (and print their own traceback): the
    rule's `chexflow launch` exits with the rank's status, and the job's log ends with its line."""
    ranks = "1" if backend == "single" else "2"
    proc = chexflow_cli("launch", "-n", ranks, "--backend", backend, sys.executable, "-c", RANK_REFUSES)
    assert proc.returncode == 7, proc.stderr[-3000:]
    expected = "chexflow keep-log: data/raw/x.csv: line 3 (Image Index a.png): unknown finding(s)" + todo("NIHError")
    assert proc.stderr.rstrip("\n").split("\n")[-1] == expected
    assert (backend != "single") == (proc.stderr.count(expected) > 1)      # repeated after the launcher's output
    trainer = chexflow_cli("launch", "-n", ranks, "--backend", backend, sys.executable, "-c", RANK_EXITS_3)
    assert trainer.returncode == 3, trainer.stderr[-3000:]


@pytest.mark.slow
def test_refused_model_file_and_missing_manifest(demo, demo_manifest, tmp_path):
    junk = tmp_path / "model.pt"
    junk.write_bytes(b"\x80\x04not a torch archive" * 100)
    line = refused(chexflow_cli("evaluate", "--model", str(junk), "--manifest", str(demo_manifest), "--out-dir",
                                str(tmp_path / "ev")), 6)
    assert line.startswith(f"chexflow evaluate: {junk}: refused: ") and line.endswith(
        todo("RefusedFile"))
    cfg = {"stage": "finetune", "dataset": "nih_demo", "backend": "single"}
    proc = chexflow_cli("train", "--config-json", json.dumps(cfg), "--manifest", str(tmp_path / "none.json"),
                        "--out-dir", str(tmp_path / "tr"), "--ckpt-dir", str(tmp_path / "tr" / "ck"))
    line = refused(proc, 7)
    assert line.startswith(f"chexflow train: {tmp_path}/none.json: cannot read dataset manifest (")
    assert line.endswith(todo("ManifestError"))


# One interpreter imports chexflow and every exception class once, then forks a child per class and
# mode: each child is a real process that runs cli.main with the class raised by a command, its stderr
# a file of its own, its exit status the one cli.main gives (a process per class started from scratch
# spent ~10 s a class importing torch, 80 processes in all).
_FORKED_REFUSALS = """
import json, os, sys, tempfile, traceback
from chexflow import cli, errors
import test_errors as T

classes, out = T.classes_by_name(), {}
for name in sys.argv[1:]:
    cls = classes[name]
    exc = OSError(2, 'No such file or directory', 'data/x.bin') if cls is OSError else T._instance(cls)
    for mode in ("quiet", "loud"):
        with tempfile.TemporaryFile() as err:
            sys.stdout.flush(); sys.stderr.flush()
            pid = os.fork()
            if pid == 0:                                   # the child: cli.main, as `python -m chexflow` runs it
                os.dup2(err.fileno(), 2)
                os.environ.pop(errors.DEBUG_ENV, None)
                if mode == "loud":
                    os.environ[errors.DEBUG_ENV] = "1"
                def boom(args, exc=exc):
                    raise exc
                cli.cmd_keep_log = boom
                try:
                    cli.main(["keep-log", "x.log"])
                    code = 0
                except SystemExit as stop:
                    code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
                except BaseException:                      # what the interpreter does with an uncaught one
                    traceback.print_exc()
                    code = 1
                sys.stderr.flush()
                os._exit(code)
            _, status = os.waitpid(pid, 0)
            err.seek(0)
            out.setdefault(name, {})[mode] = {"code": os.waitstatus_to_exitcode(status),
                                             "stderr": err.read().decode("utf-8", "replace")}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def forked_refusals() -> dict:
    env = {**cli_env(), "PYTHONPATH": f"{Path(__file__).parent}:{cli_env()['PYTHONPATH']}"}
    proc = subprocess.run([sys.executable, "-c", _FORKED_REFUSALS, *sorted(errors.REFUSALS)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(errors.REFUSALS))
def test_each_class_through_a_real_chexflow_process(name, forked_refusals):
    """Each class of the table raised by a command of a real process running cli.main: exactly its
    line, its exit status, no traceback; with CHEXFLOW_DEBUG=1 the traceback, then the same line."""
    runs = forked_refusals[name]
    quiet = subprocess.CompletedProcess([], runs["quiet"]["code"], "", runs["quiet"]["stderr"])
    line = refused(quiet, errors.REFUSALS[name].code)
    assert line.startswith("chexflow keep-log: ") and line.endswith(todo(name))
    loud = runs["loud"]
    assert loud["code"] == quiet.returncode and "Traceback" in loud["stderr"] and loud["stderr"].endswith(quiet.stderr)