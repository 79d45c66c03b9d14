"""The training loop shared by pretraining and fine-tuning, on any Backend.

Recipe (PRACE guide, Goyal et al.): global batch = per-rank batch x world size, LR scaled
linearly with gradual warmup, disjoint slices of the epoch's shuffled sample sequence per rank
(every sample once per epoch, the same number of full batches on every rank), parameters
(and, on resume, optimizer state) broadcast from rank 0, metrics averaged over ranks, only rank 0
writes. Checkpoints (every N steps, on SIGTERM/SIGUSR1: chexflow.train.cadence says when) go to a
directory that is not a declared Snakemake output; the declared outputs (model.pt, metrics.jsonl)
appear only when training ends.

Randomness is a pure function of (seed, epoch, step, rank), so a run killed at any step and
resumed from its checkpoint reproduces the uninterrupted run (bit-identical on CPU).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from chexflow import host, watchdog
from chexflow.data.loader import close_loader
from chexflow.data.stamps import StampStore
from chexflow.fsutil import write_text_atomic
from chexflow.settings import to_dict, write_yaml_atomic
from chexflow.train import checkpoint as ckpt
from chexflow.train import identity, lease, signals
from chexflow.train.backends import Backend
from chexflow.train.cadence import Cadence
from chexflow.train.config import TrainConfig
from chexflow.train.inputs import TrainData, check_inputs
from chexflow.train.losses import task_loss
from chexflow.train.init_file import start_from
from chexflow.train.models import build_model, freeze_backbone, param_groups
from chexflow.train.progress import STATE_KEYS, Progress
from chexflow.train.schedule import build_optimizer, make_scheduler, scaled_lr, set_scheduler_step
from chexflow.train.validation import validate
from chexflow.train.epoch_report import (DIVERGED_MARKER, EXIT_DIVERGED, EXIT_PREEMPTED, Scalars, acknowledge,
                                         epoch_sums, progress_bar)

EXIT_NO_VALID_EPOCH = 4  # no epoch ran, or none validated with a finite metric: no model is written
EXIT_LEASE_HELD = lease.EXIT_LEASE_HELD   # 5: another trainer holds the checkpoint directory


@dataclass(frozen=True)
class TrainPaths:
    manifest: Path          # data/shards/<dataset>/manifest.json
    out_dir: Path           # results/<stage>/ (model.pt, metrics.jsonl appear at the end)
    ckpt_dir: Path          # results/<stage>/checkpoints/ (not a declared output)
    pretrained: Path | None = None   # model.pt of the pretraining stage (init == pretrained)
    tensorboard: Path | None = None
    verified: Path | None = None     # the folder of verification stamps (chexflow.data.stamps); None: none kept


def _mix(*xs: int) -> int:
    return int(np.random.SeedSequence([int(x) for x in xs]).generate_state(1)[0])


def _log(backend: Backend, msg: str) -> None:
    if backend.is_root:
        print(f"[chexflow {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class ResumeError(RuntimeError):
    """A checkpoint of this run cannot be resumed as asked (e.g. another world size)."""


class NoValidEpoch(RuntimeError):
    """The run validated no epoch with a finite metric: there is no model of this run to write."""


def deterministic_kernels(compiled: bool) -> None:
    """``torch.use_deterministic_algorithms(True, warn_only=True)``, without importing Inductor for an eager run.

    The public call sets two flags: the one eager kernels read (``torch._C``) and Inductor's
    ``deterministic`` option, for which it imports ``torch._inductor.config`` and with it Inductor's package:
    2.3 s of a profiled rank's start (docs/benchmarks-log.md). A run that does not compile has no Inductor kernel
    for that option to reach, so it sets the first flag alone, with the call's own setter. A compiled run, or a
    process that loaded Inductor already, takes the public call."""
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if compiled or setter is None or "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        setter(True, warn_only=True)


class Trainer:
    def __init__(self, cfg: TrainConfig, paths: TrainPaths, backend: Backend,
                 device: torch.device | None = None) -> None:
        self.cfg, self.paths, self.backend = cfg, paths, backend
        # SIGTERM/SIGUSR1/SIGINT, caught since `chexflow train` started (chexflow.train.signals); the loop
        # acts on them at the next check, and at the first step for what arrived before training began
        self.signals = signals.install()
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                      else torch.device("cpu"))
        self.device = device
        if self.device.type == "cpu":
            cores = len(os.sched_getaffinity(0))
            threads = os.environ.get("OMP_NUM_THREADS") or max(1, cores // max(backend.local_size, 1))
            torch.set_num_threads(int(threads))       # ranks sharing a node share its cores
            if cfg.deterministic:
                deterministic_kernels(compiled=cfg.compile)
        # the GPU branches, each reachable on CPU when the config forces it (tests of the GPU path)
        self.channels_last = cfg.channels_last == "always" or (cfg.channels_last == "auto" and device.type == "cuda")
        self.bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")
        # where this run's epochs are measured (rank 0's host; a requeue may land on another)
        self.host = host.describe(backend=backend.name, world_size=backend.size)
        self.bpps = cfg.horovod.backward_passes_per_step
        # reads the manifest only; staging to node-local disk (a collective) happens in fit()
        self.data = TrainData.build(cfg, paths.manifest, rank=backend.rank, world=backend.size)
        # when the loop checks, saves and stops (the first check moves to a resumed run's first step in _fit)
        self.cadence = Cadence.of(cfg, self.steps_per_epoch)
        # what shapes the result (settings, the manifest's content, the starting weights): chexflow.train.identity
        self.identity = identity.identity(cfg, paths.manifest, paths.pretrained)
        self.run_id = self.identity.run_id
        self.frozen: list[torch.nn.Module] = []

    @property
    def steps_per_epoch(self) -> int:
        return self.data.steps_per_epoch

    @property
    def global_batch(self) -> int:
        """Images per optimizer step over all ranks (the batch the LR is scaled for)."""
        return self.cfg.batch_size * self.bpps * self.backend.size

    # ------------------------------------------------------------------ setup
    def _build(self):
        """Model on the training device (so a restored optimizer state lands next to its
        parameters), optimizer, LR schedule."""
        cfg, backend = self.cfg, self.backend
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model.arch, in_channels=cfg.model.in_channels, num_outputs=len(self.data.labels),
                            dropout=cfg.model.dropout)
        if cfg.freeze:
            names = freeze_backbone(model, cfg.freeze)
            self.frozen = [model.get_submodule(n) for n in names]
            _log(backend, f"frozen backbone stages (weights and BatchNorm statistics): {', '.join(names)}")
        model.to(self.device)
        # a backbone loaded from pretraining may learn slower than the new head (optim.backbone_lr_mult)
        params = param_groups(model, backbone_lr_mult=cfg.optim.backbone_lr_mult if cfg.init != "random" else 1.0)
        opt = build_optimizer(cfg.optim, params)
        sched = make_scheduler(opt, **self._schedule_args())
        return model, opt, sched

    def _schedule_args(self) -> dict:
        # the per-rank batch of one optimizer step includes the accumulated backward passes
        return dict(optim=self.cfg.optim, sched=self.cfg.schedule, batch_size=self.cfg.batch_size * self.bpps,
                    world=self.backend.size, steps_per_epoch=self.steps_per_epoch, epochs=self.cfg.epochs)

    def _restore(self, model, opt, sched) -> Progress:
        """Rank 0 decides: resume this run, or start (from pretrained weights); then broadcast."""
        backend, cfg = self.backend, self.cfg
        state, source = None, None
        if backend.is_root:
            log = lambda m: _log(backend, m)   # noqa: E731
            found = ckpt.load_newest_valid(self.paths.ckpt_dir, run_id=self.run_id, log=log,
                                           expect_model=model.state_dict())
            if found:
                source, state = found
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["optimizer"])     # moved to each parameter's device
            else:   # a fresh start: a best model of an earlier attempt is not this attempt's
                self.best_path.unlink(missing_ok=True)
                identity.explain_fresh_start(self.paths.ckpt_dir, self.identity, log)
            if not found and cfg.init != "random":
                log(start_from(model, cfg, self.paths.pretrained))
        meta = {"resumed": state is not None, "source": str(source) if source else None}
        if state is not None:
            meta.update({k: state.get(k) for k in STATE_KEYS + ("scheduler", "world_size")})
        meta = backend.broadcast_object(meta)
        prog = Progress()
        if meta["resumed"]:
            prog = Progress.from_state(meta)
            backend.broadcast_optimizer(opt)
            written_by = meta.get("world_size") or backend.size
            if written_by != backend.size:
                self._resume_other_world(prog, sched, meta["source"], written_by)
            else:
                sched.load_state_dict(meta["scheduler"])
            _log(backend, f"resuming from {meta['source']} at step {prog.step}: epoch {prog.epoch + 1}/{cfg.epochs}, "
                          f"{prog.in_epoch} of its {self.steps_per_epoch} steps done")
        # parameters last: whatever rank 0 holds now is what every rank trains
        backend.broadcast_model(model)
        return prog

    def _resume_other_world(self, prog: Progress, sched, source: str, written_by: int) -> None:
        """A checkpoint written by ``written_by`` ranks, resumed by another number of ranks."""
        size, policy = self.backend.size, self.cfg.checkpoint.on_world_change
        if policy == "refuse":
            raise ResumeError(
                f"checkpoint {source} was written by a world of {written_by} ranks, this run has {size}: "
                f"the data order and the LR schedule depend on the world size, so it cannot resume exactly. "
                f"Rerun with {written_by} ranks, set {self.cfg.stage}.checkpoint.on_world_change: remap "
                f"to resume with the position and LR recomputed for {size} ranks, or remove "
                f"{Path(source).parent} to start afresh.")
        samples_done = prog.in_epoch * self.cfg.batch_size * self.bpps * written_by
        prog.remap(samples_done=samples_done, global_batch=self.global_batch, steps_per_epoch=self.steps_per_epoch)
        set_scheduler_step(sched, prog.step)
        _log(self.backend, f"checkpoint {source} was written by {written_by} ranks, this run has {size} "
                           f"(checkpoint.on_world_change: remap): {samples_done} samples of epoch "
                           f"{prog.epoch + 1} were done, resuming at step {prog.in_epoch} of "
                           f"{self.steps_per_epoch} with the LR schedule of {size} ranks; the rest of "
                           "this epoch's data order is the new world's")

    def _prepare(self, model, opt):
        """Memory format, compilation and gradient averaging, after every broadcast."""
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)   # after the broadcast (contiguity)
        if self.cfg.compile:
            model = torch.compile(model)
        self.model = model          # the bare network (for callers inspecting the result)
        return self.backend.wrap(model, opt, fp16_compression=self.cfg.horovod.fp16_compression,
                                 backward_passes_per_step=self.bpps)

    def _train_mode(self, model) -> None:
        model.train()
        for module in self.frozen:      # frozen stages keep their BatchNorm running statistics
            module.eval()

    # ------------------------------------------------------------------ loop
    def fit(self) -> int:
        """Train to the end (or the stop a signal asks for) holding the checkpoint directory's lease."""
        try:
            with self._checkpoint_lease() as held:
                return self._fit() if held else EXIT_LEASE_HELD
        finally:
            self.signals.received = 0   # consumed by this run: a later one in this process starts afresh

    @contextlib.contextmanager
    def _checkpoint_lease(self):
        """Rank 0 holds the checkpoint directory for the run (chexflow.train.lease); every rank learns
        whether it does, so that all train or all stop."""
        held, refusal, failure = None, None, None
        if self.backend.is_root:
            try:
                held = lease.acquire(self.paths.ckpt_dir, wait_s=self.cfg.checkpoint.lease_wait_s,
                                     stale_s=self.cfg.checkpoint.lease_stale_s, log=lambda m: _log(self.backend, m))
            except lease.LeaseHeld as exc:
                refusal = str(exc)
            except OSError as exc:      # e.g. the directory is a file: every rank stops with it, none waits
                failure = exc
        refusal, failure = self.backend.broadcast_object((refusal, failure))
        if failure is not None:
            raise failure
        if refusal:
            _log(self.backend, refusal)
        try:
            yield refusal is None
        finally:
            if held is not None:
                held.release()

    def _fit(self) -> int:
        cfg, backend = self.cfg, self.backend
        watchdog.name_process(f"rank {backend.rank} of {backend.size} (pid {os.getpid()})")
        # every shard checked before the first step, each by one rank (or, staged, one per node)
        store = StampStore(self.paths.verified, self.paths.manifest, log=lambda m: _log(backend, m)) \
            if self.paths.verified is not None else None
        self.data = check_inputs(self.data, backend, local_rank=backend.local_rank, store=store,
                                 log=lambda m: _log(backend, m))
        if cfg.data.stage_to:
            _log(backend, f"staged {len(self.data.train_shards) + len(self.data.val_shards)} shards into "
                          f"{cfg.data.stage_to}")
        model, opt, sched = self._build()
        prog = self._restore(model, opt, sched)
        self.cadence = self.cadence.starting_at(prog.step)   # a signal received before training is honoured here
        model, opt = self._prepare(model, opt)
        _log(backend, f"{cfg.stage}: world {backend.size} ({backend.name}), per-rank batch {cfg.batch_size}"
                      f"{f' x {self.bpps} backward passes' if self.bpps > 1 else ''}, global batch "
                      f"{self.global_batch}, target LR "
                      f"{scaled_lr(cfg.optim, batch_size=cfg.batch_size * self.bpps, world=backend.size):.4g}, "
                      f"{self.steps_per_epoch} steps/epoch, {cfg.epochs} epochs, device {self.device}"
                      f"{', channels_last' if self.channels_last else ''}{', bf16' if self.bf16 else ''}"
                      f"{', compiled' if cfg.compile else ''}")
        writer = Scalars(self.paths.tensorboard, stage=cfg.stage, root=backend.is_root)
        stream, pin = self.data.train_stream(), self.device.type == "cuda"
        # the loaders' workers are forked once and serve every epoch and every validation pass
        self.train_loader = self.data.loader(stream, pin_memory=pin)
        self.val_loader = self.data.val_loader(pin_memory=pin)
        try:
            while prog.epoch < cfg.epochs and (prog.step < self.cadence.total_steps or prog.unvalidated()):
                code, stats = self.train_one_epoch(model, opt, sched, stream, prog, writer)
                if code:
                    return code
                self._end_epoch(model, opt, sched, prog, stats, writer)
            self._finish(model, prog)
            return 0
        finally:
            close_loader(self.train_loader)
            close_loader(self.val_loader)

    @property
    def best_path(self) -> Path:
        """The best model so far of this run (keyed by run id: another run's is never taken for this one's)."""
        return Path(self.paths.ckpt_dir) / f"best-{self.run_id}.pt"

    def _end_epoch(self, model, opt, sched, prog: Progress, stats: dict, writer) -> None:
        """Validate, record the epoch, keep the best model, checkpoint (once per step: the loop leaves
        the checkpoint of an epoch's last step to this). A max_steps stop inside an epoch is validated
        too (its row is the run's last, ``max_steps_stop``) but leaves the epoch open: its checkpoint
        resumes the epoch where it stopped, like an uninterrupted run."""
        backend = self.backend
        backend.broadcast_buffers(self.model)   # every rank evaluates rank 0's model
        val_loss, val_metric, metric_name = validate(model, self.data, backend, self.device, bf16=self.bf16,
                                                     channels_last=self.channels_last, loader=self.val_loader,
                                                     one_shape=self.cfg.compile)
        per_rank = backend.allgather_object(stats["seen"] / max(stats["elapsed"], 1e-9))
        complete = prog.in_epoch >= self.steps_per_epoch
        row = {"epoch": prog.epoch + 1, "step": prog.step, "train_loss": stats["train_loss"], "val_loss": val_loss,
               "val_metric": val_metric, "val_metric_name": metric_name, "lr": sched.get_last_lr()[0],
               "images_per_sec": float(sum(per_rank)), "images_per_sec_per_rank": [float(v) for v in per_rank],
               "epoch_time_s": stats["elapsed"], "world_size": backend.size, "host": self.host}
        if not complete:
            row["max_steps_stop"] = True
        _log(backend, json.dumps(row))
        writer.add(prog.step, **{k: row[k] for k in ("train_loss", "val_loss", "val_metric",
                                                                 "images_per_sec")})
        if not complete:
            prog.stopped = row
            self._save(model, opt, sched, prog, partial=stats["partial"])
            return
        prog.epoch += 1
        prog.in_epoch = 0
        prog.stopped = None
        prog.history.append(row)
        if math.isfinite(val_metric) and val_metric > prog.best["metric"]:
            prog.best = {"metric": val_metric, "epoch": prog.epoch}
            if backend.is_root:
                ckpt.save_atomic(self._model_file(_weights(model), row), self.best_path)
        self._save(model, opt, sched, prog)

    def train_one_epoch(self, model, opt, sched, stream, prog: Progress, writer) -> tuple[int, dict]:
        """Steps of epoch ``prog.epoch`` from step ``prog.in_epoch`` on: step, maybe check, maybe save, maybe
        stop (chexflow.train.cadence decides). Returns (exit code, stats): 0 when the epoch ended,
        EXIT_PREEMPTED / EXIT_DIVERGED when every rank stopped together."""
        stream.set_epoch(prog.epoch, skip_batches=prog.in_epoch * self.bpps)   # resume: batches not yet used
        batches = iter(self.train_loader)                 # the workers start this epoch's pass (set above)
        watchdog.beat("training")
        self._train_mode(model)
        loss_sum, n_loss, nonfinite = epoch_sums(prog, self.device)
        bar, t0, start, code = progress_bar(prog, self.steps_per_epoch, self.cfg, self.backend.is_root), time.perf_counter(), prog.in_epoch, 0
        while self.cadence.more(prog.step, prog.in_epoch):
            loss = self.train_step(model, opt, batches, prog)
            sched.step()
            loss_sum += loss
            nonfinite |= ~torch.isfinite(loss)           # stays on the device: no host sync here
            n_loss += 1
            prog.step += 1
            prog.in_epoch += 1
            watchdog.beat("training")
            bar.update(1)
            if not self.cadence.check_due(prog.step, prog.in_epoch):
                continue
            sig, bad = self._agree(nonfinite)             # the host sync, every check_every_steps steps
            writer.add(prog.step, train_loss=float(loss), lr=sched.get_last_lr()[0])
            act = self.cadence.decide(prog.step, prog.in_epoch, signal_received=sig, diverged=bool(bad))
            if act.save:
                self._save(model, opt, sched, prog, partial=(loss_sum, n_loss))
            code = acknowledge(act, sig, prog, log=lambda m: _log(self.backend, m), stage=self.cfg.stage,
                               out_dir=Path(self.paths.out_dir) if self.backend.is_root else None)
            if sig and not code:
                self.signals.received = 0       # acted on, training goes on
            if act.stop:    # every rank sees the same flags and leaves together (no hang in a collective)
                break
        bar.close()
        del batches
        if code:
            return code, {}
        elapsed = time.perf_counter() - t0
        train_loss = float(self.backend.allreduce_mean((loss_sum / max(n_loss, 1)).reshape(1).cpu()).item())
        seen = (prog.in_epoch - start) * self.cfg.batch_size * self.bpps
        return 0, {"train_loss": train_loss, "seen": seen, "elapsed": elapsed, "partial": (loss_sum, n_loss)}

    def train_step(self, model, opt, batches, prog: Progress) -> torch.Tensor:
        """One optimizer step (``bpps`` backward passes); returns the detached mean loss on the device."""
        cfg, backend, device = self.cfg, self.backend, self.device
        torch.manual_seed(_mix(cfg.seed, prog.epoch, prog.in_epoch, backend.rank))
        # augmentation draws on the training device: a CPU generator would copy to the GPU every step
        gen = torch.Generator(device=device).manual_seed(_mix(cfg.seed, prog.epoch, prog.in_epoch, backend.rank, 1))
        opt.zero_grad()
        total = torch.zeros((), device=device)
        for micro in range(self.bpps):
            images, targets, _ = next(batches)
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            x = self.data.augment(images, train=True, generator=gen, channels_last=self.channels_last)
            sync = backend.no_sync(model) if micro < self.bpps - 1 else contextlib.nullcontext()
            with sync, torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.bf16):
                logits = model(x)
                loss = task_loss(self.data.task, logits, targets) / self.bpps
            loss.backward()
            total += loss.detach()
        opt.step()
        return total

    def _agree(self, nonfinite: torch.Tensor) -> tuple[int, int]:
        """(signal, diverged) agreed by all ranks: the maximum over ranks of each."""
        bad = int(bool(nonfinite.item()))
        flags = self.backend.allreduce_max(torch.tensor([self.signals.received, bad], dtype=torch.int64))
        return int(flags[0].item()), int(flags[1].item())

    # ------------------------------------------------------------------ pieces
    def _model_file(self, sd: dict, row: dict) -> dict:
        """The model file of the weights ``sd`` as validated in ``row`` (its epoch and validation metric)."""
        cfg = self.cfg
        return ckpt.model_record(state_dict=sd, run_id=self.run_id, stage=cfg.stage, dataset=cfg.dataset,
                                 task=self.data.task, labels=list(self.data.labels), arch=cfg.model.arch,
                                 in_channels=cfg.model.in_channels, crop=cfg.data.crop, epoch=row["epoch"],
                                 val_metric=row["val_metric"], val_metric_name=row["val_metric_name"],
                                 config=to_dict(cfg), data=self.identity.summary, host=self.host)

    def _save(self, model, opt, sched, prog: Progress, partial=None) -> None:
        # collective first (every rank reaches this point at the same step), then rank 0 writes
        part = None
        if partial is not None:
            part = {"loss_sum": float(self.backend.allreduce_mean(partial[0].detach().reshape(1).cpu()).item()),
                    "n": int(partial[1])}
        if not self.backend.is_root:
            return
        state = {"model": _weights(model), "identity": self.identity.record(),
                 "optimizer": ckpt.to_cpu(opt.state_dict()), "scheduler": sched.state_dict(),
                 **prog.state(partial=part),
                 "world_size": self.backend.size, "config": to_dict(self.cfg), "run_id": self.run_id}
        path = ckpt.save_checkpoint(self.paths.ckpt_dir, prog.step, state, keep=self.cfg.checkpoint.keep)
        watchdog.beat("training")          # a checkpoint written: progress (and what follows it is training)
        _log(self.backend, f"checkpoint {path} (step {prog.step})")

    def _best_model(self, prog: Progress) -> dict:
        """best-<run id>.pt, checked (or rebuilt from the checkpoint of its epoch: checkpoint.best_model)."""
        row = next(r for r in prog.history if r["epoch"] == prog.best["epoch"])
        return ckpt.best_model(self.best_path, self.paths.ckpt_dir, run_id=self.run_id, epoch=row["epoch"],
                               step=row["step"], expect_model=_weights(self.model),
                               rebuild=lambda sd: self._model_file(sd, row), log=lambda m: _log(self.backend, m))

    def _no_valid_epoch(self, rows: list[dict]) -> NoValidEpoch:
        stage = self.cfg.stage
        if not rows:
            return NoValidEpoch(f"{stage}: no epoch ran ({stage}.epochs: {self.cfg.epochs}, {stage}.max_steps: "
                                f"{self.cfg.max_steps}, {self.steps_per_epoch} steps per epoch): no model written")
        values = ", ".join(f"epoch {r['epoch']}: {r['val_metric']}" for r in rows)
        return NoValidEpoch(f"{stage}: the validation {rows[-1]['val_metric_name']} was not finite in any epoch "
                            f"({values}); no model written (does every label have both classes in the "
                            "validation split?)")

    def _finish(self, model, prog: Progress) -> None:
        """Write the run's declared outputs: model.pt is the best validated model of this run (the
        best epoch, or the model at a max_steps stop if that validated better); no valid epoch fails."""
        stopped = prog.stopped_here()
        rows = prog.history + ([stopped] if stopped else [])
        if not any(math.isfinite(r["val_metric"]) for r in rows):
            raise self._no_valid_epoch(rows)       # on every rank: they hold the same history
        if not self.backend.is_root:
            self.backend.barrier()
            return
        out = Path(self.paths.out_dir)
        if stopped and math.isfinite(stopped["val_metric"]) and stopped["val_metric"] > prog.best["metric"]:
            final = self._model_file(_weights(model), stopped)
        else:
            final = self._best_model(prog)
        write_yaml_atomic(self.cfg, out / "config.yaml")
        write_text_atomic(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        ckpt.save_atomic(final, out / "model.pt")
        _log(self.backend, f"done: {out / 'model.pt'} (epoch {final['epoch']}, "
                           f"val {final['val_metric_name']} {final['val_metric']:.4f})")
        self.backend.barrier()


def _weights(model) -> dict:
    """The state dict of the bare network (out of its DDP and torch.compile wrappers), on the CPU."""
    net = getattr(model, "module", model)
    net = getattr(net, "_orig_mod", net)
    return {k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}
