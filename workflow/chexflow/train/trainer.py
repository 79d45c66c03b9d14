"""The training loop shared by pretraining and fine-tuning, on any Backend.

Recipe (PRACE guide, Goyal et al.): global batch = per-rank batch x world size, LR scaled
linearly with gradual warmup, disjoint shards per rank reshuffled per epoch by seed, parameters
(and, on resume, optimizer state) broadcast from rank 0, metrics averaged over ranks, only rank 0
writes. Checkpoints every N steps and on SIGTERM/SIGUSR1 go to a directory that is not a declared
Snakemake output; the declared outputs (model.pt, metrics.jsonl) appear only when training ends.

Randomness is a pure function of (seed, epoch, step, rank), so a run killed at any step and
resumed from its checkpoint reproduces the uninterrupted run (bit-identical on CPU).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from chexflow.config import TrainConfig, to_dict, write_yaml_atomic
from chexflow.data import loader as data
from chexflow.evaluate import metrics as M
from chexflow.fsutil import sha256_file, write_text_atomic
from chexflow.train import checkpoint as ckpt
from chexflow.train.distributed import Backend, gather_arrays, init_backend
from chexflow.train.losses import task_loss
from chexflow.train.models import build_model, freeze_backbone, load_backbone, param_groups
from chexflow.train.schedule import make_scheduler, scaled_lr

EXIT_PREEMPTED = 143   # after SIGTERM: checkpoint written, non-zero so the retry resumes
EXIT_DIVERGED = 3      # the training loss became NaN/inf: no model is written (sweep trials record it)


@dataclass(frozen=True)
class TrainPaths:
    manifest: Path          # data/shards/<dataset>/manifest.json
    out_dir: Path           # results/<stage>/ (model.pt, metrics.jsonl appear at the end)
    ckpt_dir: Path          # results/<stage>/checkpoints/ (not a declared output)
    pretrained: Path | None = None   # model.pt of the pretraining stage (init == pretrained)
    tensorboard: Path | None = None


def _mix(*xs: int) -> int:
    return int(np.random.SeedSequence([int(x) for x in xs]).generate_state(1)[0])


class _Signals:
    """Remembers SIGTERM/SIGUSR1/SIGINT; the loop acts on them at the next step boundary."""

    def __init__(self) -> None:
        self.received = 0
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.received = max(self.received, int(signum))


def _log(backend: Backend, msg: str) -> None:
    if backend.is_root:
        print(f"[chexflow {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cfg: TrainConfig, paths: TrainPaths) -> None:
    backend = init_backend(cfg.backend, fusion_threshold_mb=cfg.horovod.fusion_threshold_mb)
    try:
        code = Trainer(cfg, paths, backend).fit()
    finally:
        backend.shutdown()
    if code:
        sys.exit(code)


class Trainer:
    def __init__(self, cfg: TrainConfig, paths: TrainPaths, backend: Backend) -> None:
        self.cfg, self.paths, self.backend = cfg, paths, backend
        self.signals = _Signals()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        if self.device.type == "cpu":
            cores = len(os.sched_getaffinity(0))
            threads = os.environ.get("OMP_NUM_THREADS") or max(1, cores // max(backend.local_size, 1))
            torch.set_num_threads(int(threads))       # ranks sharing a node share its cores
            if cfg.deterministic:
                torch.use_deterministic_algorithms(True, warn_only=True)
        manifest = data.read_manifest(paths.manifest)
        self.task, self.labels = manifest["task"], manifest["labels"]
        self.train_shards = data.split_shards(paths.manifest, "train")
        self.val_shards = data.split_shards(paths.manifest, "val")
        if cfg.data.stage_to:
            # every rank reads other shards each epoch, so a node needs them all: its local rank 0
            # copies them once into node-local disk, the node's other ranks wait and read the copies
            local = Path(cfg.data.stage_to) / "chexflow-shards"
            copier = backend.local_rank == 0
            self.train_shards = data.stage_shards(self.train_shards, local, copy=copier)
            self.val_shards = data.stage_shards(self.val_shards, local, copy=copier)
            backend.barrier()
            _log(backend, f"staged {len(self.train_shards) + len(self.val_shards)} shards into {local}")
        self.bpps = cfg.horovod.backward_passes_per_step
        micro = data.steps_per_epoch(self.train_shards, world=backend.size, batch_size=cfg.batch_size,
                                     seed=cfg.seed, epoch=0, samples_per_epoch=cfg.data.samples_per_epoch)
        self.steps_per_epoch = max(micro // self.bpps, 1)
        self.total_steps = cfg.epochs * self.steps_per_epoch
        # a checkpoint is resumed only by the run that wrote it: same settings, same starting weights
        ident = json.dumps(to_dict(cfg), sort_keys=True)
        if cfg.init == "pretrained" and paths.pretrained is not None:
            ident += sha256_file(paths.pretrained)
        self.run_id = hashlib.sha256(ident.encode()).hexdigest()[:16]
        if cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.max_steps)

    # ------------------------------------------------------------------ setup
    def _build(self):
        cfg, backend = self.cfg, self.backend
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model.arch, in_channels=cfg.model.in_channels, num_outputs=len(self.labels),
                            dropout=cfg.model.dropout)
        if cfg.freeze:
            _log(backend, f"frozen backbone stages: {', '.join(freeze_backbone(model, cfg.freeze))}")
        # a backbone loaded from pretraining may learn slower than the new head (optim.backbone_lr_mult)
        params = param_groups(model, backbone_lr_mult=cfg.optim.backbone_lr_mult if cfg.init == "pretrained" else 1.0)
        if cfg.optim.name == "sgd":
            opt = torch.optim.SGD(params, lr=1.0, momentum=cfg.optim.momentum,
                                  weight_decay=cfg.optim.weight_decay, nesterov=cfg.optim.nesterov)
        elif cfg.optim.name == "adam":
            opt = torch.optim.Adam(params, lr=1.0, weight_decay=cfg.optim.weight_decay)
        else:
            opt = torch.optim.AdamW(params, lr=1.0, weight_decay=cfg.optim.weight_decay)
        sched = make_scheduler(opt, optim=cfg.optim, sched=cfg.schedule, batch_size=cfg.batch_size,
                               world=backend.size, steps_per_epoch=self.steps_per_epoch, epochs=cfg.epochs)
        return model, opt, sched

    def _restore(self, model, opt, sched) -> dict:
        """Rank 0 decides: resume this run, or start (from pretrained weights); then broadcast."""
        backend, cfg = self.backend, self.cfg
        state, source = None, None
        if backend.is_root:
            found = ckpt.load_newest_valid(self.paths.ckpt_dir, run_id=self.run_id, log=lambda m: _log(backend, m))
            if found:
                source, state = found
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["optimizer"])
            elif cfg.init == "pretrained":
                if self.paths.pretrained is None:
                    raise ValueError("init: pretrained needs the pretraining model file")
                pre = ckpt.load_model_file(self.paths.pretrained)
                loaded = load_backbone(model, pre["state_dict"], stages=cfg.transfer_stages)
                _log(backend, f"initialised {len(loaded)} backbone tensors from {self.paths.pretrained} "
                              "(model weights only; new head)")
        meta = {"resumed": state is not None, "source": str(source) if source else None}
        if state is not None:
            meta.update({k: state.get(k) for k in ("step", "epoch", "step_in_epoch", "history", "best", "scheduler",
                                                   "partial")})
        meta = backend.broadcast_object(meta)
        if meta["resumed"]:
            backend.broadcast_optimizer(opt)
            sched.load_state_dict(meta["scheduler"])
            _log(backend, f"resuming from {meta['source']} at step {meta['step']} "
                          f"(epoch {meta['epoch']}, step {meta['step_in_epoch']} of the epoch)")
        # parameters last: whatever rank 0 holds now is what every rank trains
        backend.broadcast_model(model)
        return meta

    # ------------------------------------------------------------------ loop
    def fit(self) -> int:
        cfg, backend, device = self.cfg, self.backend, self.device
        model, opt, sched = self._build()
        meta = self._restore(model, opt, sched)
        step = meta.get("step", 0)
        epoch = meta.get("epoch", 0)
        skip = meta.get("step_in_epoch", 0)
        history: list[dict] = list(meta.get("history", []))
        best = meta.get("best", {"metric": -math.inf, "epoch": -1})
        model.to(device)
        if device.type == "cuda" and cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)   # after the broadcast (contiguity)
        if cfg.compile:
            model = torch.compile(model)
        self.model = model          # the bare network (for callers inspecting the result)
        model, opt = backend.wrap(model, opt, fp16_compression=cfg.horovod.fp16_compression,
                                  backward_passes_per_step=self.bpps)
        bf16 = device.type == "cuda" and cfg.precision in ("auto", "bf16") or cfg.precision == "bf16"
        if backend.is_root:
            _log(backend, f"{cfg.stage}: world {backend.size} ({backend.name}), per-rank batch {cfg.batch_size}, "
                          f"global batch {cfg.batch_size * backend.size * self.bpps}, target LR "
                          f"{scaled_lr(cfg.optim, batch_size=cfg.batch_size * self.bpps, world=backend.size):.4g}, "
                          f"{self.steps_per_epoch} steps/epoch, {cfg.epochs} epochs, device {device}")
        writer = self._tensorboard()
        stream = data.ShardStream(self.train_shards, rank=backend.rank, world=backend.size, seed=cfg.seed,
                                  shuffle=True, shuffle_buffer=cfg.data.shuffle_buffer)
        while epoch < cfg.epochs and step < self.total_steps:
            stream.set_epoch(epoch)
            loader = data.make_loader(stream, batch_size=cfg.batch_size, workers=cfg.data.workers,
                                      pin_memory=device.type == "cuda")
            model.train()
            t0, seen, loss_sum, n_loss = time.perf_counter(), 0, torch.zeros((), device=device), 0
            if skip and meta.get("partial"):      # resumed mid-epoch: the epoch's loss so far
                loss_sum += meta["partial"]["loss_sum"]
                n_loss = meta["partial"]["n"]
            in_epoch = skip
            bar = tqdm(total=self.steps_per_epoch, initial=in_epoch, disable=not backend.is_root,
                       desc=f"{cfg.stage} epoch {epoch + 1}/{cfg.epochs}", mininterval=5, file=sys.stderr)
            batches = iter(loader)
            for _ in range(skip * self.bpps):       # resume: replay the data order, skip the work
                next(batches)
            skip = 0
            stopped = False
            while in_epoch < self.steps_per_epoch and step < self.total_steps:
                torch.manual_seed(_mix(cfg.seed, epoch, in_epoch, backend.rank))
                gen = torch.Generator(device="cpu").manual_seed(_mix(cfg.seed, epoch, in_epoch, backend.rank, 1))
                opt.zero_grad()
                for micro in range(self.bpps):
                    images, targets, _ = next(batches)
                    images = images.to(device, non_blocking=True)
                    targets = targets.to(device, non_blocking=True)
                    x = data.gpu_augment(images, out_size=cfg.data.crop, train=True, cfg=cfg.data.augment,
                                         generator=gen)
                    if device.type == "cuda" and cfg.channels_last:
                        x = x.contiguous(memory_format=torch.channels_last)
                    sync = backend.no_sync(model) if micro < self.bpps - 1 else contextlib.nullcontext()
                    with sync, torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                        logits = model(x)
                        loss = task_loss(self.task, logits, targets) / self.bpps
                    loss.backward()
                    loss_sum += loss.detach() * self.bpps
                    n_loss += 1
                    seen += images.shape[0]
                opt.step()
                sched.step()
                step += 1
                in_epoch += 1
                bar.update(1)
                if writer is not None and step % 10 == 0:
                    writer.add_scalar(f"{cfg.stage}/train_loss", float(loss.detach()) * self.bpps, step)
                    writer.add_scalar(f"{cfg.stage}/lr", sched.get_last_lr()[0], step)
                bad = int(not bool(torch.isfinite(loss_sum).item()))
                flags = backend.allreduce_max(torch.tensor([self.signals.received, bad], dtype=torch.int64))
                sig, bad = int(flags[0].item()), int(flags[1].item())
                if bad:     # every rank sees the same flag and leaves together (no hang in a collective)
                    _log(backend, f"non-finite training loss at step {step} (epoch {epoch + 1}): diverged, "
                                  "no model written")
                    if backend.is_root:     # what a sweep trial records as its outcome
                        write_text_atomic(Path(self.paths.out_dir) / "diverged.json",
                                          json.dumps({"step": step, "epoch": epoch + 1, "stage": cfg.stage}))
                    bar.close()
                    return EXIT_DIVERGED
                periodic = cfg.checkpoint.every_steps > 0 and step % cfg.checkpoint.every_steps == 0
                if sig or periodic:
                    self._save(model, opt, sched, step, epoch, in_epoch, history, best,
                               partial=(loss_sum, n_loss))
                if sig:
                    name = signal.Signals(sig).name
                    if sig == signal.SIGUSR1:
                        _log(backend, f"{name} received: checkpoint written at step {step}; continuing")
                        self.signals.received = 0
                    else:
                        _log(backend, f"{name} received: checkpoint written at step {step}; exiting so a "
                                      "rerun resumes from it")
                        stopped = True
                        break
            bar.close()
            del batches, loader
            if stopped:
                return EXIT_PREEMPTED
            elapsed = time.perf_counter() - t0
            train_loss = float(backend.allreduce_mean((loss_sum / max(n_loss, 1)).reshape(1).cpu()).item())
            per_rank = backend.allgather_object(seen / max(elapsed, 1e-9))
            val_loss, val_metric, metric_name = self._validate(model, bf16)
            epoch += 1
            row = {"epoch": epoch, "step": step, "train_loss": train_loss, "val_loss": val_loss,
                   "val_metric": val_metric, "val_metric_name": metric_name, "lr": sched.get_last_lr()[0],
                   "images_per_sec": float(sum(per_rank)), "images_per_sec_per_rank": [float(v) for v in per_rank],
                   "epoch_time_s": elapsed, "world_size": backend.size}
            history.append(row)
            _log(backend, json.dumps(row))
            if writer is not None:
                for k in ("train_loss", "val_loss", "val_metric", "images_per_sec"):
                    writer.add_scalar(f"{cfg.stage}/{k}", row[k], step)
            if val_metric > best["metric"]:
                best = {"metric": val_metric, "epoch": epoch}
                if backend.is_root:
                    ckpt.save_atomic(self._model_file(model, epoch, val_metric, metric_name),
                                     Path(self.paths.ckpt_dir) / "best.pt")
            self._save(model, opt, sched, step, epoch, 0, history, best)
        self._finish(model, history, best)
        return 0

    # ------------------------------------------------------------------ pieces
    def _tensorboard(self):
        if not self.backend.is_root or self.paths.tensorboard is None:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return None
        return SummaryWriter(log_dir=str(self.paths.tensorboard))

    def _validate(self, model, bf16: bool) -> tuple[float, float, str]:
        cfg, backend, device = self.cfg, self.backend, self.device
        stream = data.ShardStream(self.val_shards, rank=backend.rank, world=backend.size, seed=cfg.seed,
                                  shuffle=False)
        loader = data.make_loader(stream, batch_size=cfg.batch_size, workers=cfg.data.workers,
                                  pin_memory=device.type == "cuda")
        backend.broadcast_buffers(self.model)   # every rank evaluates rank 0's model
        model.eval()
        scores, targets_all, losses, counts = [], [], 0.0, 0
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            for images, targets, _ in loader:
                x = data.gpu_augment(images.to(device), out_size=cfg.data.crop, train=False,
                                     cfg=cfg.data.augment, generator=None)
                logits = model(x).float()
                losses += float(task_loss(self.task, logits, targets.to(device))) * images.shape[0]
                counts += images.shape[0]
                scores.append(logits.cpu().numpy())
                targets_all.append(targets.numpy())
        n_classes = len(self.labels)
        local_scores = np.concatenate(scores) if scores else np.zeros((0, n_classes), np.float32)
        local_targets = np.concatenate(targets_all) if targets_all else np.zeros((0,) if self.task == "multiclass" else (0, n_classes))
        tot = backend.allgather_object((losses, counts))
        val_loss = sum(t[0] for t in tot) / max(sum(t[1] for t in tot), 1)
        s, t = gather_arrays(backend)([local_scores, local_targets])
        if self.task == "multiclass":
            return val_loss, float((s.argmax(1) == t).mean()) if len(t) else float("nan"), "accuracy"
        per = M.auroc_per_label(t.astype(np.float64), s, list(self.labels))
        return val_loss, float(M.mean_auroc(per)), "mean_auroc"

    def _model_file(self, model, epoch: int, metric: float, metric_name: str) -> dict:
        net = getattr(model, "module", model)
        net = getattr(net, "_orig_mod", net)
        sd = {k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}
        return {"state_dict": sd, "arch": self.cfg.model.arch, "in_channels": self.cfg.model.in_channels,
                "num_outputs": len(self.labels), "labels": list(self.labels), "task": self.task,
                "crop": self.cfg.data.crop, "epoch": epoch, "val_metric": metric, "val_metric_name": metric_name,
                "config": to_dict(self.cfg)}

    def _save(self, model, opt, sched, step, epoch, in_epoch, history, best, partial=None) -> None:
        # collective first (every rank reaches this point at the same step), then rank 0 writes
        part = None
        if partial is not None:
            part = {"loss_sum": float(self.backend.allreduce_mean(partial[0].detach().reshape(1).cpu()).item()),
                    "n": int(partial[1])}
        if not self.backend.is_root:
            return
        net = getattr(model, "module", model)
        net = getattr(net, "_orig_mod", net)
        state = {"model": {k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()},
                 "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                 "step": step, "epoch": epoch, "step_in_epoch": in_epoch, "history": history, "best": best,
                 "partial": part,
                 "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state()},
                 "world_size": self.backend.size, "config": to_dict(self.cfg), "run_id": self.run_id}
        path = ckpt.save_checkpoint(self.paths.ckpt_dir, step, state, keep=self.cfg.checkpoint.keep)
        _log(self.backend, f"checkpoint {path} (step {step})")

    def _finish(self, model, history, best) -> None:
        if not self.backend.is_root:
            self.backend.barrier()
            return
        out = Path(self.paths.out_dir)
        best_path = Path(self.paths.ckpt_dir) / "best.pt"
        last = self._model_file(model, len(history), history[-1]["val_metric"] if history else float("nan"),
                                history[-1]["val_metric_name"] if history else "")
        final = torch.load(best_path, map_location="cpu", weights_only=True) if best_path.exists() else last
        write_yaml_atomic(self.cfg, out / "config.yaml")
        write_text_atomic(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in history))
        ckpt.save_atomic(final, out / "model.pt")
        _log(self.backend, f"done: {out / 'model.pt'} (epoch {final['epoch']}, "
                           f"val {final['val_metric_name']} {final['val_metric']:.4f})")
        self.backend.barrier()

