"""The fuzzer's pieces in one process (fast tier): drawn specs, the W = 1 path through impl, the
checks on assembled snapshots, and hypothesis shrinking a planted failure to a minimal model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import hypothesis
from hypothesis import Phase, example, find, given, settings

from harness.fuzz.search import fuzz
from harness.fuzz.strategies import model_specs, warm_up_spec
from harness.fuzz.check import ExampleResult, run_example
from harness.fuzz.spec import ModelSpec, as_case, build_model, describe, init_state, wrap_paths
from harness.fuzz.worker import run_example as rank_run_example
from harness.adapters import RankContext


NO_SHRINK = settings(phases=[Phase.generate], database=None, max_examples=200)


class InProcessPool:
    """The pool's interface at W = 1 with no process group: the rank code runs right here.
    `corrupt` may rewrite the reply, to plant a bug the real impl does not have."""

    size = 1  # examples in flight at once, as a RankPool

    def __init__(self, corrupt=None) -> None:
        self.corrupt = corrupt
        self.num_requests = 0
        self._requests: dict[int, dict] = {}

    def submit(self, request: dict) -> int:
        self.num_requests += 1
        self._requests[self.num_requests] = request
        return self.num_requests

    def collect(self, i: int) -> list[dict]:
        request = self._requests.pop(i)
        spec = ModelSpec.from_json(request["spec"])
        reply = rank_run_example(spec, frozenset(request["faults"]), request["init"], RankContext(0, 1, None))
        return [self.corrupt(spec, reply) if self.corrupt else reply]


def _unit_numels(spec: ModelSpec) -> list[int]:
    return [int(line.split("numel=")[1].split()[0]) for line in describe(spec).splitlines()]


@settings(max_examples=25)
@given(model_specs(4))
def test_drawn_specs_round_trip_json_and_build(spec):
    assert ModelSpec.from_json(spec.to_json()) == spec
    model = build_model(spec)
    for path in wrap_paths(spec):
        model.get_submodule(path)  # every wrap path names a real sub-module
    out = model(torch.randn(spec.global_batch, spec.in_features))
    assert out.shape == (spec.global_batch, spec.out_features)
    assert set(init_state(spec)) == set(model.state_dict())


def test_specs_reach_the_numels_where_padding_breaks():
    w = 4
    for name, hit in {
        "numel < W": lambda n: n < w,
        "W*k - 1": lambda n: n > w and n % w == w - 1,
        "W*k": lambda n: n % w == 0,
        "W*k + 1": lambda n: n > w and n % w == 1,
        "size 1": lambda n: n == 1,
    }.items():
        spec = find(model_specs(w), lambda s: any(hit(n) for n in _unit_numels(s)), settings=NO_SHRINK)
        assert any(hit(n) for n in _unit_numels(spec)), name
    tied = find(model_specs(w), lambda s: any(b.tied for b in s.blocks), settings=NO_SHRINK)
    assert any(n.endswith(".mix_t.weight") for n, _ in build_model(tied).named_parameters(remove_duplicate=False))


COUNTEREXAMPLES = Path(__file__).resolve().parents[2] / "counterexamples"


def _pinned(filename: str) -> list[ModelSpec]:
    return [ModelSpec.from_json(json.dumps(d)) for d in json.loads((COUNTEREXAMPLES / filename).read_text())]


def pin_examples(filename: str):
    """@example every spec of a counterexample corpus file (the derandomised ci profile draws the
    same examples each run; pinned ones are tested on top, whatever the profile)."""
    def decorate(test):
        for spec in _pinned(filename):
            test = example(spec)(test)
        return test
    return decorate


# fuzz_w1_misaligned_views.json: honest W = 1 examples that failed while a parameter could sit at an
# unaligned offset of its flat buffer (issue 18: `fuzz optimizer=sgd step=2 grad
# 'blocks.1.lin.weight' ratio 2.25` and its kin), found by random search on that commit.
@settings(max_examples=8)
@given(model_specs(1))
@pin_examples("fuzz_w1_misaligned_views.json")
def test_honest_examples_pass_at_w1(spec):
    result = run_example(InProcessPool(), spec)
    assert result.ok, result.summary()
    _assert_judged(result)


def _assert_judged(result) -> None:
    """Every check that applies to a fuzz example compared elements (replicas: the fuzzer assembles
    full tensors from one set of shards, there is nothing to compare; padding: a unit of a single
    parameter has none at W = 1)."""
    empty = [c for c in ("nonfinite", "init", "loss", "grad", "param") if not result.checks[c]["elements"] > 0]
    assert empty == [], (empty, result.spec.to_json())
    assert result.checks["loss"]["elements"] == result.spec.steps * result.spec.world_size


# Honest W = 1 examples with gradient accumulation that the old error model failed (ratios 1.0 to
# 5.0: micro-batches summed against one global-batch backward). The shadow now replays the same
# micro-batches, so they pass with the gradient checked to a few ulps.
@pytest.mark.parametrize("spec", _pinned("fuzz_w1_accumulation_bound.json"), ids=lambda s: f"seed{s.seed}")
def test_honest_accumulation_examples_pass_at_w1(spec):
    result = run_example(InProcessPool(), spec)
    assert result.ok, result.summary()
    _assert_judged(result)


def _drop_grad_of_odd_units(spec, reply):
    """A planted bug: the gradient of every flat parameter of odd numel is lost."""
    for grads in reply["grads"]:
        for key, grad in grads.items():
            if grad.numel() % 2:
                grads[key] = torch.zeros_like(grad)
    return reply


def test_a_planted_failure_is_caught_and_shrunk_to_a_minimal_model():
    pool = InProcessPool(corrupt=_drop_grad_of_odd_units)
    stats = fuzz(pool, world_size=1, max_examples=30, seed=3)
    assert stats.failures, "the planted bug was never hit"
    minimal = stats.failures[-1]
    first = minimal.first_divergence
    assert first is not None and first.check == "grad" and first.step == 1, minimal.summary()
    spec = minimal.spec
    assert first.name in dict(build_model(spec).named_parameters()), first.name
    # Shrunk: one block, nothing nested, the fewest features and steps the strategy allows.
    assert len(spec.blocks) == 1 and spec.blocks[0].inner is None, spec
    assert spec.in_features == 1 and spec.steps == 2 and spec.accumulation == 1, spec
    assert any(n % 2 for n in _unit_numels(spec)), describe(spec)
    # The printed replay runs the same model again and fails the same way.
    again = run_example(pool, ModelSpec.from_json(spec.to_json()))
    assert not again.ok and again.first_divergence.name == first.name


def test_warm_up_spec_and_case_are_valid():
    for w in (1, 2, 4):
        spec = warm_up_spec(w)
        case = as_case(spec)
        assert case.wrap == ("blocks.0.inner", "blocks.0") and case.global_batch == spec.global_batch


def test_bad_specs_are_refused_with_the_values():
    import pytest

    spec = warm_up_spec(4)
    with pytest.raises(ValueError, match="accumulation=3"):
        ModelSpec(4, 2, 1, spec.blocks, spec.optimizer, batch_per_rank=2, accumulation=3)
    with pytest.raises(ValueError, match="data_mode='sliced'"):
        ModelSpec(4, 2, 1, spec.blocks, spec.optimizer, data_mode="sliced")


def test_model_specs_refuse_a_world_size_below_one():
    import pytest

    for w in (0, -3):
        with pytest.raises(ValueError, match=f"world_size={w}"):
            model_specs(w)


class InProcessAdapterPool(InProcessPool):
    """The pool at W = 1 through an adapter's full tensors (impl=single, or `impl`), the path torch
    FSDP1, FSDP2 and users' adapters take."""

    def __init__(self, corrupt=None, impl: str = "single") -> None:
        super().__init__(corrupt)
        self.impl = impl

    def collect(self, i: int) -> list[dict]:
        from harness.fuzz.worker import run_adapter_example

        request = self._requests.pop(i)
        spec = ModelSpec.from_json(request["spec"])
        reply = run_adapter_example(spec, frozenset(request["faults"]), request["init"], RankContext(0, 1, None),
                                    self.impl)
        return [self.corrupt(spec, reply) if self.corrupt else reply]


