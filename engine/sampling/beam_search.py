"""Beam search for one request: which beams continue, which hypotheses are finished, when to stop.

The rule is transformers' (generation/utils.py `_beam_search`, batch size 1), so a request gives
the tokens of `generate(num_beams=W, length_penalty=..., early_stopping=..., do_sample=False)`:
each step takes the K = max(2, 1 + number of EOS ids) * W best (beam score + token logprob)
continuations of the W running beams; of those, the ones that end (an EOS id, or the length
limit) and rank among the first W join the finished hypotheses, scored by sum of logprobs /
generated_length ** length_penalty; the W best that do not end run on. The search stops when no
running beam can beat the worst finished hypothesis (transformers' heuristic, by early_stopping),
when early_stopping is True and W hypotheses are finished, or when every candidate ended.

Only the K candidates (ids and scores) come back from the device (engine/sampling/logprobs.py's top-k on
the W x V scores); the engine forks the KV blocks of the chosen parents (BlockPool.fork).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.sampling.logprobs import log_softmax, top_k_flat
from engine.core.outputs import RequestOutput
from engine.core.sequence import Sequence

NEG = np.float32(-1.0e9)     # transformers' "never pick this"


@dataclass(slots=True)
class Hypothesis:
    tokens: list[int]
    score: float


class BeamSearch:
    def __init__(self, width: int, prompt_len: int, max_tokens: int, eos_ids: set[int],
                 length_penalty: float = 1.0, early_stopping: bool | str = False):
        self.width = width
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.eos_ids = eos_ids            # every id that ends a hypothesis
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.running_scores = np.zeros(1, np.float32)   # (R,), best first; first the prompt
        # best first, `width` slots; a slot is real once a hypothesis finished into it
        self.finished = [Hypothesis([], float(NEG)) for _ in range(width)]
        self.finished_real = [False] * width
        self.improvable = True         # transformers' is_early_stop_heuristic_unsatisfied
        self.done = False
        self.rows = {}                 # seq_id -> a beam's next-token logprobs, awaiting the rest

    def step(self, backend, logprobs, beam_tokens: list[list[int]]) -> list[tuple[int, int]]:
        """logprobs (R, V) float32 on the backend: the running beams' next-token logprobs, in
        the order of running_scores; beam_tokens: their generated tokens. Returns the new running
        beams as (parent row, token), best first; sets `done` when the search ends."""
        W = self.width
        R, V = logprobs.shape
        cur = len(beam_tokens[0])                       # generated tokens so far
        K = max(2, 1 + len(self.eos_ids)) * W
        acc = logprobs + backend.asarray(self.running_scores)[:, None]
        idx, scores = top_k_flat(backend, acc.reshape(1, R * V), K)
        parents, tokens = idx // V, idx % V
        at_limit = cur + 1 >= self.max_tokens
        hits = np.array([at_limit or int(t) in self.eos_ids for t in tokens])

        # the W best continuations that do not end run on
        run_scores = scores + hits.astype(np.float32) * NEG
        keep = np.argsort(-run_scores, kind="stable")[:W]
        new_running = [(int(parents[i]), int(tokens[i])) for i in keep]
        self.running_scores = run_scores[keep].astype(np.float32)

        # the first W continuations that end may join the finished hypotheses
        did = hits & (np.arange(len(tokens)) < W)
        fin = scores / np.float32((cur + 1) ** self.length_penalty)
        if all(self.finished_real) and self.early_stopping is True:
            fin = fin + NEG
        if not self.improvable:
            fin = fin + NEG
        fin = (fin + (~did).astype(np.float32) * NEG).astype(np.float32)
        merged = [(h.score, h, real) for h, real in zip(self.finished, self.finished_real)]
        merged += [(float(fin[i]), Hypothesis(beam_tokens[parents[i]] + [int(tokens[i])],
                                              float(fin[i])), bool(did[i]))
                   for i in range(len(tokens))]
        order = np.argsort(-np.array([m[0] for m in merged], np.float32), kind="stable")[:W]
        self.finished = [merged[i][1] for i in order]
        self.finished_real = [merged[i][2] for i in order]

        # can a running beam still beat the worst finished hypothesis?
        cur += 1
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_tokens
        else:
            best_len = cur
        best_possible = self.running_scores[0] / np.float32(best_len ** self.length_penalty)
        worst = min(h.score for h in self.finished) if all(self.finished_real) else float(NEG)
        self.improvable = self.improvable and bool(best_possible > worst)
        self.done = (not self.improvable
                     or (all(self.finished_real) and self.early_stopping is True)
                     or bool(hits.all()))
        return new_running

    def best(self, n: int) -> list[Hypothesis]:
        return [h for h, real in zip(self.finished, self.finished_real) if real][:n]


class BeamRequests:
    """Steps the engine's beam searches (each a Request with a `beam`, its running beams the
    request's sequences, sharing KV blocks) once every beam of a request has its next-token
    logprobs."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self, sampled: list, logits) -> list:
        """Keep the beams' logprob rows (on the device); returns the requests whose beams all
        have theirs, with the new beams each search chose: [(request, [(parent, token)])]."""
        be = self.engine.backend
        rows = [i for i, seq in enumerate(sampled) if seq.request.beam is not None]
        if not rows:
            return []
        lps = log_softmax(be, logits[be.asarray(np.array(rows))])
        for j, i in enumerate(rows):
            sampled[i].request.beam.rows[sampled[i].seq_id] = lps[j]
        ready = []
        for request in dict.fromkeys(sampled[i].request for i in rows):
            search, beams = request.beam, request.seqs
            if all(b.seq_id in search.rows for b in beams):
                stacked = be.xp.stack([search.rows.pop(b.seq_id) for b in beams])
                chosen = search.step(be, stacked, [b.output_token_ids for b in beams])
                ready.append((request, chosen))
        return ready

    def advance(self, ready: list) -> list:
        """After the scheduler's update: fork the chosen beams (KV blocks shared, a partly
        filled last block copied) in place of the old ones; finished searches end with their
        best hypotheses as outputs."""
        eng = self.engine
        outputs = []
        for request, chosen in ready:
            if request.beam.done:
                outputs += self.finish(request)
                continue
            beams, children, pairs = request.seqs, [], []
            for parent_row, token in chosen:
                parent = beams[parent_row]
                child = Sequence(parent.token_ids[:parent.num_prompt_tokens],
                                 parent.sampling_params, request.request_id, parent.arrival_time,
                                 default_seed=0)
                child.token_ids = parent.token_ids + [token]
                child.request = request
                child.mm = parent.mm
                pair = eng.block_pool.fork(parent, child)
                if pair is not None:
                    pairs.append(pair)
                children.append(child)
            eng.runner.copy_blocks(pairs)
            eng.scheduler.replace(beams, children)
            request.seqs = children
        return outputs

    def finish(self, request, error: Exception | None = None) -> list:
        """End the search: free its beams and remove the request; its n best hypotheses (or n
        errors) as outputs."""
        eng = self.engine
        search, beams = request.beam, request.seqs
        eng.scheduler.replace(beams, [])
        request.seqs, request.beam = [], None
        eng.requests.pop(request.request_id, None)
        params = request.params
        P = request.num_prompt_tokens
        if error is not None:
            return [RequestOutput(request.request_id, finished=True, finish_reason="error",
                                  error=f"{type(error).__name__}: {error}", index=i,
                                  num_prompt_tokens=P) for i in range(params.n)]
        eng.num_prompt_tokens += P
        outs = []
        for i, h in enumerate(search.best(params.n)):
            eng.num_generation_tokens += len(h.tokens)
            text = "" if eng.tokenizer is None else eng.tokenizer.decode(
                h.tokens, skip_special_tokens=params.skip_special_tokens)
            ended = bool(h.tokens) and h.tokens[-1] in search.eos_ids
            outs.append(RequestOutput(
                request.request_id, new_token_ids=list(h.tokens), text_delta=text,
                token_ids=list(h.tokens), text=text, finished=True,
                finish_reason="stop" if ended else "length", index=i,
                num_prompt_tokens=P, num_output_tokens=len(h.tokens)))
        return outs
