"""A checkpoint folder from someone else cannot run code ([Note: checkpoint trust] in
runtime/safeload.py, docs/checkpoints.md). Real checkpoints of the real runner (test_checkpoint's
``three``: PP 2 x EP 2, step_3) are tampered with so that a pickle payload that creates a file when
unpickled sits in ``.metadata``, in the RNG states (the earlier, pickled format), in a tensor file
that the metadata declares a bytes entry, or in a tensor file's slice; ``checkpoint.json``'s sizes
and CRC32s are updated to match. ``--resume`` refuses each with one line and exit 2, and the file
is never created. A checkpoint of the earlier format (pickled RNG states) resumes bitwise and
restores its RNG states. No module of the five packages unpickles, evals or YAML-loads unsafely."""

from __future__ import annotations

import ast
import io
import json
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from runtime import checkpoint as ck
from test_checkpoint import _one_error, _run, _summary, straight, three  # noqa: F401 - fixtures

REPO = Path(__file__).resolve().parents[3]
PACKAGES = ("k3sched", "runtime", "moe", "offload", "traces")
RANKS = 4  # test_checkpoint's layout: PP 2 x EP 2


class _Payload:
    """Unpickled, it creates ``path`` (``open(path, "w")``): what a pickle from someone else can do."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _reseal(d: Path) -> None:
    """Sizes and CRC32s of every file of ``d`` into its marker, as an attacker can do."""
    marker = json.loads((d / ck.MARKER).read_text())
    marker["files"] = {f.name: list(ck.crc32_file(f)) for f in sorted(d.iterdir()) if f.name != ck.MARKER}
    (d / ck.MARKER).write_text(json.dumps(marker, indent=1) + "\n")


def _tensors(d: Path) -> dict:
    """Every entry of checkpoint ``d`` (our own: the test reads it with DCP's reader)."""
    md = FileSystemReader(str(d)).read_metadata().state_dict_metadata
    sd = {k: torch.zeros(tuple(v.size), dtype=v.properties.dtype) for k, v in md.items()}
    dcp.load(sd, checkpoint_id=str(d), no_dist=True)
    return sd


def _with_rng(good: Path, dst: Path, rng: dict) -> None:
    """``good`` rewritten into ``dst`` (one DCP file, marker resealed) with its RNG entries replaced
    by ``rng``: ``rng.rank<R>`` -> bytes, as the earlier format stored its pickled RNG dict."""
    sd = {k: v for k, v in _tensors(good).items() if not k.startswith("rng.")}
    sd.update({k: torch.frombuffer(bytearray(raw), dtype=torch.uint8) for k, raw in rng.items()})
    dcp.save(sd, checkpoint_id=str(dst), no_dist=True)
    shutil.copy(good / ck.MARKER, dst / ck.MARKER)
    _reseal(dst)


def _refused(out: Path, bad: Path, capfd, target: Path, *needles: str) -> None:
    """``--resume bad`` creates no ``target``, exits 2 with one line naming ``needles``, runs nothing."""
    rc = _run(out, 6, resume=str(bad))
    assert not target.exists(), "the checkpoint's pickle ran"
    assert rc == 2
    line = _one_error(capfd)
    assert all(n in line for n in needles), line
    assert not (out / "summary.json").exists()


@pytest.mark.slow
def test_metadata_payload_is_refused(three, tmp_path, capfd):
    bad, target = tmp_path / "bad", tmp_path / "pwned"
    shutil.copytree(three / "checkpoints" / "step_3", bad)
    (bad / ".metadata").write_bytes(pickle.dumps(_Payload(target)))
    _reseal(bad)
    _refused(tmp_path / "out", bad, capfd, target, "refused", ".metadata", "io.open")


@pytest.mark.slow
def test_bytes_entry_payload_is_refused(three, tmp_path, capfd):
    """The metadata (of DCP's own classes) declares a scalar a bytes entry held in a new tensor file
    that is a torch.save'd payload: DCP's planner would read it with torch.load(weights_only=False)."""
    bad, target = tmp_path / "bad", tmp_path / "pwned"
    shutil.copytree(three / "checkpoints" / "step_3", bad)
    md = FileSystemReader(str(bad)).read_metadata()
    key = next(k for k, v in md.state_dict_metadata.items() if k.startswith("optim.") and k.endswith(".step")
               and len(v.size) == 0)
    md.state_dict_metadata[key] = BytesStorageMetadata()
    md.storage_data = {i: s for i, s in md.storage_data.items() if i.fqn != key}
    blob = io.BytesIO()
    torch.save(_Payload(target), blob)
    (bad / "__9_0.distcp").write_bytes(blob.getvalue())
    md.storage_data[MetadataIndex(key)] = _StorageInfo("__9_0.distcp", 0, len(blob.getvalue()))
    (bad / ".metadata").write_bytes(pickle.dumps(md))
    _reseal(bad)
    _refused(tmp_path / "out", bad, capfd, target, "refused", "BytesStorageMetadata")


@pytest.mark.slow
def test_tensor_file_payload_is_refused(three, tmp_path, capfd):
    """A tensor's slice points at a new tensor file that is a torch.save'd payload: the ranks read
    tensor files with weights_only=True and refuse, naming the global."""
    bad, target = tmp_path / "bad", tmp_path / "pwned"
    shutil.copytree(three / "checkpoints" / "step_3", bad)
    md = FileSystemReader(str(bad)).read_metadata()
    idx = next(i for i in md.storage_data if i.fqn == "model.final_norm")
    blob = io.BytesIO()
    torch.save(_Payload(target), blob)
    (bad / "__9_0.distcp").write_bytes(blob.getvalue())
    md.storage_data[idx] = _StorageInfo("__9_0.distcp", 0, len(blob.getvalue()))
    (bad / ".metadata").write_bytes(pickle.dumps(md))
    _reseal(bad)
    _refused(tmp_path / "out", bad, capfd, target, "refused", "tensor file", "io.open")


@pytest.mark.slow
def test_rng_payload_of_the_earlier_format_is_refused(three, tmp_path, capfd):
    bad, target = tmp_path / "bad", tmp_path / "pwned"
    _with_rng(three / "checkpoints" / "step_3", bad, {f"rng.rank{r}": pickle.dumps(_Payload(target))
                                                      for r in range(RANKS)})
    _refused(tmp_path / "out", bad, capfd, target, "refused", "rng.rank", "io.open")


def _old_states(r: int) -> tuple:
    """Distinct torch, Python and NumPy RNG states for rank ``r``, as the earlier format saved them."""
    py = random.Random(1000 + r)
    py.gauss(0.0, 1.0)  # a cached Gaussian in the state
    npr = np.random.RandomState(2000 + r)
    npr.standard_normal()
    return torch.Generator().manual_seed(3000 + r).get_state(), py.getstate(), npr.get_state()


@pytest.mark.slow
def test_checkpoint_of_the_earlier_format_resumes_bitwise(straight, three, tmp_path):
    """Pickled RNG dicts (``rng.rank<R>``, the earlier format) load through the allow-list: the run
    continues bitwise, and the RNG states it saves at step 6 are the ones it loaded (nothing in a
    step draws from the global generators)."""
    old = tmp_path / "old"
    states = {r: _old_states(r) for r in range(RANKS)}
    _with_rng(three / "checkpoints" / "step_3", old,
              {f"rng.rank{r}": pickle.dumps({"torch": t, "python": py, "numpy": npy})
               for r, (t, py, npy) in states.items()})
    assert not any(k.startswith("rng.") and k.count(".") > 1 for k in _tensors(old))
    out = tmp_path / "out"
    assert _run(out, 6, resume=str(old), save_every=3) == 0
    s = _summary(out)
    assert s["first_step"] == 3 and s["losses"] == straight[3:], (s["losses"], straight)
    got = _tensors(out / "checkpoints" / "step_6")
    for r, (t, (version, words, gauss), (_, keys, pos, has_g, cached)) in states.items():
        assert torch.equal(got[f"rng.rank{r}.torch"], t)
        assert got[f"rng.rank{r}.python"].tolist() == [version, *words, 1, gauss]
        assert got[f"rng.rank{r}.numpy"].tolist() == [*keys.tolist(), pos, has_g, cached]


# ---- no unsafe loader in the packages ----------------------------------------------------------------

PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle"}
LOADS = ("load", "loads", "Unpickler", "_Unpickler", "_load", "_loads")
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}