LIVE_TENSORS = '''
from harness.adapters import Adapter


class LiveTensors(Adapter):
    """The plain model, its evidence handed back as the live parameters and gradients."""

    name = "live_tensors"
    needs_process_group = False

    def wrap(self, model, wrap_paths, ctx):
        return model

    def full_params(self, model):
        return {n: p for n, p in model.named_parameters()}

    def full_grads(self, model):
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
'''


def test_an_adapter_that_hands_back_its_live_tensors_is_judged_on_each_steps_values(tmp_path):
    """A user's adapter may return its parameters themselves: the next step changes them in place,
    so every recorded step read as the last one and an honest run failed; the evidence is copied
    when it is taken (harness/run/rank.py evidence_copy), as the matrix worker always did."""
    (tmp_path / "live.py").write_text(LIVE_TENSORS)
    spec = ModelSpec.from_json(json.dumps({**json.loads(FROZEN.to_json()), "steps": 3}))
    result = run_example(InProcessAdapterPool(impl=f"{tmp_path / 'live.py'}:LiveTensors"), spec,
                         impl=f"{tmp_path / 'live.py'}:LiveTensors")
    assert result.ok, result.summary()
    assert result.checks["param"]["elements"] > 0


FROZEN = ModelSpec.from_json(json.dumps({
    "world_size": 1, "in_features": 2, "out_features": 1, "optimizer": {"kind": "adamw", "lr": 1e-3,
                                                                        "weight_decay": 0.01},
    "blocks": [{"width": 3, "frozen": True}, {"width": 2}], "steps": 2}))


