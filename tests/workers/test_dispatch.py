"""Dispatch: split by rank with padding, merge in order without it; the local group of one rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.protocol import Batch
from hybridflow.workers.dispatch import merge_batches, split_batch
from hybridflow.workers.group import CriticHandle, LocalGroup
from hybridflow.workers.rank import RankWorker


def rows(n: int) -> Batch:
    return Batch(
        {"x": torch.arange(n)[:, None].float()}, {"tag": np.array([f"r{i}" for i in range(n)], dtype=object)}
    )


def test_split_pads_to_the_world_and_merge_strips_it() -> None:
    chunks, pad = split_batch(rows(5), 2)
    assert pad == 1 and [len(c) for c in chunks] == [3, 3]
    assert chunks[0]["x"].flatten().tolist() == [0, 1, 2]  # contiguous chunks, in rank order
    assert chunks[1]["x"].flatten().tolist() == [3, 4, 0]  # the pad repeats rows from the start
    merged = merge_batches([c for c in chunks], pad)
    assert merged["x"].flatten().tolist() == [0, 1, 2, 3, 4]
    assert list(merged["tag"]) == ["r0", "r1", "r2", "r3", "r4"]
    same, none = split_batch(rows(4), 1)
    assert none == 0 and len(same) == 1 and len(same[0]) == 4


class Doubler:
    """A stand-in role with the critic's method names (the handle is under test, not a model)."""

    def compute_values(self, batch: Batch) -> Batch:
        assert set(batch.keys()) == {"input_ids", "responses"}  # only the keys the call reads travel
        return Batch({"values": batch["responses"] * 2.0})

    def update_critic(self, batch: Batch) -> dict[str, float]:
        return {"critic/vf_loss": float(batch["returns"].sum())}


def test_local_group_of_one_rank_calls_the_role_directly() -> None:
    group = LocalGroup(RankWorker({"critic": Doubler()}))
    handle = CriticHandle(group, "critic", 0)
    batch = Batch(
        {"input_ids": torch.ones(3, 2), "responses": torch.arange(3.0)[:, None], "other": torch.zeros(3)}
    )
    assert handle.compute_values(batch)["values"].flatten().tolist() == [0.0, 2.0, 4.0]
    batch["returns"] = torch.ones(3, 1)
    assert handle.update_critic(batch) == {"critic/vf_loss": 3.0}
    assert group.world == 1 and group.run_all("has", "critic") == [True]


def test_shares_of_different_widths_merge_into_the_one_batch_layout() -> None:
    """Each rank lays out its samples with its own longest prompt; merged, they equal one rank's layout."""
    from hybridflow.engine.ops.sequences import layout_padding, pack_prompt_response

    prompts = [[5, 6, 7, 8, 9, 10], [11], [12, 13], [14, 15, 16, 17]]  # rank 0 gets the long one
    responses = [[1, 2], [3], [4, 4, 4], [2]]  # end at different places; R = 3
    whole = pack_prompt_response(prompts, responses, 3, pad_token_id=0)
    shares = [pack_prompt_response(prompts[i : i + 2], responses[i : i + 2], 3, 0) for i in (0, 2)]
    for share in shares:
        share["rollout_log_probs"] = -share["response_mask"] * share["responses"]  # a per-token value
    whole["rollout_log_probs"] = -whole["response_mask"] * whole["responses"]
    assert shares[0]["input_ids"].shape[1] == 9 and shares[1]["input_ids"].shape[1] == 7
    merged = merge_batches(shares, 0, layout_padding(0))
    assert merged.keys() == whole.keys()
    for key in whole.keys():  # noqa: SIM118 (a Batch is not iterable)
        assert torch.equal(merged[key], whole[key]), key
    with pytest.raises(ValueError, match=r"different trailing shapes.*pad="):
        merge_batches(shares, 0)  # without the layout the widths cannot join
    assert merge_batches(shares, 1, layout_padding(0))["input_ids"].shape == (3, 9)  # pad rows still go


