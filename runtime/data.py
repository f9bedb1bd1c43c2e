"""Training tokens from a flat token file, and ``k3sched data prepare``.

[Note: token files]
A token file is a flat array of token ids, nothing else (no header): ``data.dtype`` (uint16 or
uint32, native little-endian) per id, read with ``np.memmap`` (only the rows a batch needs are
touched). ``k3sched data prepare TEXT... -o FILE`` writes one with the byte tokenizer: every UTF-8
byte of a text is its id (0..255) and each file ends with :data:`EOS` (256), so a model needs
``model.vocab >= 257``; a JSON sidecar ``FILE.json`` says what was written. No tokenizer model,
nothing downloaded.

Samples. With ``S = model.seq_len`` the file holds ``N = (tokens - 1) // S`` samples; sample ``i``
is ``ids[i*S : i*S + S + 1]`` (inputs are its first S ids, targets its last S). A step takes
``R * M * B`` samples (R = ep*dp data replicas, M micro-batches, B = micro_batch_size) starting at
the data *position* (samples consumed so far, all replicas together): replica ``r``, micro-batch
``m``, row ``b`` reads sample ``(position + (r*M + m)*B + b) mod N``, so each (DP, EP) replica
reads its own contiguous slice of the step's window, every PP stage of a replica reads the same
rows, and the file wraps around (epochs) when it is used up. The position advances by ``R*M*B``
per step and is saved in checkpoints (``runtime/checkpoint.py``), so a resumed run reads exactly
the rows the uninterrupted run would have read.

Bad input is one line (:class:`DataError`; exit 2 from ``k3sched run``): a data.path that is
missing, a directory or unreadable, a size that is not a whole number of ids, fewer than
``S + 1`` tokens, or an id past the vocabulary (checked over the whole file before launch, and
per batch in the ranks).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
EOS = 256
"""The byte tokenizer's end-of-text id (bytes are 0..255)."""
BYTE_VOCAB = 257
SCAN_CHUNK = 1 << 24
"""Ids checked per read when scanning a whole file for out-of-vocabulary ids."""


class DataError(ValueError):
    """Bad token file or text input; ``str(err)`` is one line."""


