"""The shard stage on hostile archives (issue 17 items 4 and 5), generated here from the demo release:
duplicate image names, incomplete images, oversize members and images, a killed part resumed, and a
shard job that finds only its own archive on disk."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

import hostile
from chexflow.data.config import ShardConfig
from chexflow.data import nih
from chexflow.data import shards as S
from conftest import cli_env, snakemake

N_ARCHIVES = 3           # the demo_manifest fixture's release: 3 archives of 80 images at 32 px


def _cfg(**kw) -> ShardConfig:
    base = dict(dataset="nih_demo", image_size=32, samples_per_shard=10, val_fraction=0.2, max_reject_fraction=0.0)
    return ShardConfig(**{**base, **kw})


def _members(demo_manifest: Path, archive: int) -> list[tuple[str, bytes]]:
    """(member name, bytes) of the files of one archive of the demo release, in archive order."""
    with tarfile.open(demo_manifest.parent.parent / "raw" / nih.archive_name(archive), "r:gz") as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar if m.isfile()]


def _release(root: Path, demo_manifest: Path, archives: dict[int, list[tuple[str, bytes | int]]]) -> Path:
    """A raw directory: the demo release's tables and the given archives (number -> members)."""
    raw = root / "raw"
    raw.mkdir(parents=True)
    for table in nih.NIH_TABLES:
        shutil.copyfile(demo_manifest.parent.parent / "raw" / table, raw / table)
    for number, members in archives.items():
        hostile.tar_gz(raw / nih.archive_name(number), members)
    return raw


def _write_part(raw: Path, demo_manifest: Path, out: Path, part: int = 1, **cfg) -> dict:
    return S.write_part("nih_demo", f"images_{part:03d}", raw, demo_manifest.parent / "splits.csv", out, _cfg(**cfg),
                        n_archives=N_ARCHIVES)


def _written_keys(part_dir: Path) -> list[str]:
    from chexflow.data import shard_reader as SR
    return [json.loads(s["meta.json"])["image"] for shard in sorted(part_dir.glob("*.tar"))
            for s in SR.iter_shard(str(shard))]


# --------------------------------------------------------------------------- duplicate image names

def test_same_name_in_two_folders_of_one_archive_is_an_error(tmp_path, demo_manifest):
    members = _members(demo_manifest, 1)
    name = Path(members[5][0]).name
    raw = _release(tmp_path, demo_manifest, {1: [*members, (f"images/again/{name}", members[5][1])]})
    with pytest.raises(S.ShardError) as ei:
        _write_part(raw, demo_manifest, tmp_path / "out")
    assert str(ei.value).startswith(
        f"nih_demo/images_001: 1 image name(s) found more than once, which would put the same image in the split "
        f"twice: '{name}' in images_001.tar.gz:images/{name} and in images_001.tar.gz:images/again/{name}")
    assert not (tmp_path / "out" / "manifest.json").exists()
    # each copy alone is fine: 80 distinct images
    m = _write_part(_release(tmp_path / "ok", demo_manifest, {1: members}), demo_manifest, tmp_path / "ok_out")
    assert sum(s["count"] for s in m["shards"]) == 80 and len(m["members"]) == 80


def test_same_name_in_two_archives_is_an_error_at_the_gather(tmp_path, demo_manifest):
    one, two = _members(demo_manifest, 1), _members(demo_manifest, 2)
    copied = Path(one[7][0]).name
    raw = _release(tmp_path, demo_manifest, {1: one, 2: [*two[:30], one[7], *two[30:]], 3: _members(demo_manifest, 3)})
    parts = []
    for part in (1, 2, 3):
        m = _write_part(raw, demo_manifest, tmp_path / "parts" / f"images_{part:03d}", part)
        parts.append(tmp_path / "parts" / f"images_{part:03d}" / "manifest.json")
        assert m["members"][copied if part < 3 else Path(_members(demo_manifest, 3)[0][0]).name]
    assert sorted(_written_keys(tmp_path / "parts/images_001") + _written_keys(tmp_path / "parts/images_002")
                  ).count(copied) == 2                      # each part alone wrote it once
    with pytest.raises(S.ShardError) as ei:
        S.gather("nih_demo", parts, tmp_path / "manifest.json", _cfg(), splits_csv=demo_manifest.parent / "splits.csv")
    assert (f"'{copied}' in images_001.tar.gz:images/{copied} and in images_002.tar.gz:images/{copied}"
            in str(ei.value))
    assert not (tmp_path / "manifest.json").exists()


