"""Distributed checkpoints (torch.distributed.checkpoint) of a training run, and resuming from them.

[Note: checkpoint contents]
One DCP checkpoint holds everything the next step reads, under names that do not depend on the
parallel layout (so a checkpoint saved with one PP x EP x DP layout loads into another: DCP reads
each name from wherever it was written):

- ``model.<name>``: every parameter and buffer by its full name in :class:`moe.MoEModel`
  (``embed``, ``layers.<global layer>.wqkv``, ``final_norm``, ``head`` ...); an expert weight
  (``w1``, ``w3``, ``w2``: dim 0 = expert) is split into one entry per expert,
  ``model.layers.<L>.w1.e<global expert>``. Replicas (EP ranks of non-expert weights, DP
  replicas, every PP rank of nothing) write one copy (DCP deduplicates equal names).
- ``optim.<name>[.e<E>].exp_avg / .exp_avg_sq / .step``: AdamW state per parameter (per expert).
- with ``schedule.grad_offload``: the host fp32 parameter shards and their AdamW state
  (:class:`offload.GradShards`), all-gathered per segment at save time and stored per parameter
  as ``master.<name>[.e<E>]`` (fp32) and the same ``optim.*`` names (fp32 moments), so they too
  load into another layout (each rank re-cuts its shard). The host fp32 *gradient* shards are
  zero at every step boundary (``GradShards.step`` zeroes them), so there is nothing to save.
- ``rng.rank<R>.torch / .cuda / .python / .numpy``: each rank's torch (and CUDA), Python and NumPy
  RNG states as tensors (:func:`runtime.safeload.rng_entries`). A checkpoint folder cannot run code:
  nothing in it is unpickled but through an allow-list ([Note: checkpoint trust] in
  runtime/safeload.py; docs/checkpoints.md says what a checkpoint can make k3sched do).

The marker file ``checkpoint.json`` (written last, by rank 0) holds the global step (steps done),
the data state (synthetic: the step; file: samples consumed, ``runtime/data.py``), the model
shape, the layout, the seed and a size and CRC32 of every file of the checkpoint.

[Note: atomic checkpoints]
``OUT/checkpoints/step_K`` (K = steps done) is complete or absent. Every rank writes its DCP
files into ``OUT/checkpoints/.tmp-step_K-<run nonce>``; once every rank's write has finished (DCP's
coordinator has written ``.metadata`` after all write results came in, and each rank has sent the
CRC32 of its files), rank 0 writes ``checkpoint.json`` (to a temporary name, fsync, rename) and
renames the directory to ``step_K`` (fsync of the parent). A rank killed at any point before that
leaves a ``.tmp-*`` directory, never a ``step_K``: ``--resume latest`` takes the newest ``step_K``
holding a marker, and checks its files (sizes, CRC32), DCP metadata, tensors and RNG states
(:func:`verify`) before launching. Stale ``.tmp-*`` directories of earlier runs are deleted by the
next run that saves.

[Note: asynchronous save]
``--save-mode async`` (default) uses ``dcp.async_save`` on a process group of its own (a gloo
group over every rank: DCP's planning collectives then run in its background thread without
meeting the training lanes' collectives on the default group, and gloo is what async save needs
on CPU). The blocking part is staging (a CPU copy of the state dict; with grad_offload also the
all-gather of the host shards) and waiting for the previous save; the write, the CRC32 and the
commit run in the background while training goes on. ``--save-mode blocking`` runs ``dcp.save``
and the commit before the next step. ``summary.json`` reports both costs (``checkpoint_s``: the
seconds training stood still for checkpoints, slowest rank).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
import zlib
from pathlib import Path

from runtime.safeload import (ALLOWED, CheckpointError, check_tensors, legacy_rng, read_metadata, rng_entries,
                              rng_shapes, safe_reader, set_rng, weights_only_refusal)

FORMAT = "k3sched.checkpoint/1"
MARKER = "checkpoint.json"
SUBDIR = "checkpoints"
STEP_RE = re.compile(r"^step_(\d+)$")
KILL_ENV = "K3SCHED_CKPT_KILL"
"""``RANK:STEP``: rank RANK SIGKILLs itself right after writing its DCP files of checkpoint step_STEP,
before the checkpoint is complete (tests: a kill during a checkpoint write)."""
VERIFIED_ENV = "K3SCHED_CKPT_VERIFIED"
"""Set by the launcher once it has checked the checkpoint's files; the ranks then skip the CRC32 pass."""
SHAPE_FIELDS = ("layers", "dense_layers", "hidden", "heads", "experts", "shared_experts", "expert_hidden",
                "dense_hidden", "vocab", "dtype")
EXPERT_PARAMS = frozenset({"w1", "w3", "w2"})  # as moe.model.EXPERT_PARAMS (no torch import here)


# ---- files (no torch needed) ---------------------------------------------------------------------

def root_of(out: str | Path) -> Path:
    return Path(out) / SUBDIR


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, dir)`` of every ``step_K`` under ``root`` holding a marker for step K, by step."""
    out = []
    root = Path(root)
    if not root.is_dir():
        return out
    for d in root.iterdir():
        m = STEP_RE.match(d.name)
        if not m or not (d / MARKER).is_file():
            continue
        try:
            doc = json.loads((d / MARKER).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("format") == FORMAT and doc.get("step") == int(m.group(1)):
            out.append((int(m.group(1)), d))
    return sorted(out)


def latest(out: str | Path) -> Path | None:
    """The newest complete checkpoint under ``out/checkpoints`` (None: there is none)."""
    done = complete_checkpoints(root_of(out))
    return done[-1][1] if done else None


def crc32_file(path: Path) -> tuple[int, int]:
    """(bytes, CRC32) of a file."""
    crc, n = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
            n += len(chunk)
    return n, crc


def model_shape(cfg) -> dict:
    m = cfg.model
    d = {f: getattr(m, f) for f in SHAPE_FIELDS}
    d["dense_hidden"] = m.ffn_dense_hidden
    return d


def read_marker(path: Path, what: str) -> dict:
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{what} {p}: no such checkpoint; allowed: a directory OUT/checkpoints/step_K written "
                              f"by --save-every, or latest")
    if not p.is_dir():
        raise CheckpointError(f"{what} {p}: not a directory; allowed: a checkpoint directory OUT/checkpoints/step_K")
    if not (p / MARKER).is_file():
        raise CheckpointError(f"{what} {p}: incomplete checkpoint (no {MARKER}: its save never finished); allowed: "
                              f"a complete checkpoint (--resume latest finds the newest)")
    try:
        doc = json.loads((p / MARKER).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{what} {p}: corrupt checkpoint ({MARKER} unreadable: {e}); allowed: a complete "
                              f"checkpoint") from None
    keys = ("step", "data", "model", "files")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or any(k not in doc for k in keys):
        raise CheckpointError(f"{what} {p}: corrupt checkpoint ({MARKER} is not a {FORMAT} marker); allowed: a "
                              f"checkpoint written by k3sched run --save-every")
    return doc


def verify(path: str | Path, what: str = "--resume", *, files: bool = True) -> dict:
    """Check a checkpoint before resuming from it: marker, every file's size and CRC32 (``files``),
    DCP metadata readable through the allow-list (:func:`runtime.safeload.read_metadata`), every
    tensor readable with ``weights_only`` and every RNG state decodable (``files``:
    :func:`runtime.safeload.check_tensors`). Returns the marker; CheckpointError (one line) otherwise."""
    p = Path(path)
    doc = read_marker(p, what)
    if files:
        for name, (size, crc) in sorted(doc["files"].items()):
            f = p / name
            if not f.is_file():
                raise CheckpointError(f"{what} {p}: corrupt checkpoint ({name} is missing); allowed: a complete "
                                      f"checkpoint")
            try:
                got = crc32_file(f)
            except OSError as e:
                raise CheckpointError(f"{what} {p}: cannot read {name} ({e.strerror or e})") from None
            if got[0] != size:
                raise CheckpointError(f"{what} {p}: corrupt checkpoint ({name} is {got[0]} bytes, {size} were "
                                      f"written); allowed: a complete checkpoint")
            if got[1] != crc:
                raise CheckpointError(f"{what} {p}: corrupt checkpoint ({name} fails its CRC32 check); allowed: "
                                      f"a complete checkpoint")
    md = read_metadata(p, what)
    if files:
        check_tensors(p, md, what)
    return doc


def check_compatible(doc: dict, cfg, path: Path, what: str = "--resume") -> None:
    """The checkpoint's model shape must be the config's (the layout may differ)."""
    here = model_shape(cfg)
    saved = doc.get("model") or {}
    for f in SHAPE_FIELDS:
        if saved.get(f) != here[f]:
            raise CheckpointError(f"{what} {path}: saved from another model shape (model.{f} {saved.get(f)!r} in the "
                                  f"checkpoint, {here[f]!r} here); allowed: a checkpoint of this model (the PP x EP x "
                                  f"DP layout may differ)")


def resolve_resume(spec: str, out: str | Path, cfg, steps: int, *, files: bool = True) -> tuple[Path, dict]:
    """``--resume DIR|latest`` -> (checkpoint dir, marker), checked: complete, not corrupt, this
    model's shape, fewer steps done than ``steps``. CheckpointError (one line) otherwise."""
    if spec == "latest":
        p = latest(out)
        if p is None:
            raise CheckpointError(f"--resume latest: no complete checkpoint under {root_of(out)}; allowed: a run "
                                  f"with this --out and --save-every N first, or --resume DIR")
    else:
        p = Path(spec)
    doc = verify(p, files=files)
    check_compatible(doc, cfg, p)
    if doc["step"] >= steps:
        raise CheckpointError(f"--resume {p}: the checkpoint is at step {doc['step']}; --steps {steps} leaves nothing "
                              f"to run; allowed: --steps greater than {doc['step']}")
    return p.resolve(), doc