def _dtype(dtype: str) -> np.dtype:
    if dtype not in DTYPES:
        raise DataError(f"data.dtype: {dtype!r} is not a token dtype; allowed: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def open_tokens(path: str | Path, dtype: str = "uint16") -> np.memmap:
    """The token ids of ``path`` as a read-only memmap; DataError when the file cannot be one."""
    p = Path(path)
    dt = _dtype(dtype)
    if not p.exists():
        raise DataError(f"data.path {p}: no such file; allowed: a token file (k3sched data prepare)")
    if p.is_dir():
        raise DataError(f"data.path {p}: is a directory; allowed: a token file (k3sched data prepare)")
    try:
        size = p.stat().st_size
        with p.open("rb") as f:  # a permission problem shows here, not inside np.memmap
            f.read(1)
    except OSError as e:
        raise DataError(f"data.path {p}: cannot read ({e.strerror or e}); allowed: a readable token file") from None
    if size % dt.itemsize:
        raise DataError(f"data.path {p}: {size} bytes is not a whole number of {dtype} ids ({dt.itemsize} bytes "
                        f"each); allowed: a flat {dtype} token file (or set data.dtype)")
    if size < 2 * dt.itemsize:
        raise DataError(f"data.path {p}: holds {size // dt.itemsize} token(s); allowed: at least 2")
    try:
        return np.memmap(p, dtype=dt, mode="r")
    except (OSError, ValueError) as e:
        raise DataError(f"data.path {p}: cannot map ({e}); allowed: a readable token file") from None


def check_token_file(path: str | Path, dtype: str, vocab: int, seq_len: int) -> dict:
    """Check a token file against a model before launching: readable, at least one sample of
    ``seq_len + 1`` ids, every id below ``vocab`` (the whole file, in chunks). Returns
    ``{"tokens": n, "samples": N}``; raises DataError (one line) otherwise."""
    ids = open_tokens(path, dtype)
    n = int(ids.shape[0])
    if n < seq_len + 1:
        raise DataError(f"data.path {path}: {n} tokens are fewer than one sample of model.seq_len + 1 = "
                        f"{seq_len + 1}; allowed: a longer file or a shorter model.seq_len")
    for lo in range(0, n, SCAN_CHUNK):
        chunk = np.asarray(ids[lo:lo + SCAN_CHUNK])
        top = int(chunk.max())
        if top >= vocab:
            at = lo + int(np.argmax(chunk >= vocab))
            raise DataError(f"data.path {path}: token id {int(ids[at])} at index {at} is past the vocabulary "
                            f"(model.vocab {vocab}); allowed: ids below {vocab} (a larger model.vocab, or "
                            f"re-prepare the file)")
    return {"tokens": n, "samples": (n - 1) // seq_len}


class TokenData:
    """Batches of one data replica from a token file (see [Note: token files]).

    ``replicas`` = ep*dp, ``replica`` = this rank's (``Layout.replica``); ``position`` = samples
    consumed before the next step (0 for a fresh run, the checkpoint's for a resumed one)."""

    kind = "file"

    def __init__(self, path: str | Path, dtype: str, *, vocab: int, seq_len: int, batch: int, microbatches: int,
                 replicas: int, replica: int, position: int = 0) -> None:
        self.path, self.dtype = str(path), dtype
        self.ids = open_tokens(path, dtype)
        self.vocab, self.S, self.B, self.M = vocab, seq_len, batch, microbatches
        self.R, self.replica = replicas, replica
        self.samples = (int(self.ids.shape[0]) - 1) // seq_len
        if self.samples < 1:
            raise DataError(f"data.path {path}: {self.ids.shape[0]} tokens are fewer than one sample of "
                            f"model.seq_len + 1 = {seq_len + 1}; allowed: a longer file or a shorter model.seq_len")
        self.position = int(position)

    @property
    def per_step(self) -> int:
        """Samples one step consumes (all replicas)."""
        return self.R * self.M * self.B

    def rows(self, mb: int) -> list[int]:
        """Sample indices of micro-batch ``mb`` of this replica at the current position."""
        base = self.position + (self.replica * self.M + mb) * self.B
        return [(base + b) % self.samples for b in range(self.B)]

    def batch(self, mb: int):
        """Tokens and next-token targets ``[B, S]`` (int64 tensors) of micro-batch ``mb``."""
        import torch

        S = self.S
        x = np.stack([np.asarray(self.ids[r * S:r * S + S + 1]) for r in self.rows(mb)]).astype(np.int64)
        top = int(x.max())
        if top >= self.vocab:
            raise DataError(f"data.path {self.path}: token id {top} is past the vocabulary (model.vocab {self.vocab}); "
                            f"allowed: ids below {self.vocab}")
        t = torch.from_numpy(x)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def advance(self) -> None:
        """After a step: the next step reads the next window."""
        self.position += self.per_step

    def state(self) -> dict:
        return {"kind": self.kind, "position": self.position, "path": self.path, "dtype": self.dtype}


def synthetic_state(next_step: int) -> dict:
    """The data state of synthetic tokens: their position is the step (``synthetic_batch``)."""
    return {"kind": "synthetic", "position": int(next_step)}


def byte_tokens(text: bytes) -> np.ndarray:
    """The byte tokenizer: one id per byte, then :data:`EOS`."""
    return np.concatenate([np.frombuffer(text, dtype=np.uint8).astype(np.uint32), np.array([EOS], np.uint32)])


def prepare(texts: list[str | Path], out: str | Path, dtype: str = "uint16") -> dict:
    """Tokenize ``texts`` (byte tokenizer) into the flat token file ``out`` (written to a temporary
    file, then renamed) and its sidecar ``out.json``. Returns the sidecar's content."""
    dt = _dtype(dtype)
    if not texts:
        raise DataError("data prepare: no text files given; allowed: one or more text files")
    parts, names = [], []
    for t in texts:
        p = Path(t)
        if p.is_dir():
            raise DataError(f"{p}: is a directory; allowed: text files")
        try:
            raw = p.read_bytes()
        except OSError as e:
            raise DataError(f"{p}: cannot read ({e.strerror or e}); allowed: readable text files") from None
        if not raw:
            raise DataError(f"{p}: is empty; allowed: text files with some text")
        parts.append(byte_tokens(raw))
        names.append(str(p))
    ids = np.concatenate(parts).astype(dt)
    o = Path(out)
    if o.is_dir():
        raise DataError(f"-o {o}: is a directory; allowed: a file path")
    o.parent.mkdir(parents=True, exist_ok=True)
    tmp = o.with_name(f".{o.name}.tmp-{os.getpid()}")
    try:
        ids.tofile(tmp)
        os.replace(tmp, o)
    finally:
        tmp.unlink(missing_ok=True)
    meta = {"format": "k3sched.tokens/1", "tokenizer": "bytes", "eos": EOS, "vocab_needed": BYTE_VOCAB,
            "dtype": dtype, "tokens": int(ids.shape[0]), "files": names}
    Path(str(o) + ".json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta
