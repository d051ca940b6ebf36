"""Distributed runs on 2 gloo ranks (CPU): every rank takes the same decision, disagreement is an error."""

import json
import pathlib
import socket
import textwrap

import pytest
import torch

HERE = pathlib.Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(python, scenario):
    proc = python(None, str(HERE / "dist_worker.py"), scenario, str(free_port()), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in ranks:
        assert "crash" not in r, r.get("crash")
    return ranks


def test_ddp_with_a_grad_scaler_holds_identically_on_every_rank(python):
    r0, r1 = run_ranks(python, "ddp_scaler")
    assert r0 == r1  # same last_epoch, LR, stats, scale and parameters
    assert r0["skipped"] == 2 and r0["held"] == 2 and r0["applied"] == 4
    assert r0["last_epoch"] == 4  # 6 iterations, 2 skipped on both ranks (DDP all-reduced rank 1's inf)
    assert r0["scheduler_warnings"] == []


def test_a_rank_without_the_guard_makes_no_guarded_rank_wait_forever(python):
    r0, r1 = run_ranks(python, "one_rank_unguarded")  # run_ranks has a 120 s limit: a hang fails the test
    assert len(r0["warnings"]) == 1 and "1 of 2 ranks reached ampguard's first decision" in r0["warnings"][0]
    assert r0["applied"] == 4 and r1["warnings"] == []
    assert r0["seconds"] < 60  # one handshake timeout (3 s here), once


def test_sharded_grad_scaler_disagreement_raises_on_every_rank(python):
    r0, r1 = run_ranks(python, "sharded_fused")
    # without ampguard (and with distributed=False) the ranks silently diverge
    for run in ("plain", "distributed_off"):
        assert r0[run]["scale"] == 65536.0 and r1[run]["scale"] == 32768.0
        assert r0[run]["weight"] != r1[run]["weight"]
    # with ampguard both ranks stop at the same update() with the same message
    assert r0["error_type"] == r1["error_type"] == "AmpGuardError"
    assert r0["error"] == r1["error"]
    assert "rank(s) [1] skipped the step (inf/NaN gradients) while rank(s) [0] applied it" in r0["error"]
    assert "The parameters have diverged across ranks" in r0["error"]
    assert r0["skipped"] == r1["skipped"] == 0  # nothing was counted from the disputed step
    # the fix the message names: a non-fused optimizer, whose unscale_() all-reduces found_inf
    assert r0["fixed"] == r1["fixed"]
    assert r0["fixed"]["scale"] == 32768.0 and r0["fixed"]["last_epoch"] == 2
    assert r0["fixed_held"] == r1["fixed_held"] == 1


def test_nan_inside_a_ddp_model_names_the_op_and_the_module_on_every_rank(python):
    r0, r1 = run_ranks(python, "ddp_nan_origin")
    assert r0 == r1
    assert r0["op"] == "torch.sqrt" and r0["module"] == "1" and r0["kind"] == "nan"
    assert r0["ops"][0] == "Sequential"  # the wrapped module is the call replayed, never DDP


def test_trace_eager_raises_an_op_found_on_one_rank_where_every_rank_reads(python):
    """trace='eager' finds the op on rank 1 as it runs. Raised there, rank 0 went on into the backward's all-reduce
    and waited for a rank that had stopped. Every rank now stops at the same read: under a GradScaler its update(),
    whose agreement tells rank 0; without one the step, where DDP has brought the NaN into rank 0's gradients."""
    r0, r1 = run_ranks(python, "eager_nan_on_one_rank")  # no crash, within run_ranks' 120 s
    for scaler, at in (("True", [2, "update"]), ("False", [2, "step"])):
        e0, e1 = r0[scaler], r1[scaler]
        assert e0["at"] == e1["at"] == at, (scaler, e0["at"], e1["at"])
        assert e1["op"] == "torch.log" and e1["module"] == "0" and e1["sink"] == "the output of this op"
        assert "EAGER POISON" in e1["line"]
        assert e1["message"].startswith("ampguard: torch.log created NaN from inputs without NaN in module '0' at")
        if scaler == "True":
            assert e0["sink"] == "the output of this op on rank 1"
            assert "\n  rank 1: ampguard: torch.log created NaN from inputs without NaN in module '0' at\n" in \
                e0["message"]
        else:
            assert e0["sink"] == "gradient of parameter '0.fc.weight'"
            assert "this rank's own backward stayed finite: the value came into its gradients from outside it" in \
                e0["message"]


def test_a_teachers_nan_output_on_one_rank_is_raised_where_every_rank_reads(python):
    """On the CPU a no_grad call's NaN output is raised by that call, except in a distributed run: there rank 1
    would stop at its teacher's call and leave rank 0 waiting in DDP's all-reduce (here: crashed as rank 1 left)."""
    r0, r1 = run_ranks(python, "teacher_nan_on_one_rank")  # no crash, within run_ranks' 120 s
    assert r0["reached"] == r1["reached"] == "backward"
    assert r1["sink"] == "output of module 'Linear'" and r0["sink"] is not None


@pytest.mark.parametrize("scenario", ["nan_loss_scaler", "nan_loss_scaler_accumulating", "nan_loss_accumulating"])
def test_a_nan_loss_on_one_rank_stops_every_rank_at_the_same_read_and_none_waits(python, scenario):
    """A corrupt sample on rank 1 only. Before, rank 1 raised alone (at update(), or at its next micro-batch's call)
    while rank 0 went on into the next all-reduce and waited for it (here: crashed as rank 1 exited)."""
    r0, r1 = run_ranks(python, scenario)  # no crash, within run_ranks' 120 s
    for r in (r0, r1):
        assert r["plain"]["weight"] == r["clean"]["weight"] and r["plain"]["lr"] == r["clean"]["lr"]
    p0, p1 = r0["poisoned"], r1["poisoned"]
    at = "step" if scenario == "nan_loss_accumulating" else "update"
    assert (p0["iteration"], p0["at"]) == (p1["iteration"], p1["at"]) == (2, at)
    assert p1["sink"] == "loss" and p1["kind"] == "nan"
    if scenario == "nan_loss_scaler":
        assert "It entered already non-finite (NaN): argument 0 of the call of 'Sequential'" in p1["message"]
    else:  # an earlier micro-batch, read with the others at the step: its data is the user's to keep
        assert "an earlier micro-batch of a step that accumulates gradients" in p1["message"]
        assert "in a distributed run, where every rank decides together" in p1["message"]
    if at == "update":
        assert p0["sink"] == "loss on rank 1" and p0["kind"] == "nan"
        assert p0["message"].startswith("ampguard: rank 1 stopped at this GradScaler.update() on a non-finite value.")
        assert "\n  rank 1: ampguard: NaN reached the loss.\n" in p0["message"]
        assert "This rank's GradScaler skipped the optimizer step" in p0["message"]
        # ampguard's collectives: one a clean update(), of the 2 x 1 found_inf table as before (the checks' totals
        # ride in it), and one more on the failure path, where the ranks exchange their verdicts
        assert r0["clean"]["calls"] == r1["clean"]["calls"] == [1, 1, 1, 1]
        assert r0["clean"]["sizes"] == [2]
        assert p0["calls"] == p1["calls"] == [1, 1, 2]
    else:  # no GradScaler: DDP reduced rank 1's NaN gradients into rank 0's, which its own step's check reads
        assert p0["sink"] == "gradient of parameter '0.weight'"
        assert "another rank's non-finite gradients reach this rank's too" in p0["message"]
        # its own backward, replayed, is finite: that is the evidence, with no "did not reproduce" list first
        assert "this rank's own backward stayed finite: the value came into its gradients from outside it" in \
            p0["message"]
        assert "stayed finite: the value did not reproduce" not in p0["message"]
        assert r0["clean"]["calls"] == [0, 0, 0, 0]


def test_a_failed_rank_whose_words_never_reached_the_store_makes_no_rank_wait(python):
    r0, r1 = run_ranks(python, "verdict_without_words")  # within run_ranks' 120 s: the store's timeout is 30 min
    assert r0["failed"] == {"1": {}}  # known failed, with nothing of its message
    assert r1["failed"] == {}  # (its own failure is its own error, raised by the caller)
    assert r0["seconds"] < 30


def test_gradients_non_finite_at_every_scale_on_one_rank_stop_every_rank_at_the_same_update(python):
    """check_unscaled_after's replay at scale 1 runs on each rank, and only rank 1's own backward makes the NaN:
    before, rank 1 raised alone and rank 0 went on into its next all-reduce (here: crashed as rank 1 exited)."""
    r0, r1 = run_ranks(python, "unscaled_nan_on_one_rank")
    assert r0["iteration"] == r1["iteration"] == 3  # the fourth skip in a row: the replays at the 3rd and 4th agree
    assert r0["scale"] == r1["scale"] == 16.0  # update() ran on both before the error (256 backed off 4 times)
    assert r1["sink"] == "gradients at every loss scale" and r1["op"] == "torch.sqrt"
    assert r0["sink"] == "gradients at every loss scale on rank 1" and r0["op"] is None
    assert "\n  rank 1: ampguard: GradScaler skipped 4 optimizer steps in a row" in r0["message"]


def test_nan_inside_a_ddp_model_that_looks_for_unused_parameters_names_the_op(python):
    r0, r1 = run_ranks(python, "ddp_unused_nan_origin")
    assert r0 == r1
    assert r0["op"] == "torch.sqrt" and r0["module"] == "1" and r0["sink"] == "loss"


LIGHTNING_DDP = """
import os, torch, lightning.pytorch as L
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.n = 0
        self.layer.weight.register_hook(lambda g: g * float("inf") if self.n in (1, 3) else None)

    def training_step(self, batch, i):
        self.n += 1
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        for group in optimizer.param_groups:  # the seed: LR warm-up, and the closure forgotten
            group["lr"] = group["lr"] * min(1.0, (self.trainer.global_step + 1) / 2)
        optimizer.step()

m = Model()
trainer = L.Trainer(max_epochs=1, strategy="ddp", accelerator="cpu", devices=2, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=16.0))])
trainer.fit(m, DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4))
import ampguard
g = ampguard.active()
s = g.stats
sched = trainer.lr_scheduler_configs[0].scheduler
with open(f"rank{trainer.global_rank}.txt", "w") as f:  # one file a rank: their stdouts interleave
    print(trainer.global_rank, m.n, s.closures_injected, s.optimizer_steps_skipped, s.scheduler_steps_held,
          sched.last_epoch, m.layer.weight.detach().sum().item(), file=f)
# As PyTorch asks of every distributed program: without it, gloo's threads can outlive the interpreter and
# abort the exit ("terminate called without an active exception", pytorch/pytorch#190489), once in many runs.
torch.distributed.destroy_process_group()
"""


def test_lightning_ddp_strategy_under_ampguard_env_reaches_both_ranks(python, tmp_path):
    pytest.importorskip("lightning.pytorch")
    script = tmp_path / "train_ddp.py"
    script.write_text(textwrap.dedent(LIGHTNING_DDP))
    proc = python(None, str(script), env={"AMPGUARD": "1", "MASTER_PORT": str(free_port())}, timeout=240,
                  cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [(tmp_path / f"rank{r}.txt").read_text().split() for r in (0, 1)]  # the worker Lightning started ran
    assert [r[0] for r in rows] == ["0", "1"]
    # 4 batches per rank: training_step ran 4 times, 4 closures injected, 2 skips, 2 held, 2 scheduler steps
    assert rows[0][1:6] == rows[1][1:6] == ["4", "4", "2", "2", "2"]
    assert rows[0][6] == rows[1][6]  # the same weights on both ranks
    assert "optimizer.step(closure=optimizer_closure)" in proc.stderr
    assert proc.stderr.count("ampguard report (rank") == 2
    # the script destroyed its process group before exit, as PyTorch asks: each report still names its rank
    assert "ampguard report (rank 0 of 2)" in proc.stderr and "ampguard report (rank 1 of 2)" in proc.stderr


LIGHTNING_STRATEGY_NAN = """
import json, sys, warnings, torch, torch.distributed as dist, lightning.pytorch as L
import ampguard
from torch.utils.data import DataLoader, TensorDataset

class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        if "find_unused" in sys.argv[1]:
            self.unused = torch.nn.Linear(4, 4)  # what that strategy is for
        self.logged = 0

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        out = self(batch[0])
        loss = out.pow(2).mean()
        self.log("train_loss", loss)
        self.logged += 1
        if batch_idx == 1:
            loss = loss + torch.log(out - out - 1).mean()  # POISON
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

warnings.filterwarnings("ignore")
ampguard.install(repro_dir="bundles")
model = Model()
trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, strategy=sys.argv[1], logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
try:
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=8))
    result = {"error": None}
except ampguard.NonFiniteError as err:
    result = {"op": err.op, "line": err.origin[-1].line if err.origin else None, "logged": model.logged,
              "replayed": "Found by replaying" in str(err), "repro": err.repro}
if dist.is_initialized():
    dist.destroy_process_group()
print(json.dumps(result))
"""


@pytest.mark.parametrize("strategy", ["ddp", "ddp_find_unused_parameters_true"])
def test_a_nan_in_training_step_under_a_lightning_ddp_strategy_is_replayed_through_training_step(
        python, tmp_path, strategy):
    """Lightning's strategies run training_step as the wrapped module's forward, for that one call: the replay
    runs training_step (its self.log() logs nothing then), not the LightningModule's own forward."""
    pytest.importorskip("lightning.pytorch")
    script = tmp_path / "strategy_nan.py"
    script.write_text(textwrap.dedent(LIGHTNING_STRATEGY_NAN))
    proc = python(None, str(script), strategy, env={"MASTER_PORT": str(free_port())}, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["replayed"] and result["op"] == "torch.log" and result["line"].endswith("# POISON")
    # training_step ran for two batches, and once more in the replay of the second (torch.log is only there), whose
    # count the replay put back: it leaves the module's attributes as the user's training_step left them
    assert result["logged"] == 2
    # the op of training_step's own code is bundled as that op and its inputs, as the loss code of a plain loop is
    meta = torch.load(result["repro"], weights_only=True)
    assert meta["kind"] == "op" and meta["op"] == "torch.log"


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
def test_fsdp_trains_unchanged_and_a_nan_is_reported_truthfully_on_every_rank(python, kind):
    """FSDP2 (fully_shard, DTensor parameters) and FSDP1 (flat parameters) on 2 gloo ranks. A forward under FSDP
    cannot be replayed on one rank (its all-gathers would hang the other), and the message says so and what works:
    trace='eager', which then names the op (it once blamed the uninitialised all-gather buffers FSDP allocates)."""
    r0, r1 = run_ranks(python, kind)
    assert r0["identical"] and r1["identical"]
    origin, other = r1["replay"], r0["replay"]  # the NaN is made on rank 1; rank 0 gets it through the gradients
    assert origin["sink"] == "loss" and origin["op"] is None
    assert "it runs FSDP's collectives in its forward" in origin["message"]
    assert "trace='eager'" in origin["message"]
    assert other["sink"].startswith("gradient of parameter 'blocks.") and other["op"] is None
    assert "could not replay" not in other["message"] and "freed before the check" not in other["message"]
    assert "another rank's non-finite gradients reach this rank's too" in other["message"]
    if kind == "fsdp2":
        assert "in this rank's shard" in other["message"]
    for r in (r0, r1):
        assert r["eager"]["op"] == "torch.log" and r["eager"]["line"].endswith("# FSDP POISON"), r["eager"]
    # made on rank 1 alone: rank 1 names the op at the step's read, where rank 0 stops on the gradients it received
    # (raised as the op ran, rank 1 left rank 0 waiting in the forward's next all-gather)
    assert r1["eager_one"]["op"] == "torch.log" and r1["eager_one"]["line"].endswith("# FSDP POISON")
    assert r0["eager_one"]["sink"].startswith("gradient of parameter 'blocks.")
    assert "another rank's non-finite gradients reach this rank's too" in r0["eager_one"]["message"]


def test_a_replay_on_one_rank_runs_none_of_the_forwards_collectives(python):
    """A NaN on one rank is replayed there alone. The forward it re-ran all-reduced, and that all_reduce paired with
    the other rank's next collective: that rank got the replay's data, and the replaying rank's own next collective
    then waited forever for a partner (run_ranks times out)."""
    r0, r1 = run_ranks(python, "collective_in_forward")
    assert r1["error"] is None and r1["check"] == 3.0 and r0["check"] == 3.0, (r0, r1)
    assert "NaN reached the loss" in r0["error"], r0["error"]
    assert "it runs a collective (c10d.allreduce_), which one rank cannot re-run alone" in r0["error"], r0["error"]


def test_a_backward_replay_on_one_rank_stops_before_the_backwards_collective(python):
    """Tensor parallelism all-reduces gradients inside backward (an autograd Function, as Megatron's is). The
    backward replay that names a NaN gradient ran that all_reduce on the one rank replaying: the other rank's next
    collective received it, and gloo aborted that rank ("collective mismatch")."""
    r0, r1 = run_ranks(python, "collective_in_backward")
    assert r1["error"] is None and r1["check"] == 3.0 and r0["check"] == 3.0, (r0, r1)
    assert "The backward of torch.sqrt (SqrtBackward0) turned finite gradients into +Inf" in r0["error"], r0["error"]
