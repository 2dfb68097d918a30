"""The bench runner's peers: config of per-method precision and llama.cpp methods, the "peers"
preset, interleaving order, llama.cpp recorded as unavailable when llama_cpp is missing (never
faked), GGUF resolution, greedy agreement, and llama.cpp's batched decoding loop against its
batch-1 path on a fake llama_cpp module (the real one is optional and slow to build)."""
from __future__ import annotations

import sys
import types

import pytest

from specinfer.bench.agreement import common_prefix, compare, greedy_agreement
from specinfer.bench.config import GGUF_TYPES, BenchConfig, load_config
from specinfer.bench.peers import PeerUnavailable


def _cfg(methods, **kw):
    d = {"name": "t", "model": "m", "methods": methods}
    d.update(kw)
    return BenchConfig.from_dict(d)


# ---------------------------------------------------------------- config
def test_peers_preset_holds_every_peer_interleaved_at_batch_1_and_16():
    cfg = load_config("peers")
    engines = {m.name: (m.engine, m.dtype, m.quantization, m.gguf_type) for m in cfg.methods}
    assert engines == {
        "specinfer-fp32": ("specinfer", None, None, None),
        "specinfer-bf16": ("specinfer", "bfloat16", None, None),
        "specinfer-int8": ("specinfer", None, "int8", None),
        "hf-fp32": ("hf", None, None, None),
        "vllm-fp32": ("vllm", None, None, None),
        "llama.cpp-f32": ("llama_cpp", None, None, "f32"),
        "llama.cpp-q8_0": ("llama_cpp", None, None, "q8_0"),
    }
    assert cfg.baseline.name == "specinfer-fp32" and cfg.dtype == "float32"
    assert cfg.batch_sizes == (1, 16) and cfg.threads == 1 and cfg.temperature == 0.0 and cfg.repeats >= 3
    assert cfg.method_dtype(cfg.methods[1]) == "bfloat16" and cfg.method_dtype(cfg.methods[0]) == "float32"


@pytest.mark.parametrize("method,field", [
    ({"name": "x", "engine": "hf", "quantization": "int8"}, "quantization"),
    ({"name": "x", "quantization": "int4"}, "quantization"),
    ({"name": "x", "gguf_type": "f32"}, "gguf_type"),
    ({"name": "x", "engine": "llama_cpp", "gguf_type": "q4_k"}, "gguf_type"),
    ({"name": "x", "engine": "llama_cpp", "dtype": "bfloat16"}, "dtype"),
    ({"name": "x", "engine": "llama_cpp", "speculative": {"method": "ngram"}}, "speculative"),
    ({"name": "x", "dtype": "float8"}, "dtype"),
    ({"name": "x", "engine": "llamacpp"}, "engine"),
])
def test_bad_peer_options_are_refused_with_the_field_named(method, field):
    with pytest.raises(ValueError, match=field):
        _cfg([{"name": "base"}, method])


def test_every_gguf_type_is_accepted_and_lower_precision_is_never_the_baseline():
    methods = [{"name": "bf16", "dtype": "bfloat16"}, {"name": "int8", "quantization": "int8"}]
    methods += [{"name": t, "engine": "llama_cpp", "gguf_type": t} for t in GGUF_TYPES]
    with pytest.raises(ValueError, match="baseline"):
        _cfg(methods)
    cfg = _cfg(methods + [{"name": "fp32"}])
    assert cfg.baseline.name == "fp32"
    # the config's own dtype named on a method is still plain decoding at that dtype
    assert _cfg([{"name": "b", "dtype": "bfloat16"}], dtype="bfloat16").baseline.name == "b"
    assert BenchConfig.from_dict(cfg.to_dict()) == cfg


def test_llama_cpp_convert_is_a_config_key():
    cfg = _cfg([{"name": "base"}], llama_cpp_convert="/x/convert_hf_to_gguf.py")
    assert cfg.llama_cpp_convert == "/x/convert_hf_to_gguf.py"


