"""Executors run the two model groups (target, draft): `execute(plan)` runs one engine step's plan
(engine/plan.py) and reports what came back. EngineCore.step is its one caller.

A model group is `tp` GroupRanks, one per device, all running the same forward on their shard.
LocalExecutor keeps one rank per group in this process. RayExecutor makes each rank a Ray actor in a
placement group, joins each group's ranks in its own torch.distributed group (gloo on CPU, NCCL on
CUDA), sends every call to every rank and reads rank 0. With a colocated draft
(draft_placement), each target actor also holds a draft rank (ColocatedRanks), on the same device
and in the same torch.distributed group. The draft group's result goes to the
target group as an ObjectRef, so Ray moves it without the coordinator touching it, and sampling
happens inside the target group: full logits never leave it.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Protocol

import torch

from engine.config import EngineConfig
from engine.errors import ExecutorError, StepError
from engine.memory import DeviceMemory, device_budget, plan_blocks
from engine.plan import RequestStart, StepOutput, StepPlan
from engine.proposer import DraftModelProposer
from engine.grammar_masks import GrammarMasks
from engine.models.loading import eos_token_ids, load_config, load_tokenizer, resolve_model
from engine.step import AheadBatch, DraftBatch, DraftOutput, Prefill, RequestGrammar, VerifyBatch, VerifyOutput
from engine.frequent_tokens import restrict_head
from engine.verifier import Verifier
from engine.vocab_mapping import VocabMapping
from engine.worker import ModelWorker

log = logging.getLogger(__name__)


class GroupRank:
    """One rank of a model group: a ModelWorker shard and the group's job (drafting or verifying)."""

    def __init__(self, role: str, config: EngineConfig, target_vocab: int,
                 vocab_mapping: VocabMapping | None = None, rank: int = 0, world: int = 1,
                 dist_address: str | None = None, threads: int | None = None, cores: list[int] | None = None,
                 group=None):
        """group: a torch.distributed group this process has joined already (a colocated draft
        shares its target's); else one is made at dist_address when world > 1."""
        if cores:  # this rank's own cores (disjoint_cores): as if it had a device to itself
            os.sched_setaffinity(0, cores)
            threads = len(cores)
        if threads:
            torch.set_num_threads(threads)
        device = config.resolved_device()
        if world > 1 and group is None:
            if device == "cuda":
                torch.cuda.set_device(0)  # Ray gives each rank actor one visible GPU
            torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo",
                                                 init_method=f"tcp://{dist_address}", rank=rank, world_size=world)
            group = torch.distributed.group.WORLD
        spec = config.speculative_config
        name = config.model if role == "target" else spec.model
        self.worker = ModelWorker(resolve_model(name), None, config.block_size, config.torch_dtype(),
                                  device, rng_stream=role, rank=rank, world=world, group=group,
                                  gguf_weights=config.gguf_weights, cpu_kernels=config.cpu_kernels,
                                  cpu_isa=config.cpu_isa, compiled=config.compiled_step())
        self.rank, self.group, self.config = rank, group, config
        self.grammars = self._grammars(config, target_vocab)  # in the target's tokens, on both groups
        if role == "draft" and spec.draft_head_tokens:
            restrict_head(self.worker.model, load_tokenizer(resolve_model(spec.model)), spec.draft_head_tokens)
        if role == "draft":
            self.proposer = DraftModelProposer(self.worker, spec, target_vocab, vocab_mapping, self.grammars)
        else:
            self.verifier = Verifier(self.worker, spec, self.grammars)

    @staticmethod
    def _grammars(config: EngineConfig, vocab: int) -> GrammarMasks:
        """Grammar state in the target's tokens (what every grammar is written in)."""
        source = resolve_model(config.model)
        tokenizer = load_tokenizer(source, config.tokenizer)
        return GrammarMasks(tokenizer, eos_token_ids(tokenizer, load_config(source)), vocab,
                            threads=torch.get_num_threads(), kernel=config.cpu_kernels)

    def warm_grammars(self) -> None:
        """Build the grammar tokenizer view in the background (seconds for 262k tokens), so that a
        step doesn't wait for it; called when the engine sees its first grammar, not at start, so
        engines that never get one never pay it."""
        threading.Thread(target=self.grammars.warm, name="tandem-grammar-warm", daemon=True).start()

    def ready(self) -> bool:
        return True

    def ragged_rows(self) -> bool:
        return self.worker.takes_ragged_rows

    def _workers(self) -> list[ModelWorker]:
        return [self.worker]

    def memory(self) -> DeviceMemory:
        """What a KV block costs on this rank's device (every model on it) and what it may spend."""
        workers, config = self._workers(), self.config
        budget, where = device_budget(config.resolved_device(), config.gpu_memory_utilization,
                                      config.kv_cache_memory_bytes)
        return DeviceMemory(sum(w.block_bytes() for w in workers), budget, sum(w.weight_bytes() for w in workers), where)

    def allocate(self, num_blocks: int, max_model_len: int | None = None) -> None:
        for worker in self._workers():
            worker.allocate_cache(num_blocks, max_model_len)

    def add_request(self, request_id: str, seed: int, grammar: RequestGrammar | None = None) -> None:
        self.worker.add_request(request_id, seed)
        if grammar is not None and self.grammars is not None:
            self.grammars.add(request_id, grammar.grammar, list(grammar.output_ids), list(grammar.stop_token_ids))

    def remove_request(self, request_id: str) -> None:
        self.worker.remove_request(request_id)
        if self.grammars is not None:
            self.grammars.remove(request_id)

    def update_requests(self, removed: list[str], started: list[RequestStart]) -> None:
        """A step's removals, then its starts: one call, not one per request."""
        for request_id in removed:
            self.remove_request(request_id)
        for s in started:
            self.add_request(s.request_id, s.seed, s.grammar)

    def prefill(self, chunks: list[Prefill], after=None, scored: tuple[int, int] | None = None):
        """`after`: an ObjectRef this call waits for (Ray resolves it first), to order two groups'
        prefills without a round trip through the coordinator. `scored` = (the token after the chunk,
        top n), with one chunk: also return each next token's log-probability and the top n at each
        position."""
        if scored is None:
            self.worker.prefill(chunks)
            return None
        (chunk,) = chunks
        tokens = chunk.tokens
        out = self.worker.prefill_scored(chunk.table, chunk.start, tokens, tokens[1:] + [scored[0]], scored[1])
        return out if self.rank == 0 else None

    def propose(self, batch: DraftBatch) -> DraftOutput | None:
        start = time.perf_counter()
        out = self.proposer.propose(batch)
        out.elapsed_s = time.perf_counter() - start
        return out if self.rank == 0 else None

    def propose_ahead(self, batch: AheadBatch, fresh: DraftOutput | None):
        """(the proposals without distributions, for the scheduler; the whole output, for the next
        verify): two Ray return values, so the distributions go only where they are used."""
        start = time.perf_counter()
        out = self.proposer.propose_ahead(batch, fresh)
        out.elapsed_s = time.perf_counter() - start
        return (out.summary(), out) if self.rank == 0 else (None, None)

    def verify(self, batch: VerifyBatch, drafts: DraftOutput | None,
               ahead: DraftOutput | None = None) -> VerifyOutput | None:
        start = time.perf_counter()
        out = self.verifier.verify(batch, drafts, ahead)
        out.elapsed_s = time.perf_counter() - start
        out.cached = [s + len(p) + a for s, p, a in zip(batch.starts, batch.pending, out.num_accepted)]
        if drafts is not None:
            out.draft_elapsed_s = drafts.elapsed_s
            out.draft_cached = dict(zip(drafts.seq_ids, drafts.cached))
        return out if self.rank == 0 else None

    def logits(self, tables: list[list[int]], starts: list[int], tokens: list[list[int]]):
        """Raw float32 logits of a ragged forward (diagnostics and parity tests)."""
        out = self.worker.forward(tables, starts, tokens)
        return out if self.rank == 0 else None


