"""Every rule of the speculative-config table (vLLM's, as the seed document gives it), and the errors listed under it."""
import pytest

from engine.config import EngineConfig, SamplingParams, SpeculativeConfig, check_model_pair

DRAFT = "random:tiny-llama:1"


def spec(**kw):
    return SpeculativeConfig.model_validate({"model": DRAFT, "num_speculative_tokens": 3, **kw})


def test_defaults_and_inferred_method():
    s = spec()
    assert s.method == "draft_model"
    assert s.rejection_sample_method == "standard"
    assert s.draft_sample_method == "greedy"
    assert s.use_heterogeneous_vocab is False and s.parallel_drafting is False


@pytest.mark.parametrize("k", [0, -1])
def test_num_speculative_tokens_positive(k):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        spec(num_speculative_tokens=k)


def test_num_speculative_tokens_required():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.model_validate({"model": DRAFT})


def test_model_required_for_draft_model():
    with pytest.raises(ValueError, match="'model' is required"):
        SpeculativeConfig.model_validate({"method": "draft_model", "num_speculative_tokens": 2})


def test_ngram_not_yet():
    with pytest.raises(ValueError, match="ngram"):
        SpeculativeConfig.model_validate({"method": "ngram", "num_speculative_tokens": 2})


def test_tensor_parallel_size_points_to_draft_tp():
    with pytest.raises(ValueError, match="draft_tensor_parallel_size"):
        spec(tensor_parallel_size=2)


@pytest.mark.parametrize("key", ["temperature", "top_p"])
def test_sampling_keys_refused(key):
    with pytest.raises(ValueError, match=f"'{key}' is a sampling parameter, not speculative config"):
        spec(**{key: 0.5})


@pytest.mark.parametrize("key", ["target_model_config", "draft_model_config", "target_parallel_config",
                                 "draft_parallel_config", "draft_load_config"])
def test_internal_fields_refused(key):
    with pytest.raises(ValueError, match=f"'{key}' is an internal field"):
        spec(**{key: {}})


def test_unknown_key():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['num_tokens'\]"):
        spec(num_tokens=3)


def test_draft_tp_one_or_target_tp():
    assert EngineConfig(model="m", tensor_parallel_size=2,
                        speculative_config=spec(draft_tensor_parallel_size=1)).draft_tensor_parallel_size == 1
    assert EngineConfig(model="m", tensor_parallel_size=2,
                        speculative_config=spec()).draft_tensor_parallel_size == 2  # inherited
    with pytest.raises(ValueError, match="draft_tensor_parallel_size"):
        EngineConfig(model="m", tensor_parallel_size=2, speculative_config=spec(draft_tensor_parallel_size=3))
    with pytest.raises(ValueError, match="draft_tensor_parallel_size"):
        spec(draft_tensor_parallel_size=0)


def test_max_model_len_bounds():
    with pytest.raises(ValueError, match="max_model_len"):
        spec(max_model_len=0)
    check_model_pair(spec(max_model_len=100), 48, 48, 4096, 2048)
    with pytest.raises(ValueError, match="'max_model_len' \\(3000\\) is above"):
        check_model_pair(spec(max_model_len=3000), 48, 48, 4096, 2048)


def test_parallel_drafting_is_a_config_key():
    """Accepted here; whether the draft can do it (a mask token) is checked with the draft's config
    (tests/test_parallel_drafting.py)."""
    assert spec(parallel_drafting=True).parallel_drafting is True


def test_rejection_sample_method_values():
    for m in ("standard", "block"):
        assert spec(rejection_sample_method=m).rejection_sample_method == m
    with pytest.raises(ValueError, match="rejection_sample_method"):
        spec(rejection_sample_method="fancy")


def test_synthetic_rates_rules():
    s = spec(rejection_sample_method="synthetic", synthetic_acceptance_rates=[0.9, 0.8, 0.8])
    assert s.synthetic_rates() == [0.9, 0.8, 0.8]
    with pytest.raises(ValueError, match="num_speculative_tokens=3 entries"):
        spec(rejection_sample_method="synthetic", synthetic_acceptance_rates=[0.9, 0.8])
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        spec(rejection_sample_method="synthetic", synthetic_acceptance_rates=[1.2, 0.8, 0.1])
    with pytest.raises(ValueError, match="non-increasing"):
        spec(rejection_sample_method="synthetic", synthetic_acceptance_rates=[0.5, 0.8, 0.1])
    with pytest.raises(ValueError, match="only valid with rejection_sample_method 'synthetic'"):
        spec(synthetic_acceptance_rates=[0.9, 0.8, 0.7])


