"""aggregated: the non-disaggregated baseline. Prefill and decode on one server, one process, no KV transfer."""
from __future__ import annotations

import logging
import threading

from .. import config
from ..bounded import BoundedExecutor
from ..engines.manifest import configured_engines
from ..engines.runtime import load_engine
from ..sampling import is_stop_token
from ..scheduler import DecodeScheduler, Sequence
from .common import check_prompt, engine_dir, grammar_matchers, inp, log_if_ours, sampling_params, send_error, tokenizer
from .metrics import REGISTRY, BusyMeter, Poller
from .preprocess import tokenize_request
from .streaming import TextStreamer

log = logging.getLogger("hetserve.aggregated")


class _StopGeneration(Exception):
    pass


class TritonPythonModel:
    def initialize(self, args):
        d = engine_dir()
        self.prefill = load_engine(d, configured_engines(d, "HETSERVE_PREFILL_ENGINE")[0])
        dec = load_engine(d, configured_engines(d, "HETSERVE_AGGREGATED_DECODE_ENGINE")[0])
        self.precision = dec.precision
        self.cfg = self.prefill.config
        self.sched = DecodeScheduler({dec.precision: dec}, eos_ids=self.cfg.eos_token_ids,
                                     max_batch=int(config.get("HETSERVE_MAX_BATCH")),
                                     max_queue=int(config.get("HETSERVE_MAX_QUEUE")),
                                     matcher_factory=grammar_matchers(self.cfg))
        self.lock = threading.Lock()
        self.work = BoundedExecutor(2, int(config.get("HETSERVE_MAX_QUEUE")), "aggregated")
        self.busy = BusyMeter()
        self.poller = Poller(lambda: {"busy_seconds": self.busy.total() + self.sched.stats["step_seconds"]},
                             "aggregated", engine_cpu=True)
        tokenizer()

    def finalize(self):
        self.poller.close()
        self.work.shutdown()
        self.sched.close()
        REGISTRY.close()  # last: metrics released while the stub still takes the deletes

    def _handle(self, r, sender):
        streamer = None
        try:
            params = sampling_params(r)
            streamer = TextStreamer(sender, tokenizer(), params, self.cfg.eos_token_ids, model="aggregated")
            ids = inp(r, "input_ids")
            prompt = [int(x) for x in ids.reshape(-1)] if ids is not None and ids.size else \
                [int(x) for x in tokenize_request(r)]
            check_prompt(prompt, self.cfg, params.max_tokens)
            params.check_vocab(self.cfg.vocab_size)
            sampler = self.sched.new_sampler(params, prompt, ())  # refuses a guide it cannot serve, before work
            with self.busy.timed():
                logits, k, v = self.prefill.prefill(prompt)
            first, lp = sampler.next(logits, 0)
            stop = is_stop_token(first, params, self.cfg.eos_token_ids)
            if not streamer.push([first], "stop" if stop else ("length" if params.max_tokens == 1 else None), lp):
                return

            def on_tokens(toks, reason, logprobs=None):
                if streamer.finish_reason is None and not streamer.push(toks, reason, logprobs) and reason is None:
                    raise _StopGeneration()

            cancelled = getattr(sender, "is_cancelled", lambda: False)
            self.sched.submit(Sequence(f"agg-{id(r)}", len(prompt), [first], params, self.precision, on_tokens,
                                       cancelled, on_error=streamer.fail, k=k, v=v, prompt_ids=prompt,
                                       sampler=sampler))
        except Exception as e:
            log_if_ours(log, e, "aggregated", r.request_id())
            if streamer is not None:
                streamer.fail(e)
            else:
                send_error(sender, e)

    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            try:  # prefill + admission off Triton's thread, bounded (decoding itself runs in the scheduler)
                self.work.submit(self._handle, r, sender)
            except Exception as e:  # Overloaded: UNAVAILABLE with a retry hint
                send_error(sender, e)
        return None
