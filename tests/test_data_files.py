"""Bring your own data, without a cluster: `prepare` writes what the tokenizer says, token files
are memory-mapped (never read whole), the step-keyed order is the same at every world size and
for every file format, bad input is one line and exit code 2 with nothing half-written, and an
exported model is GPT-2 to `transformers`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from orchestrator.cli import main
from orchestrator.config import load_config
from orchestrator.data.stream import TextData, builtin_text, open_data
from orchestrator.data.tokenfiles import DataError, open_tokens
from orchestrator.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
JOB = str(ROOT / "jobs" / "llm.yaml")


def _bpe(path: Path, text_file: Path, vocab: int = 400) -> Path:
    """A byte-level BPE tokenizer trained here on a small text (nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(text_file)], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    d = tmp_path_factory.mktemp("texts")
    text = builtin_text()
    docs = [text[i:i + 3000] for i in range(0, 180_000, 3000)]
    (d / "all.txt").write_text("\n".join(docs))
    with open(d / "docs.jsonl", "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    return d, docs, _bpe(d / "tokenizer.json", d / "all.txt")


def _one_line_error(capsys, code: int, *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err
    return err


def test_prepare_with_a_tokenizer_writes_each_document_then_eos(texts, tmp_path, capsys):
    from tokenizers import Tokenizer

    d, docs, tok_file = texts
    out = tmp_path / "train.npy"
    assert main(["prepare", str(d / "docs.jsonl"), "--out", str(out), "--tokenizer", str(tok_file)]) == 0
    tok = Tokenizer.from_file(str(tok_file))
    eos = tok.token_to_id("<|endoftext|>")
    want = np.concatenate([np.r_[tok.encode(doc, add_special_tokens=False).ids, eos] for doc in docs])
    arr = np.load(out, mmap_mode="r")
    assert arr.dtype == np.uint16 and np.array_equal(arr, want)
    meta = json.loads(Path(str(out) + ".meta.json").read_text())
    assert meta["vocab_size"] == tok.get_vocab_size() == 400
    assert (meta["tokens"], meta["documents"], meta["eos_id"], meta["dtype"]) == (len(want), len(docs), eos, "uint16")
    assert meta["tokenizer"] == str(tok_file.resolve())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.npy", "train.npy.meta.json"]  # no temporaries


def test_a_text_file_streamed_in_pieces_tokenizes_as_the_whole_text(texts, tmp_path, monkeypatch):
    from tokenizers import Tokenizer

    import orchestrator.data.corpus

    d, _, tok_file = texts
    text = (d / "all.txt").read_text()
    monkeypatch.setattr(orchestrator.data.corpus, "CHUNK_BYTES", 500)  # hundreds of pieces, cut between words
    out = tmp_path / "t.npy"
    assert main(["prepare", str(d / "all.txt"), "--out", str(out), "--tokenizer", str(tok_file)]) == 0
    tok = Tokenizer.from_file(str(tok_file))
    want = tok.encode(text, add_special_tokens=False).ids + [tok.token_to_id("<|endoftext|>")]
    assert np.load(out).tolist() == want


def test_prepare_bytes_of_a_directory_gives_nanogpt_bin(texts, tmp_path):
    d, docs, _ = texts
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_bytes("héllo\nworld\n".encode())
    (src / "sub" / "b.jsonl").write_text(json.dumps({"text": "ünï"}) + "\n\n" + json.dumps({"text": "z"}) + "\n")
    out = tmp_path / "bytes.bin"
    assert main(["prepare", str(src), "--out", str(out)]) == 0
    want = list("héllo\nworld\n".encode()) + [256] + list("ünï".encode()) + [256, ord("z"), 256]
    assert np.fromfile(out, dtype=np.uint16).tolist() == want  # nanoGPT reads it back the same way
    assert json.loads(Path(str(out) + ".meta.json").read_text())["vocab_size"] == 257


def test_vocabulary_over_65535_is_written_as_uint32(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"<unk>": 70_000, "</s>": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "big.json"))
    (tmp_path / "t.txt").write_text("w69999 w3 w65536 w0\n" * 50)
    out = tmp_path / "big.npy"
    assert main(["prepare", str(tmp_path / "t.txt"), "--out", str(out), "--tokenizer", str(tmp_path / "big.json")]) == 0
    arr = open_tokens(out)
    assert arr.dtype == np.uint32 and arr[:4].tolist() == [69999, 3, 65536, 0] and arr[-1] == 70_001
    data = TextData(arr, block_size=8, val_fraction=0.1, seed=1, vocab_size=70_002)
    x, y = data.train_batch(0, 4, 0, 1)
    assert x.max() > 65535 and torch.equal(x[:, 1:], y[:, :-1])
    # .bin is uint16 by definition: refused, and nothing is left behind
    code = main(["prepare", str(tmp_path / "t.txt"), "--out", str(tmp_path / "big.bin"), "--tokenizer",
                 str(tmp_path / "big.json")])
    _one_line_error(capsys, code, "big.bin", "uint16", ".npy")
    assert not list(tmp_path.glob("big.bin*")) and not list(tmp_path.glob(".big*"))


def _nanogpt_bin(path: Path, ids: np.ndarray) -> Path:
    ids.astype(np.uint16).tofile(path)  # what nanoGPT's prepare.py does
    return path


def test_step_order_is_the_same_at_every_world_size_and_format(tmp_path):
    ids = np.random.default_rng(0).integers(0, 50_000, 20_000)
    sources = {
        "bin": open_tokens(_nanogpt_bin(tmp_path / "t.bin", ids)),
        "npy16": open_tokens(np.save(tmp_path / "t16.npy", ids.astype(np.uint16)) or tmp_path / "t16.npy"),
        "npy32": open_tokens(np.save(tmp_path / "t32.npy", ids.astype(np.uint32)) or tmp_path / "t32.npy"),
        "memory": torch.from_numpy(ids),
    }
    for step in (0, 7, 123):
        ref = None
        for name, tokens in sources.items():
            data = TextData(tokens, block_size=16, val_fraction=0.1, seed=3, vocab_size=50_000)
            for world in (1, 2, 4):
                parts = [data.train_batch(step, 8, r, world) for r in range(world)]
                x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
                if ref is None:
                    ref = (x, y)
                    # every sample is a real window of the training split
                    train = ids[: len(ids) - 2000]
                    for row in x.tolist():
                        starts = np.flatnonzero(train[: len(train) - 16] == row[0])
                        assert any(train[s:s + 16].tolist() == row for s in starts)
                assert torch.equal(x, ref[0]) and torch.equal(y, ref[1]), (name, world, step)
            vx, _ = data.val_batch(0, 8, 1, 2)
            assert int(vx.max()) < 50_000


def test_separate_validation_file(tmp_path):
    train = open_tokens(_nanogpt_bin(tmp_path / "train.bin", np.arange(1000) % 300))
    data = open_data(str(tmp_path / "train.bin"), str(_nanogpt_bin(tmp_path / "val.bin", np.full(100, 299))),
                     0.1, 8, 0, vocab_size=300)
    assert len(data.train) == len(train) == 1000  # all of path trains
    assert set(data.val_batch(0, 4, 0, 1)[0].flatten().tolist()) == {299}


def _mapped_rss_bytes(path: Path) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:
            inside = line.rstrip().endswith(str(path))
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_a_token_file_far_larger_than_a_run_reads_is_mapped_never_read_whole(tmp_path):
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:  # 16 GiB of uint16 zeros, sparse: costs no disk
        f.truncate(16 << 30)
    cfg = load_config(JOB, [f"data.path={big}", "model.block_size=256"])  # what submit checks
    data = open_data(cfg.data.path, None, cfg.data.val_fraction, 256, 0, vocab_size=256)
    assert isinstance(data.train, np.memmap) and Path(data.train.filename) == big.resolve()
    for step in range(20):
        x, _ = data.train_batch(step, 32, 1, 2)
        assert x.shape == (16, 256)
    for i in range(4):
        data.val_batch(i, 32, 0, 2)
    # 20 steps x 16 samples x 514 bytes, plus one page around each: a few MiB of 16 GiB
    assert _mapped_rss_bytes(big.resolve()) < 8 << 20


def _submit_error(capsys, *overrides: str) -> str:
    return _one_line_error(capsys, main(["submit", JOB, *overrides, "monitor.progress=false"]))


def test_bad_token_files_are_refused_by_submit_before_anything_starts(tmp_path, capsys):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00" * 500 + b"\x01")
    assert "odd.bin" in _submit_error(capsys, f"data.path={odd}")
    floats = tmp_path / "f.npy"
    np.save(floats, np.zeros(1000, dtype=np.float32))
    err = _submit_error(capsys, f"data.path={floats}")
    assert "f.npy" in err and "integer dtype" in err and "float32" in err
    cut = tmp_path / "cut.npy"
    np.save(cut, np.arange(1000, dtype=np.uint32))
    cut.write_bytes(cut.read_bytes()[:-3])
    err = _submit_error(capsys, f"data.path={cut}")
    assert "cut.npy" in err and "truncated" in err
    missing = _submit_error(capsys, f"data.val_path={tmp_path / 'nope.bin'}")
    assert "data.val_path" in missing


def test_model_vocabulary_below_the_tokenizers_is_refused(texts, tmp_path, capsys):
    d, _, tok_file = texts
    out = tmp_path / "t.npy"
    assert main(["prepare", str(d / "all.txt"), "--out", str(out), "--tokenizer", str(tok_file)]) == 0
    capsys.readouterr()
    err = _submit_error(capsys, f"data.path={out}", "model.vocab_size=256")
    assert "model.vocab_size" in err and "400" in err
    # a file without metadata (nanoGPT's) is checked as its batches are read, naming the file
    raw = _nanogpt_bin(tmp_path / "raw.bin", np.r_[np.zeros(250), 300, np.zeros(750)])
    data = open_data(str(raw), None, 0.5, 400, 0, vocab_size=256)
    with pytest.raises(DataError, match=r"raw\.bin: token id 300 .* model\.vocab_size \(256\)"):
        data.train_batch(0, 4, 0, 1)


def test_bad_prepare_input_is_one_line_and_leaves_nothing(texts, tmp_path, capsys):
    d, _, tok_file = texts
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    out = tmp_path / "out.npy"
    _one_line_error(capsys, main(["prepare", str(bad), "--out", str(out)]), "bad.jsonl:2", "'text'")
    _one_line_error(capsys, main(["prepare", str(d / "all.txt"), "--out", str(out), "--tokenizer",
                                  str(tmp_path / "missing.json")]), "missing.json", "no such file")
    _one_line_error(capsys, main(["prepare", str(tmp_path / "nothing"), "--out", str(out)]), "nothing")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no output, no temporary file
    # an existing output is kept unless --force, and replaced only once the new one is complete
    out.write_bytes(b"mine")
    _one_line_error(capsys, main(["prepare", str(d / "all.txt"), "--out", str(out)]), "exists", "--force")
    assert out.read_bytes() == b"mine"
    assert main(["prepare", str(bad), "--out", str(out), "--force"]) == 2
    assert out.read_bytes() == b"mine"


def test_exported_gpt_is_gpt2_to_transformers(tmp_path):
    from transformers import GPT2LMHeadModel

    from orchestrator.control.export import export_model, load_exported
    from orchestrator.workloads.gpt import GPT, GPTConfig

    for bias in (True, False):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=300, block_size=24, bias=bias)).eval()
        with torch.no_grad():
            for p in model.parameters():  # away from the init, where zeros could hide a wrong mapping
                p.add_(0.1 * torch.randn_like(p))
        out = export_model(model, tmp_path / f"bias{bias}")
        x = torch.randint(300, (2, 24))
        with torch.no_grad():
            ours = model(x)
            theirs = GPT2LMHeadModel.from_pretrained(out).eval()(x).logits
            back = load_exported(out).eval()(x)
        torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
        assert torch.equal(back, ours)
    with pytest.raises(UserError, match="not an empty directory"):
        export_model(model, tmp_path / "biasTrue")
