"""Real, offline training data for notebook 03: the Python standard library's own source code.

- `load_corpus`: the *.py files of this interpreter's stdlib outside its test suites, split into
  train / validation deterministically *by file* (a hash of the relative path), with a corpus hash and
  the Python version so a run can say exactly what it trained on.
- `train_bpe_tokenizer`: a small byte-level BPE (`tokenizers`) trained on the training split only, for
  from-scratch models; retrofit uses the embedded model's own tokenizer (`encode_texts` takes either).
- `pack_blocks` / `to_dataset`: token streams -> fixed-length blocks in a `datasets.Dataset`.
- `induction_mask`: positions whose next token repeats an identifier bigram seen earlier in the block.

Tokenized blocks are cached under ~/.cache/decodelab/mtp (or $DECODELAB_CACHE) keyed by corpus hash,
tokenizer and block size, so re-runs skip tokenization.
"""
from __future__ import annotations

import hashlib
import json
import keyword
import platform
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Directories that hold test suites, vendored packages or generated data rather than library code.
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "dist-packages"}
EXCLUDED_PREFIXES = ("config-", "_sysconfigdata")  # machine-specific build config
SEPARATOR = "<|endoftext|>"  # between files in a packed stream; id 0 in our BPE


@dataclass
class Corpus:
    """A deterministic file-level split of a source tree."""

    root: Path
    train_files: list[str]  # paths relative to root, sorted
    val_files: list[str]
    corpus_hash: str  # sha256 over (relative path, bytes) of every file, in sorted order
    python_version: str
    n_bytes: int
    info: dict = field(default_factory=dict)

    def texts(self, split: str, *, order: str = "path") -> list[str]:
        """File contents of `split` ("train" or "val"), in sorted path order or in hash order ("hash":
        a fixed shuffle, so any prefix of the list mixes packages)."""
        files = {"train": self.train_files, "val": self.val_files}
        if split not in files:
            raise ValueError(f"split={split!r} must be 'train' or 'val'")
        if order not in ("path", "hash"):
            raise ValueError(f"order={order!r} must be 'path' or 'hash'")
        names = files[split] if order == "path" else sorted(files[split], key=shuffle_key)
        return [(self.root / rel).read_text(encoding="utf-8", errors="replace") for rel in names]

    def provenance(self) -> dict:
        """What to log beside results: version, hash, sizes."""
        return {"corpus": "python-stdlib", "corpus_root": str(self.root), "corpus_hash": self.corpus_hash,
                "python_version": self.python_version, "corpus_bytes": self.n_bytes,
                "train_files": len(self.train_files), "val_files": len(self.val_files), **self.info}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(root: Path) -> list[str]:
    """Sorted relative paths of *.py files under root outside test suites and build config."""
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if any(part.startswith(EXCLUDED_PREFIXES) for part in rel.parts):
            continue
        if path.is_file() and path.stat().st_size > 0:  # empty __init__.py files carry no code
            files.append(rel.as_posix())
    return sorted(files)


def file_bucket(rel: str) -> float:
    """A path's fixed position in [0, 1): the split depends on nothing but the file's relative path."""
    return int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16) / 2**32


def shuffle_key(rel: str) -> str:
    """A fixed pseudo-random order of files, independent of the split (`file_bucket`)."""
    return hashlib.sha1(b"order/" + rel.encode()).hexdigest()


def load_corpus(root: str | Path | None = None, *, val_fraction: float = 0.1,
                max_bytes: int | None = None) -> Corpus:
    """The stdlib source (or any tree of *.py files) split by file into train / validation.

    max_bytes keeps a deterministic subset (files in hash order until the budget is reached, the
    validation share kept by the same rule), for smoke runs. None keeps everything (~12 MB).
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction!r} must be in (0, 1)")
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes={max_bytes!r} must be a positive int or None")
    root = Path(root) if root is not None else stdlib_root()
    files = list_source_files(root)
    if not files:
        raise ValueError(f"root={str(root)!r} holds no *.py files outside test directories")
    if max_bytes is not None:  # a random-like sample of files (hash order) that fits the budget
        kept, total = [], 0
        for rel in sorted(files, key=shuffle_key):
            size = (root / rel).stat().st_size
            if size > max_bytes // 8:  # one big file would crowd out the rest of the sample
                continue
            if total + size > max_bytes:
                break
            kept.append(rel)
            total += size
        files = sorted(kept)
    digest = hashlib.sha256()
    n_bytes = 0
    for rel in files:
        data = (root / rel).read_bytes()
        digest.update(rel.encode() + b"\0" + data + b"\0")
        n_bytes += len(data)
    val = [rel for rel in files if file_bucket(rel) < val_fraction]
    train = [rel for rel in files if file_bucket(rel) >= val_fraction]
    if not val or not train:
        raise ValueError(f"max_bytes={max_bytes!r} leaves an empty split (train {len(train)}, val {len(val)} files)")
    return Corpus(root=root, train_files=train, val_files=val, corpus_hash=digest.hexdigest()[:16],
                  python_version=platform.python_version(), n_bytes=n_bytes,
                  info={"val_fraction": val_fraction, "max_bytes": max_bytes})


def cache_root() -> Path:
    from decodelab.core.models import cache_dir

    return cache_dir() / "mtp"


def train_bpe_tokenizer(corpus: Corpus, vocab_size: int = 4096, *, cache: bool = True):
    """A byte-level BPE `tokenizers.Tokenizer` trained on the training split only (id 0 = SEPARATOR).

    Deterministic for a given corpus and vocab size; cached as JSON keyed by both.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not 256 < vocab_size <= 65536:
        raise ValueError(f"vocab_size={vocab_size!r} must be in (256, 65536]")
    path = cache_root() / f"bpe-{corpus.corpus_hash}-{vocab_size}.json"
    if cache and path.exists():
        return Tokenizer.from_file(str(path))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[SEPARATOR], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus.texts("train"), trainer=trainer)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial")
        tokenizer.save(str(tmp))
        tmp.rename(path)
    return tokenizer


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of a tokenizer's vocabulary (either kind), for cache keys and provenance."""
    vocab = tokenizer.get_vocab()
    return hashlib.sha1(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:12]


