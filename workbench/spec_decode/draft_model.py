"""The draft-model proposer (vLLM's `method: "draft_model"`): a smaller or cheaper model with
the target's vocabulary drafts k tokens per request, which the target then verifies in one
forward pass: its greedy tokens for a greedy request; for a sampled one, tokens drawn from
its own distribution under the request's filters (temperature, top-k, top-p, min-p, its
penalties), kept as `draft_probs` for the rejection sampler, which keeps a draft x with
probability min(1, p(x) / q(x)): for a draft near the target, most (a greedy draft of a
sampled request is kept at p(x), about half the time for SmolLM2 at temperature 0.7).

The draft is an engine's model in all but the scheduler: it is loaded by the engine's own
loader (executor/device_model.py: any model source, dtype and weight format an EngineConfig
takes, e.g. the embedded model's own 'gguf-a8' blocks drafting for its fp32 self), runs
through a ModelRunner of its own (the target's attention backends and captured decode
graphs) and keeps its K/V in its own paged pool, held per request in a BlockManager between
calls. Each call brings every request's tokens (prompt, then output); the draft feeds what
it has not computed yet (after the longest prefix it has in common with what it computed:
the target may have replaced its rejected drafts) as one batched catch-up step for all
requests, then k-1 batched decode steps. Its pool caches prefixes as the target's does (a
new request whose prompt starts as an earlier one's feeds only the rest: a chat's system
prompt, the same document asked about again), where the engine caches them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..config import EngineConfig
from ..core.block_manager import BlockManager
from ..core.scheduler import (CachedRequestData, NewRequestData, ScheduledRequest,
                              SchedulerOutput)
from ..executor.device_model import load_device_model
from ..executor.kv_sizing import kv_bytes_per_block
from ..executor.runner import ModelRunner
from ..executor.sampler import _search, _uniforms, target_probs
from ..executor.sampling_metadata import SamplingMetadataBuilder, SamplingRow
from ..utils import cdiv

log = logging.getLogger("workbench")

DEFAULT_KV_BYTES = 2**30
"""The draft's KV pool where the device has no memory figure of its own (the CPU), or, on a
device with one, at most a tenth of what is free once the draft is loaded."""


@dataclass(slots=True)
class _DraftRequest:
    """What the draft holds of one request between calls."""
    token_ids: list[int] = field(default_factory=list)
    """The tokens whose K/V its pool holds, position by position."""
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    """The prefix cache's hash of each of its first blocks, full of the request's own
    tokens (never a draft's, whose positions may be written again)."""


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def tokenizer_difference(target, draft) -> str | None:
    """What differs between two tokenizers where it matters to a draft (the ids it proposes
    must mean the same tokens): the vocabulary and the special ids; None where they agree or
    either side has none (a random model's)."""
    if target is None or draft is None:
        return None
    if len(target) != len(draft):
        return f"the target's tokenizer has {len(target)} tokens, the draft's {len(draft)}"
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(target, name, None), getattr(draft, name, None)
        if a != b:
            return f"{name} is {a} for the target and {b} for the draft"
    if target.get_vocab() != draft.get_vocab():
        return "the same ids stand for different tokens"
    return None


def _device_name(device) -> str:
    """'cpu', 'cuda', 'npu' from a name ('cuda:0'), a torch.device or a Platform."""
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, str):
        return device.split(":")[0]
    return getattr(device, "name")