# ---------------------------------------------------------------- interleaving
def test_interleaved_schedule_runs_every_method_before_the_next_repeat():
    from specinfer.bench.runner import interleaved_schedule

    cfg = _cfg([{"name": "a"}, {"name": "b", "engine": "hf"}, {"name": "c", "engine": "llama_cpp"}],
               repeats=2, batch_sizes=[1, 4], tasks=["qa", "chat"])
    order = [(r, b, t, m.name) for r, b, t, m in interleaved_schedule(cfg)]
    assert len(order) == 2 * 2 * 2 * 3
    expected = [(r, b, t, m) for r in (0, 1) for b in (1, 4) for t in ("qa", "chat") for m in "abc"]
    assert order == expected


# ---------------------------------------------------------------- unavailable, never faked
@pytest.fixture
def no_llama_cpp(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ImportError


def test_llama_cpp_missing_is_unavailable_before_any_file_is_made(no_llama_cpp, monkeypatch, tmp_path):
    from specinfer.bench.peers import gguf_files
    from specinfer.bench.engines import make_engine

    monkeypatch.setattr(gguf_files, "cache_dir", lambda: tmp_path)
    cfg = _cfg([{"name": "base"}, {"name": "q8", "engine": "llama_cpp", "gguf_type": "q8_0"}])
    with pytest.raises(PeerUnavailable, match="llama_cpp is not importable"):
        make_engine(cfg, cfg.methods[1], max_prompt_len=8, eos_token_ids=(0,))
    assert not list(tmp_path.iterdir())


def test_gguf_resolution(monkeypatch, tmp_path, no_llama_cpp):
    from specinfer.bench.peers import gguf_files

    monkeypatch.setattr(gguf_files, "cache_dir", lambda: tmp_path / "cache")
    monkeypatch.delenv(gguf_files.CONVERT_ENV, raising=False)
    pack = tmp_path / "model.Q4_1.gguf"
    pack.write_bytes(b"GGUF")
    assert gguf_files.resolve_gguf(str(pack), "pack") == str(pack)
    assert gguf_files.gguf_path(str(pack), "q8_0") == tmp_path / "cache" / "model.Q4_1.q8_0.gguf"
    with pytest.raises(PeerUnavailable, match=gguf_files.CONVERT_ENV):  # no converter named
        gguf_files.resolve_gguf(str(pack), "f32")
    with pytest.raises(PeerUnavailable, match="is not a file"):
        gguf_files.resolve_gguf(str(pack), "f16", convert_script=str(tmp_path / "missing.py"))
    with pytest.raises(PeerUnavailable, match="not importable"):  # q8_0 needs llama.cpp's quantizer
        (tmp_path / "cache").mkdir()
        (tmp_path / "cache" / "model.Q4_1.f32.gguf").write_bytes(b"GGUF")
        gguf_files.resolve_gguf(str(pack), "q8_0")
    # a file made before is used as it is
    assert gguf_files.resolve_gguf(str(pack), "f32") == str(tmp_path / "cache" / "model.Q4_1.f32.gguf")
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    with pytest.raises(PeerUnavailable, match="needs a .gguf"):
        gguf_files.resolve_gguf(str(hf_dir), "pack")


# ---------------------------------------------------------------- greedy agreement
def test_agreement_counts_identical_sequences_and_first_divergence():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([1], [1, 2]) == 1
    a = compare([[1, 2, 3], [4, 5, 6], [7, 8]], [[1, 2, 3], [4, 9, 6], [7]])
    assert a["identical"] == 1 and a["sequences"] == 3 and a["first_divergence"] == 1
    assert a["mean_common_prefix"] == pytest.approx((3 + 1 + 1) / 3)
    assert compare([[1]], [[1]])["first_divergence"] is None
    with pytest.raises(ValueError):
        compare([[1]], [[1], [2]])


def test_greedy_agreement_rows_pair_methods_with_the_baseline():
    cfg = _cfg([{"name": "base"}, {"name": "other", "engine": "llama_cpp"}], batch_sizes=[1, 2], tasks=["qa"])
    runs = [dict(method="base", batch_size=1, task="qa", repeat=0, token_ids=[[1, 2], [3]]),
            dict(method="other", batch_size=1, task="qa", repeat=0, token_ids=[[1, 2], [4]]),
            dict(method="base", batch_size=2, task="qa", repeat=0, token_ids=[[1, 2], [1, 2]]),
            dict(method="other", batch_size=2, task="qa", repeat=0, error="unavailable")]
    rows = greedy_agreement(cfg, runs)
    assert [(r["method"], r["batch_size"], r["identical"]) for r in rows] == [("base", 1, 2), ("base", 2, 2),
                                                                            ("other", 1, 1)]
    assert greedy_agreement(_cfg(cfg.to_dict()["methods"], temperature=0.7), runs) == []


# ---------------------------------------------------------------- end to end, tiny model
def test_runner_records_llama_cpp_unavailable_and_agreement(tiny_dir, tmp_path, no_llama_cpp):
    import json

    from specinfer.bench.runner import run_benchmark
    from specinfer.bench.table import format_agreement, format_table

    model_dir, _ = tiny_dir("llama", scale=4.0)
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "chat.jsonl").write_text("".join(
        json.dumps({"task": "chat", "id": f"c{i}", "prompt": " ".join(f"t{i * 7 + j}" for j in range(5 + 3 * i))})
        + "\n"
        for i in range(2)))
    cfg = {"name": "tiny-peers", "model": str(model_dir), "tasks": ["chat"], "num_prompts": 2, "batch_sizes": [1, 2],
           "max_tokens": 4, "repeats": 2, "ignore_eos": True, "prompt_dir": str(prompts), "plots": False,
           "methods": [{"name": "fp32"}, {"name": "bf16", "dtype": "bfloat16"},
                       {"name": "llama.cpp-f32", "engine": "llama_cpp", "gguf_type": "f32"},
                       {"name": "fp32-again"}]}
    results = run_benchmark(cfg, tmp_path / "out", log=lambda *_: None)
    assert "not importable" in results["unavailable"]["llama.cpp-f32"]
    runs = results["runs"]
    assert [r["method"] for r in runs if r["repeat"] == 1 and r["batch_size"] == 2] == ["fp32", "bf16", "fp32-again"]
    assert all(("token_ids" in r) == (r["repeat"] == 0) for r in runs)
    assert all(len(ids) == 4 for r in runs if r["repeat"] == 0 for ids in r["token_ids"])
    agree = {(a["method"], a["batch_size"]): a for a in results["agreement"]}
    # the same fp32 engine twice: token for token the same; llama.cpp has no row (it did not run)
    assert agree[("fp32-again", 1)]["identical"] == agree[("fp32-again", 2)]["identical"] == 2
    assert not any(m == "llama.cpp-f32" for m, _ in agree)
    assert agree[("bf16", 1)]["sequences"] == 2
    assert "llama.cpp-f32" in format_table(results) and "fp32-again" in format_agreement(results)