def separator_id(tokenizer) -> int:
    """Token placed between files: our SEPARATOR, else the HF tokenizer's EOS."""
    vocab = tokenizer.get_vocab()
    if SEPARATOR in vocab:
        return vocab[SEPARATOR]
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError("tokenizer has neither <|endoftext|> nor an eos_token_id to separate files")
    return eos


def encode_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids per text with a `tokenizers.Tokenizer` or a transformers tokenizer (no special tokens)."""
    if hasattr(tokenizer, "encode_batch"):
        return [enc.ids for enc in tokenizer.encode_batch(texts)]
    return list(tokenizer(texts, add_special_tokens=False).input_ids)


def pack_blocks(token_lists, block_len: int, sep_id: int, max_blocks: int | None = None) -> torch.Tensor:
    """Concatenate files (sep after each) and cut into non-overlapping blocks: -> (N, block_len) long.

    token_lists may be a lazy iterable: it is consumed only until max_blocks blocks are filled.
    The tail that does not fill a block is dropped.
    """
    if block_len < 2:
        raise ValueError(f"block_len={block_len!r} must be >= 2")
    stream: list[int] = []
    for ids in token_lists:
        stream.extend(ids)
        stream.append(sep_id)
        if max_blocks is not None and len(stream) >= max_blocks * block_len:
            break
    n_blocks = len(stream) // block_len
    if max_blocks is not None:
        n_blocks = min(n_blocks, max_blocks)
    if n_blocks == 0:
        raise ValueError(f"block_len={block_len} exceeds the {len(stream)} tokens available")
    return torch.tensor(stream[: n_blocks * block_len], dtype=torch.long).view(n_blocks, block_len)


def iter_encoded(tokenizer, texts: list[str], chunk: int = 16):
    """Token ids per text, encoded lazily in chunks (so a capped pack tokenizes only what it needs)."""
    for start in range(0, len(texts), chunk):
        yield from encode_texts(tokenizer, texts[start:start + chunk])


def tokenized_blocks(corpus: Corpus, tokenizer, split: str, block_len: int, *,
                     max_blocks: int | None = None, cache: bool = True) -> torch.Tensor:
    """`pack_blocks` of one split, cached on disk keyed by corpus, tokenizer, split, sizes: (N, block_len)."""
    key = f"{corpus.corpus_hash}-{tokenizer_fingerprint(tokenizer)}-{split}-{block_len}-{max_blocks}"
    path = cache_root() / f"blocks-{key}.pt"
    if cache and path.exists():
        return torch.load(path)
    blocks = pack_blocks(iter_encoded(tokenizer, corpus.texts(split, order="hash")), block_len,
                         separator_id(tokenizer), max_blocks=max_blocks)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial")
        torch.save(blocks, tmp)
        tmp.rename(path)
    return blocks


def to_dataset(blocks: torch.Tensor):
    """(N, T) blocks -> a `datasets.Dataset` with one column input_ids, formatted as torch tensors."""
    import datasets

    return datasets.Dataset.from_dict({"input_ids": blocks.tolist()}).with_format("torch")


def identifier_token_ids(tokenizer, min_chars: int = 3) -> torch.Tensor:
    """(V,) bool: tokens that are (part of) an identifier: letters/digits/_ only, >= min_chars, not a keyword."""
    vocab_size = len(tokenizer.get_vocab())
    flags = torch.zeros(vocab_size, dtype=torch.bool)
    for index in tokenizer.get_vocab().values():
        word = tokenizer.decode([index]).strip()
        if index < vocab_size and len(word) >= min_chars and word.isidentifier() and not keyword.iskeyword(word):
            flags[index] = True
    return flags


def induction_mask(blocks: torch.Tensor, is_identifier: torch.Tensor) -> torch.Tensor:
    """(N, T) blocks -> (N, T-1) bool: position i is an induction case for predicting blocks[:, i+1].

    Case: the target t[i+1] is an identifier token and the bigram (t[i], t[i+1]) already occurred
    earlier in the same block (A B ... A -> B), i.e. copying from context predicts it.
    """
    n_rows, length = blocks.shape
    mask = torch.zeros((n_rows, length - 1), dtype=torch.bool)
    for row in range(n_rows):
        seen: set[tuple[int, int]] = set()
        ids = blocks[row].tolist()
        for i in range(length - 1):
            pair = (ids[i], ids[i + 1])
            if pair in seen and bool(is_identifier[ids[i + 1]]):
                mask[row, i] = True
            seen.add(pair)
    return mask
