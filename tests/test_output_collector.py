"""RequestOutputCollector and RequestOutput.add: a slow reader gets merged outputs, nothing lost."""
import asyncio

import pytest

from engine.entrypoints.output_collector import RequestOutputCollector
from engine.outputs import CompletionOutput, Logprob, RequestOutput


def _out(deltas, finished=False, prompt_logprobs=None, cached=0):
    return RequestOutput("r", None, [1, 2], [CompletionOutput(i, text, ids, logprobs=lps, finish_reason=fr,
                                                              stop_reason=sr) for i, text, ids, lps, fr, sr in deltas],
                         finished=finished, prompt_logprobs=prompt_logprobs, num_cached_tokens=cached)


def test_add_concatenates_per_completion_and_keeps_the_last_finish():
    lp = lambda t: [{t: Logprob(-1.0, 1, str(t))}]  # noqa: E731
    a = _out([(0, "a", [5], lp(5), None, None)], prompt_logprobs=[None, {2: Logprob(-0.5, 1, "p")}])
    a.add(_out([(1, "x", [9], None, None, None), (0, "b", [6], lp(6), None, None)], cached=1))
    a.add(_out([(0, "c", [7], lp(7), "stop", 0)], finished=True, cached=1))
    assert [c.index for c in a.outputs] == [0, 1]
    c0, c1 = a.outputs
    assert (c0.text, c0.token_ids, [list(d) for d in c0.logprobs]) == ("abc", [5, 6, 7], [[5], [6], [7]])
    assert (c0.finish_reason, c0.stop_reason) == ("stop", 0)  # a stop token id 0 is kept, not dropped as falsy
    assert (c1.text, c1.token_ids, c1.finish_reason) == ("x", [9], None)
    assert a.finished and a.num_cached_tokens == 1
    assert a.prompt_logprobs[1][2].decoded_token == "p"  # carried once, kept


def test_delta_outputs_merge_while_the_reader_is_behind():
    async def main():
        col = RequestOutputCollector(aggregate=True)
        col.put(_out([(0, "a", [1], None, None, None)]))
        col.put(_out([(0, "b", [2], None, None, None)]))
        first = await col.get()
        col.put(_out([(0, "c", [3], None, "length", None)], finished=True))
        last = await col.get()
        return first, last
    first, last = asyncio.run(main())
    assert (first.outputs[0].text, first.outputs[0].token_ids, first.finished) == ("ab", [1, 2], False)
    assert (last.outputs[0].text, last.finished) == ("c", True)


def test_cumulative_outputs_replace():
    async def main():
        col = RequestOutputCollector(aggregate=False)
        col.put(_out([(0, "a", [1], None, None, None)]))
        col.put(_out([(0, "ab", [1, 2], None, None, None)]))
        return await col.get()
    assert asyncio.run(main()).outputs[0].text == "ab"


def test_an_error_is_raised_after_the_output_before_it():
    async def main():
        col = RequestOutputCollector(aggregate=True)
        col.put(_out([(0, "a", [1], None, None, None)]))
        col.put(RuntimeError("engine died"))
        first = await col.get()
        with pytest.raises(RuntimeError, match="engine died"):
            await col.get()
        return first
    assert asyncio.run(main()).outputs[0].text == "a"


def test_wait_final_wakes_early_on_the_last_output_and_times_out_otherwise():
    async def main():
        loop = asyncio.get_running_loop()
        col = RequestOutputCollector(aggregate=True)
        start = loop.time()
        await col.wait_final(0.05)
        waited = loop.time() - start
        loop.call_later(0.01, col.put, _out([(0, "z", [1], None, "length", None)], finished=True))
        start = loop.time()
        await col.wait_final(5.0)
        return waited, loop.time() - start
    timed_out, woke = asyncio.run(main())
    assert timed_out >= 0.045 and woke < 1.0