def unsafe_loads(source: str) -> list[str]:
    """What ``source`` does that can run code from data, one item per use:

    forbidden: ``<pickle-like>.load / loads / Unpickler(...)`` (pickle, _pickle, marshal, shelve, dill,
    cloudpickle, jsonpickle; also imported by name), a ``pickle.Unpickler`` subclass without its own
    ``find_class``, ``eval`` / ``exec``, ``yaml.unsafe_load / full_load`` and ``yaml.load`` without a
    ``Loader=`` that is ``yaml.SafeLoader`` (C/Base variants) or a class of the module deriving from
    one, ``torch.load`` without ``weights_only=True``, ``np.load(allow_pickle=True)``;
    allowed: ``.load()`` of a ``pickle.Unpickler`` subclass that overrides ``find_class`` (an
    allow-list: the only way to get an unpickler here), ``pickle.dumps``."""
    tree = ast.parse(source)
    mods: dict[str, str] = {}  # local name -> module
    bad: list[str] = []
    safe_classes: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                mods[a.asname or a.name.split(".")[0]] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            root = node.module.split(".")[0]
            for a in node.names:
                if root in PICKLE_MODULES and a.name in LOADS:
                    bad.append(f"from {node.module} import {a.name}")
                if root == "yaml" and a.name in ("load", "unsafe_load", "full_load", "Loader", "UnsafeLoader",
                                                 "FullLoader"):
                    bad.append(f"from yaml import {a.name}")

    def dotted(e) -> str:
        if isinstance(e, ast.Name):
            return mods.get(e.id, e.id)
        if isinstance(e, ast.Attribute):
            return f"{dotted(e.value)}.{e.attr}"
        return "?"

    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = {dotted(b) for b in node.bases}
            if bases & {f"{m}.Unpickler" for m in PICKLE_MODULES}:
                if not any(isinstance(f, ast.FunctionDef) and f.name == "find_class" for f in node.body):
                    bad.append(f"class {node.name}(Unpickler) without find_class")
            if bases & {f"yaml.{n}" for n in SAFE_YAML_LOADERS}:
                safe_classes.add(node.name)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func)
        kw = {k.arg: k.value for k in node.keywords}
        mod, _, attr = name.rpartition(".")
        if name in ("eval", "exec", "builtins.eval", "builtins.exec"):
            bad.append(name)
        elif mod in PICKLE_MODULES and attr in LOADS:
            bad.append(name)
        elif mod == "yaml" and attr in ("unsafe_load", "full_load", "unsafe_load_all", "full_load_all"):
            bad.append(name)
        elif mod == "yaml" and attr in ("load", "load_all"):
            loader = kw.get("Loader", node.args[1] if len(node.args) > 1 else None)
            ok = loader is not None and (dotted(loader) in {f"yaml.{n}" for n in SAFE_YAML_LOADERS}
                                         or (isinstance(loader, ast.Name) and loader.id in safe_classes))
            if not ok:
                bad.append(f"{name} without a SafeLoader")
        elif name == "torch.load":
            wo = kw.get("weights_only")
            if not (isinstance(wo, ast.Constant) and wo.value is True):
                bad.append("torch.load without weights_only=True")
        elif name in ("numpy.load", "np.load"):
            ap = kw.get("allow_pickle")
            if not (ap is None or (isinstance(ap, ast.Constant) and ap.value is False)):
                bad.append(f"{name}(allow_pickle=...)")
    return bad


