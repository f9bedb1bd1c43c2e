"""Reading a checkpoint folder without running code from it (see docs/checkpoints.md).

[Note: checkpoint trust]
A checkpoint folder may come from someone else, and its marker's CRC32s prove nothing about who
wrote it (the same folder carries them). So nothing read from it can name code to run:

- DCP's ``.metadata`` is a pickle. :func:`read_metadata` unpickles it with an unpickler whose
  ``find_class`` hands out only the classes DCP metadata is made of (its metadata dataclasses,
  ``_StorageInfo``, ``torch.Size``, torch dtypes and layouts, the ``PosixPath`` of
  ``StorageMeta.checkpoint_id``), as ``torch.load(weights_only=True)`` does for tensors; every
  other global is refused, naming it. ``BytesStorageMetadata`` is not among them: a bytes entry is
  read by DCP's planner with ``torch.load(weights_only=False)``, and k3sched writes tensors only.
  The result is checked too: tensor entries only, data in the folder's own ``__R_I.distcp`` files,
  no stream transforms. :func:`safe_reader` (a ``FileSystemReader``) serves it to ``dcp.load``.
- The tensor files are read with ``torch.load(weights_only=True)``: by DCP in the ranks, and
  before that by :func:`check_tensors` in the launcher (which decodes every RNG state too), so a
  refusal is one line before anything launches.
- RNG states are tensors (:func:`rng_entries`): torch's (and CUDA's) generator states as uint8,
  Python's ``random`` and NumPy's MT19937 states as float64 numbers (every field an integer below
  2**32 or the cached Gaussian, exact in float64). :func:`set_rng` accepts these shapes and values
  and nothing else.
- Checkpoints written before RNG states were tensors hold ``rng.rank<R>``, a pickled dict, as
  uint8. :func:`legacy_rng` unpickles it with an allow-list too, which hands out only
  what that dict is made of (a tensor rebuilt from a ``torch.load(weights_only=True)`` storage,
  a NumPy uint32 array, ``OrderedDict``), and converts it to the entries above.
"""

from __future__ import annotations

import io
import math
import pickle
import random
import re
from collections import OrderedDict
from pathlib import Path

PY_WORDS = 625  # random.getstate()[1]: 624 MT words and the position
NP_WORDS = 624  # np.random.get_state()[1]
DISTCP_RE = re.compile(r"__\d+_\d+\.distcp")
ALLOWED = "allowed: a checkpoint written by k3sched run --save-every (a checkpoint folder cannot run code)"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from (missing, incomplete, corrupt, another model); one line."""


class _Refused(pickle.UnpicklingError):
    """A global that the unpickler's allow-list does not hold; ``args[0]``: ``module.name``."""


class _RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that hands out ``allowed[(module, name)]`` and refuses every other global (no
    persistent ids either: ``pickle.Unpickler`` refuses those itself)."""

    def __init__(self, raw: bytes, allowed: dict) -> None:
        super().__init__(io.BytesIO(raw))
        self.allowed = allowed

    def find_class(self, module: str, name: str):
        got = self.allowed.get((module, name))
        if got is None:
            raise _Refused(f"{module}.{name}")
        return got


def _metadata_globals() -> dict:
    import pathlib

    import torch
    from torch.distributed.checkpoint import filesystem as fs
    from torch.distributed.checkpoint import metadata as m
    from torch.serialization import _get_layout

    allowed = {("torch.distributed.checkpoint.metadata", c.__name__): c for c in
               (m.Metadata, m.TensorStorageMetadata, m.TensorProperties, m.ChunkStorageMetadata, m.MetadataIndex,
                m.StorageMeta, m._MEM_FORMAT_ENCODING)}
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = fs._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = _get_layout  # a lookup of torch's layouts by name
    for mod in ("pathlib", "pathlib._local"):
        allowed[(mod, "PosixPath")] = pathlib.PosixPath
    for name, v in vars(torch).items():
        if isinstance(v, torch.dtype):
            allowed[("torch", name)] = v
    return allowed


def _loads(raw: bytes, allowed: dict, where: str, what: str, p: Path):
    """``raw`` unpickled with only ``allowed``'s globals; CheckpointError (one line) naming a refused
    global or the failure."""
    try:
        return _RestrictedUnpickler(raw, allowed).load()
    except _Refused as e:
        raise CheckpointError(f"{what} {p}: refused: {where} asks to load {e.args[0]}, which is not part of a "
                              f"checkpoint; {ALLOWED}") from None
    except Exception as e:  # noqa: BLE001 - anything else unreadable is a corrupt file
        raise CheckpointError(f"{what} {p}: corrupt checkpoint ({where} unreadable: {type(e).__name__})") from None


def read_metadata(path: str | Path, what: str = "--resume"):
    """DCP metadata of checkpoint ``path`` through the allow-list (see [Note: checkpoint trust]),
    checked to describe tensors in the folder's own files; CheckpointError (one line) otherwise."""
    from torch.distributed.checkpoint import filesystem as fs
    from torch.distributed.checkpoint import metadata as m

    p = Path(path)
    try:
        raw = (p / ".metadata").read_bytes()
    except OSError as e:
        raise CheckpointError(f"{what} {p}: corrupt checkpoint (DCP metadata unreadable: {e.strerror or e})") from None
    md = _loads(raw, _metadata_globals(), ".metadata", what, p)

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{what} {p}: corrupt checkpoint (.metadata {why}); {ALLOWED}")

    if type(md) is not m.Metadata or not isinstance(getattr(md, "state_dict_metadata", None), dict) \
            or not isinstance(getattr(md, "storage_data", None), dict):
        raise bad("is not DCP metadata")
    for k, v in md.state_dict_metadata.items():
        if not isinstance(k, str) or not _tensor_entry(v):
            raise bad(f"entry {k!r} is not a tensor")
    for k, v in md.storage_data.items():
        name, offset, length = (getattr(v, f, None) for f in ("relative_path", "offset", "length"))
        if type(k) is not m.MetadataIndex or not isinstance(getattr(k, "fqn", None), str) \
                or type(v) is not fs._StorageInfo or not all(isinstance(n, int) and n >= 0 for n in (offset, length)):
            raise bad("storage entry is not an index and a file slice")
        if not isinstance(name, str) or not DISTCP_RE.fullmatch(name):
            raise bad(f"names data file {name!r}, not one of the folder's __R_I.distcp files")
        if getattr(v, "transform_descriptors", None):
            raise bad(f"asks for stream transforms {v.transform_descriptors!r}")
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = m.StorageMeta()
    if type(md.storage_meta) is not m.StorageMeta:
        raise bad("storage_meta is not a StorageMeta")
    return md


def _tensor_entry(v) -> bool:
    """``v`` is a TensorStorageMetadata with a dtype, a size and chunks as DCP writes them (fields
    that BUILD may have left out included)."""
    import torch
    from torch.distributed.checkpoint import metadata as m

    chunks = getattr(v, "chunks", None)
    return (type(v) is m.TensorStorageMetadata and type(getattr(v, "size", None)) is torch.Size
            and isinstance(getattr(getattr(v, "properties", None), "dtype", None), torch.dtype)
            and isinstance(chunks, list)
            and all(type(c) is m.ChunkStorageMetadata and type(getattr(c, "offsets", None)) is torch.Size
                    and type(getattr(c, "sizes", None)) is torch.Size for c in chunks))


def safe_reader(path: str | Path, what: str = "--resume"):
    """A DCP ``FileSystemReader`` of ``path`` whose metadata comes from :func:`read_metadata`."""
    from torch.distributed.checkpoint import FileSystemReader

    class _SafeReader(FileSystemReader):
        def read_metadata(self):  # no **kwargs: DCP then never falls back to per-rank __R.metadata files
            md = read_metadata(self.path, what)
            md.storage_meta.load_id = self.load_id
            return md

    return _SafeReader(str(path))


# ---- RNG states ----------------------------------------------------------------------------------

def rng_entries(prefix: str) -> dict:
    """This process's RNG states as tensors: ``<prefix>.torch`` (uint8), ``<prefix>.cuda`` (uint8,
    one row per device; only once CUDA is initialized), ``<prefix>.python`` (float64: version,
    625 words, has-Gaussian, Gaussian), ``<prefix>.numpy`` (float64: 624 words, position,
    has-Gaussian, Gaussian)."""
    import numpy as np
    import torch

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return _encode(prefix, torch.get_rng_state(), random.getstate(), np.random.get_state(legacy=True), cuda)