class ColocatedRanks(GroupRank):
    """A target rank with a draft rank in the same actor, on its device (draft_placement colocated).
    The draft shares the target's torch.distributed group when it has as many ranks; with one rank
    it lives in the target's rank 0 only. Its calls are the target's with a `draft_` prefix; calls
    to one actor run in the order they were sent, so every rank sees the same collective order."""

    def __init__(self, config: EngineConfig, target_vocab: int,
                 vocab_mapping: VocabMapping | None = None, rank: int = 0, world: int = 1,
                 dist_address: str | None = None, threads: int | None = None, cores: list[int] | None = None):
        super().__init__("target", config, target_vocab, None, rank, world, dist_address, threads, cores)
        draft_world = config.draft_tensor_parallel_size
        self.draft = None
        if draft_world > 1 or rank == 0:
            self.draft = GroupRank("draft", config, target_vocab, vocab_mapping,
                                   rank if draft_world > 1 else 0, draft_world,
                                   group=self.group if draft_world > 1 else None)

    def draft_ready(self) -> bool:
        return self.draft is not None

    def _workers(self) -> list[ModelWorker]:
        return [self.worker] + ([self.draft.worker] if self.draft is not None else [])

    def draft_update_requests(self, removed: list[str], started: list[RequestStart]) -> None:
        self.draft.update_requests(removed, started)

    def draft_prefill(self, chunks: list[Prefill], after=None, scored=None):
        return self.draft.prefill(chunks, after, scored)

    def draft_propose(self, batch: DraftBatch) -> DraftOutput | None:
        return self.draft.propose(batch)

    def draft_propose_ahead(self, batch: AheadBatch, fresh: DraftOutput | None):
        return self.draft.propose_ahead(batch, fresh)


