"""Training data from token files (runtime/data.py, ``k3sched data prepare``): the byte tokenizer,
each replica's slice, a PP 2 x EP 2 run on the text in tests/data whose loss falls over 20 steps
and whose resume reads on where it stopped, and bad token files as one line and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.data import EOS, DataError, TokenData, check_token_file, prepare
from runtime.launch import run_command

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "configs" / "tiny-cpu.yaml"
TEXT = REPO / "tests" / "data" / "lighthouse.txt"
LIMIT_S = 200.0
SHAPES = ["model.seq_len=32", "model.micro_batch_size=2"]


def test_prepare_writes_bytes_then_eos(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(b"hi\n")
    b.write_text("\u00e9", encoding="utf-8")  # two bytes
    meta = prepare([a, b], tmp_path / "t.bin", "uint16")
    ids = np.fromfile(tmp_path / "t.bin", dtype="<u2")
    assert ids.tolist() == [104, 105, 10, EOS, 0xC3, 0xA9, EOS]
    assert meta["tokens"] == 7 and meta["vocab_needed"] == 257
    assert json.loads((tmp_path / "t.bin.json").read_text())["tokenizer"] == "bytes"
    prepare([a], tmp_path / "t32.bin", "uint32")
    assert np.fromfile(tmp_path / "t32.bin", dtype="<u4").tolist() == [104, 105, 10, EOS]


def test_each_replica_reads_its_own_slice_and_the_position_moves_on(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(1000, dtype="<u2").tofile(path)  # id i at index i
    S, B, M, R = 8, 2, 3, 4
    readers = [TokenData(path, "uint16", vocab=1000, seq_len=S, batch=B, microbatches=M, replicas=R, replica=r)
               for r in range(R)]
    rows = [sorted(x for m in range(M) for x in d.rows(m)) for d in readers]
    assert sorted(x for rs in rows for x in rs) == list(range(R * M * B))  # disjoint, together the window
    tok, tgt = readers[1].batch(0)
    first = readers[1].rows(0)[0]
    assert tok[0].tolist() == list(range(first * S, first * S + S))
    assert tgt[0].tolist() == list(range(first * S + 1, first * S + S + 1))  # next-token targets
    for d in readers:
        d.advance()
    assert readers[0].position == R * M * B and readers[0].rows(0)[0] == R * M * B
    late = TokenData(path, "uint16", vocab=1000, seq_len=S, batch=B, microbatches=M, replicas=R, replica=0,
                     position=10 * R * M * B)
    assert late.rows(0)[0] == (10 * R * M * B) % late.samples  # wraps around (epochs)


def test_bad_token_files_are_one_line(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        check_token_file(tmp_path / "missing.bin", "uint16", 512, 8)
    with pytest.raises(DataError, match="is a directory"):
        check_token_file(tmp_path, "uint16", 512, 8)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match="not a whole number of uint16 ids"):
        check_token_file(odd, "uint16", 512, 8)
    big = tmp_path / "big.bin"
    np.array([1, 2, 3, 600, 4] * 10, dtype="<u2").tofile(big)
    with pytest.raises(DataError, match="token id 600 at index 3 is past the vocabulary"):
        check_token_file(big, "uint16", 512, 8)
    with pytest.raises(DataError, match="fewer than one sample"):
        check_token_file(big, "uint16", 1000, 64)


def _prepare_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3sched.cli", "data", "prepare", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokens") / "lighthouse.bin"
    r = _prepare_cli(str(TEXT), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert out.stat().st_size == 2 * (TEXT.stat().st_size + 1)
    return out


def test_data_prepare_cli_errors_are_one_line_exit_2(tmp_path):
    r = _prepare_cli(str(tmp_path / "missing.txt"), "-o", str(tmp_path / "t.bin"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "cannot read" in r.stderr, r.stderr
    r = _prepare_cli(str(TEXT), "-o", str(tmp_path / "t.bin"), "--dtype", "int8")
    assert r.returncode == 2 and "--dtype" in r.stderr, r.stderr


@pytest.mark.slow
def test_run_on_the_text_loss_falls_and_resume_reads_on(tokens, tmp_path):
    data = [f"data.path={tokens}"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert run_command(TINY, SHAPES + data, 20, None, a, False, None, timeout_s=LIMIT_S, quiet=True,
                       save_every=15) == 0
    s = json.loads((a / "summary.json").read_text())
    losses = s["losses"]
    assert len(losses) == 20 and max(losses[-3:]) < losses[0] - 1.0, losses
    per_step = 2 * 4 * 2  # replicas (ep 2 x dp 1) x micro-batches x micro_batch_size
    assert s["data"]["kind"] == "file" and s["data"]["position"] == 20 * per_step
    marker = json.loads((a / "checkpoints" / "step_15" / "checkpoint.json").read_text())
    assert marker["data"]["position"] == 15 * per_step
    assert run_command(TINY, SHAPES + data, 20, None, b, False, None, timeout_s=LIMIT_S, quiet=True,
                       resume=str(a / "checkpoints" / "step_15")) == 0
    assert json.loads((b / "summary.json").read_text())["losses"] == losses[15:]


def test_bad_data_path_is_one_line_exit_2_before_launch(tokens, tmp_path, capfd):
    def one(overrides: list[str]) -> str:
        assert run_command(TINY, SHAPES + overrides, 2, None, tmp_path / "out", False, None, timeout_s=LIMIT_S,
                           quiet=True) == 2
        err = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and err[0].startswith("error: data.path "), err
        return err[0]

    assert "past the vocabulary (model.vocab 200)" in one([f"data.path={tokens}", "model.vocab=200"])
    assert "no such file" in one([f"data.path={tmp_path / 'nope.bin'}"])
    assert "is a directory" in one([f"data.path={tmp_path}"])
    assert "past the vocabulary" in one([f"data.path={tokens}", "data.dtype=uint32"])  # the wrong dtype
    assert not (tmp_path / "out" / "summary.json").exists()
