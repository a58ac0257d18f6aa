"""The quarantine in the Hugging Face Trainer (`gradbus.hf.guard(..., quarantine=True)`):
python/examples/hf_trainer.py under torchrun, 2 processes, DDP over gloo, with a GRPO-style loss
normalised per sequence by its length (`--per-sequence-loss`). One item without a label token (an
empty response) on rank 1 makes the update's loss 0/0 = NaN: the report names the samples of rank 1's
micro-batch, rank 0 lists them in quarantine.jsonl, the abort saves a checkpoint through the
Trainer's own save, and the run resumed from it leaves them out and passes the update. A clean run
with the quarantine's plumbing is the Trainer's alone, bit for bit."""

import json
import math
import os

from skip import framework

framework("transformers", "transformers")

import example_run  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "hf_trainer.py")


def torchrun(tmp_path, name, *args):
    return example_run.torchrun(EXAMPLE, tmp_path, name, "--per-sequence-loss", *args)


def test_an_empty_response_is_named_quarantined_and_the_resume_passes(tmp_path):
    _, _, alone = torchrun(tmp_path, "alone", "--policy", "none")
    rc, out, clean = torchrun(tmp_path, "clean", "--quarantine")
    assert rc == 0, out
    assert [r["weights"] for r in clean] == [r["weights"] for r in alone], "the quarantine's plumbing changed the run"
    assert [e.get("loss") for e in clean[0]["log_history"]] == [e.get("loss") for e in alone[0]["log_history"]]
    # Rank 1's micro-batch at step 2, and in it the item that gets an empty response.
    batch = next(s["ids"] for s in clean[1]["seen"] if s["step"] == 2)
    bad = batch[1]

    rc, out, res = torchrun(tmp_path, "empty", "--quarantine", "--empty-response", str(bad))
    assert rc != 0
    run_dir = tmp_path / "empty" / "run"
    report = json.loads((run_dir / "report.json").read_text())
    assert (report["step"], report["ranks"], report["loss_finite"]) == (2, [1], False), report
    assert [p["samples"] for p in report["per_rank"]] == [batch], report
    checkpoint = str(run_dir / "checkpoint-2")
    for k, r in enumerate(res):
        assert r["report"] == report and f"rank 1 samples {batch}" in r["error"] and r["checkpoint"] == checkpoint
        assert r["global_step"] == 2 and r["optimizer_steps"] == [2] and r["nonfinite_params"] == []
    q = [json.loads(x) for x in (run_dir / "quarantine.jsonl").read_text().splitlines()]
    assert [(x["update"], x["rank"], x["verdict"], x["samples"]) for x in q] == [(2, 1, "abort", batch)]
    assert json.loads((run_dir / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2

    # The resume, in the same run dir (its quarantine.jsonl), leaves those samples out and passes
    # step 2 and the rest.
    rc, out, res = example_run.torchrun(EXAMPLE, tmp_path, "resumed", "--per-sequence-loss", "--quarantine",
                                        "--empty-response", str(bad), "--resume", checkpoint, run_dir=run_dir)
    assert rc == 0, out
    assert f"leaving out 4 quarantined sample(s): {batch}" in out
    for r in res:
        assert r["error"] is None and r["global_step"] == 6 and r["nonfinite_params"] == []
        assert [s["step"] for s in r["seen"]] == [2, 3, 4, 5]
        assert not {i for s in r["seen"] for i in s["ids"]} & set(batch)
        assert all(math.isfinite(e["loss"]) for e in r["log_history"] if "loss" in e)
    assert res[0]["weights"] == res[1]["weights"]