# ---------------------------------------------------------------- llama.cpp's loops on a fake llama_cpp
V = 97  # the fake model's vocabulary


def _next_token(history):
    """The fake model: a deterministic function of the whole sequence (token and position), so a
    wrong position, a token fed twice or a KV left over from another prompt changes the output."""
    return sum((pos + 1) * tok for pos, tok in enumerate(history)) % V


class _FakeLlama:
    def __init__(self, model_path, **kw):
        self.context_params = _Params(**kw)
        self._model = types.SimpleNamespace(model=object())
        self.history = []

    def reset(self):
        self.history = []

    def generate(self, tokens, **kw):
        assert kw["temp"] == 0.0 and kw["reset"] is False
        self.history = self.history + list(tokens)  # reset() was called: nothing kept from before
        while True:
            tok = _next_token(self.history)
            self.history.append(tok)
            yield tok

    def close(self):
        pass


class _Params:
    def __init__(self, **kw):
        self.n_seq_max, self.kv_unified, self.n_ctx, self.n_batch, self.n_ubatch = 1, True, kw.get("n_ctx"), 0, 0

    @classmethod
    def from_buffer_copy(cls, other):
        return cls(n_ctx=other.n_ctx)


def _fake_llama_cpp(calls):
    lc = types.ModuleType("llama_cpp")
    lc.Llama = _FakeLlama

    class Ctx:
        def __init__(self, params):
            self.params, self.kv, self.out = params, {}, {}

    def llama_init_from_model(model, params):
        assert params.n_seq_max >= 2 and params.kv_unified is False
        return Ctx(params)

    def llama_batch_init(n, embd, n_seq_max):
        return types.SimpleNamespace(n_tokens=0, token=[0] * n, pos=[0] * n, n_seq_id=[0] * n,
                                     seq_id=[[0] for _ in range(n)], logits=[0] * n, cap=n)

    def llama_decode(ctx, batch):
        assert batch.n_tokens <= batch.cap
        calls.append(batch.n_tokens)
        ctx.out = {}
        for i in range(batch.n_tokens):
            seq = ctx.kv.setdefault(batch.seq_id[i][0], {})
            assert batch.pos[i] == len(seq), "positions must be contiguous per sequence"
            seq[batch.pos[i]] = batch.token[i]
            if batch.logits[i]:
                ctx.out[i] = _next_token([seq[p] for p in range(len(seq))])
        return 0

    lc.llama_init_from_model = llama_init_from_model
    lc.llama_batch_init = llama_batch_init
    lc.llama_decode = llama_decode
    lc.llama_get_memory = lambda ctx: ctx
    lc.llama_memory_clear = lambda mem, data: mem.kv.clear()
    lc.llama_sampler_init_greedy = lambda: "greedy"
    lc.llama_sampler_sample = lambda smpl, ctx, i: ctx.out[i]
    lc.llama_sampler_free = lc.llama_batch_free = lc.llama_free = lambda *a: None
    return lc