def _encode(prefix: str, torch_state, py_state: tuple, np_state: tuple, cuda: list | None) -> dict:
    """:func:`rng_entries` of the states as ``torch.get_rng_state``, ``random.getstate``,
    ``np.random.get_state`` and ``torch.cuda.get_rng_state_all`` return them; ValueError when the
    NumPy state is not MT19937's."""
    import numpy as np
    import torch

    version, words, gauss = py_state
    kind, keys, pos, has_gauss, cached = np_state
    if kind != "MT19937" or not isinstance(keys, np.ndarray) or keys.dtype != np.uint32:
        raise ValueError(f"numpy's RNG is {kind}, not MT19937")
    out = {f"{prefix}.torch": torch_state,
           f"{prefix}.python": torch.tensor([version, *words, gauss is not None, gauss or 0.0], dtype=torch.float64),
           f"{prefix}.numpy": torch.tensor([*keys.tolist(), pos, has_gauss, cached], dtype=torch.float64)}
    if cuda is not None:
        out[f"{prefix}.cuda"] = torch.stack(list(cuda))
    return out


def rng_shapes(prefix: str, cuda_rows: tuple | None) -> dict:
    """The tensors :func:`rng_entries` writes, zeroed, to load into (``cuda_rows``: the saved
    ``.cuda`` shape, None when there is none)."""
    import torch

    out = {f"{prefix}.torch": torch.zeros_like(torch.get_rng_state()),
           f"{prefix}.python": torch.zeros(PY_WORDS + 3, dtype=torch.float64),
           f"{prefix}.numpy": torch.zeros(NP_WORDS + 3, dtype=torch.float64)}
    if cuda_rows is not None:
        out[f"{prefix}.cuda"] = torch.zeros(cuda_rows, dtype=torch.uint8)
    return out


def _ints(t, what: str, lo: int, hi: int) -> list[int]:
    vals = t.tolist()
    if not all(isinstance(v, float) and math.isfinite(v) and v == int(v) and lo <= v < hi for v in vals):
        raise ValueError(f"{what}: not integers in [{lo}, {hi})")
    return [int(v) for v in vals]


def decode_rng(entries: dict, prefix: str, what: str, p: Path) -> tuple:
    """(torch state, ``random`` state, NumPy state, CUDA rows or None) of :func:`rng_entries`'
    tensors, checked (dtype, shape, every value in its range, each state taken by a fresh
    generator); CheckpointError (one line) otherwise."""
    import numpy as np
    import torch

    try:
        t, py, npy = (entries[f"{prefix}.{k}"] for k in ("torch", "python", "numpy"))
        cuda = entries.get(f"{prefix}.cuda")
        for name, x, dt in (("torch", t, torch.uint8), ("python", py, torch.float64), ("numpy", npy, torch.float64),
                            ("cuda", cuda, torch.uint8)):
            if x is not None and (not isinstance(x, torch.Tensor) or x.dtype != dt):
                raise ValueError(f"{name}: not a {dt} tensor")
        if tuple(t.shape) != tuple(torch.get_rng_state().shape):
            raise ValueError(f"torch: shape {list(t.shape)}")
        if tuple(py.shape) != (PY_WORDS + 3,) or tuple(npy.shape) != (NP_WORDS + 3,):
            raise ValueError("python / numpy: wrong length")
        if cuda is not None and cuda.dim() != 2:
            raise ValueError("cuda: not one row per device")
        version, *words, has_g = _ints(py[:-1], "python", 0, 2**32)
        gauss = float(py[-1])
        if version != 3 or has_g not in (0, 1) or not math.isfinite(gauss):
            raise ValueError("python: not a version 3 Mersenne Twister state")
        *keys, pos, np_has_g = _ints(npy[:-1], "numpy", 0, 2**32)
        cached = float(npy[-1])
        if np_has_g not in (0, 1) or not math.isfinite(cached):
            raise ValueError("numpy: not an MT19937 state")
        py_state = (version, tuple(words), gauss if has_g else None)
        np_state = ("MT19937", np.array(keys, dtype=np.uint32), pos, np_has_g, cached)
        random.Random().setstate(py_state)
        np.random.RandomState().set_state(np_state)
        torch.Generator().set_state(t.contiguous())
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{what} {p}: corrupt checkpoint ({prefix} is not an RNG state: {first}); "
                              f"{ALLOWED}") from None
    return t.contiguous(), py_state, np_state, cuda


def set_rng(entries: dict, prefix: str, what: str, p: Path) -> None:
    """Set torch's, CUDA's, Python's and NumPy's RNG from :func:`rng_entries`' tensors, checked by
    :func:`decode_rng`."""
    import numpy as np
    import torch

    t, py_state, np_state, cuda = decode_rng(entries, prefix, what, p)
    random.setstate(py_state)
    np.random.set_state(np_state)
    torch.set_rng_state(t)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(cuda[:torch.cuda.device_count()]))