def _zero_grad_for_frozen(spec, reply):
    """What torch FSDP1's summon_full_params(with_grads=True) hands the harness: a zero gradient
    for a frozen parameter that shares a flat parameter with trainable ones."""
    frozen = [n for n, p in as_case(spec).build_model().named_parameters() if not p.requires_grad]
    assert frozen
    for grads in reply["grads"]:
        grads.update({n: torch.zeros_like(reply["init"][n]) for n in frozen})
    return reply


def test_a_zero_gradient_reported_for_a_frozen_parameter_is_not_evidence_of_a_difference():
    result = run_example(InProcessAdapterPool(corrupt=_zero_grad_for_frozen), FROZEN, impl="single")
    assert result.ok, result.summary()


def _drop_a_trainable_gradient(spec, reply):
    name = next(iter(reply["grads"][0]))
    del reply["grads"][0][name]
    return reply


def test_a_trainable_gradient_left_out_is_a_lost_gradient_naming_the_parameter():
    result = run_example(InProcessAdapterPool(corrupt=_drop_a_trainable_gradient), FROZEN, impl="single")
    first = result.first_divergence
    assert not result.ok and result.error is None and first is not None, result
    assert (first.step, first.check, first.lost_gradient) == (1, "grad", True), first


def _reshape_a_trainable_gradient(spec, reply):
    name = next(iter(reply["grads"][0]))
    reply["grads"][0][name] = reply["grads"][0][name].reshape(-1, 1)
    return reply


def test_evidence_the_checks_cannot_read_is_an_error_result_not_a_traceback():
    result = run_example(InProcessAdapterPool(corrupt=_reshape_a_trainable_gradient), FROZEN, impl="single")
    assert not result.ok and result.error is not None and "the checks raised (no verdict)" in result.error, result


class InProcessReplicaPool(InProcessPool):
    """W = 2 replicas with no process group: the plain model (impl=single) trained in each "rank"
    on identical data, which is the averaged run (every rank's local gradient is the mean); the
    path of DDP and of every adapter that hands back full tensors."""

    def collect(self, i: int) -> list[dict]:
        from harness.fuzz.worker import run_adapter_example

        request = self._requests.pop(i)
        spec = ModelSpec.from_json(request["spec"])
        replies = [run_adapter_example(spec, frozenset(request["faults"]), request["init"], RankContext(r, 2, None),
                                       "single") for r in range(2)]
        return self.corrupt(spec, replies) if self.corrupt else replies


REPLICATED = ModelSpec.from_json(json.dumps({
    "world_size": 2, "in_features": 3, "out_features": 2, "optimizer": {"kind": "sgd", "lr": 0.05, "momentum": 0.9},
    "blocks": [{"width": 4}, {"width": 3}], "steps": 1, "data_mode": "identical"}))