def test_llama_cpp_batched_decoding_equals_its_batch_1_path(monkeypatch, tmp_path):
    from specinfer.bench.peers import llama_cpp as llama_cpp_engine

    calls = []
    monkeypatch.setitem(sys.modules, "llama_cpp", _fake_llama_cpp(calls))
    monkeypatch.setattr(llama_cpp_engine, "N_BATCH", 8)  # prefill spans several llama_decode calls
    pack = tmp_path / "m.gguf"
    pack.write_bytes(b"GGUF")
    eos = 5
    cfg = _cfg([{"name": "base"}, {"name": "l", "engine": "llama_cpp", "model": str(pack)}], model=str(pack),
               batch_sizes=[1, 3], max_tokens=6)
    eng = llama_cpp_engine.LlamaCppEngine(cfg, cfg.methods[1], (eos,), max_model_len=32)
    prompts = [[3, 1, 4, 1, 5, 9, 2], [6, 5, 3], [5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6]]
    singles = []
    for p in prompts:
        n, _ = eng.run([p], cfg)
        singles.append(eng.last_token_ids[0])
        assert n == len(singles[-1])
    for _ in range(2):  # twice: the KV of the first call must not leak into the second
        n, metrics = eng.run(prompts, cfg)
        assert eng.last_token_ids == singles and n == sum(map(len, singles)) and metrics is None
    assert max(calls) <= 8 and sum(calls) >= sum(map(len, prompts))
    # EOS stops a sequence (and is counted) unless ignore_eos; the others run on
    assert eos not in [t for ids in singles for t in ids]
    eng.eos = {singles[1][2]}
    eng.run(prompts, cfg)
    stopped = eng.last_token_ids
    assert stopped[1] == singles[1][:3] and stopped[0] == singles[0][:len(stopped[0])]
    assert eng.run([prompts[1]], cfg)[0] == 3
    forced = _cfg(cfg.to_dict()["methods"], model=str(pack), batch_sizes=[1, 3], max_tokens=6, ignore_eos=True)
    eng.run(prompts, forced)
    assert eng.last_token_ids == singles
    with pytest.raises(PeerUnavailable, match="greedy"):
        eng.run(prompts, _cfg(cfg.to_dict()["methods"], model=str(pack), temperature=0.5))
    eng.close()


