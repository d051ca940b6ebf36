"""Runs one distributed scenario on 2 gloo ranks (CPU) and prints every rank's results as JSON.

``python tests/dist_worker.py SCENARIO PORT``. torch is imported once, then the ranks are forked,
so a scenario costs one interpreter start-up and stays within a few seconds.
"""

import contextlib
import json
import os
import sys
import tempfile
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def lam(step):
    return 1.0 / (step + 1)


def ddp_scaler(rank):
    """DDP all-reduces gradients, so inf on one rank reaches both: both skip and hold alike."""
    import ampguard

    g = ampguard.install()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    scaler = torch.amp.GradScaler("cpu")
    it = [0]
    if rank == 1:
        model.module.weight.register_hook(lambda grad: grad * float("inf") if it[0] in (0, 3) else None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(6):
            it[0] = i
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * rank + i))
            scaler.scale(model(x).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad()
    s = g.stats
    return {"last_epoch": sched.last_epoch, "lr": opt.param_groups[0]["lr"], "skipped": s.optimizer_steps_skipped,
            "applied": s.optimizer_steps_applied, "held": s.scheduler_steps_held, "scale": scaler.get_scale(),
            "weight": model.module.weight.detach().tolist(),
            "scheduler_warnings": [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]}


def sharded_loop(rank, fused=True, steps=3):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, fused=fused, foreach=None if fused else True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    scaler = ShardedGradScaler("cpu")
    it = [0]
    if rank == 1:
        m.weight.register_hook(lambda grad: grad * float("inf") if it[0] == 1 else None)
    for i in range(steps):
        it[0] = i
        scaler.scale(m(torch.ones(2, 4)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
    return {"scale": scaler.get_scale(), "weight": m.weight.detach().tolist(), "last_epoch": sched.last_epoch}


def sharded_fused(rank):
    """ShardedGradScaler + fused AdamW does not all-reduce found_inf: without ampguard the ranks diverge."""
    import ampguard

    out = {"plain": sharded_loop(rank)}
    with ampguard.guard(distributed=False):
        out["distributed_off"] = sharded_loop(rank)
    with ampguard.guard() as g:
        try:
            sharded_loop(rank)
            out["error"] = None
        except ampguard.AmpGuardError as err:
            out["error"] = str(err)
            out["error_type"] = type(err).__name__
        out["skipped"] = g.stats.optimizer_steps_skipped
        out["applied"] = g.stats.optimizer_steps_applied
    with ampguard.guard() as g:
        out["fixed"] = sharded_loop(rank, fused=False)  # the fix the error names
        out["fixed_held"] = g.stats.scheduler_steps_held
    return out


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.sqrt(self.fc(x) - 100.0)  # NaN on every rank


def ddp_nan_origin(rank):
    """A NaN inside the module DDP wraps is traced from that module, not from DDP's own forward."""
    import ampguard
    from ampguard import nonfinite

    ampguard.install()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4), Block()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = model(torch.ones(2, 4))
    ops = [type(getattr(e, "module", None)).__name__ for e in nonfinite.T.window]  # the calls recorded
    try:
        out.sum().backward()
        opt.step()
        return {"error": None, "ops": ops}
    except ampguard.NonFiniteError as err:
        return {"op": err.op, "module": err.module, "kind": err.kind, "sink": err.sink, "ops": ops}


def ddp_unused_nan_origin(rank):
    """DDP looking for unused parameters hands its module's outputs back through an identity Function: the loss
    code sees new tensors, and the origin inside the module is still found, also in a second micro-batch."""
    import ampguard

    class Sometimes(Block):
        poisoned = False

        def forward(self, x):
            return super().forward(x) if self.poisoned else self.fc(x)

    ampguard.install()
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(4, 4), Sometimes())
    inner.unused = torch.nn.Linear(4, 4)
    model = torch.nn.parallel.DistributedDataParallel(inner, find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.no_sync():
        model(torch.ones(2, 4)).sum().backward()  # micro-batch 1: finite (its output is not kept)
    inner[1].poisoned = True
    try:
        model(torch.ones(2, 4)).sum().backward()  # micro-batch 2: NaN in Block's sqrt
        opt.step()
        return {"error": None}
    except ampguard.NonFiniteError as err:
        return {"op": err.op, "module": err.module, "kind": err.kind, "sink": err.sink}


def nan_loss_on_one_rank(rank, scaler, micro_batches):
    """Rank 1's batch at iteration 2 holds a NaN (its loss is NaN); rank 0's data is clean. DDP, an AdamW, fp16
    autocast with a GradScaler (or bf16 without one), ``micro_batches`` per step, the first under no_sync().

    Also counts ampguard's collectives (torch.distributed.all_reduce: DDP's own reducer does not call it) per
    iteration, and runs the same loop clean, plain and guarded."""
    import contextlib

    import ampguard

    calls = []
    sizes = set()  # the elements of each tensor ampguard all-reduces
    real = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        calls[-1] += 1
        sizes.add(tensor.numel())
        return real(tensor, *args, **kwargs)

    def loop(poison):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
        model = torch.nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
        amp = torch.amp.GradScaler("cpu", init_scale=256.0, enabled=scaler)
        calls.clear()
        for i in range(4):
            calls.append(0)
            for micro in range(micro_batches):
                x = torch.randn(8, 8, generator=torch.Generator().manual_seed(100 * rank + 10 * i + micro))
                y = x.sum(1, keepdim=True)
                if poison and rank == 1 and i == 2 and micro == 0:
                    x[3, 5] = float("nan")  # a corrupt sample
                ctx = model.no_sync() if micro < micro_batches - 1 else contextlib.nullcontext()
                try:
                    with ctx:
                        with torch.autocast("cpu", dtype=torch.float16 if scaler else torch.bfloat16):
                            loss = torch.nn.functional.mse_loss(model(x).float(), y) / micro_batches
                        amp.scale(loss).backward()
                except ampguard.NonFiniteError as err:
                    return {"iteration": i, "at": f"micro-batch {micro}", "sink": err.sink, "kind": err.kind,
                            "message": str(err), "calls": list(calls)}
            try:
                amp.step(opt)
                amp.update()
            except ampguard.NonFiniteError as err:
                return {"iteration": i, "at": "update" if scaler else "step", "sink": err.sink, "kind": err.kind,
                        "message": str(err), "calls": list(calls)}
            sched.step()
            opt.zero_grad()
        return {"weight": net[0].weight.detach().tolist(), "lr": opt.param_groups[0]["lr"], "calls": list(calls)}

    plain = loop(False)
    dist.all_reduce = counted
    try:
        with ampguard.guard():
            clean = loop(False)
        clean["sizes"] = sorted(sizes)
        with ampguard.guard():
            poisoned = loop(True)
    finally:
        dist.all_reduce = real
    return {"plain": plain, "clean": clean, "poisoned": poisoned}


def unscaled_nan_on_one_rank(rank):
    """Rank 1's loss adds sqrt(out * 0): 0 forward, NaN gradients at every scale (sqrt's Inf at 0 times the
    product's 0). DDP reduces them into rank 0's, so both ranks skip every step; at the third and fourth skips
    (check_unscaled_after, and the next, which must agree) each rank replays its backward at scale 1, and only rank
    1's is non-finite."""
    import ampguard

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    with ampguard.guard():
        for i in range(5):
            x = torch.randn(8, 8, generator=torch.Generator().manual_seed(10 * rank + i))
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x).float()
            loss = out.pow(2).mean()
            if rank == 1:
                loss = loss + torch.sqrt(out * 0).sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            try:
                scaler.update()
            except ampguard.NonFiniteError as err:
                return {"iteration": i, "sink": err.sink, "op": err.op, "message": str(err),
                        "scale": scaler.get_scale()}
            opt.zero_grad()
    return {"iteration": None, "scale": scaler.get_scale()}


def one_rank_unguarded(rank):
    """Rank 1 runs without ampguard (a launcher that did not pass AMPGUARD=1 on): rank 0 must not wait forever
    in an all-reduce rank 1 never makes; it says so once and decides alone."""
    import time

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    g = None
    if rank == 0:
        import ampguard
        from ampguard import schedulers

        schedulers.HANDSHAKE_TIMEOUT_S = 3.0
        g = ampguard.install()
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(4):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * rank + i))
            scaler.scale(model(x).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return {"seconds": time.monotonic() - start, "applied": g.stats.optimizer_steps_applied if g else None,
            "warnings": [str(w.message) for w in caught if "not every rank" in str(w.message)]}


def skip_together(rank, ddp):
    """nonfinite='skip': rank 1's batch 2 is corrupt. Under DDP its NaN reaches both ranks' gradients; with
    independent replicas (no gradient all-reduce) only rank 1's, and rank 0 must skip with it all the same."""
    import ampguard

    with tempfile.TemporaryDirectory() as bundles:  # (each rank's reproducer bundles)
        g = ampguard.install(nonfinite="skip", repro_dir=bundles)
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        if ddp:
            model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(5):
                x = torch.randn(8, 4, generator=torch.Generator().manual_seed(i))  # the same batch on both ranks
                if rank == 1 and i == 2:
                    x[0, 0] = float("nan")
                model(x).pow(2).mean().backward()
                opt.step()
                sched.step()
                opt.zero_grad()
        s = g.stats
        weight = (model.module if ddp else model).weight
        return {"skipped": s.nonfinite_steps_skipped, "applied": s.optimizer_steps_applied,
                "lr": opt.param_groups[0]["lr"], "weight": weight.detach().tolist(),
                "bundles": sorted(os.listdir(bundles)),
                "warnings": [str(w.message) for w in caught if "nonfinite='skip'" in str(w.message)]}


class GlobalTokenMean(torch.nn.Module):
    """A layer that all-reduces in its forward: it averages over every rank's tokens, as a loss normalised by the
    global token count does (an MoE's dispatch or a custom synchronised normalisation all-reduce there too)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        tokens = torch.tensor([float(x.shape[0])])
        dist.all_reduce(tokens)
        return torch.sqrt(self.fc(x) + 10.0).sum() / tokens  # SQRT: NaN where an output is below -10


def collective_in_forward(rank):
    """Only rank 0's batch makes a NaN, and rank 0 alone replays. The replay re-ran the forward's all_reduce, which
    paired with rank 1's next collective (the check below): rank 1 got rank 0's token count, and rank 0's own check
    then waited forever for a partner. No DDP: rank 1's gradients stay finite, so rank 1 does not replay."""
    def batch(i):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
        return x * 1000.0 if rank == 0 and i == 2 else x

    return _steps_then_a_collective(rank, GlobalTokenMean(), batch)


def _steps_then_a_collective(rank, model, batch):
    """Three steps of ``model(batch(i)).backward()`` under ampguard, until a NonFiniteError; then one all_reduce on
    both ranks, which sums 1 + 2 unless a replay ran a collective of its own that paired with it."""
    import ampguard

    ampguard.install()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    out = {"error": None}
    for i in range(3):
        try:
            model(batch(i)).backward()
            opt.step()
        except ampguard.NonFiniteError as err:
            out["error"] = str(err)
            break
        opt.zero_grad()
    check = torch.tensor([rank + 1.0])
    dist.all_reduce(check)  # the next collective on both ranks
    out["check"] = check.item()
    return out


class CopyToParallelRegion(torch.autograd.Function):
    """Tensor parallelism's entry (Megatron's): the identity forward, an all-reduce of the gradient in backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class ParallelBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
        self.gain = torch.nn.Parameter(torch.ones(1))
        self.zero = False

    def forward(self, x):
        h = CopyToParallelRegion.apply(self.fc1(x))
        return self.fc2(h).sum() + torch.sqrt(self.gain * (0.0 if self.zero else 1.0)).sum()  # GAIN: sqrt at 0


def collective_in_backward(rank):
    """Only rank 0's step makes a NaN gradient (sqrt at 0 reaches the gain alone), and rank 0 alone replays the
    backward. Past the origin, that replay reached the backward's all_reduce, which must not run: rank 1 is not
    replaying, and its next collective is the check below."""
    model = ParallelBlock()

    def batch(i):
        model.zero = rank == 0 and i == 2
        return torch.randn(8, 4, generator=torch.Generator().manual_seed(i))

    return _steps_then_a_collective(rank, model, batch)


def teacher_nan_on_one_rank(rank):
    """Distillation under DDP: a frozen teacher called under no_grad, whose output is NaN on rank 1 only. On the CPU
    that NaN is known as the teacher's call returns; raised there, rank 1 would stop before backward() while rank 0
    waited for it in DDP's all-reduce. Both stop at the step's read instead."""
    import ampguard

    ampguard.install()
    torch.manual_seed(0)
    teacher = torch.nn.Linear(4, 2).eval()
    student = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    if rank == 1:
        with torch.no_grad():
            teacher.bias[0] = float("nan")
    x, reached = torch.randn(3, 4), "teacher"
    try:
        with torch.no_grad():
            target = teacher(x)
        reached = "backward"
        torch.nn.functional.mse_loss(student(x), target).backward()
        opt.step()
        return {"error": None}
    except ampguard.NonFiniteError as err:
        return {"sink": err.sink, "reached": reached}


def verdict_without_words(rank):
    """Rank 1 fails and its words never reach the store (their write raises: here, an error that cannot be said).
    Rank 0 learns of the failure from the verdicts alone, at once: a get of the key never set would wait for the
    store's timeout (30 minutes)."""
    import time

    import ampguard
    from ampguard import schedulers

    class Unsayable(ampguard.NonFiniteError):
        def __str__(self):
            raise RuntimeError("cannot be said")

    mine = Unsayable("x", kind="inf", sink="loss") if rank == 1 else None
    start = time.monotonic()
    failed = schedulers._verdicts(schedulers._Ranks(dist, None, rank, WORLD), mine)
    return {"failed": {str(r): said for r, said in failed.items()}, "seconds": time.monotonic() - start}


class LogOnRankOne(torch.nn.Module):
    """A Linear whose output, on rank 1 at the poisoned iteration, passes through log(-1 - x * x): NaN."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.poisoned = False

    def forward(self, x):
        x = self.fc(x)
        if self.poisoned:
            x = x + torch.log(-1 - x * x)  # EAGER POISON
        return x


def eager_nan_on_one_rank(rank):
    """trace='eager' and a NaN made by an op on rank 1 at iteration 2, DDP with fp16 autocast and a GradScaler, then
    bf16 without one: where each rank raises, and what it says."""
    import ampguard

    out = {}
    for scaler in (True, False):
        torch.manual_seed(0)
        inner = torch.nn.Sequential(LogOnRankOne(), torch.nn.GELU(), torch.nn.Linear(8, 1))
        model = torch.nn.parallel.DistributedDataParallel(inner)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        amp = torch.amp.GradScaler("cpu", enabled=scaler)
        at = None
        with ampguard.guard(trace="eager"):
            try:
                for i in range(4):
                    inner[0].poisoned = rank == 1 and i == 2
                    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + i))
                    at = (i, "forward")
                    with torch.autocast("cpu", dtype=torch.float16 if scaler else torch.bfloat16):
                        loss = model(x).float().pow(2).mean()
                    at = (i, "backward")
                    amp.scale(loss).backward()
                    at = (i, "step")
                    amp.step(opt)
                    at = (i, "update")
                    amp.update()
                    opt.zero_grad()
                out[str(scaler)] = None
            except ampguard.NonFiniteError as err:
                out[str(scaler)] = {"at": list(at), "op": err.op, "module": err.module, "sink": err.sink,
                                    "line": err.origin[-1].line if err.origin else None, "message": str(err)}
    return out


SCENARIOS = {"collective_in_forward": collective_in_forward, "collective_in_backward": collective_in_backward,
             "ddp_scaler": ddp_scaler, "sharded_fused": sharded_fused, "ddp_nan_origin": ddp_nan_origin,
             "ddp_unused_nan_origin": ddp_unused_nan_origin,
             "nan_loss_scaler": lambda rank: nan_loss_on_one_rank(rank, True, 1),
             "nan_loss_scaler_accumulating": lambda rank: nan_loss_on_one_rank(rank, True, 2),
             "nan_loss_accumulating": lambda rank: nan_loss_on_one_rank(rank, False, 2),
             "unscaled_nan_on_one_rank": unscaled_nan_on_one_rank,
             "one_rank_unguarded": one_rank_unguarded, "skip_ddp": lambda rank: skip_together(rank, True),
             "skip_replicas": lambda rank: skip_together(rank, False),
             "fsdp2": lambda rank: fsdp(rank, "fsdp2"), "fsdp1": lambda rank: fsdp(rank, "fsdp1"),
             "verdict_without_words": verdict_without_words, "teacher_nan_on_one_rank": teacher_nan_on_one_rank,
             "eager_nan_on_one_rank": eager_nan_on_one_rank}


class Blocks(torch.nn.Module):
    """Residual MLP blocks, each its own FSDP unit; ``poison``: the block after which a log(-1) is added."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)) for _ in range(3))
        self.head = torch.nn.Linear(16, 1)
        self.poison = None

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = x + block(x)
            if i == self.poison:
                x = x + torch.log(x - x - 1)  # FSDP POISON
        return self.head(x)


def _fsdp_run(rank, kind, trace=None, poison=None):
    """Four AdamW steps of Blocks sharded by FSDP2 (fully_shard) or FSDP1 (use_orig_params), with clipping."""
    import ampguard

    model = Blocks()
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        sharded = fully_shard(model)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel

        sharded = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    losses = []
    guard = ampguard.guard(trace=trace) if trace is not None else contextlib.nullcontext()
    with guard:
        for i in range(4):
            model.poison = 1 if i == 2 and rank in (poison or ()) else None
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * rank + i))
            loss = sharded(x).pow(2).mean()
            loss.backward()
            if kind == "fsdp2":
                torch.nn.utils.clip_grad_norm_(sharded.parameters(), 1.0)
            else:
                sharded.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses


def fsdp(rank, kind):
    """Clean runs train as without the guard; a NaN on one rank is reported on both, truthfully, with no hang."""
    import ampguard

    out = {"identical": _fsdp_run(rank, kind) == _fsdp_run(rank, kind, trace="replay")}
    for name, trace, poison in (("replay", "replay", (1,)), ("eager", "eager", (0, 1)), ("eager_one", "eager", (1,))):
        try:
            _fsdp_run(rank, kind, trace=trace, poison=poison)
            out[name] = None
        except ampguard.NonFiniteError as err:
            out[name] = {"sink": err.sink, "op": err.op, "message": str(err),
                         "line": err.origin[-1].line if err.origin else None}
    return out


def worker(rank, scenario, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        result = SCENARIOS[scenario](rank)
    except BaseException:
        result = {"crash": traceback.format_exc()}
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def main():
    scenario, port = sys.argv[1], int(sys.argv[2])
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(worker, args=(scenario, port, out_dir), nprocs=WORLD, start_method="fork")
        results = []
        for r in range(WORLD):
            with open(os.path.join(out_dir, f"{r}.json")) as f:
                results.append(json.load(f))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
