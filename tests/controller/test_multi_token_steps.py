"""Steps that return several tokens per request (verified drafts): the scheduler schedules the
drafts, appends every accepted token with the stop conditions checked after each, and rolls
``num_computed_tokens`` back past the rejected ones."""

from __future__ import annotations

from pagedserve.controller.request import Request, RequestStatus
from pagedserve.controller.scheduler import Scheduler
from pagedserve.kv import BlockHasher, KVCacheManager
from pagedserve.messages import ModelRunnerOutput, SamplingParams, SchedulerOutput

BS = 4
PROMPT = [11, 12, 13, 14, 15, 16, 17]  # 7 tokens: one full block, 3 of the second
EOS = 2


def _scheduler() -> Scheduler:
    kv = KVCacheManager(None, 64, BS, 256)
    return Scheduler(
        kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256, eos_token_ids=[EOS]
    )


def _prefilled(sched: Scheduler, params: SamplingParams, rid: str = "a") -> Request:
    """A running request whose prompt is computed and which sampled its first token, 30."""
    req = Request(rid, PROMPT, params, hasher=BlockHasher(BS))
    sched.add_request(req)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {rid: len(PROMPT)}
    sched.update_from_output(so, ModelRunnerOutput(so.step_id, [rid], [[30]]))
    assert req.output_token_ids == [30] and req.num_computed_tokens == len(PROMPT)
    return req


def _verify(sched: Scheduler, req: Request, drafts: list[int], accepted: list[int],
            logprobs: list | None = None) -> SchedulerOutput:
    """One step that verifies ``drafts`` and accepts ``accepted``."""
    req.draft_token_ids = list(drafts)
    so = sched.schedule()
    rid = req.request_id
    assert so.num_scheduled_tokens[rid] == 1 + len(drafts)
    assert so.draft_token_ids == ({rid: drafts} if drafts else {})
    assert req.num_computed_tokens == req.num_tokens + len(drafts)
    lps = None if logprobs is None else [logprobs]
    sched.update_from_output(so, ModelRunnerOutput(so.step_id, [rid], [accepted], lps))
    return so


def test_three_accepted_tokens_are_appended_and_hashed() -> None:
    sched = _scheduler()
    req = _prefilled(sched, SamplingParams(max_tokens=10))
    assert len(req.block_hashes) == 2  # 8 tokens: the second block just became full
    _verify(sched, req, [31, 32], [31, 32, 33])
    assert req.output_token_ids == [30, 31, 32, 33]
    assert req.num_tokens == 11 and req.num_computed_tokens == 10  # the bonus token is not
    assert req.draft_token_ids == [] and req.status == RequestStatus.RUNNING
    assert len(req.block_hashes) == 2
    # The next step sends the three new tokens and computes the last one only.
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 1} and so.draft_token_ids == {}
    assert so.cached_reqs.new_token_ids == [[31, 32, 33]]
    assert so.cached_reqs.num_computed_tokens == [10]
    sched.update_from_output(so, ModelRunnerOutput(so.step_id, ["a"], [[34]]))
    assert len(req.block_hashes) == 3  # 12 tokens: the block of the accepted tokens is full
    # It is cached in the prefix cache once its tokens are computed, like any other block.
    req.draft_token_ids = []
    sched.update_from_output(sched.schedule(), ModelRunnerOutput(so.step_id + 1, [], []))
    other = Request("b", req.all_token_ids[:12] + [99], SamplingParams(), hasher=BlockHasher(BS))
    _, hit = sched.kv.get_computed_blocks(other)
    assert hit == 12


def test_rejected_drafts_roll_back_num_computed_tokens() -> None:
    sched = _scheduler()
    req = _prefilled(sched, SamplingParams(max_tokens=10))
    # Three drafts, the second one wrong: the first draft and the model's own token are kept.
    _verify(sched, req, [31, 40, 41], [31, 32])
    assert req.output_token_ids == [30, 31, 32]
    assert req.num_computed_tokens == req.num_tokens - 1 == 9
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.cached_reqs.num_computed_tokens == [9]
    assert so.cached_reqs.new_token_ids == [[31, 32]]


def test_stop_token_in_the_middle_truncates_the_rest() -> None:
    sched = _scheduler()
    req = _prefilled(sched, SamplingParams(max_tokens=10, stop_token_ids=(77,), logprobs=0))
    lps = [([31], [-0.1]), ([77], [-0.2]), ([33], [-0.3])]
    _verify(sched, req, [31, 77], [31, 77, 33], lps)
    assert req.output_token_ids == [30, 31, 77]
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == 77
    assert req.logprobs == [{31: -0.1}, {77: -0.2}]  # the first sample had none (not asked)
    assert req.cumulative_logprob == -0.1 + -0.2
    assert "a" not in sched.requests and not sched.running
    assert not sched.kv.has_request("a")


def test_eos_in_the_middle_truncates_the_rest() -> None:
    sched = _scheduler()
    req = _prefilled(sched, SamplingParams(max_tokens=10))
    _verify(sched, req, [EOS, 50], [EOS, 50, 51])
    assert req.output_token_ids == [30, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason is None


def test_max_tokens_reached_in_the_middle() -> None:
    sched = _scheduler()
    req = _prefilled(sched, SamplingParams(max_tokens=3))
    _verify(sched, req, [31, 32], [31, 32, 33])
    assert req.output_token_ids == [30, 31, 32]
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert not sched.has_unfinished() and not sched.kv.has_request("a")


def test_budget_schedules_only_the_drafts_it_reaches() -> None:
    sched = _scheduler()
    req = _prefilled(sched, SamplingParams(max_tokens=10))
    sched.max_num_batched_tokens = 3
    req.draft_token_ids = [31, 32, 33, 34]
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 3} and so.draft_token_ids == {"a": [31, 32]}
    sched.update_from_output(so, ModelRunnerOutput(so.step_id, ["a"], [[31, 32, 35]]))
    assert req.output_token_ids == [30, 31, 32, 35]
    assert req.num_computed_tokens == req.num_tokens - 1 and req.draft_token_ids == []


def test_blocks_only_rejected_drafts_filled_go_back_to_the_pool() -> None:
    sched = _scheduler()
    req = _prefilled(sched, SamplingParams(max_tokens=20))
    free = sched.kv.num_free_blocks
    # 8 tokens in 2 blocks; the last token and 6 drafts reach position 13: two more blocks.
    so = _verify(sched, req, [31, 32, 33, 34, 35, 36], [40])
    assert req.num_tokens == 9 and len(sched.kv.get_block_ids("a")[0]) == 3
    assert sched.kv.num_free_blocks == free - 1  # the fourth block went back
    # The workers hear of it with the next step that runs, before its new blocks.
    so = sched.schedule()
    assert so.block_table_trims == {"a": 3}
    sched.update_from_output(so, ModelRunnerOutput(so.step_id, ["a"], [[41]]))
    assert sched.schedule().block_table_trims == {}
    sched.kv.check_integrity()


def test_trims_of_a_preempted_request_are_not_sent() -> None:
    sched = _scheduler()
    req = _prefilled(sched, SamplingParams(max_tokens=20))
    _verify(sched, req, [31, 32, 33, 34, 35, 36], [40])
    sched.running.remove(req)
    sched.preempt(req)
    assert req.draft_token_ids == []
    so = sched.schedule()  # it comes back in full, with its trimmed blocks only
    assert so.block_table_trims == {} and [r.req_id for r in so.new_reqs] == ["a"]