def _rank1_digest_drifts(spec, replies):
    """Rank 1's parameters after the last step one ulp off rank 0's: no loss ever shows it, and
    the full tensors judged are rank 0's."""
    from harness.run.rank import replica_digests

    model = as_case(spec).build_model()
    last = replies[0]["data"][-1]
    name = next(iter(last))
    drifted = {**last, name: torch.nextafter(last[name], torch.full_like(last[name], torch.inf))}
    grads = {n: g for n, g in replies[0]["grads"][-1].items()}
    replies[1]["replicas"][-1] = replica_digests(drifted, grads, list(grads))
    assert set(last) == {n for n, _ in model.named_parameters()}
    return replies


def test_every_ranks_full_tensors_are_judged_not_only_rank_0s():
    """An adapter that hands back full tensors (DDP, FSDP1/2, a user's) is judged on rank 0's, and
    every other rank's must be the same bits (the replicas check, through digests): a rank whose
    parameters drift after the last step fails, naming the rank; the honest replicas pass with
    the replicas check counting every tensor of every rank."""
    honest = run_example(InProcessReplicaPool(), REPLICATED, impl="single")
    assert honest.ok, honest.summary()
    num_tensors = 2 * len(dict(as_case(REPLICATED).build_model().named_parameters()))  # params and grads
    assert honest.checks["replicas"]["elements"] == REPLICATED.steps * 2 * num_tensors
    drifted = run_example(InProcessReplicaPool(corrupt=_rank1_digest_drifts), REPLICATED, impl="single")
    first = drifted.first_divergence
    assert drifted.error is None and first is not None, drifted.summary()
    assert (first.check, first.step, first.rank) == ("replicas", 1, 1), first


def test_a_refused_example_is_never_a_pass():
    assert not ExampleResult(FROZEN, (), refused="fsdp2: 0-d parameter").ok


def test_deepspeed_refuses_a_0d_parameter_at_wrap_naming_it():
    """deepspeed.initialize views every parameter as bytes to broadcast it, which torch refuses for
    a 0-d tensor: a clear refusal at wrap (the fuzzer and mutants count the model as not run)."""
    from harness.adapters.deepspeed import DeepSpeed

    model = as_case(FROZEN).build_model()
    model.register_parameter("gain", torch.nn.Parameter(torch.tensor(1.0)))
    with pytest.raises(ValueError, match=r"0-d parameter\(s\) \['gain'\]: deepspeed.initialize cannot broadcast"):
        DeepSpeed().wrap(model, (), RankContext(0, 2, None))


def test_a_fuzz_run_whose_every_model_is_refused_judges_nothing_and_is_not_a_pass(monkeypatch):
    """Every example refused (an implementation that runs none of the drawn models): hypothesis
    gives up; the fuzzer returns with no example judged (main prints NOT RUN and returns False)."""
    class RefusingPool(InProcessPool):
        def collect(self, i: int) -> list[dict]:
            self._requests.pop(i)
            return [{"refused": "impl: refuses every model"}]

    class NoReference:  # the parent's replay is beside the point here (and costs a step per draw)
        def __init__(self, *args) -> None:
            pass

        def start(self) -> None:
            pass

    import harness.fuzz.check

    monkeypatch.setattr(harness.fuzz.check, "_Reference", NoReference)
    monkeypatch.setattr(harness.fuzz.check, "init_state", lambda spec: {})
    pool = RefusingPool()
    stats = fuzz(pool, world_size=1, max_examples=5, seed=0)
    assert stats.num_examples == 0 and not stats.failures
    assert stats.refusals == {"impl: refuses every model": pool.num_requests} and pool.num_requests > 0


def test_the_fuzzer_draws_no_0d_parameter_for_an_implementation_that_refuses_them():
    """torch FSDP2 refuses 0-d parameters at wrap: drawn for it, such models were most of what it
    drew (32 refused for 6 run at W = 2); now it draws none, and ours still draws them."""
    from harness.fuzz.strategies import specs_for

    def has_gain(spec):
        return any(p.dim() == 0 for p in build_model(spec).parameters())

    assert find(specs_for(2, "ours"), has_gain, settings=NO_SHRINK)
    with pytest.raises(hypothesis.errors.NoSuchExample):
        find(specs_for(2, "fsdp2"), has_gain, settings=NO_SHRINK)