def launch_args(cfg, out: str | Path, steps: int, *, save_every: int = 0, save_mode: str = "async",
                resume: str | None = None) -> tuple[list[str], list[str], dict]:
    """The launcher's checks of the checkpoint and data options (before anything launches):
    returns (extra runtime.train arguments, extra --set overrides, extra environment);
    ValueError (one line) on bad input: ``--save-every`` below 0, an unknown ``--save-mode``, a
    resume checkpoint that is missing / incomplete / corrupt / of another model shape, an
    unreadable or out-of-vocabulary ``data.path``."""
    from runtime.data import DataError, check_token_file

    extra: list[str] = []
    sets: list[str] = []
    env: dict = {}
    if save_every < 0:
        raise ValueError(f"--save-every: must be 0 (never) or a number of steps >= 1; got {save_every}")
    if save_mode not in ("async", "blocking"):
        raise ValueError(f"--save-mode: must be async or blocking; got {save_mode!r}")
    if save_every:
        extra += ["--save-every", str(save_every), "--save-mode", save_mode]
    if resume:
        p, _ = resolve_resume(resume, out, cfg, steps)
        extra += ["--resume", str(p)]
        env[VERIFIED_ENV] = "1"
    if cfg.data.path:
        try:
            check_token_file(cfg.data.path, cfg.data.dtype, cfg.model.vocab, cfg.model.seq_len)
        except DataError as e:
            raise ValueError(str(e)) from None
        sets.append(f"data.path={Path(cfg.data.path).resolve()}")  # the ranks run in the repository
    return extra, sets, env


# ---- ranks (torch) -------------------------------------------------------------------------------