class DraftHandle:
    """A colocated draft rank as the executor calls it: `handle.propose.remote(...)` goes to the
    target actor's `draft_propose` (ColocatedRanks), and so on for each call a draft rank takes."""

    def __init__(self, actor):
        self.actor = actor
        self.ready = actor.draft_ready
        self.update_requests = actor.draft_update_requests
        self.prefill = actor.draft_prefill
        self.propose = actor.draft_propose
        self.propose_ahead = actor.draft_propose_ahead


class Executor(Protocol):
    """What EngineCore calls to run the two model groups (LocalExecutor, RayExecutor)."""

    num_blocks: int  # KV cache blocks each model's cache holds
    overlaps_groups: bool  # whether the draft group's calls can run beside the target's (draft-ahead)
    # whether the target's forward takes rows of any lengths unpadded (a prompt's rest as a row's
    # pending tokens costs no padding of the other rows)
    ragged_rows: bool

    def execute(self, plan: StepPlan) -> StepOutput:
        """Run a step's plan: StepError when a call raised in a live worker (EngineCore then runs the
        plan's parts alone), ExecutorError when a group died."""

    def update_requests(self, removed: list[str], started: list[RequestStart]) -> None:
        """Drop finished requests' state on the workers, then make new requests' (their random
        streams, their grammar): on the target, and on the draft for those that hold state there
        (a request that will never draft, RequestStart.draft False, costs the draft group nothing)."""

    def prefill(self, target: list[Prefill], draft: list[Prefill],
                scored: tuple[int, int] | None = None) -> list | None:
        """Write prompt chunks into each model's cache, one call per group for all of them (an
        empty list: nothing for that model). `scored` needs one target chunk, and returns its
        prompt logprobs."""

    def step(self, verify: VerifyBatch, draft: DraftBatch | None, ahead: AheadBatch | None = None) -> VerifyOutput: ...

    def target_logits(self, tables: list[list[int]], starts: list[int], tokens: list[list[int]]): ...

    def restart(self) -> None: ...

    def shutdown(self) -> None: ...

    def warm_grammars(self) -> None: ...