def test_the_unsafe_load_check_tells_forbidden_from_allowed():
    forbidden = ["import pickle\npickle.loads(b'')", "import pickle as p\np.load(f)", "from pickle import loads",
                 "import _pickle\n_pickle.Unpickler(f).load()", "import marshal\nmarshal.loads(b'')",
                 "import pickle\nclass U(pickle.Unpickler):\n    pass", "eval('1')", "exec('x = 1')",
                 "import yaml\nyaml.load(t)", "import yaml\nyaml.load(t, Loader=yaml.Loader)",
                 "import yaml\nyaml.unsafe_load(t)", "import yaml\nyaml.full_load(t)",
                 "import torch\ntorch.load(f)", "import torch\ntorch.load(f, weights_only=False)",
                 "import numpy as np\nnp.load(f, allow_pickle=True)"]
    for src in forbidden:
        assert unsafe_loads(src), src
    allowed = ("import pickle\nclass U(pickle.Unpickler):\n    def find_class(self, m, n):\n        raise KeyError\n"
               "U(f).load()\npickle.dumps(1)\n"
               "import yaml\nclass L(yaml.SafeLoader):\n    pass\n"
               "yaml.load(t, Loader=L)\nyaml.load(t, yaml.SafeLoader)\n"
               "import torch\ntorch.load(f, weights_only=True)\nimport numpy as np\nnp.load(f)\nmodel.eval()\n")
    assert unsafe_loads(allowed) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_unsafe_load_in_the_packages(package):
    found = {str(f.relative_to(REPO)): got for f in sorted((REPO / package).rglob("*.py"))
             if (got := unsafe_loads(f.read_text()))}
    assert not found, found