def test_llama_cpp_extra_buffers_off_patches_the_model_params_only_while_loading(monkeypatch, tmp_path):
    from specinfer.bench.peers import llama_cpp as llama_cpp_engine

    lib = types.ModuleType("llama_cpp.llama_cpp")
    lib.llama_model_default_params = lambda: types.SimpleNamespace(use_extra_bufts=True)
    seen = []

    class Recording(_FakeLlama):
        def __init__(self, model_path, **kw):
            super().__init__(model_path, **kw)
            seen.append(sys.modules["llama_cpp.llama_cpp"].llama_model_default_params().use_extra_bufts)

    fake = _fake_llama_cpp([])
    fake.Llama = Recording
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_cpp", lib)
    pack = tmp_path / "m.gguf"
    pack.write_bytes(b"GGUF")
    methods = [{"name": "base"}, {"name": "l", "engine": "llama_cpp", "model": str(pack)}]
    for flag in (True, False):
        cfg = _cfg(methods, model=str(pack), llama_cpp_extra_buffers=flag)
        llama_cpp_engine.LlamaCppEngine(cfg, cfg.methods[1], (0,), max_model_len=16).close()
    assert seen == [True, False]
    assert lib.llama_model_default_params().use_extra_bufts is True  # restored after loading


# ---------------------------------------------------------------- GGUF as stored vs llama.cpp on the same files
@pytest.mark.parametrize("method,batch_sizes,field", [
    ({"name": "x", "engine": "llama_cpp", "mode": "assisted"}, [1], "mode"),
    ({"name": "x", "engine": "llama_cpp", "mode": "draft_model"}, [1], "needs draft_model"),
    ({"name": "x", "engine": "llama_cpp", "mode": "prompt_lookup", "draft_model": "d"}, [1], "draft_model"),
    ({"name": "x", "engine": "llama_cpp", "draft_model": "d"}, [1], "draft_model"),
    ({"name": "x", "engine": "llama_cpp", "mode": "prompt_lookup", "num_speculative_tokens": 0}, [1],
     "num_speculative_tokens"),
    ({"name": "x", "engine": "llama_cpp", "mode": "prompt_lookup"}, [1, 16], "'x'.*'prompt_lookup'.*batch 1"),
    ({"name": "x", "engine": "llama_cpp", "mode": "draft_model", "draft_model": "d"}, [16],
     "'x'.*'draft_model'.*batch 1"),
    ({"name": "x", "engine": "llama_cpp", "quantization": "gguf"}, [1], "quantization"),
])
def test_llama_cpp_modes_are_validated_by_name(method, batch_sizes, field):
    with pytest.raises(ValueError, match=field):
        _cfg([{"name": "base"}, method], batch_sizes=batch_sizes)