class SideBySidePool(InProcessPool):
    """InProcessPool with the `size` of a pool group: the fuzzer keeps two examples in flight."""

    size = 2


def _sequential_order(world_size: int, max_examples: int, seed: int, pool=None) -> list[ModelSpec]:
    """The examples hypothesis hands the property one at a time (the fuzzer before examples ran
    side by side), each judged through `pool` when one is given (none: every example passes)."""
    from hypothesis import seed as hypothesis_seed

    from harness.fuzz.search import _fuzz_settings
    from harness.fuzz.strategies import specs_for

    seen = []

    @hypothesis_seed(seed)
    @_fuzz_settings(max_examples, (Phase.generate, Phase.shrink))
    @given(specs_for(world_size, "ours"))
    def prop(spec):
        seen.append(spec)
        assert pool is None or run_example(pool, spec).ok

    try:
        prop()
    except AssertionError:
        pass
    return seen


def test_examples_judged_side_by_side_are_those_hypothesis_hands_over_in_its_order():
    judged = []
    stats = fuzz(SideBySidePool(), world_size=1, max_examples=12, seed=5,
                 on_example=lambda _, result: judged.append(result.spec))
    assert not stats.failures and stats.num_examples == 12
    assert judged == _sequential_order(1, 12, 5)


def test_a_failure_found_side_by_side_shrinks_to_the_model_one_at_a_time_finds():
    one = fuzz(InProcessPool(corrupt=_drop_grad_of_odd_units), world_size=1, max_examples=30, seed=3)
    two = fuzz(SideBySidePool(corrupt=_drop_grad_of_odd_units), world_size=1, max_examples=30, seed=3)
    assert one.failures and two.failures
    assert two.failures[-1].spec == one.failures[-1].spec
    # Each example hypothesis hands over is counted once, as one at a time: the ones judged ahead
    # are not counted again when hypothesis hands them back, the one in flight beside the failing
    # one not at all.
    expected = len(_sequential_order(1, 30, 3, InProcessPool(corrupt=_drop_grad_of_odd_units)))
    assert one.num_examples == two.num_examples == expected
    assert [r.spec for r in two.failures] == [r.spec for r in one.failures]


def test_specs_draw_fan_outs_and_draw_unused_parameters_only_when_asked():
    """A fan-out block's h feeds q, k, v and a residual; its gradient is one accumulation over the
    four. A parameter the forward never reads is drawn only with unused_params (off until the
    harness and impl judge parameters without gradients, issue 30)."""
    fan_out = find(model_specs(2), lambda s: any(b.fan_out for b in s.blocks), settings=NO_SHRINK)
    names = {n for n, _ in build_model(fan_out).named_parameters()}
    assert {f"blocks.{i}.{m}.weight" for i, b in enumerate(fan_out.blocks) if b.fan_out for m in "qkv"} <= names
    with pytest.raises(hypothesis.errors.NoSuchExample):
        find(model_specs(2), lambda s: any(b.unused for b in s.blocks), settings=NO_SHRINK)
    unused = find(model_specs(2, unused_params=True), lambda s: any(b.unused for b in s.blocks), settings=NO_SHRINK)
    model = build_model(unused)
    model(torch.randn(unused.global_batch, unused.in_features)).sum().backward()
    without = {n for n, p in model.named_parameters() if p.grad is None}
    assert {f"blocks.{i}.unused" for i, b in enumerate(unused.blocks) if b.unused} <= without


def test_specs_without_the_later_block_options_serialise_as_before():
    """fan_out and unused came after the corpus and the pinned counterexamples: off, they stay out
    of the JSON, so those specs keep their text (replay commands, judged-ahead keys)."""
    for filename in ("fuzz_w1_accumulation_bound.json", "fuzz_w1_misaligned_views.json"):
        for spec in _pinned(filename):
            text = spec.to_json()
            assert '"fan_out"' not in text and '"unused"' not in text
            assert ModelSpec.from_json(text) == spec
    on = ModelSpec.from_json(_pinned("fuzz_w1_accumulation_bound.json")[0].to_json().replace(
        '"frozen":', '"fan_out":true,"unused":true,"frozen":', 1))
    assert on.blocks[0].fan_out and on.blocks[0].unused and ModelSpec.from_json(on.to_json()) == on
