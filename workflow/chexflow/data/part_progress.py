"""A part's resume record (``progress.json`` beside its shards): what an interrupted attempt of a
shard job left that a rerun keeps, and what it discards (``chexflow.data.shards.write_part`` writes
the record as each shard finishes); and which file names a part's records may give for its shards."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from chexflow.data.dataset import SPLITS
from chexflow.fsutil import check_regular, read_regular, sha256_file


def resumable(out_dir: Path, key: str) -> tuple[list[dict], dict[str, dict]]:
    """(finished shard records, decode rejects by image key) of an earlier attempt with the same
    ``key``; the shards of an attempt with another key are deleted and logged. Per split, shards
    are resumed up to the first one that is missing or no longer has its recorded checksum."""
    progress_path = out_dir / "progress.json"
    progress: dict = {}
    if progress_path.exists():
        try:
            progress = json.loads(read_regular(progress_path, follow_symlinks=False))
        except (OSError, ValueError) as exc:
            print(f"{progress_path}: unreadable ({exc}); starting the part afresh", file=sys.stderr)
        progress = progress if isinstance(progress, dict) else {}
    records = progress.get("shards", [])
    if progress.get("key") != key:
        stale = sorted(p.name for split in SPLITS for p in out_dir.glob(f"{split}-*.tar"))
        for fname in stale:
            (out_dir / fname).unlink()
        progress_path.unlink(missing_ok=True)
        if stale:
            was = "an attempt without a resume record" if "key" not in progress else f"key {progress['key'][:12]}"
            print(f"{out_dir}: discarded {len(stale)} shard(s) of an earlier attempt written with other settings "
                  f"or another copy of the input ({was}, now {key[:12]}): {stale[:5]}", file=sys.stderr)
        return [], {}
    done, broken = [], set()
    for r in records:
        path = out_dir / str(r["file"])
        if r["split"] in broken or not own_shard(out_dir, r["file"]) or sha256_file(path) != r["sha256"]:
            broken.add(r["split"])
            continue
        done.append(r)
    earlier = {r["image"]: r for r in progress.get("rejects", []) if r.get("stage") == "decode"}
    return done, (earlier if done else {})


def own_shard(part_dir: Path, fname: object) -> bool:
    """Whether ``fname`` (from a part's own record) names a regular file directly in ``part_dir``."""
    if not isinstance(fname, str) or fname in ("", ".", "..") or "/" in fname or os.sep in fname:
        return False
    try:
        check_regular(part_dir / fname, follow_symlinks=False)
    except OSError:
        return False
    return True