def test_each_role_splits_by_its_own_data_parallel_coordinate() -> None:
    """Replicas of a training view (tp, pp, Ulysses sp) and of the generation view; the first rank of each
    returns its results."""
    from hybridflow.engine import GenerateView, ParallelDims
    from hybridflow.workers.dispatch import DataLayout, generate_coord, train_coord

    def layout(coords) -> tuple[tuple[int, ...], tuple[int, ...]]:
        out = DataLayout.of(coords)
        return out.replica_of, out.sources

    assert layout([train_coord(ParallelDims(4, tp=2), r) for r in range(4)]) == ((0, 1, 0, 1), (0, 1))
    assert layout([train_coord(ParallelDims(4, pp=2), r) for r in range(4)]) == ((0, 1, 0, 1), (0, 1))
    assert layout([train_coord(ParallelDims(4, tp=2, pp=2), r) for r in range(4)]) == ((0, 0, 0, 0), (0,))
    assert layout([train_coord(ParallelDims(4, sp=2), r) for r in range(4)]) == ((0, 0, 1, 1), (0, 2))
    assert layout([train_coord(ParallelDims(4), r) for r in range(4)]) == ((0, 1, 2, 3), (0, 1, 2, 3))
    assert layout([generate_coord(GenerateView(4, 2), r) for r in range(4)]) == ((0, 1, 0, 1), (0, 1))
    assert DataLayout.of([train_coord(ParallelDims(8, tp=2, pp=2), r) for r in range(8)]).dp == 2


class StubActor:
    """A stand-in actor on one of 4 ranks (training view of ``tp`` x ``pp``, rollout groups of ``rollout_tp``):
    it records the shares it is handed and answers as a pure function of them, as a model replica would (the
    dispatch is under test)."""

    def __init__(self, rank: int, tp: int, pp: int, rollout_tp: int) -> None:
        self.rank, self.sizes, self.rollout_tp = rank, (tp, pp), rollout_tp
        self.seen: list[tuple[list, int]] = []

    def data_coord(self):
        from hybridflow.engine import ParallelDims
        from hybridflow.workers.dispatch import train_coord

        return train_coord(ParallelDims(4, *self.sizes), self.rank)

    def rollout_coord(self):
        from hybridflow.engine import GenerateView
        from hybridflow.workers.dispatch import generate_coord

        return generate_coord(GenerateView(4, self.rollout_tp), self.rank)

    def generate(self, prompts: Batch, params, desc: str) -> Batch:
        mask = prompts["attention_mask"].bool()
        ids = [row[m].tolist() for row, m in zip(prompts["input_ids"], mask)]
        out = sampled(ids, params.n)
        self.seen.append((ids, out["input_ids"].shape[1]))  # the group's samples at its longest prompt
        out.meta["rollout_stats"] = {"rank": self.rank}
        out.meta["reshard"] = {"bytes": float(self.rank)}
        return out

    def compute_log_prob(self, batch: Batch) -> Batch:
        self.seen.append((batch["input_ids"].tolist(), batch["input_ids"].shape[1]))
        return scored(batch)

    def update_actor(self, batch: Batch) -> Batch:
        return Batch(meta={"metrics": {"actor/pg_loss": float(len(batch))}})


def sampled(ids: list[list[int]], n: int) -> Batch:
    """n responses per prompt, ending at different places (a function of the prompt), laid out at the longest
    prompt; a bool and an object field beside."""
    from hybridflow.engine import pack_prompt_response

    responses = [[p[-1] % 5 + 1] * (1 + (len(p) + k) % 3) for p in ids for k in range(n)]
    out = pack_prompt_response([p for p in ids for _ in range(n)], responses, 3, pad_token_id=0)
    out["rollout_log_probs"] = -0.25 * out["responses"].float() * out["response_mask"]
    out["stopped"] = out["response_mask"].sum(-1) < 3  # (B,) bool
    out["finish_reason"] = np.array(["eos" if len(r) < 3 else "length" for r in responses], dtype=object)
    return out