def test_synthetic_length_rules():
    # vLLM's minimum-variance schedule, unconditional rates: mean length = 1 + sum(rates)
    for length, k, rates in [(2.6, 3, [1.0, 0.6, 0.0]), (3.5, 4, [1.0, 1.0, 0.5, 0.0]), (1.0, 3, [0.0] * 3),
                             (4.0, 3, [1.0] * 3), (2.5, 3, [1.0, 0.5, 0.0])]:
        s = spec(num_speculative_tokens=k, rejection_sample_method="synthetic", synthetic_acceptance_length=length)
        assert s.synthetic_rates() == pytest.approx(rates) and 1 + sum(s.synthetic_rates()) == pytest.approx(length)
    with pytest.raises(ValueError, match=r"\[1, 4\]"):
        spec(rejection_sample_method="synthetic", synthetic_acceptance_length=4.5)
    with pytest.raises(ValueError, match="mutually exclusive"):
        spec(rejection_sample_method="synthetic", synthetic_acceptance_length=2.0,
             synthetic_acceptance_rates=[0.5, 0.5, 0.5])
    with pytest.raises(ValueError, match="only valid with rejection_sample_method 'synthetic'"):
        spec(synthetic_acceptance_length=2.0)
    with pytest.raises(ValueError, match="needs 'synthetic_acceptance_rates' or 'synthetic_acceptance_length'"):
        spec(rejection_sample_method="synthetic")


def test_heterogeneous_vocab_and_vocab_size_rule():
    assert spec(use_heterogeneous_vocab=True).use_heterogeneous_vocab
    with pytest.raises(ValueError, match="Target and draft model should have the same vocabulary size"):
        check_model_pair(spec(), 262144, 49152, 4096, 4096)
    check_model_pair(spec(use_heterogeneous_vocab=True), 262144, 49152, 4096, 4096)


def test_draft_sample_method_values():
    assert spec(draft_sample_method="probabilistic").draft_sample_method == "probabilistic"
    with pytest.raises(ValueError, match="draft_sample_method"):
        spec(draft_sample_method="beam")


def test_engine_config_wraps_spec_errors():
    with pytest.raises(ValueError, match="speculative_config: 'temperature'"):
        EngineConfig(model="m", speculative_config={"model": DRAFT, "num_speculative_tokens": 2, "temperature": 1})


@pytest.mark.parametrize("kw, key", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"top_k": 0}, "top_k"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"stop": [""]}, "stop"),
])
def test_sampling_params_errors(kw, key):
    with pytest.raises(ValueError, match=key):
        SamplingParams(**kw)


def test_sampling_params_defaults():
    p = SamplingParams(stop="###")
    assert p.stop == ["###"] and p.temperature == 1.0 and p.top_k == -1 and not p.greedy
    assert SamplingParams(temperature=0).greedy


def test_cpu_knobs_are_engine_keys_the_environment_fills_and_the_config_overrides(monkeypatch):
    from deployments.app import parse_args
    from deployments.cli import serve_args_from_cli

    plain = EngineConfig(model="m")
    assert (plain.cpu_kernels, plain.rank_threads, plain.placement_timeout_s, plain.omp_spin_count) == (True, None, 120.0, 30000)
    for var, value in (("TANDEM_SKINNY_KERNEL", "0"), ("TANDEM_RANK_THREADS", "3"),
                       ("TANDEM_PLACEMENT_TIMEOUT_S", "7.5"), ("TANDEM_GOMP_SPINCOUNT", "0")):
        monkeypatch.setenv(var, value)
    from_env = EngineConfig(model="m")
    assert (from_env.cpu_kernels, from_env.rank_threads, from_env.placement_timeout_s, from_env.omp_spin_count) == (False, 3, 7.5, 0)
    given = EngineConfig(model="m", cpu_kernels=True, rank_threads=1)  # the config wins
    assert given.cpu_kernels is True and given.rank_threads == 1 and given.placement_timeout_s == 7.5
    cli = serve_args_from_cli(["m", "--no-cpu-kernels", "--rank-threads", "2", "--placement-timeout-s", "30",
                               "--omp-spin-count", "1000"])["args"]
    config = parse_args(cli).engine_config()
    assert (config.cpu_kernels, config.rank_threads, config.placement_timeout_s, config.omp_spin_count) == (False, 2, 30.0, 1000)
    monkeypatch.setenv("TANDEM_RANK_THREADS", "zero")
    with pytest.raises(ValueError, match="rank_threads"):
        EngineConfig(model="m")
    with pytest.raises(ValueError, match="placement_timeout_s"):
        EngineConfig(model="m", rank_threads=1, placement_timeout_s=-1)