def _storage_weights_only(raw: bytes):
    """What ``torch.storage._load_from_bytes`` does, with ``weights_only=True``."""
    import torch

    return torch.load(io.BytesIO(raw), weights_only=True)


def _tensor(storage, offset, size, stride, requires_grad, hooks, metadata=None):
    """``torch._utils._rebuild_tensor_v2`` of a storage, without backward hooks or metadata."""
    import torch
    from torch._utils import _rebuild_tensor_v2

    if not isinstance(storage, (torch.UntypedStorage, torch.TypedStorage)) or hooks or metadata:
        raise pickle.UnpicklingError("not a plain tensor")
    return _rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())


def _legacy_rng_globals() -> dict:
    import numpy as np

    out = {("collections", "OrderedDict"): OrderedDict, ("torch._utils", "_rebuild_tensor_v2"): _tensor,
           ("torch.storage", "_load_from_bytes"): _storage_weights_only,
           ("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out[(mod, "_reconstruct")] = _np_reconstruct
    return out


def _np_reconstruct(subtype, shape, dtype):
    """NumPy's ``_reconstruct`` (an empty array, filled by ``ndarray.__setstate__``), of ndarray only."""
    import numpy as np

    if subtype is not np.ndarray:
        raise pickle.UnpicklingError("not a plain ndarray")
    return np.ndarray.__new__(np.ndarray, shape, dtype)


def legacy_rng(raw: bytes, prefix: str, what: str, p: Path) -> dict:
    """:func:`rng_entries`' tensors from a pickled RNG dict of the earlier format (see [Note:
    checkpoint trust]); CheckpointError (one line) for anything else."""
    st = _loads(raw, _legacy_rng_globals(), f"{prefix} (a pickled RNG state of the earlier format)", what, p)
    try:
        return _encode(prefix, st["torch"], st["python"], st["numpy"], st.get("cuda"))
    except (AttributeError, KeyError, TypeError, ValueError, RuntimeError):
        raise CheckpointError(f"{what} {p}: corrupt checkpoint ({prefix} is not a pickled RNG state of the earlier "
                              f"format); {ALLOWED}") from None


def weights_only_refusal(text: str) -> str | None:
    """The global that ``torch.load(weights_only=True)`` refused, from its error text (None: not a refusal)."""
    m = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    return m.group(1) if m else None


def check_tensors(path: str | Path, md, what: str = "--resume") -> None:
    """Read every tensor of checkpoint ``path`` (metadata ``md`` from :func:`read_metadata`) as the
    ranks do (``torch.load(weights_only=True)`` of its slice) and decode every rank's RNG states:
    a refused global or anything unreadable is one line before anything launches."""
    import torch

    p = Path(path)
    rng: dict = {}
    for idx, info in sorted(md.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
        try:
            with open(p / info.relative_path, "rb") as f:
                f.seek(info.offset)
                raw = f.read(info.length)
            t = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            if (name := weights_only_refusal(str(e))) is not None:
                raise CheckpointError(f"{what} {p}: refused: tensor file {info.relative_path} asks to load {name}, "
                                      f"which is not part of a checkpoint; {ALLOWED}") from None
            raise CheckpointError(f"{what} {p}: corrupt checkpoint ({idx.fqn} unreadable: UnpicklingError)") from None
        except Exception as e:  # noqa: BLE001 - anything else unreadable is a corrupt file
            raise CheckpointError(f"{what} {p}: corrupt checkpoint ({idx.fqn} unreadable: {type(e).__name__})"
                                  ) from None
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{what} {p}: corrupt checkpoint ({idx.fqn} is not a tensor)")
        if idx.fqn.startswith("rng."):
            rng[idx.fqn] = t
    for prefix in sorted({k if k.count(".") == 1 else k.rsplit(".", 1)[0] for k in rng}):
        if prefix in rng and (rng[prefix].dtype != torch.uint8 or rng[prefix].layout != torch.strided):
            raise CheckpointError(f"{what} {p}: corrupt checkpoint ({prefix} is not the bytes of a pickled RNG state)")
        entries = legacy_rng(rng[prefix].numpy().tobytes(), prefix, what, p) if prefix in rng else rng
        decode_rng(entries, prefix, what, p)
