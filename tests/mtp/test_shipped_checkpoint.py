"""The retrofit checkpoint shipped in checkpoints/mtp/ matches its record and the default spec."""
import json

from decodelab.mtp import shipped
from decodelab.mtp.retrofit_train import RetrofitSpec, spec_hash


def test_shipped_checkpoint_matches_its_record():
    directory = shipped.shipped_path()
    record = shipped.read_record(directory)
    assert shipped.sha256_of(directory / shipped.WEIGHTS) == record["sha256"]
    assert shipped.check_record(directory, spec=RetrofitSpec(), model_name="smollm2-135m") == []
    assert record["content_hash"] == spec_hash(RetrofitSpec(), record["model"], record["corpus_hash"])
    for key in ("command", "seed", "corpus_hash", "spec", "train_s", "load_average", "train_agreement_bf16"):
        assert key in record, key
    assert (directory / shipped.WEIGHTS).stat().st_size < 20 * 2**20  # a few MB: one block in bf16


def test_shipped_config_names_the_frozen_model_and_one_module():
    meta = json.loads((shipped.shipped_path() / "mtp_config.json").read_text())
    assert meta["retrofit_model"] == "smollm2-135m" and meta["frozen_trunk"] is True
    assert meta["mtp"]["style"] == "deepseek" and meta["mtp"]["n_heads"] == 2
    assert meta["trunk_config"]["vocab_size"] == 49152
