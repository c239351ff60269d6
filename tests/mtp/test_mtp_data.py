"""The stdlib corpus: deterministic file-level split, hashing, BPE training, packing, induction probe."""
import pytest
import torch

from decodelab.mtp import data as mtp_data


@pytest.fixture
def tree(source_tree):
    root = source_tree
    for skipped in ("test/test_x.py", "pkg0/tests/test_y.py", "idlelib/idle_test/t.py", "site-packages/z.py"):
        (root / skipped).parent.mkdir(parents=True, exist_ok=True)
        (root / skipped).write_text("SKIPPED = True\n")
    return root


def test_test_suites_are_excluded(tree):
    files = mtp_data.list_source_files(tree)
    assert len(files) == 40
    assert not any("test" in f or "site-packages" in f for f in files)


def test_split_is_by_file_deterministic_and_disjoint(tree):
    a, b = mtp_data.load_corpus(tree, val_fraction=0.25), mtp_data.load_corpus(tree, val_fraction=0.25)
    assert a.train_files == b.train_files and a.val_files == b.val_files
    assert not set(a.train_files) & set(a.val_files)
    assert len(a.train_files) + len(a.val_files) == 40
    assert all(mtp_data.file_bucket(f) < 0.25 for f in a.val_files)


def test_corpus_hash_tracks_content(tree):
    before = mtp_data.load_corpus(tree).corpus_hash
    (tree / "pkg1" / "mod1.py").write_text("changed = 1\n")
    assert mtp_data.load_corpus(tree).corpus_hash != before


def test_max_bytes_keeps_a_deterministic_subset(tree):
    full = mtp_data.load_corpus(tree)
    sub = mtp_data.load_corpus(tree, max_bytes=full.n_bytes // 3)
    assert sub.n_bytes <= full.n_bytes // 3
    assert set(sub.train_files) <= set(full.train_files)
    assert sub.corpus_hash == mtp_data.load_corpus(tree, max_bytes=full.n_bytes // 3).corpus_hash


def test_bpe_tokenizer_round_trips_training_text(tree):
    corpus = mtp_data.load_corpus(tree, val_fraction=0.25)
    tok = mtp_data.train_bpe_tokenizer(corpus, vocab_size=300)
    assert tok.get_vocab_size() <= 300
    assert mtp_data.separator_id(tok) == 0
    text = corpus.texts("val")[0]
    assert tok.decode(tok.encode(text).ids) == text
    cached = mtp_data.train_bpe_tokenizer(corpus, vocab_size=300)
    assert cached.get_vocab() == tok.get_vocab()


def test_pack_blocks_concatenates_with_separators():
    blocks = mtp_data.pack_blocks([[1, 2, 3], [4, 5], [6, 7, 8, 9]], block_len=4, sep_id=0)
    assert blocks.tolist() == [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]]
    assert mtp_data.pack_blocks(iter([[1, 2, 3]] * 100), 4, 0, max_blocks=2).shape == (2, 4)
    with pytest.raises(ValueError, match="block_len=1"):
        mtp_data.pack_blocks([[1]], 1, 0)


def test_tokenized_blocks_cache_returns_same_tensor(tree):
    corpus = mtp_data.load_corpus(tree, val_fraction=0.25)
    tok = mtp_data.train_bpe_tokenizer(corpus, vocab_size=300)
    first = mtp_data.tokenized_blocks(corpus, tok, "train", 16)
    assert torch.equal(first, mtp_data.tokenized_blocks(corpus, tok, "train", 16))
    dataset = mtp_data.to_dataset(first)
    assert torch.equal(dataset[[0, 1]]["input_ids"], first[:2])


def test_induction_mask_marks_repeated_identifier_bigrams():
    is_ident = torch.zeros(10, dtype=torch.bool)
    is_ident[[5, 6]] = True
    blocks = torch.tensor([[1, 5, 2, 1, 5, 3, 6, 3, 6]])
    # positions i predicting blocks[i+1]: (1,5) repeats at i=3; (3,6) repeats at i=7
    assert mtp_data.induction_mask(blocks, is_ident).nonzero()[:, 1].tolist() == [3, 7]


def test_bad_arguments_name_the_value(tree):
    with pytest.raises(ValueError, match="val_fraction=1.5"):
        mtp_data.load_corpus(tree, val_fraction=1.5)
    with pytest.raises(ValueError, match="split='test'"):
        mtp_data.load_corpus(tree).texts("test")
