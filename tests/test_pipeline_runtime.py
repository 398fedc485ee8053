"""The pipeline runtime on gloo: two stages train exactly as one process does."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from orchestrator.planning.model_math import ModelShape  # noqa: E402
from orchestrator.planning.pipeline import resolve_pipeline  # noqa: E402
from orchestrator.runtime.pipeline import build_schedule, pipeline_stages, split_stages, sync_tied_grads  # noqa: E402
from orchestrator.workloads.gpt import GPT, GPTConfig  # noqa: E402

CFG = GPTConfig(n_layer=4, n_head=2, n_embd=32, vocab_size=64, block_size=16)
SHAPE = ModelShape(layers=4, hidden=32, heads=2, vocab=64, seq=16)
STEPS, BATCH, MICRO = 3, 8, 4


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (BATCH, 16), generator=g), torch.randint(0, 64, (BATCH, 16), generator=g))
            for _ in range(STEPS)]


def _reference():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in _batches():
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker(rank: int, world: int, init: str, schedule: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        pl = resolve_pipeline(SHAPE, world, schedule, MICRO, 2 if schedule == "interleaved_1f1b" else 1)
        stages = pipeline_stages(_model(), pl, rank, torch.device("cpu"))
        modules = [s.submod for s in stages]
        sched = build_schedule(stages, pl.schedule, pl.microbatches)
        params = [p for m in modules for p in m.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-2)
        last = (pl.chunks - 1) % pl.stages
        losses = []
        for x, y in _batches():
            opt.zero_grad()
            step_losses: list = []
            if rank == 0 and rank == last:
                sched.step(x, target=y, losses=step_losses)
            elif rank == 0:
                sched.step(x)
            elif rank == last:
                sched.step(target=y, losses=step_losses)
            else:
                sched.step()
            sync_tied_grads(modules, 0, last)
            opt.step()
            if step_losses:
                losses.append(torch.stack(step_losses).mean().item())
        state = {k: v.detach().clone() for m in modules for k, v in m.state_dict().items()}
        torch.save({"losses": losses, "state": state}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _run(schedule: str, world: int, tmp_path):
    ctx = mp.get_context("spawn")
    init = f"file://{tmp_path}/store"
    procs = [ctx.Process(target=_worker, args=(r, world, init, schedule, str(tmp_path))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    return [(r, *torch.load(tmp_path / f"rank{r}.pt", weights_only=True).values()) for r in range(world)]


def test_split_keeps_names_and_every_block_once():
    model = _model()
    parts = [split_stages(model, c, (1, 2, 1)) for c in range(3)]
    names = [set(n for n, _ in p.named_parameters()) for p in parts]
    assert "wte.weight" in names[0] and "lm_head.weight" in names[2] and "ln_f.weight" in names[2]
    assert any(n.startswith("h.1.") for n in names[1]) and any(n.startswith("h.2.") for n in names[1])
    assert not any(n.startswith("h.1.") for n in names[0] | names[2])
    # The last stage's head is its own parameter, equal to the embedding it was tied to.
    assert parts[2].lm_head.weight is not parts[0].wte.weight
    assert torch.equal(parts[2].lm_head.weight, model.wte.weight)
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        out = parts[2](parts[1](parts[0](x)))
        assert torch.allclose(out, model(x), atol=1e-6)
    with pytest.raises(ValueError, match="covers 3 blocks"):
        split_stages(model, 0, (1, 2))


def test_two_stages_on_gloo_match_one_process(tmp_path):
    ref_losses, ref_state = _reference()
    results = _run("1f1b", 2, tmp_path)
    by_rank = {r: (losses, state) for r, losses, state in results}
    assert by_rank[1][0] == pytest.approx(ref_losses, abs=1e-5)
    for rank in (0, 1):
        for k, v in by_rank[rank][1].items():
            assert torch.allclose(v, ref_state[k], atol=1e-5), (rank, k)
    # The tied copies took the same steps.
    assert torch.allclose(by_rank[0][1]["wte.weight"], by_rank[1][1]["lm_head.weight"], atol=1e-6)