# --------------------------------------------------------------------------- incomplete and oversize images

def test_incomplete_images_are_rejects_with_their_reason(tmp_path, demo_manifest, capsys):
    members = _members(demo_manifest, 1)
    name = [Path(m).name for m, _ in members]
    grey = np.random.default_rng(0).integers(0, 256, (40, 40), dtype=np.uint8)
    bad = {3: hostile.png_declaring_height(members[3][1], 64),                          # 8-bit, 32 of 64 rows
           9: hostile.png_declaring_height(hostile.png(grey.astype(np.uint16) * 250), 41),  # 16-bit, 40 of 41 rows
           20: (lambda j: j[:len(j) // 2] + b"\xff\xd9")(hostile.jpeg(grey)),          # a JPEG cut short
           30: hostile.jpeg_declaring_height(hostile.jpeg(grey), 80),
           50: hostile.png(np.zeros((2100, 2000), np.uint8))}                            # 4.2 MP > 4 MP
    for i, data in bad.items():
        members[i] = (members[i][0], data)
    raw = _release(tmp_path, demo_manifest, {1: members})
    with pytest.raises(S.ShardError, match=r"5 of 80 images rejected"):
        _write_part(raw, demo_manifest, tmp_path / "strict", max_image_megapixels=4)
    strict_log = capsys.readouterr().err
    m = _write_part(raw, demo_manifest, tmp_path / "out", max_reject_fraction=0.1, max_image_megapixels=4)
    logged = [line for line in capsys.readouterr().err.splitlines() if "rejected" in line]
    # the job's log names each reject with its member and reason, as the manifest lists them (also when it fails)
    assert logged == [f"images_001: rejected {r['image']} ({r['origin']}) at decode: {r['reason']}" for r in m["rejects"]]
    assert all(line in strict_log for line in logged)
    rejects = {r["image"]: r for r in m["rejects"]}
    assert list(rejects) == [name[i] for i in sorted(bad)]
    assert all(r["stage"] == "decode" and r["part"] == "images_001" for r in rejects.values())
    assert rejects[name[3]]["origin"] == f"images_001.tar.gz:{members[3][0]}"
    assert "incomplete PNG: its image data ends before the 32 x 64 px its header declares" in rejects[name[3]]["reason"]
    assert "40 x 41 px its header declares" in rejects[name[9]]["reason"]
    for i in (20, 30):
        assert "incomplete or corrupt JPEG: Corrupt JPEG data: premature end of data segment" in rejects[name[i]]["reason"]
    assert "header declares 2000 x 2100 = 4.2 MP, more than the 4 MP allowed (max_image_megapixels); not decoded" \
        in rejects[name[50]]["reason"]
    written = _written_keys(tmp_path / "out")
    assert sorted(written) == sorted(set(name) - set(rejects)) and len(written) == 75
    assert sorted(m["members"]) == sorted(name)            # the rejected images were found (coverage)
    assert set(rejects) <= set(m["listed_found"])


def _peak_rss_of_shard_job(raw: Path, splits: Path, out: Path, cfg: dict) -> tuple[int, subprocess.CompletedProcess]:
    """Peak RSS in bytes of ``chexflow shards`` run as the rule runs it (its own process: os.wait4)."""
    log = out.parent / f"{out.name}.log"
    cmd = [sys.executable, "-m", "chexflow", "shards", "--config-json", json.dumps(cfg), "--part", "images_001",
           "--raw", str(raw), "--splits", str(splits), "--out", str(out), "--n-archives", str(N_ARCHIVES)]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=cli_env(), stdout=fh, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, log.read_text()[-3000:]
    return usage.ru_maxrss * 1024, proc             # Linux: KiB


@pytest.mark.slow
def test_oversize_member_is_skipped_unread(tmp_path, demo_manifest):
    """A 1 GiB member (4.7 MB in the gzip tar) costs no memory: the shard job's peak RSS is that of
    the same job without it. Before the cap it was read whole (then rejected as not a PNG)."""
    members = _members(demo_manifest, 1)
    huge_name, huge = members[40][0], 1 << 30
    cfg = {"dataset": "nih_demo", "image_size": 32, "samples_per_shard": 10, "max_reject_fraction": 0.05,
           "max_member_mb": 16}
    splits = demo_manifest.parent / "splits.csv"
    base_raw = _release(tmp_path / "base", demo_manifest, {1: members[:40] + members[41:]})
    big_raw = _release(tmp_path / "big", demo_manifest, {1: members[:40] + [(huge_name, huge)] + members[41:]})
    assert (big_raw / "images_001.tar.gz").stat().st_size < 8e6
    base_rss, _ = _peak_rss_of_shard_job(base_raw, splits, tmp_path / "base_out", cfg)
    big_rss, _ = _peak_rss_of_shard_job(big_raw, splits, tmp_path / "big_out", cfg)
    assert big_rss - base_rss < 64 * 2**20, (base_rss, big_rss)     # far below the member's 1,024 MiB
    m = json.loads((tmp_path / "big_out" / "manifest.json").read_text())
    assert m["rejects"] == [{"image": huge_name, "part": "images_001", "stage": "read",
                             "reason": "1,073,741,824 bytes, more than the 16,000,000 allowed (max_member_mb); "
                                       "not read"}]
    assert sum(s["count"] for s in m["shards"]) == 79


# --------------------------------------------------------------------------- a killed part, resumed

def _killed_mid_part(cmd: list[str], out: Path, tries: int = 5) -> None:
    """Run the shard job and SIGKILL it as soon as its first shard is recorded (progress.json); a run
    that finished before the kill is discarded and tried again."""
    for _ in range(tries):
        shutil.rmtree(out, ignore_errors=True)
        proc = subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while proc.poll() is None and not (out / "progress.json").exists():
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if not (out / "manifest.json").exists() and (out / "progress.json").exists():
            return
    pytest.fail(f"the shard job finished {tries} times before it could be killed")


@pytest.mark.slow
def test_rejects_are_counted_once_when_a_killed_part_resumes(tmp_path, demo_manifest):
    """Member-level rejects (unsafe, not listed, oversize) and decode rejects before and after the
    kill: the resumed part reports exactly those of an uninterrupted run (not the earlier attempt's
    plus the replay's), and the same shards."""
    members = _members(demo_manifest, 1)
    for i in (4, 33, 71):                                              # decode rejects
        members[i] = (members[i][0], hostile.png_declaring_height(members[i][1], 33))
    padded: list[tuple[str, bytes | int]] = [("../evil.png", members[0][1]), ("images/not_listed.png", members[1][1])]
    for i, member in enumerate(members):
        padded.append(member)
        if i % 8 == 7:         # oversize members, skipped unread: rejects, and time for the kill
            padded.append((f"images/pad_{i:02d}.png", 48_000_000))
    raw = _release(tmp_path, demo_manifest, {1: padded})
    cfg = {"dataset": "nih_demo", "image_size": 32, "samples_per_shard": 5, "max_reject_fraction": 0.5,
           "max_member_mb": 16}

    def cmd(out: Path) -> list[str]:
        return [sys.executable, "-m", "chexflow", "shards", "--config-json", json.dumps(cfg), "--part", "images_001",
                "--raw", str(raw), "--splits", str(demo_manifest.parent / "splits.csv"), "--out", str(out),
                "--n-archives", str(N_ARCHIVES)]

    subprocess.run(cmd(tmp_path / "clean"), env=cli_env(), check=True, capture_output=True)
    clean = json.loads((tmp_path / "clean" / "manifest.json").read_text())
    assert len(clean["rejects"]) == 1 + 1 + 10 + 3
    assert [r["stage"] for r in clean["rejects"]].count("decode") == 3

    out = tmp_path / "killed"
    _killed_mid_part(cmd(out), out)
    progress = json.loads((out / "progress.json").read_text())
    assert progress["shards"] and progress["rejects"]
    resumed = subprocess.run(cmd(out), env=cli_env(), check=True, capture_output=True, text=True)
    assert "resuming" in resumed.stdout
    m = json.loads((out / "manifest.json").read_text())
    assert m["rejects"] == clean["rejects"]
    assert [(s["file"], s["sha256"]) for s in m["shards"]] == [(s["file"], s["sha256"]) for s in clean["shards"]]
    assert f"{sum(s['count'] for s in m['shards'])} images, {len(clean['rejects'])} rejected" in resumed.stdout
    # the resumed job's log names every reject, those its earlier attempt found as such
    named = [line for line in resumed.stderr.splitlines() if ": rejected " in line]
    assert [line.split(" rejected ", 1)[1].split(" ", 1)[0] for line in named] == [r["image"] for r in m["rejects"]]
    assert any(" by an earlier attempt: " in line for line in named)
    assert "images_001: rejected ../evil.png at read: " in resumed.stderr


# --------------------------------------------------------------------------- a shard job's view of its source

def test_shard_job_needs_only_its_own_archive(tmp_path, demo_manifest):
    """The write_shards job of images_003, as Snakemake runs it, with only its own archive and the
    tables downloaded (archives 1 and 2 still downloading): its view of the release comes from the
    configuration, not from what other jobs have finished."""
    import yaml
    from conftest import REPO
    work = tmp_path / "work"
    raw = work / "data/raw/nih_demo"
    raw.mkdir(parents=True)
    for table in nih.NIH_TABLES:
        shutil.copyfile(demo_manifest.parent.parent / "raw" / table, raw / table)
    shutil.copyfile(demo_manifest.parent.parent / "raw" / "images_003.tar.gz", raw / "images_003.tar.gz")
    (work / "data/shards/nih_demo").mkdir(parents=True)
    shutil.copyfile(demo_manifest.parent / "splits.csv", work / "data/shards/nih_demo/splits.csv")
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["demo_release"].update(n_images=240, images_per_archive=80)          # the fixture's release: 3 archives
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    target = "data/shards/nih_demo/parts/images_003/manifest.json"
    dry = snakemake(work, target, "--configfile", str(work / "config.yaml"), "-n", "--allowed-rules", "write_shards")
    assert dry.returncode == 0, (dry.stdout + dry.stderr)[-3000:]
    commands = [line.split("Shell command:", 1)[1].strip() for line in (dry.stdout + dry.stderr).splitlines()
                if "Shell command: chexflow shards" in line]
    assert len(commands) == 1 and "--part images_003" in commands[0] and "--n-archives 3" in commands[0]
    (work / "logs/shards/nih_demo").mkdir(parents=True)
    job = subprocess.run(["bash", "-c", f"set -euo pipefail; {commands[0]}"], cwd=work, env=cli_env(),
                         capture_output=True, text=True)
    assert job.returncode == 0, (work / "logs/shards/nih_demo/images_003.log").read_text()[-3000:]
    m = json.loads((work / target).read_text())
    assert m["part"] == "images_003" and not m["rejects"]
    assert sorted(m["members"]) == sorted(Path(n).name for n, _ in _members(demo_manifest, 3))
    assert sum(s["count"] for s in m["shards"]) == 80
    assert sorted(p.name for p in raw.iterdir()) == sorted([*nih.NIH_TABLES, "images_003.tar.gz"])


def test_size_caps_are_positive_numbers():
    from chexflow.settings import ConfigError, from_dict
    for key in ("max_member_mb", "max_image_megapixels"):
        for bad, why in ((0, "0.0 is not > 0"), (-1, "-1.0 is not > 0"), (float("nan"), "expected a finite number")):
            with pytest.raises(ConfigError, match=rf"^shards\.nih\.{key}: {why}"):
                from_dict(ShardConfig, {"dataset": "nih", key: bad}, "shards.nih")
    cfg = from_dict(ShardConfig, {"max_member_mb": 0.5, "max_image_megapixels": 2})
    from chexflow.data.images import million
    assert (million(cfg.max_member_mb), million(cfg.max_image_megapixels)) == (500_000, 2_000_000)


def test_a_generated_release_part_takes_its_archive_count_from_the_caller(tmp_path, demo_manifest):
    raw, splits = demo_manifest.parent.parent / "raw", demo_manifest.parent / "splits.csv"
    with pytest.raises(S.ShardError, match="nih_demo/images_002: a generated release's shard job needs its archive "
                                           "count as configured"):
        S.write_part("nih_demo", "images_002", raw, splits, tmp_path / "o", _cfg())
    with pytest.raises(S.ShardError, match=r"no part 'images_004'; its parts are \['images_001', 'images_002', "
                                           r"'images_003'\]"):
        S.write_part("nih_demo", "images_004", raw, splits, tmp_path / "o", _cfg(), n_archives=N_ARCHIVES)
    assert not (tmp_path / "o").exists()