class DraftModelProposer:
    """Proposals from a draft model (see the module's docstring).

    config: the speculative_config ("model", optional "dtype" and "quantization" with
    EngineConfig's meanings, 'auto' where absent; optional "num_kv_blocks", the draft pool's
    size), or an object with those attributes (None: absent). The draft's vocabulary must be
    the target's (target_vocab_size, target_tokenizer). device: the target's ('cpu',
    'cuda:0', a torch.device or a Platform). A Proposer (spec_decode/__init__.py) that
    draws a sampled request's drafts."""

    draws = True

    def __init__(self, config: dict, target_vocab_size: int, target_tokenizer, device,
                 num_speculative_tokens: int, max_model_len: int, max_num_seqs: int,
                 enable_prefix_caching: bool = True):
        if not isinstance(config, dict):      # a SpeculativeConfig: its fields, None unset
            config = {name: getattr(config, name) for name in ("model", "dtype", "quantization")
                      if getattr(config, name, None) is not None}
        source = config.get("model")
        if not isinstance(source, str) or not source:
            raise ValueError(f"speculative_config.model: the draft model to load is missing "
                             f"(got {source!r})")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens: must be >= 1 (got "
                             f"{num_speculative_tokens})")
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        draft_config = EngineConfig(
            model=source, device=_device_name(device), dtype=config.get("dtype") or "auto",
            quantization=config.get("quantization", "auto"), max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, enable_prefix_caching=False)
        # Positions: the target's max_model_len, or fewer where the draft takes fewer (as
        # vLLM does, requests past them get no proposals).
        def positions(c, hf_config):
            return min(c.max_model_len, getattr(hf_config, "max_position_embeddings",
                                                c.max_model_len))
        try:
            m = load_device_model(draft_config, positions)
        except Exception as e:       # noqa: BLE001 (any failure to load names the source)
            raise ValueError(f"speculative_config.model: cannot load the draft model "
                             f"{source!r}: {e}") from e
        vocab = m.hf_config.vocab_size
        if vocab != target_vocab_size:
            raise ValueError(f"speculative_config.model: the draft {source!r} has a vocabulary "
                             f"of {vocab} tokens, the target's has {target_vocab_size}; a "
                             "draft must share the target's vocabulary")
        why = tokenizer_difference(target_tokenizer, m.tokenizer)
        if why is not None:
            raise ValueError(f"speculative_config.model: the draft {source!r} has a different "
                             f"tokenizer from the target's ({why})")
        self.draft_len = m.max_model_len
        """The positions the draft computes (at most the target's max_model_len)."""
        self.source, self.config = source, m.config
        self.model, self.platform, self.quantization = m.model, m.platform, m.quantization
        self.tokenizer = m.tokenizer
        for text in m.notices:
            log.info("draft model: %s", text)

        bs = m.config.block_size
        per_block = kv_bytes_per_block(m.model, bs, m.dtype)
        if config.get("num_kv_blocks"):
            num_blocks = int(config["num_kv_blocks"])
        else:
            # Enough for every sequence at its longest, within the budget.
            memory = m.platform.memory_info()
            budget = DEFAULT_KV_BYTES if memory is None else min(DEFAULT_KV_BYTES,
                                                                 memory[0] // 10)
            want = max_num_seqs * cdiv(self.draft_len, bs) + 1
            num_blocks = max(2, min(want, int(budget // per_block)))
        self.block_manager = BlockManager(num_blocks, bs, enable_prefix_caching)
        self.runner = ModelRunner(m.model, num_blocks, bs, m.platform, m.attn_backend,
                                  max_num_tokens=m.config.max_num_batched_tokens,
                                  max_num_seqs=max_num_seqs, max_model_len=self.draft_len)
        plan = self.runner.capture_graphs(m.config, self.draft_len)
        self.graph_mode = plan.mode
        for text in plan.notices:
            log.info("draft model: %s", text)
        self._reqs: dict[str, _DraftRequest] = {}
        self._in_runner: set[str] = set()
        """Requests the runner holds (sent whole, not yet told to forget)."""
        self._forget: list[str] = []
        """Requests freed since the last step, for the runner to forget."""
        self._told_full = False
        self.sampling = SamplingMetadataBuilder(m.platform, vocab)
        """The sampled requests' rows (no stop tokens: min_tokens' ban is the target's)."""
        self.draft_probs: dict[str, torch.Tensor] = {}
        """The last call's sampled requests' draft distributions, [drafts, vocab] fp32 each."""
        self._probs: dict[str, list[torch.Tensor]] = {}
        """The same, row by row, while a call drafts."""
        self.longest_catch_up = 0
        """The most tokens the last call's catch-up step fed one request: its drafts' and the
        target's tokens since the call before (about k + 1), or a whole prompt for a new
        request, or every token since a pause. SpecDecoding leaves a step whose catch-up was
        a prefill out of its step costs."""

    # ---- the pool --------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.block_manager.num_usable_blocks

    def free(self, req_id: str) -> None:
        """Give the request's blocks back (a request that finished or was preempted)."""
        st = self._reqs.pop(req_id, None)
        if st is not None:
            self.block_manager.free(st.block_ids)
        if req_id in self._in_runner:
            self._in_runner.discard(req_id)
            self._forget.append(req_id)

    def _hold(self, req_id: str, st: _DraftRequest, num_tokens: int,
              computed: list[int] = ()) -> bool:
        """Hold exactly the blocks num_tokens tokens take (the tail beyond them given back;
        a new request's first blocks a prefix hit's `computed` ones); False, the request
        freed, where the pool has too few."""
        need = cdiv(num_tokens, self.block_manager.block_size)
        if len(st.block_ids) > need:
            self.block_manager.free(st.block_ids[need:])
            del st.block_ids[need:]
            return True
        new = self.block_manager.allocate_slots(len(st.block_ids), num_tokens, computed)
        if new is None:
            self.free(req_id)
            if not self._told_full:
                self._told_full = True
                log.warning("draft model: its KV pool (%d blocks of %d tokens) is full; "
                            "requests that do not fit get no proposals until it has room "
                            "(said once)", self.block_manager.num_usable_blocks,
                            self.block_manager.block_size)
            return False
        st.block_ids += [*computed, *new]
        return True

    # ---- proposing -------------------------------------------------------------------------
    def _run(self, out: SchedulerOutput, sampled: dict[str, SamplingRow],
             shared: torch.Generator | None) -> dict[str, int]:
        """One step of the draft; each request's token: greedy, or drawn for the `sampled`
        ones (their rows' histories are the tokens before this one), whose distributions go
        to draft_probs."""
        result = self.runner.execute(out)
        logits = result.logits[:len(result.req_ids)]
        picked = dict(zip(result.req_ids, logits.argmax(dim=-1).tolist()))
        rows = [(i, rid) for i, rid in enumerate(result.req_ids) if rid in sampled]
        if rows:
            md = self.sampling.build([sampled[rid] for _, rid in rows], shared=shared,
                                     logits_rows=[i for i, _ in rows])
            q = target_probs(logits, md).probs
            cum = q.cumsum(-1)
            drawn = _search(cum, cum[:, -1], _uniforms(md.draw, len(rows), q.device)).tolist()
            for j, ((_, rid), tok) in enumerate(zip(rows, drawn)):
                picked[rid] = tok
                self._probs.setdefault(rid, []).append(q[j])
        return picked

    @torch.inference_mode()
    def propose(self, reqs: list[tuple[str, list[int]]],
                rows: list[SamplingRow | None] | None = None,
                shared: torch.Generator | None = None) -> list[list[int]]:
        """Up to k draft tokens for each (request id, all its tokens so far), in order:
        fewer where the request nears max_model_len (no more than it can still grow by, less
        the target's own token after them) or the draft's own positions, [] where none fit
        or the pool is full. rows[i]: request i's sampling (its params, prompt length and
        generator), for a sampled request whose drafts are drawn; None (or no rows): greedy
        drafts. shared: what drawn rows without a generator of their own draw from."""
        proposals: list[list[int]] = [[] for _ in reqs]
        self.longest_catch_up = 0
        self.draft_probs, self._probs = {}, {}
        sampled = {rid: row for (rid, _), row in zip(reqs, rows or ())
                   if row is not None and not row.params.greedy}
        first = SchedulerOutput(finished_req_ids=self._forget)
        self._forget = []
        want: dict[str, int] = {}
        where: dict[str, int] = {}
        for i, (rid, tokens) in enumerate(reqs):
            n = len(tokens)
            # No more than the request can still grow by, less the target's own token after
            # them; K/V for positions up to n + k - 2 within the draft's.
            k = min(self.k, self.max_model_len - n - 1, self.draft_len - n + 1)
            if n == 0 or k <= 0:
                continue
            st = self._reqs.get(rid)
            hit: list[int] = []
            if st is None:
                st = self._reqs[rid] = _DraftRequest()
                found = self.block_manager.match_prefix(tokens)
                hit, st.block_hashes = found.block_ids, found.block_hashes
            start = min(max(common_prefix_len(st.token_ids, tokens),
                            len(hit) * self.block_manager.block_size), n - 1)
            # The K/V it writes: every token but the last draft (positions 0 .. n + k - 2).
            if not self._hold(rid, st, n + k - 1, hit):
                continue
            if rid in self._in_runner:       # sent whole again: its tokens may have changed
                first.finished_req_ids.append(rid)
            self._in_runner.add(rid)
            first.new_reqs.append(NewRequestData(rid, list(tokens), n, list(st.block_ids),
                                                 start, None))
            first.scheduled.append(ScheduledRequest(rid, n - start, start, True,
                                                    n - start == 1))
            st.token_ids = list(tokens)
            want[rid], where[rid] = k, i
            self.longest_catch_up = max(self.longest_catch_up, n - start)
        if not first.scheduled:
            self._forget = first.finished_req_ids + self._forget   # told at the next step
            return proposals
        try:
            self._draft(first, want, where, proposals,
                        {rid: row for rid, row in sampled.items() if rid in want}, shared)
        except BaseException:
            # What the failed step wrote is unknown: these requests start again next time.
            for rid in want:
                self.free(rid)
            raise
        for rid, i in where.items():
            # Blocks full of the request's own tokens before its last one (which the next
            # call feeds again) are never written again: cached for later requests.
            tokens, st = reqs[i][1], self._reqs[rid]
            st.block_hashes += self.block_manager.cache_full_blocks(
                tokens, st.block_ids, st.block_hashes, len(tokens) - 1)
        self.draft_probs = {rid: torch.stack(q) for rid, q in self._probs.items()}
        return proposals

    def _draft(self, first: SchedulerOutput, want: dict[str, int], where: dict[str, int],
               proposals: list[list[int]], sampled: dict[str, SamplingRow],
               shared: torch.Generator | None) -> None:
        """The catch-up step, then the decode steps, each one batch of every request that
        still wants a token; the tokens appended to `proposals`."""
        def rows() -> dict[str, SamplingRow]:        # each sampled request's history now
            return {rid: SamplingRow(r.params, self._reqs[rid].token_ids, r.num_prompt_tokens,
                                     r.generator) for rid, r in sampled.items()}
        last = self._run(first, rows(), shared)
        for rid, tok in last.items():
            proposals[where[rid]].append(tok)
        for j in range(1, self.k):
            step = SchedulerOutput()
            for rid, tok in last.items():
                if want[rid] <= j:
                    continue
                st = self._reqs[rid]
                pos = len(st.token_ids)
                step.scheduled.append(ScheduledRequest(rid, 1, pos, True, True))
                step.cached_reqs.append(CachedRequestData(rid, [tok], [], pos))
                st.token_ids.append(tok)
            if not step.scheduled:
                break
            last = self._run(step, rows(), shared)
            for rid, tok in last.items():
                proposals[where[rid]].append(tok)

    def release(self) -> None:
        """Drop the draft's pool, graphs and model."""
        self.runner.release()
        self.model = None