def test_gguf_quantization_and_llama_cpp_modes_are_accepted():
    cfg = _cfg([{"name": "gguf", "quantization": "gguf", "role": "baseline"},
                {"name": "plain", "engine": "llama_cpp", "gguf_type": "pack"},
                {"name": "lookup", "engine": "llama_cpp", "mode": "prompt_lookup", "num_speculative_tokens": 8},
                {"name": "draft", "engine": "llama_cpp", "mode": "draft_model", "draft_model": "qwen2.5-coder-0.5b"}],
               llama_cpp_bin="/opt/llama.cpp/bin")
    assert cfg.baseline.name == "gguf" and cfg.methods[0].quantization == "gguf"
    assert [m.k for m in cfg.methods] == [None, None, 8, 4]
    assert cfg.llama_cpp_bin == "/opt/llama.cpp/bin"
    assert BenchConfig.from_dict(cfg.to_dict()) == cfg
    # plain llama.cpp still runs at any batch size
    assert _cfg(cfg.to_dict()["methods"][:2], batch_sizes=[1, 16]).batch_sizes == (1, 16)


def test_gguf_llamacpp_configs():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "benches" / "configs"
    cfgs = {p.stem: load_config(p) for p in sorted(root.glob("gguf-llamacpp-*.json"))}
    assert set(cfgs) == {"gguf-llamacpp-smollm2", "gguf-llamacpp-qwen", "gguf-llamacpp-batch16"}
    for name, cfg in cfgs.items():
        assert cfg.baseline.name == "specinfer-gguf" and cfg.baseline.quantization == "gguf"
        assert cfg.max_tokens == 64 and cfg.ignore_eos and cfg.threads == 1 and cfg.temperature == 0.0
        assert all(m.quantization == "gguf" for m in cfg.methods if m.engine == "specinfer")
        assert all(m.gguf_type == "pack" for m in cfg.methods if m.engine == "llama_cpp")
    assert cfgs["gguf-llamacpp-batch16"].batch_sizes == (16,)
    assert {m.mode for m in cfgs["gguf-llamacpp-batch16"].methods} == {"plain"}
    qwen = cfgs["gguf-llamacpp-qwen"]
    assert qwen.model == "qwen2.5-coder-1.5b" and "code_editing" in qwen.tasks and qwen.batch_sizes == (1,)
    modes = {(m.engine, m.mode, (m.speculative or {}).get("method")) for m in qwen.methods}
    assert {("llama_cpp", "prompt_lookup", None), ("llama_cpp", "draft_model", None),
            ("specinfer", "plain", "ngram"), ("specinfer", "plain", "draft_model")} <= modes
    assert all(m.draft_model == "qwen2.5-coder-0.5b" for m in qwen.methods if m.mode == "draft_model")


def _smollm2_prompts(llm):
    texts = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef add(a, b):\n",
             "The cat sat on the mat. The dog sat on the log. The cat sat on the"]
    return [list(llm.tokenize(t.encode(), add_bos=True, special=True)) for t in texts]


def test_llama_cpp_prompt_lookup_is_greedy_decoding_on_the_smollm2_pack():
    """Where llama_cpp imports: llama-cpp-python's prompt lookup gives its plain greedy output on
    the SmolLM2 pack (2 prompts, 8 tokens) and really drafted; elsewhere it is unavailable, by name."""
    from specinfer.bench.peers.llama_cpp import LlamaCppEngine

    methods = [{"name": "base", "quantization": "gguf", "role": "baseline"},
               {"name": "plain", "engine": "llama_cpp", "gguf_type": "pack"},
               {"name": "lookup", "engine": "llama_cpp", "gguf_type": "pack", "mode": "prompt_lookup",
                "num_speculative_tokens": 4}]
    cfg = _cfg(methods, model="smollm2-135m", max_tokens=8, ignore_eos=True)
    try:
        plain = LlamaCppEngine(cfg, cfg.methods[1], (2,), max_model_len=128)
    except PeerUnavailable as e:
        assert "llama_cpp is not importable" in str(e)
        with pytest.raises(PeerUnavailable, match="not importable"):
            LlamaCppEngine(cfg, cfg.methods[2], (2,), max_model_len=128)
        return
    lookup = LlamaCppEngine(cfg, cfg.methods[2], (2,), max_model_len=128)
    drafted = []
    inner = lookup.llm.draft_model

    def counting(ids, **kw):
        out = inner(ids, **kw)
        drafted.append(len(out))
        return out

    lookup.llm.draft_model = counting
    prompts = _smollm2_prompts(plain.llm)
    for p in prompts:
        n_plain, _ = plain.run([p], cfg)
        n_lookup, metrics = lookup.run([p], cfg)
        assert n_plain == n_lookup == 8 and metrics is None
        assert lookup.last_token_ids == plain.last_token_ids
    assert sum(drafted) > 0 and max(drafted) <= 4
    with pytest.raises(PeerUnavailable, match="batch 1"):
        lookup.run(prompts, cfg)
    plain.close()
    lookup.close()