def scored(batch: Batch) -> Batch:
    return Batch(
        {"old_log_probs": -0.5 * batch["responses"].float(), "entropys": batch["response_mask"] * 1.0}
    )


PROMPTS = [[13], [7, 8, 9, 10, 11, 12], [14, 15], [16, 17, 18, 19], [20, 21, 22]]  # 5: one pad row on 2


def spmd_actor(rank: int, tp: int, pp: int, rollout_tp: int) -> dict:
    """One of 4 processes that each run the driver (torchrun's layout): generate 5 prompts, then score."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from hybridflow.engine import pad_rows
    from hybridflow.workers.group import ActorHandle

    dist.init_process_group("gloo")
    stub = StubActor(rank, tp, pp, rollout_tp)
    handle = ActorHandle(LocalGroup(RankWorker({"actor": stub})), None, pad_token_id=0)
    ids, mask = pad_rows(PROMPTS, 6, 0, torch.long, left=True)
    out = handle.generate(Batch({"input_ids": ids, "attention_mask": mask}), SimpleNamespace(n=2))
    logps = handle.compute_log_prob(out)
    metrics, none = handle.update_actor(out)
    return {"out": out, "logps": logps, "seen": stub.seen, "metrics": metrics, "none": none}


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "rollout_tp"), [(2, 1, 2), (2, 2, 1)])
def test_a_replicas_ranks_get_one_share_and_its_result_comes_back_once(
    tp: int, pp: int, rollout_tp: int
) -> None:
    """4 torchrun-style processes; train tp=2 (replicas {0, 2} and {1, 3}) with rollout groups of 2 (the same
    pairs), or train tp=2 x pp=2 (one replica) with a whole rollout replica per rank (every rank returns
    samples, each laid out at its own longest prompt). The merged results equal one process's."""
    from support.dist_util import run_world_kept

    results = run_world_kept(4, spmd_actor, tp, pp, rollout_tp)
    whole = sampled(PROMPTS, 2)
    whole.meta["reshard"] = [{"bytes": float(r)} for r in range(4)]
    whole.meta["rollout_stats"] = {"rank": 0}
    for res in results:  # every process holds the same merged batch
        out = res["out"]
        assert out.meta == whole.meta
        assert list(out["uid"]) == [str(i) for i in range(5) for _ in range(2)]
        for key in whole.keys():  # noqa: SIM118 (a Batch is not iterable)
            same = (
                (out[key] == whole[key]).all()
                if key == "finish_reason"
                else torch.equal(out[key], whole[key])
            )
            assert same, key
        assert out["stopped"].dtype == torch.bool
        want = scored(whole)
        assert torch.equal(res["logps"]["old_log_probs"], want["old_log_probs"])
        assert torch.equal(res["logps"]["entropys"], want["entropys"])
        assert res["metrics"] == {"actor/pg_loss": 10.0 / (4 // (tp * pp))} and res["none"] is None
    if rollout_tp == 1:  # 8 prompts (3 pad rows) over 4 groups: shares of 2, laid out at 6, 4, 3 and 6
        assert [res["seen"][0][1] - 3 for res in results] == [6, 4, 3, 6]
        assert all(res["seen"][1] == results[0]["seen"][1] for res in results)  # one training replica
        return
    # the ranks of a rollout group were handed the same prompts, the groups different halves, each laid out
    # at its own longest prompt (the pad row repeats the first prompt)
    assert results[0]["seen"][0] == results[2]["seen"][0] == (PROMPTS[:3], 6 + 3)
    assert results[1]["seen"][0] == results[3]["seen"][0] == ([*PROMPTS[3:], PROMPTS[0]], 4 + 3)
    # the training replicas {0, 2} and {1, 3}: one share each, the halves of the merged batch
    assert results[0]["seen"][1] == results[2]["seen"][1] != results[1]["seen"][1] == results[3]["seen"][1]
    assert results[0]["seen"][1][0] == whole["input_ids"][:5].tolist()