class RunsPlans:
    """execute(plan): a step's calls in the plan's order (removals, starts, prefills, the round),
    timed for the scheduler's cost model. Both executors share it."""

    def execute(self, plan: StepPlan) -> StepOutput:
        began = time.perf_counter()
        out = StepOutput()
        if plan.remove or plan.start:
            self.update_requests(plan.remove, plan.start)
        for call in plan.prefills:
            start = time.perf_counter()
            got = self.prefill(call.target, call.draft, call.scored)
            if call.scored is not None:
                out.prompt_logprobs[call.target[0].seq_id] = got or []
            elif call.draft and not call.target:  # the draft's prompt tokens alone: their cost
                out.draft_prefill.append((time.perf_counter() - start, sum(len(c.tokens) for c in call.draft)))
        if plan.round is not None:
            start = time.perf_counter()
            out.round = self.step(plan.round.verify, plan.round.draft, plan.round.ahead)
            out.round_s = time.perf_counter() - start
        out.execute_s = time.perf_counter() - began
        return out


class LocalExecutor(RunsPlans):
    overlaps_groups = False  # one process: the draft runs after the verify, never beside it

    def __init__(self, config: EngineConfig, max_model_len: int, target_vocab: int,
                 vocab_mapping: VocabMapping | None = None):
        self.target = GroupRank("target", config, target_vocab)
        self.draft = None
        if config.speculative_config is not None:
            self.draft = GroupRank("draft", config, target_vocab, vocab_mapping)
        # both models on this process's device: one budget for their caches together
        reports = [r.memory() for r in self._ranks()]
        joint = DeviceMemory(sum(r.block_bytes for r in reports), reports[0].budget_bytes,
                             sum(r.weight_bytes for r in reports), reports[0].where)
        self.num_blocks = plan_blocks([joint], config.block_size, max_model_len, config.resolved_max_num_seqs(),
                                      config.gpu_memory_utilization)
        for r in self._ranks():
            r.allocate(self.num_blocks, max_model_len)
        self.ragged_rows = self.target.ragged_rows()
        self._ahead = None  # the last step's draft-ahead blocks (whole: the next verify reads them)

    def _ranks(self):
        return [r for r in (self.target, self.draft) if r is not None]

    def update_requests(self, removed: list[str], started: list[RequestStart]) -> None:
        try:
            self.target.update_requests(removed, started)
            if self.draft is not None:  # removing what it never held is nothing
                self.draft.update_requests(removed, [s for s in started if s.draft])
        except Exception as e:
            raise StepError(f"update_requests raised {type(e).__name__}") from e

    def prefill(self, target: list[Prefill], draft: list[Prefill], scored: tuple[int, int] | None = None):
        try:
            out = self.target.prefill(target, None, scored) if target else None
            if self.draft is not None and draft:
                self.draft.prefill(draft)
            return out
        except Exception as e:
            raise StepError(f"prefill raised {type(e).__name__}") from e

    def step(self, verify: VerifyBatch, draft: DraftBatch | None, ahead: AheadBatch | None = None) -> VerifyOutput:
        """One round. In one process the draft-ahead blocks are drafted after the verify (nothing
        overlaps here; the rounds are the same as RayExecutor's)."""
        try:
            previous, self._ahead = self._ahead, None
            drafts = self.draft.propose(draft) if draft is not None else None
            out = self.target.verify(verify, drafts, previous)
            if ahead is not None:
                out.ahead, self._ahead = self.draft.propose_ahead(ahead, drafts)
            return out
        except Exception as e:
            raise StepError(f"step raised {type(e).__name__}") from e

    def target_logits(self, tables: list[list[int]], starts: list[int], tokens: list[list[int]]):
        return self.target.logits(tables, starts, tokens)

    def restart(self) -> None:
        pass  # nothing in this process can die without taking the process with it

    def warm_grammars(self) -> None:
        self.target.warm_grammars()  # the draft's view is the same one: one per process

    def shutdown(self) -> None:
        pass