# ---------------------------------------------------------------- llama.cpp's native draft-model speculation
_SPEC_METHODS = [{"name": "base", "quantization": "gguf", "role": "baseline"},
                 {"name": "draft", "engine": "llama_cpp", "gguf_type": "pack", "mode": "draft_model",
                  "draft_model": "smollm2-135m", "num_speculative_tokens": 3}]


def test_llama_cpp_draft_model_without_the_binary_is_unavailable_by_name(monkeypatch, tmp_path):
    from specinfer.bench.engines import make_engine
    from specinfer.bench.peers.llama_cpp_native import BIN_ENV

    monkeypatch.delenv(BIN_ENV, raising=False)
    cfg = _cfg(_SPEC_METHODS, model="smollm2-135m")
    with pytest.raises(PeerUnavailable, match=BIN_ENV):
        make_engine(cfg, cfg.methods[1], max_prompt_len=8, eos_token_ids=(2,))
    monkeypatch.setenv(BIN_ENV, str(tmp_path))  # a directory without llama-speculative
    with pytest.raises(PeerUnavailable, match=f"no executable llama-speculative.*{BIN_ENV}"):
        make_engine(cfg, cfg.methods[1], max_prompt_len=8, eos_token_ids=(2,))


_FAKE_SPECULATIVE = r"""#!/bin/sh
# records its arguments and prints what llama-speculative prints
printf '%s\n' "$@" > "$(dirname "$0")/args.txt"
while [ "$1" != "-f" ]; do shift; done
printf '\n\n' ; head -c -1 "$2"; printf ' generated text\n\n\n\n'
cat >&2 <<'ERR'
llama_model_loader: loaded meta data
0.01.940.922 I encoded   NPROMPT tokens in    0.250 seconds, speed:   40.000 t/s
0.01.940.961 I decoded   11 tokens in    0.500 seconds, speed:   22.000 t/s
0.01.940.984 I
0.01.941.006 I n_draft   = 3
0.01.941.027 I n_predict = 11
0.01.941.049 I n_drafted = 9
0.01.941.071 I n_accept  = 7
0.01.941.093 I accept    = 77.778%
ERR
"""


