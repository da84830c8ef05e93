"""The controller's side of a draft model: the drafts the workers send come back as the next
step's drafts only while the request's tokens are the ones they follow; the drafter asks for
lookahead slots only in steps that speculate; lookahead slots never cost a preemption."""

from __future__ import annotations

from pagedserve.controller.drafts.drafter import Drafter
from pagedserve.controller.drafts.model import ModelDrafts
from pagedserve.controller.request import Request, RequestStatus
from pagedserve.controller.scheduler import Scheduler
from pagedserve.kv import BlockHasher, KVCacheManager
from pagedserve.messages import ModelRunnerOutput, SamplingParams

BS = 4
PROMPT = [11, 12, 13, 14, 15, 16, 17]


def test_drafts_follow_the_tokens_they_were_made_for() -> None:
    p = ModelDrafts()
    assert p.propose("a", [1, 2, 3], 2, 4) == []
    p.receive("a", 3, [7, 8, 9])
    assert p.propose("a", [1, 2, 3], 2, 2) == [7, 8]  # cut to the room
    assert p.propose("a", [1, 2, 3], 2, 5) == [7, 8, 9]  # kept until replaced
    assert p.propose("a", [1, 2, 3, 4], 2, 5) == []  # the request moved on
    p.release("a")
    assert p.propose("a", [1, 2, 3], 2, 5) == []


def _engine_parts(num_blocks: int = 64, k: int = 3) -> tuple[Scheduler, Drafter]:
    kv = KVCacheManager(None, num_blocks, BS, 256)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256)
    return sched, Drafter(ModelDrafts(), k, disable_by_batch_size=2, max_model_len=256)


def _step(sched: Scheduler, drafter: Drafter, sampled: dict[str, list[int]],
          drafts: dict[str, list[int]]):
    sched.num_lookahead_tokens = drafter.propose(sched.running)
    so = sched.schedule()
    out = ModelRunnerOutput(so.step_id, list(sampled), list(sampled.values()),
                            draft_token_ids=drafts)
    sched.update_from_output(so, out)
    drafter.record(so, out, sched.requests)
    return so


def test_the_workers_drafts_are_the_next_steps() -> None:
    sched, drafter = _engine_parts()
    req = Request("a", PROMPT, SamplingParams(max_tokens=20), hasher=BlockHasher(BS))
    sched.add_request(req)
    so = _step(sched, drafter, {"a": [30]}, {"a": [31, 32, 33]})
    assert so.num_lookahead_tokens == 3
    # Room for the prompt and three lookahead slots: ceil(10 / 4) blocks.
    assert len(so.new_reqs[0].block_ids[0]) == 3
    # The next step verifies them; two are accepted and the workers guess on from there.
    so = _step(sched, drafter, {"a": [31, 32, 40]}, {"a": [41, 42, 43]})
    assert so.draft_token_ids == {"a": [31, 32, 33]}
    assert so.num_scheduled_tokens == {"a": 4}
    assert req.output_token_ids == [30, 31, 32, 40]
    so = _step(sched, drafter, {"a": [41]}, {})
    assert so.draft_token_ids == {"a": [41, 42, 43]}
    assert drafter.num_draft_tokens == 6 and drafter.num_accepted_tokens == 2
    # No drafts came with the last step: the next one verifies none.
    so = _step(sched, drafter, {"a": [50]}, {})
    assert so.draft_token_ids == {}


def test_no_lookahead_while_speculation_stands_back() -> None:
    sched, drafter = _engine_parts()
    for rid in ("a", "b"):
        sched.add_request(Request(rid, PROMPT, SamplingParams(max_tokens=20),
                                  hasher=BlockHasher(BS)))
    so = _step(sched, drafter, {"a": [30], "b": [30]}, {"a": [1, 2], "b": [3, 4]})
    assert so.num_lookahead_tokens == 3  # nothing ran when this step was planned
    so = _step(sched, drafter, {"a": [1], "b": [3]}, {})
    assert so.num_lookahead_tokens == 0 and so.draft_token_ids == {}  # two run: too many


def test_lookahead_slots_never_cost_a_preemption() -> None:
    """Two usable blocks hold the 7-token prompt but not 3 lookahead slots past it: the
    request runs without them instead of preempting itself."""
    sched, drafter = _engine_parts(num_blocks=3)
    req = Request("a", PROMPT, SamplingParams(max_tokens=1), hasher=BlockHasher(BS))
    sched.add_request(req)
    sched.num_lookahead_tokens = drafter.propose(sched.running)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 7} and so.num_lookahead_tokens == 3
    assert len(so.new_reqs[0].block_ids[0]) == 2
    assert sched.num_preemptions == 0 and req.status == RequestStatus.RUNNING