def _free_address() -> str:
    """host:port free on this node, for a torch.distributed rendezvous (run on rank 0's node)."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    import ray

    return f"{ray.util.get_node_ip_address()}:{port}"


def actor_env(config: EngineConfig) -> dict:
    """The rank processes' environment. The draft and target groups take turns on the same cores;
    libgomp's threads spin for a while after each parallel region (300k spins by default), stealing
    the cores from the group whose turn it is; a shorter spin keeps the Ray path within ~5% of
    in-process (benchmarks/batch_bench.py: default 1.18x, PASSIVE 1.4x, 30k spins 1.05x a step)."""
    return {"env_vars": {"GOMP_SPINCOUNT": str(config.omp_spin_count)}}


def bundles_needed(config: EngineConfig) -> int:
    """One bundle per rank of each model group (a colocated draft's ranks use the target's)."""
    separate_draft = config.speculative_config is not None and not config.colocated_draft()
    return config.tensor_parallel_size + (config.draft_tensor_parallel_size if separate_draft else 0)


def init_ray(config: EngineConfig, **kwargs) -> None:
    """Start (or join) Ray so that this engine's groups can always be placed: a cluster we start
    ourselves gets at least one logical CPU per rank (the ranks share the real cores: each group's
    threads are sized from os.cpu_count()); LLM(..., tensor_parallel_size=2, speculative_config=...)
    on a 2-core machine needs 4. An existing cluster is joined as it is."""
    import ray

    cpus = None if config.resolved_device() == "cuda" else max(os.cpu_count() or 1, bundles_needed(config))
    try:
        ray.init(ignore_reinit_error=True, num_cpus=cpus, **kwargs)
    except ValueError:  # joining a cluster started elsewhere: its resources are its own
        ray.init(ignore_reinit_error=True, **kwargs)


def ensure_ray(config: EngineConfig) -> None:
    """Join the Ray this process is in, or start one that fits this engine (init_ray)."""
    import ray

    if not ray.is_initialized():
        init_ray(config, log_to_driver=False)


def _started_here() -> bool:
    """Whether this process started its Ray cluster (a local one, fixed in size), not joined one."""
    import ray

    return bool(getattr(getattr(ray._private.worker, "_global_node", None), "head", False))


class RayExecutor(RunsPlans):
    """Target and draft groups as Ray actors, one per tensor-parallel rank."""

    overlaps_groups = True  # the draft group's calls run beside the target's (draft_ahead needs separate)

    def __init__(self, config: EngineConfig, max_model_len: int, target_vocab: int,
                 vocab_mapping: VocabMapping | None = None, timeout_s: float = 600.0):
        ensure_ray(config)
        self.config, self.max_model_len, self.target_vocab = config, max_model_len, target_vocab
        self.vocab_mapping, self.timeout_s = vocab_mapping, timeout_s
        self._ahead = None  # ObjectRef: the last step's draft-ahead blocks, whole, for the next verify
        self._with_draft: set[str] = set()  # requests the draft group holds state for
        # calls sent and not yet waited for: the step's next _get waits for them with its own (an
        # actor runs one caller's calls in the order sent, so they run before the step's calls)
        self._unwaited: list = []
        self._grammars_warmed = False
        self._start()

    def _start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group

        config = self.config
        cuda = config.resolved_device() == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if cuda else {"CPU": 1}
        tp = config.tensor_parallel_size
        colocated = config.colocated_draft()
        dtp = config.draft_tensor_parallel_size if config.speculative_config and not colocated else 0
        cores = len(os.sched_getaffinity(0))
        if config.disjoint_cores and not cuda and cores < bundles_needed(config):
            raise ValueError(f"disjoint_cores: {bundles_needed(config)} ranks (target and draft groups) need at "
                             f"least as many cores; this node has {cores}")
        needed = bundles_needed(config)
        kind = "GPU" if cuda else "CPU"
        total = ray.cluster_resources().get(kind, 0)
        if total < needed and _started_here():  # no autoscaler: waiting could never help
            raise ExecutorError(f"this engine needs {needed} x {bundle} (a bundle per rank of each model group); the "
                                f"Ray cluster holds {total:g} {kind} in all. A Ray started by this process keeps the "
                                f"size it started with: call ray.shutdown() before building this engine (it then "
                                f"starts one that fits), or start Ray with num_cpus/num_gpus >= {needed}")
        self.placement = placement_group([bundle] * needed, strategy=config.placement_strategy)
        try:
            ray.get(self.placement.ready(), timeout=config.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            hint = ("; a GPU per rank of each group: draft_placement 'colocated' puts the draft on the "
                    "target's GPUs" if cuda and dtp else "")
            raise ExecutorError(f"could not reserve {tp + dtp} x {bundle} ({config.placement_strategy}) in the Ray "
                                f"cluster (cluster resources: {ray.cluster_resources()}){hint}") from None
        self.target = self._group("target", tp, 0)
        if colocated:  # the target actors hold the draft ranks: all of them, or rank 0's
            self.draft = [DraftHandle(r) for r in self.target[: config.draft_tensor_parallel_size]]
        else:
            self.draft = self._group("draft", dtp, tp) if dtp else []
        self._get([r.ready.remote() for r in self.target + self.draft])
        devices = self.target + [r for r in self.draft if not isinstance(r, DraftHandle)]  # one per device
        reports = self._get([r.memory.remote() for r in devices])
        try:
            blocks = plan_blocks(reports, config.block_size, self.max_model_len, config.resolved_max_num_seqs(),
                                 config.gpu_memory_utilization)
            if blocks < getattr(self, "num_blocks", blocks):  # a rebuild: the scheduler's pools are that big
                raise ValueError(f"rebuilt model groups fit {blocks} KV cache blocks, {self.num_blocks} before")
        except ValueError:
            self.shutdown()
            raise
        self.num_blocks = getattr(self, "num_blocks", blocks)
        self._get([r.allocate.remote(self.num_blocks, self.max_model_len) for r in devices])
        self.ragged_rows = all(self._get([r.ragged_rows.remote() for r in self.target]))
        log.info("model groups placed (%s): %s", config.placement_strategy,
                 "; ".join(f"{role} ranks on {', '.join(ips)}" for role, ips in self.nodes().items()))

    def nodes(self) -> dict[str, list[str]]:
        """The node address each rank runs on, per group (rank order)."""
        import ray
        from ray.util.placement_group import placement_group_table

        address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        on = placement_group_table(self.placement)["bundles_to_node_id"]
        tp = len(self.target)
        return {"target": [address.get(on[i], "?") for i in range(tp)],
                "draft": [address.get(on[(0 if self.config.colocated_draft() else tp) + i], "?")
                          for i in range(len(self.draft))]}

    def _group(self, role: str, world: int, first_bundle: int) -> list:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cuda = self.config.resolved_device() == "cuda"

        def placed(bundle: int) -> dict:
            return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.placement, placement_group_bundle_index=bundle)}

        address = None
        if world > 1:  # rank 0's node picks the rendezvous port, so two engines never collide
            address = ray.get(ray.remote(_free_address).options(num_cpus=0, **placed(first_bundle)).remote())
        # each rank's torch threads: the node's cores shared by the group's ranks, unless the config
        # says (several replicas on one node: their groups would otherwise oversubscribe it)
        threads = None if cuda else self.config.rank_threads or max(1, (os.cpu_count() or 1) // world)
        colocated = role == "target" and self.config.colocated_draft()
        actor = ray.remote(ColocatedRanks if colocated else GroupRank)
        resources = {"num_gpus": 1, "num_cpus": 1} if cuda else {"num_cpus": 1}
        role_args = (self.config, self.target_vocab, self.vocab_mapping) if colocated else (
            role, self.config, self.target_vocab, self.vocab_mapping if role == "draft" else None)
        return [actor.options(**resources, **placed(first_bundle + rank), runtime_env=actor_env(self.config)).remote(
                    *role_args, rank, world, address, threads, self._cores(first_bundle + rank))
                for rank in range(world)]

    def _cores(self, index: int) -> list[int] | None:
        """disjoint_cores: rank `index` of all ranks gets its share of this node's cores (the
        groups of one engine on one node; on several nodes each node's share is the same range)."""
        if not self.config.disjoint_cores or self.config.resolved_device() == "cuda":
            return None
        cores = sorted(os.sched_getaffinity(0))
        share = len(cores) // bundles_needed(self.config)  # >= 1: checked before placing the groups
        return cores[index * share: (index + 1) * share]

    def execute(self, plan: StepPlan) -> StepOutput:
        out = super().execute(plan)
        if self._unwaited:  # a step with no call after its removals and starts
            self._get([])
        return out

    def _get(self, refs):
        import ray

        unwaited, self._unwaited = self._unwaited, []
        try:
            return ray.get(unwaited + refs, timeout=self.timeout_s)[len(unwaited):]
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
                ray.exceptions.ActorUnavailableError) as e:
            raise ExecutorError(f"model worker failed: {type(e).__name__}: {e}") from e
        except ray.exceptions.RayTaskError as e:  # the call raised; the worker process lives on
            raise StepError(f"model worker raised {type(e.cause).__name__ if e.cause else 'an error'}") from e

    def _all(self):
        return self.target + self.draft  # a colocated draft's handles reach the target actors' draft_ calls

    def update_requests(self, removed: list[str], started: list[RequestStart]) -> None:
        """One call per rank, sent without waiting: the step's first call that waits (its prefill or
        its round) waits for these too, so a burst of new requests costs no round trip each."""
        draft_removed = [r for r in removed if r in self._with_draft]
        self._with_draft.difference_update(removed)
        drafting = [s for s in started if s.draft]
        self._with_draft.update(s.request_id for s in drafting)
        self._unwaited += [r.update_requests.remote(removed, started) for r in self.target]
        if draft_removed or drafting:
            self._unwaited += [r.update_requests.remote(draft_removed, drafting) for r in self.draft]

    def prefill(self, target: list[Prefill], draft: list[Prefill], scored: tuple[int, int] | None = None):
        refs = [r.prefill.remote(draft) for r in self.draft] if draft else []
        # On CPU both groups use every core: run at once, their threads preempt each other (the
        # first step took 100-430 ms instead of ~75 ms). So the target waits for the draft there.
        after = refs[0] if refs and self.config.resolved_device() == "cpu" else None
        target_refs = [r.prefill.remote(target, after, scored) for r in self.target] if target else []
        results = self._get(target_refs + refs)
        return results[0] if target_refs else None

    def step(self, verify: VerifyBatch, draft: DraftBatch | None, ahead: AheadBatch | None = None) -> VerifyOutput:
        previous, self._ahead = self._ahead, None
        draft_refs = [r.propose.remote(draft) for r in self.draft] if draft is not None else []
        drafts = draft_refs[0] if draft_refs else None  # an ObjectRef: Ray hands it to the target ranks
        verify_refs = [r.verify.remote(verify, drafts, previous) for r in self.target]
        ahead_refs = []
        if ahead is not None:  # drafted while the target verifies (the draft group's next call)
            ahead_refs = [r.propose_ahead.options(num_returns=2).remote(ahead, drafts) for r in self.draft]
        results = self._get(verify_refs + draft_refs + [summary for summary, _ in ahead_refs])
        out = results[0]
        if ahead_refs:
            out.ahead, self._ahead = results[len(verify_refs) + len(draft_refs)], ahead_refs[0][1]
        return out

    def target_logits(self, tables: list[list[int]], starts: list[int], tokens: list[list[int]]):
        return self._get([r.logits.remote(tables, starts, tokens) for r in self.target])[0]

    def restart(self) -> None:
        """Replace both groups with fresh actors (after a failure)."""
        log.warning("restarting the model groups")
        self.shutdown()
        self._ahead, self._unwaited = None, []
        self._start()
        if self._grammars_warmed:
            self.warm_grammars()

    def warm_grammars(self) -> None:
        """Each rank process's grammar tokenizer view, in its background (not waited for)."""
        self._grammars_warmed = True
        for r in self.target + [r for r in self.draft if not isinstance(r, DraftHandle)]:
            r.warm_grammars.remote()  # a colocated draft shares its target's process (and view)

    def shutdown(self) -> None:
        """Kill the actors and free their placement group (idempotent; nothing to do once Ray is down)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        for r in getattr(self, "target", []) + getattr(self, "draft", []):
            if not isinstance(r, DraftHandle):  # a colocated draft dies with its target actor
                ray.kill(r, no_restart=True)
        self.target, self.draft = [], []
        if getattr(self, "placement", None) is not None:
            remove_placement_group(self.placement)
            self.placement = None