def test_llama_cpp_native_engine_on_a_fake_binary(monkeypatch, tmp_path):
    """The command line (greedy, threads, draft max, -n), the prompt given as text that tokenizes
    to our ids, llama.cpp's own timers reported as last_elapsed_s, and a prompt that does not
    tokenize the same refused."""
    from specinfer.bench.engines import make_engine
    from specinfer.bench.peers.llama_cpp_native import BIN_ENV, _tokenizer
    from specinfer.packs import resolve_pack

    tok, add_bos, bos = _tokenizer(str(resolve_pack("smollm2-135m")))
    ids = tok.encode("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n").ids
    script = tmp_path / "llama-speculative"
    script.write_text(_FAKE_SPECULATIVE.replace("NPROMPT", str(len(ids))))
    script.chmod(0o755)
    monkeypatch.setenv(BIN_ENV, str(tmp_path))
    cfg = _cfg(_SPEC_METHODS, model="smollm2-135m", max_tokens=10, ignore_eos=True, threads=2)
    eng = make_engine(cfg, cfg.methods[1], max_prompt_len=len(ids), eos_token_ids=(2,))
    assert type(eng).__name__ == "LlamaCppNativeEngine"
    n, metrics = eng.run([ids], cfg)
    args = (tmp_path / "args.txt").read_text().split("\n")
    opt = {a: b for a, b in zip(args, args[1:])}
    assert n == 11 and metrics is None and eng.last_elapsed_s == pytest.approx(0.75)
    assert eng.last_stats == {"prompt_tokens": len(ids), "prompt_s": 0.25, "decode_tokens": 11, "decode_s": 0.5,
                              "n_draft": 3, "n_drafted": 9, "n_accept": 7}
    assert opt["--temp"] == "0" and opt["--top-k"] == "1" and opt["--sampling-seq"] == "k"
    assert opt["-n"] == "9" and opt["--spec-draft-n-max"] == "3" and "--ignore-eos" in args
    assert opt["-t"] == opt["-tb"] == opt["-td"] == opt["-tbd"] == "2"
    assert opt["-md"] == opt["-m"] == str(resolve_pack("smollm2-135m")) and int(opt["-c"]) >= len(ids) + 10
    assert eng.last_texts == [" generated text"] and eng.last_token_ids == []
    with pytest.raises(PeerUnavailable, match="not the same prompt"):
        eng.run([ids + ids], cfg)
    with pytest.raises(PeerUnavailable, match="batch 1"):
        eng.run([ids, ids], cfg)
    eng.close()


def test_llama_cpp_native_draft_model_runs_greedy_where_the_binary_is():
    """Where $SPECINFER_LLAMA_CPP_BIN names llama.cpp's binaries: llama-speculative on the SmolLM2
    pack drafted by itself (2 prompts, 8 tokens) emits at least 8 tokens, accepts drafts, times
    itself, and (where llama_cpp imports too) its text starts with llama.cpp's plain greedy text.
    Elsewhere the peer is unavailable, by the variable's name."""
    import os

    from specinfer.bench.engines import make_engine
    from specinfer.bench.peers.llama_cpp_native import BIN_ENV

    cfg = _cfg(_SPEC_METHODS + [{"name": "plain", "engine": "llama_cpp", "gguf_type": "pack"}],
               model="smollm2-135m", max_tokens=8, ignore_eos=True)
    if not os.environ.get(BIN_ENV):
        with pytest.raises(PeerUnavailable, match=BIN_ENV):
            make_engine(cfg, cfg.methods[1], max_prompt_len=64, eos_token_ids=(2,))
        return
    eng = make_engine(cfg, cfg.methods[1], max_prompt_len=64, eos_token_ids=(2,))
    try:
        plain = make_engine(cfg, cfg.methods[2], max_prompt_len=64, eos_token_ids=(2,))
    except PeerUnavailable:
        plain = None
    # prompts without a near tie in their first tokens: llama-speculative evaluates the prompt as
    # n - 1 tokens then 1, which can flip a near tie that a one-batch prefill resolves the other way
    # ("The cat sat on the mat. The dog": " was" 23.155 vs " ran" 23.128 there, the other way here)
    texts = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
             "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"]
    for text in texts:
        ids = eng.tok.encode(text).ids
        n, _ = eng.run([ids], cfg)
        s = eng.last_stats
        assert 8 <= n <= 8 + 3 and s["decode_tokens"] == n and s["n_drafted"] > 0 and s["n_accept"] > 0
        assert eng.last_elapsed_s == pytest.approx(s["prompt_s"] + s["decode_s"]) and eng.last_elapsed_s > 0
        if plain is not None:
            plain.run([ids], cfg)
            expected = plain.llm.detokenize(plain.last_token_ids[0]).decode("utf-8", errors="replace")
            assert eng.last_texts[0].startswith(expected)
    eng.close()
    if plain is not None:
        plain.close()