def _is_expert(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in EXPERT_PARAMS


def _entries(prefix: str, name: str, t, experts: range, field: str | None = None, clone: bool = True) -> dict:
    """Checkpoint entries of tensor ``t`` belonging to parameter ``name``: one, or one per expert
    of ``experts`` (this rank's global expert indices) when ``name`` is an expert weight (``t``
    shaped like it, dim 0 = local expert; a scalar is repeated under every expert's name).
    ``clone``: the expert slices are copies (``torch.save`` would write a view's whole storage)."""
    tail = f".{field}" if field else ""
    if not _is_expert(name):
        return {f"{prefix}{name}{tail}": t}
    if t.dim() == 0:
        return {f"{prefix}{name}.e{e}{tail}": t for e in experts}
    return {f"{prefix}{name}.e{e}{tail}": (t[j].clone() if clone else t[j]) for j, e in enumerate(experts)}


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def make_group(timeout=None):
    """The checkpoints' own process group (gloo, every rank; see [Note: asynchronous save]); None
    without torch.distributed. Every rank must call it at the same point. ``timeout`` (a timedelta:
    the run's ``--timeout``) bounds its collectives, and so an asynchronous save's wait."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo", timeout=timeout)


class Checkpointer:
    """Saves and loads one rank's share of a run's checkpoints (see [Note: checkpoint contents])."""

    def __init__(self, runner, *, out: str | Path, cfg, seed: int, rank: int, world: int, every: int = 0,
                 mode: str = "async", group=None, kill_step: int | None = None) -> None:
        import torch.distributed as dist

        self.runner, self.cfg, self.seed = runner, cfg, seed
        self.rank, self.world = rank, world
        self.every, self.mode = every, mode
        self.group = group
        self.dist = dist.is_initialized()
        self.root = root_of(out)
        self.saves: list[dict] = []
        self._pending: threading.Thread | None = None
        self._error: BaseException | None = None
        lo = runner.groups.layout
        self.ep_rank, self.ep = lo.ep_idx, lo.ep
        per = cfg.model.experts // self.ep
        self.experts = range(self.ep_rank * per, (self.ep_rank + 1) * per)  # this rank's, global indices
        self._kill_step = kill_step  # KILL_ENV of this rank (RuntimeOptions.ckpt_kill_step)
        self.nonce = f"{os.getpid()}{int(time.time() * 1e3) % 10**6}"
        if self.dist and every:
            box = [self.nonce]
            dist.broadcast_object_list(box, src=0, group=group)
            self.nonce = box[0]
        if rank == 0 and every:
            self.root.mkdir(parents=True, exist_ok=True)
            for d in self.root.glob(".tmp-step_*"):  # interrupted saves of earlier runs
                shutil.rmtree(d, ignore_errors=True)
            for d in self.root.glob(".old-step_*"):
                shutil.rmtree(d, ignore_errors=True)

    # -- the state dict ------------------------------------------------------------------------------
    def _opt_names(self, opt) -> list[tuple[str, object]]:
        names = {id(p): n for n, p in self.runner.model.named_parameters()}
        return [(names[id(p)], p) for g in opt.param_groups for p in g["params"]]

    def state_dict(self, clone: bool = True) -> dict:
        """This rank's entries (see [Note: checkpoint contents]); expert slices are copies."""
        r, e0 = self.runner, self.experts
        sd: dict = {}
        for name, t in r.model.state_dict().items():
            sd.update(_entries("model.", name, t.detach(), e0, clone=clone))
        if r.optimizer is not None:
            for name, p in self._opt_names(r.optimizer):
                st = r.optimizer.state.get(p)
                if not st:
                    continue
                for f in ("exp_avg", "exp_avg_sq", "step"):
                    sd.update(_entries("optim.", name, st[f].detach(), e0, f, clone=clone))
        if r.gshards is not None:
            for (L, name), fields in self._gshard_full().items():
                full = f"layers.{L}.{name}"
                for f, t in fields.items():
                    if f == "master":
                        sd.update(_entries("master.", full, t, e0, clone=False))
                    else:
                        sd.update(_entries("optim.", full, t, e0, f, clone=False))
        sd.update(rng_entries(f"rng.rank{self.rank}"))
        return sd

    def _gshard_full(self) -> dict:
        """(layer, name) -> {master, exp_avg, exp_avg_sq, step}: the host shards all-gathered and cut
        into full per-parameter fp32 tensors (collectives on the optim groups: every rank of the stage)."""
        import torch

        gs = self.runner.gshards
        st = gs.optimizer.state
        fields = {"master": gs.master}
        if all(st.get(m) for m in gs.master.values()):
            fields["exp_avg"] = {L: st[m]["exp_avg"] for L, m in gs.master.items()}
            fields["exp_avg_sq"] = {L: st[m]["exp_avg_sq"] for L, m in gs.master.items()}
        out: dict = {}
        for f, shards in fields.items():
            full = gs._gather(shards, torch.float32)
            for L, segs in gs.segments.items():
                names = {id(p): n for n, p in gs.named[L]}
                for s, flat in zip(segs, full[L]):
                    off = 0
                    for p in s.params:
                        t = flat[off:off + p.numel()].view(p.shape).cpu().clone()
                        out.setdefault((L, names[id(p)]), {})[f] = t
                        off += p.numel()
        if "exp_avg" in fields:
            for L, segs in gs.segments.items():
                step = st[gs.master[L]]["step"].detach().clone()
                for n, _ in gs.named[L]:
                    out[(L, n)]["step"] = step
        return out

    # -- saving --------------------------------------------------------------------------------------
    def due(self, steps_done: int) -> bool:
        return bool(self.every) and steps_done % self.every == 0

    def save(self, steps_done: int, data_state: dict) -> float:
        """Checkpoint ``step_<steps_done>``; returns the seconds training was blocked."""
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        self.wait()  # the previous save's collectives come first, on every rank
        tmp = self.root / f".tmp-step_{steps_done}-{self.nonce}"
        final = self.root / f"step_{steps_done}"
        marker = self._marker(steps_done, data_state) if self.rank == 0 else None
        writer = _writer(tmp, kill=self._kill_step == steps_done)
        entry = {"step": steps_done}
        if self.mode == "async":
            sd = self.state_dict(clone=False)  # async_save stages a CPU copy itself
            fut = dcp.async_save(sd, storage_writer=writer, process_group=self.group, no_dist=not self.dist)
            th = threading.Thread(target=self._background, args=(fut, tmp, final, marker, t0, entry),
                                  name="k3sched-checkpoint", daemon=True)
            self._pending = th
            th.start()
        else:
            dcp.save(self.state_dict(), storage_writer=writer, process_group=self.group, no_dist=not self.dist)
            self._commit(tmp, final, marker)
            entry["total_s"] = time.perf_counter() - t0
        entry["blocking_s"] = time.perf_counter() - t0
        self.saves.append(entry)
        return entry["blocking_s"]

    def _background(self, fut, tmp: Path, final: Path, marker: dict | None, t0: float, entry: dict) -> None:
        try:
            fut.result()
            self._commit(tmp, final, marker)
            entry["total_s"] = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - re-raised by wait()
            self._error = e

    def _commit(self, tmp: Path, final: Path, marker: dict | None) -> None:
        """Every rank: CRC32 of its files to rank 0; rank 0: marker, then rename (see [Note: atomic
        checkpoints])."""
        import torch.distributed as dist

        me = dist.get_rank(self.group) if self.dist else 0
        files = {f.name: crc32_file(f) for f in sorted(tmp.glob(f"__{me}_*"))}
        if self.dist:
            got: list | None = [None] * dist.get_world_size(self.group) if self.rank == 0 else None
            dist.gather_object(files, got, dst=0, group=self.group)
        else:
            got = [files]
        if self.rank != 0:
            return
        allf: dict = {}
        for d in got:
            allf.update(d)
        allf[".metadata"] = crc32_file(tmp / ".metadata")
        marker["files"] = {k: list(v) for k, v in sorted(allf.items())}
        part = tmp / (MARKER + ".part")
        with open(part, "w") as f:
            f.write(json.dumps(marker, indent=1) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, tmp / MARKER)
        _fsync_dir(tmp)
        old = None
        if final.exists():
            old = final.with_name(f".old-{final.name}-{self.nonce}")
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _marker(self, steps_done: int, data_state: dict) -> dict:
        import torch

        p, s = self.cfg.parallel, self.cfg.schedule
        return {"format": FORMAT, "step": steps_done, "data": dict(data_state), "seed": self.seed,
                "model": model_shape(self.cfg), "layout": {"pp": p.pp, "vpp": p.vpp, "ep": p.ep, "dp": p.dp,
                                                           "microbatches": p.microbatches, "world": self.world},
                "grad_offload": s.grad_offload, "act_quant": s.act_quant, "mode": self.mode,
                "written_unix_s": time.time(), "torch": torch.__version__, "files": {}}

    def wait(self) -> None:
        """Wait for an asynchronous save in flight; re-raise its error."""
        th, self._pending = self._pending, None
        if th is not None:
            th.join()
        err, self._error = self._error, None
        if err is not None:
            raise RuntimeError(f"checkpoint save failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")

    def summary(self) -> dict:
        return {"every": self.every, "mode": self.mode, "saves": self.saves,
                "blocking_s": sum(e["blocking_s"] for e in self.saves)}

    # -- loading -------------------------------------------------------------------------------------
    def load(self, path: str | Path) -> dict:
        """Load checkpoint ``path`` into this rank's model, optimizer, host shards and RNG; returns
        its marker. CheckpointError (one line) when the checkpoint lacks an entry or has another
        shape for one."""
        import torch
        import torch.distributed.checkpoint as dcp

        p = Path(path)
        doc = read_marker(p, "--resume")
        md = read_metadata(p).state_dict_metadata
        r, e0 = self.runner, self.experts
        want: dict = {}
        for name, t in r.model.state_dict().items():
            want.update(_entries("model.", name, t, e0, clone=False))  # views: loaded in place
        opt_state: dict = {}
        if r.optimizer is not None:
            for i, (name, q) in enumerate(self._opt_names(r.optimizer)):
                st = {"exp_avg": torch.zeros_like(q), "exp_avg_sq": torch.zeros_like(q),
                      "step": torch.zeros((), dtype=torch.float32)}
                opt_state[i] = st
                for f, t in st.items():
                    want.update(_entries("optim.", name, t, e0, f, clone=False))
        gfull: dict = {}
        if r.gshards is not None:
            for L, named in r.gshards.named.items():
                for n, q in named:
                    full = f"layers.{L}.{n}"
                    d = gfull[(L, n)] = {f: torch.zeros(q.shape, dtype=torch.float32) for f in
                                         ("master", "exp_avg", "exp_avg_sq")}
                    d["step"] = torch.zeros((), dtype=torch.float32)
                    for f, t in d.items():
                        if f == "master":
                            ents = _entries("master.", full, t, e0, clone=False)
                            if all(k in md for k in ents):  # else (a checkpoint without grad_offload): the params
                                want.update(ents)
                            else:
                                d["master"] = None
                        else:
                            want.update(_entries("optim.", full, t, e0, f, clone=False))
        rng_prefix, rng = self._rng_want(md)
        want.update(rng)
        for k, t in want.items():
            if k not in md:
                raise CheckpointError(f"--resume {p}: the checkpoint has no {k} (saved from another model?); "
                                      f"allowed: a checkpoint of this model")
            size = tuple(getattr(md[k], "size", ()))
            if size != tuple(t.shape):
                raise CheckpointError(f"--resume {p}: {k} has shape {list(size)} in the checkpoint, this model needs "
                                      f"{list(t.shape)}; allowed: a checkpoint of this model")
        try:
            dcp.load(want, storage_reader=safe_reader(p), process_group=self.group, no_dist=not self.dist)
        except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - a file that reads wrong is corrupt
            raise _load_error(e, p) from None
        if r.optimizer is not None and opt_state:
            r.optimizer.load_state_dict({"state": opt_state, "param_groups": r.optimizer.state_dict()["param_groups"]})
        if r.gshards is not None:
            self._load_gshards(gfull)
        if rng_prefix in rng:  # the earlier format: a pickled dict, read through an allow-list
            rng = legacy_rng(rng[rng_prefix].numpy().tobytes(), rng_prefix, "--resume", p)
        if rng:
            set_rng(rng, rng_prefix, "--resume", p)
        return doc

    def _rng_want(self, md: dict) -> tuple[str, dict]:
        """(prefix, the RNG entries to load; see [Note: checkpoint contents]): this rank's, else rank
        0's (a checkpoint of fewer ranks); of the earlier format, ``{prefix: its pickled bytes}``;
        none in a checkpoint without RNG states."""
        import torch

        mine = f"rng.rank{self.rank}"
        prefix = mine if f"{mine}.torch" in md or mine in md else "rng.rank0"
        if f"{prefix}.torch" in md:
            cuda = md.get(f"{prefix}.cuda")
            return prefix, rng_shapes(prefix, tuple(cuda.size) if cuda is not None else None)
        if prefix in md:
            return prefix, {prefix: torch.zeros(tuple(md[prefix].size), dtype=torch.uint8)}
        return prefix, {}

    def _load_gshards(self, gfull: dict) -> None:
        """Cut this rank's host shards (master and AdamW moments) out of the full tensors."""
        import torch

        gs = self.runner.gshards
        states = {}
        with torch.no_grad():
            for i, (L, m) in enumerate(gs.master.items()):
                names = {id(q): n for n, q in gs.named[L]}
                avg, sq = torch.zeros_like(m), torch.zeros_like(m)
                step = None
                for s in gs.segments[L]:
                    for field, dst in (("master", m), ("exp_avg", avg), ("exp_avg_sq", sq)):
                        parts = []
                        for q in s.params:
                            d = gfull[(L, names[id(q)])]
                            t = d[field] if d[field] is not None else q.detach().float().cpu()
                            parts.append(t.reshape(-1))
                        flat = torch.zeros(s.world * s.k, dtype=torch.float32)
                        cat = torch.cat(parts)
                        flat[:cat.numel()] = cat
                        dst[s.offset:s.offset + s.k].copy_(flat[s.index * s.k:(s.index + 1) * s.k])
                    step = gfull[(L, names[id(s.params[0])])]["step"]
                states[i] = {"step": step if step is not None else torch.zeros((), dtype=torch.float32),
                             "exp_avg": avg, "exp_avg_sq": sq}
        gs.optimizer.load_state_dict({"state": states, "param_groups": gs.optimizer.state_dict()["param_groups"]})


def _load_error(e: BaseException, p: Path) -> CheckpointError:
    """The one line for a failed ``dcp.load`` (a CheckpointException, a BaseException, carries every
    failed rank's error): a CheckpointError of ours, a global that ``weights_only`` refused, or the
    first failure."""
    causes = [exc for exc, _ in getattr(e, "failures", {}).values()] or [e]
    for c in causes:
        if isinstance(c, CheckpointError):
            return c
    refused = weights_only_refusal("\n".join(str(c) for c in causes))
    if refused:
        return CheckpointError(f"--resume {p}: refused: a tensor file asks to load {refused}, which is not part of a "
                               f"checkpoint; {ALLOWED}")
    first = str(causes[0]).strip().splitlines()[0] if str(causes[0]).strip() else ""
    return CheckpointError(f"--resume {p}: corrupt checkpoint (loading failed: {type(causes[0]).__name__} {first})")


def _writer(path: Path, kill: bool = False):
    """A DCP FileSystemWriter; with ``kill`` the rank SIGKILLs itself right after writing its files
    (before the checkpoint is complete: see KILL_ENV)."""
    from torch.distributed.checkpoint import FileSystemWriter

    class _Writer(FileSystemWriter):
        def write_data(self, plan, planner):
            fut = super().write_data(plan, planner)
            if kill:
                fut.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            return fut

    return _Writer(str(path))
