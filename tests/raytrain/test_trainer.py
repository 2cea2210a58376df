"""``make_trainer``'s storage: the run folder's train/ by default; a folder every node mounts
(``storage: file://...``) written in place, like train/; object storage staged (tested against an
S3 server in integration/test_object_storage.py)."""

from __future__ import annotations

from jaxray.config import parse_trial
from jaxray.raytrain.trainer import make_trainer

TRIAL = parse_trial({"model": {"workload": "mlp", "width": 8}, "train": {"steps": 2, "log_every": 1}})


def test_a_mounted_folder_is_written_in_place_and_holds_the_run_files(tmp_path):
    local = make_trainer(TRIAL, {}, storage_path=tmp_path / "train", name="t")
    assert local.run_config.storage_path == str(tmp_path / "train")
    assert local.train_loop_config["trial_uri"] is None
    assert local.train_loop_config["attempts_file"] == str(tmp_path / "train" / "t.attempts.json")
    shared = (tmp_path / "shared").as_uri()
    mounted = make_trainer(TRIAL, {}, storage_path=tmp_path / "train", name="t", storage_uri=shared)
    assert mounted.run_config.storage_path == str(tmp_path / "shared")
    assert mounted.train_loop_config["trial_uri"] is None  # no staging: every worker writes in place
    assert mounted.train_loop_config["attempts_file"] == f"{shared}/t.attempts.json"
