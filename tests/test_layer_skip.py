"""Layer-skip self-speculation: the target's first E layers + final norm + lm_head draft, sharing
the target's KV. Lossless under greedy in every setting; E = L accepts every draft."""
import pytest

from specinfer import Generator, SamplingParams
from spec_cases import check_greedy_exact, check_prefix_hits, prompts, reference


@pytest.fixture(scope="module")
def target(tiny_dir):
    return tiny_dir("llama", False, layers=3)[0]


@pytest.fixture(scope="module")
def ref(target):
    return reference(target)


@pytest.mark.parametrize("scorer,k", [pytest.param("mqa", 4, marks=pytest.mark.slow), ("batch_expansion", 2)])
def test_layer_skip_greedy_is_exact(target, ref, scorer, k):
    spec = {"method": "layer_skip", "exit_layer": 2, "num_speculative_tokens": k, "scorer": scorer}
    tot = check_greedy_exact(target, spec, ref)
    assert 0 < tot["num_accepted_tokens"] < tot["num_draft_tokens"], tot


def test_layer_skip_prefix_hits(target, ref):
    check_prefix_hits(target, {"method": "layer_skip", "exit_layer": 1, "num_speculative_tokens": 3}, ref)


@pytest.mark.parametrize("scorer", ["mqa", "batch_expansion"])
def test_exit_at_the_last_layer_accepts_everything(target, scorer):
    k = 4
    params = SamplingParams(max_tokens=1 + 6 * (k + 1), temperature=0.0, ignore_eos=True)
    gen = Generator(str(target), speculative={"method": "layer_skip", "exit_layer": 3, "num_speculative_tokens": k,
                                              "scorer": scorer})
    outs = gen.generate(prompts(4), params, use_tqdm=False)
    m = gen.spec_metrics()
    assert m["acceptance_rate"] == 1.0 and m["mean_acceptance_length"] == k + 1
    assert all(o.num_accepted_tokens == o.num_draft_tokens == 6 * k for o in outs)


def test_layer_skip_sampling_runs(target):
    gen = Generator(str(target), speculative={"method": "layer_skip", "exit_layer": 3, "num_speculative_tokens": 3})
    outs = gen.generate(prompts(3), SamplingParams(max_tokens=12, temperature=0.05, seed=5), use_tqdm=False)
    assert all(len(o.token_ids) == 12 or o.finish_reason == "stop" for o in outs)
    # the draft is the argmax of p itself (q one-hot): accepted with probability p(argmax) < 1
    assert 0 < gen.spec_metrics()["acceptance_rate"] < 1


@pytest.mark.parametrize("bad,match", [
    ({"method": "layer_skip"}, "exit_layer"),
    ({"method": "layer_skip", "exit_layer": 0}, "exit_layer"),
    ({"method": "layer_skip", "exit_layer": 4}, "exit_layer"),
    ({"method": "layer_skip", "exit_layer": True}, "exit_layer"),
    ({"method": "ngram", "exit_layer": 1}, "exit_layer"),
    ({"method": "layer_skip", "exit_layer": 1, "model": "x"}, "model"),
])
def test_bad_layer_skip_config_is_refused(target, bad, match):
    with pytest.raises(ValueError, match=match):
        Generator(str(target), speculative=bad)


@pytest.mark.slow  # subprocess start-up; the flags map onto SpeculativeConfig fields tested above
def test_cli_layer_skip_and_head_flags(target):
    import subprocess
    import sys

    def run(*args):
        return subprocess.run([sys.executable, "-m", "specinfer", "generate", str(target), *map(str, args)],
                              capture_output=True, text=True, timeout=120)

    proc = run("--prompt", "t1 t2 t3", "--method", "layer_skip", "--exit-layer", 3, "-k", 3, "--max-tokens", 9,
               "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    assert "acceptance rate: 1.000" in proc.stderr and "(layer_skip, k=3)" in proc.stderr
    bad = run("--prompt", "t1", "--method", "medusa")
    assert bad.returncode != 0 and "--head" in bad.stderr
