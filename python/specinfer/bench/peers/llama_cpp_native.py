"""llama.cpp's own draft-model speculation as a bench peer: the native `llama-speculative` binary
(llama.cpp's examples/speculative), one process per prompt, batch 1, greedy. llama-cpp-python has
no draft-model speculation of llama.cpp's (only its Python prompt lookup), hence the binary.

What runs, per prompt: `llama-speculative -m TARGET -md DRAFT -f PROMPT_FILE -n N --spec-draft-n-max k
--temp 0 --top-k 1 --sampling-seq k -t/-tb/-td/-tbd threads -c ctx [--ignore-eos] [--no-repack]`.
- target: the method's GGUF (`gguf_type`, resolved as for the in-process llama.cpp peer); draft: the
  method's `draft_model` (a pack name or .gguf file) as stored.
- the same prompt token ids as every method: our ids are detokenized with the target file's
  tokenizer (special tokens kept as text, a leading BOS left to llama.cpp) and llama.cpp tokenizes
  that text again (parse_special; the file gets one extra newline, which `-f` strips); the prompt
  length it reports must equal ours (or ours + 1, a BOS llama.cpp adds), or the run is refused.
- greedy: temperature 0 takes llama-speculative's greedy verification branch; `--top-k 1
  --sampling-seq k` makes its sampler chain a plain argmax (after the EOS bias of --ignore-eos).
  The drafts are the draft model's argmax, `k` per step (llama-speculative has no early stop).
- llama-speculative stops once it has emitted more than `-n` tokens, after a whole verification
  step: `-n max_tokens - 1` gives at least max_tokens, at most max_tokens + k; the count reported is
  the number llama.cpp decoded (its `n_predict`), the tokens its timer covers.

What is measured: `last_elapsed_s`, set after each run(), is llama.cpp's own timers, prompt
evaluation of target and draft ("encoded ... in s") plus the decode loop ("decoded ... in s"): end
to end from the prompt's token ids, like the other methods' rows, but without process start, model
loading, llama.cpp's warm-up run and prompt tokenization, which come before its timer starts. A
runner that reads `last_elapsed_s` uses it in place of its own clock around run(); a runner that
does not times the whole process, loading included, and understates this peer's speed.
`last_child_cpu_s` is the process's whole CPU time (loading included: not comparable with the
others' CPU time). `last_stats` keeps the raw figures (prompt and decode seconds, drafted and
accepted counts). The generated token ids are not printed by the binary, so this peer has no
greedy-agreement row; `last_texts` keeps the text.
"""
from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import tempfile

from specinfer.bench.config import BenchConfig, MethodConfig
from specinfer.bench.peers import PeerUnavailable
from specinfer.bench.peers.gguf_files import model_file, resolve_gguf

BIN_ENV = "SPECINFER_LLAMA_CPP_BIN"
BINARY = "llama-speculative"
TIMEOUT_S = 1800  # one prompt; a hung process must not hang the bench

_ENCODED = re.compile(r"encoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds")
_DECODED = re.compile(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds")
_COUNTS = re.compile(r"\b(n_draft|n_predict|n_drafted|n_accept)\s*=\s*(\d+)")  # lines carry a log prefix


def find_binary(cfg: BenchConfig, name: str = BINARY) -> str:
    """The native binary `name` from config.llama_cpp_bin or $SPECINFER_LLAMA_CPP_BIN (a directory)."""
    directory = cfg.llama_cpp_bin or os.environ.get(BIN_ENV)
    if not directory:
        raise PeerUnavailable(f"llama.cpp's native {name} is not configured: set {BIN_ENV} (or the config's "
                              f"llama_cpp_bin) to the directory holding {name} (docs/benchmarking.md)")
    path = os.path.join(directory, name)
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise PeerUnavailable(f"no executable {name} in {directory!r} ({BIN_ENV} / llama_cpp_bin)")
    return path


def parse_output(stderr: str) -> dict:
    """llama-speculative's summary lines -> prompt/decode token counts and seconds, drafted/accepted."""
    enc, dec = _ENCODED.search(stderr), _DECODED.search(stderr)
    if enc is None or dec is None:
        raise PeerUnavailable(f"llama-speculative printed no timing lines: {stderr.strip()[-600:]}")
    counts = {k: int(v) for k, v in _COUNTS.findall(stderr)}
    return {"prompt_tokens": int(enc.group(1)), "prompt_s": float(enc.group(2)),
            "decode_tokens": int(dec.group(1)), "decode_s": float(dec.group(2)),
            "n_draft": counts.get("n_draft"), "n_drafted": counts.get("n_drafted"),
            "n_accept": counts.get("n_accept")}


def _tokenizer(path: str):
    """(tokenizer, add_bos, bos id) of a GGUF file, from its metadata only."""
    from specinfer.loader.gguf_file import GGUFFile
    from specinfer.loader.gguf_tokenizer import build_gguf_tokenizer

    reader = GGUFFile(path)
    meta = {k: v for k, v in reader.fields.items() if not k.startswith("GGUF.")}
    tok, add_bos = build_gguf_tokenizer(meta, path)
    return tok, add_bos, meta.get("tokenizer.ggml.bos_token_id")


class LlamaCppNativeEngine:
    def __init__(self, cfg: BenchConfig, method: MethodConfig, eos_token_ids, max_model_len: int,
                 log=lambda m: None):
        if method.mode != "draft_model":
            raise ValueError(f"the native llama.cpp peer runs mode 'draft_model' (got {method.mode!r})")
        self.binary = find_binary(cfg)  # first: a missing binary is reported before any file is made
        model = method.model or cfg.model
        gguf_type = "pack" if model.endswith(".gguf") and method.model else (method.gguf_type or "f32")
        self.target = resolve_gguf(model, gguf_type, convert_script=cfg.llama_cpp_convert, threads=cfg.threads,
                                   log=log)
        self.draft = model_file(method.draft_model)
        if not self.draft.endswith(".gguf"):
            raise PeerUnavailable(f"draft_model {method.draft_model!r} is not a .gguf file ({self.draft})")
        self.k = method.num_speculative_tokens
        self.ctx = -(-(max_model_len + self.k + 16) // 256) * 256
        self.extra_buffers = cfg.llama_cpp_extra_buffers
        self.tok, self.add_bos, self.bos = _tokenizer(self.target)
        self.tmp = tempfile.mkdtemp(prefix="specinfer-llama-spec-")
        self.last_token_ids: list[list[int]] = []  # not printed by the binary: no agreement row
        self.last_texts: list[str] = []
        self.last_elapsed_s: float | None = None
        self.last_child_cpu_s = 0.0
        self.last_stats: dict | None = None

    def command(self, prompt_file: str, cfg: BenchConfig) -> list[str]:
        t = str(cfg.threads)
        cmd = [self.binary, "-m", self.target, "-md", self.draft, "-f", prompt_file,
               "-n", str(max(cfg.max_tokens - 1, 0)), "--spec-draft-n-max", str(self.k), "-np", "1",
               "--temp", "0", "--top-k", "1", "--sampling-seq", "k",
               "-t", t, "-tb", t, "-td", t, "-tbd", t, "-c", str(self.ctx)]
        if cfg.ignore_eos:
            cmd.append("--ignore-eos")
        if not self.extra_buffers:
            cmd.append("--no-repack")
        return cmd

    def prompt_text(self, ids: list[int]) -> str:
        if self.add_bos and ids and ids[0] == self.bos:
            ids = ids[1:]  # llama.cpp adds its own
        return self.tok.decode(ids, skip_special_tokens=False)

    def run(self, prompts: list[list[int]], cfg: BenchConfig, seed: int = 0) -> tuple[int, None]:
        if cfg.temperature > 0:
            raise PeerUnavailable("the llama.cpp draft-model peer runs greedy decoding only (config.temperature > 0)")
        if len(prompts) != 1:
            raise PeerUnavailable(f"llama.cpp's llama-speculative runs batch 1 only (got {len(prompts)} prompts)")
        ids = prompts[0]
        text = self.prompt_text(ids)
        path = os.path.join(self.tmp, "prompt.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")  # `-f` drops one trailing newline; a chat prompt ends with one of its own
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        try:
            proc = subprocess.run(self.command(path, cfg), capture_output=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise PeerUnavailable(f"llama-speculative ran over {TIMEOUT_S} s") from None
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.last_child_cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        out = proc.stdout.decode("utf-8", errors="replace")
        err = proc.stderr.decode("utf-8", errors="replace")
        if proc.returncode != 0:
            raise PeerUnavailable(f"llama-speculative failed (exit {proc.returncode}): {err.strip()[-800:]}")
        stats = parse_output(err)
        n = stats["prompt_tokens"]
        if n not in (len(ids), len(ids) + 1):  # + 1: a BOS llama.cpp adds that our ids lack
            raise PeerUnavailable(f"llama.cpp tokenized the prompt text to {n} tokens, ours are {len(ids)}: "
                                  "not the same prompt")
        # stdout: "\n\n", the prompt as llama.cpp's pieces, the generated text, "\n\n\n\n"
        start = out.find(text)
        generated = out[start + len(text):] if start >= 0 else out
        self.last_texts = [generated[:-4] if generated.endswith("\n\n\n\n") else generated]
        self.last_stats = stats
        self.last_elapsed_s = stats["prompt_s"] + stats["decode_s"]
        self.last_token_ids = []
        return stats["decode_tokens"], None

    def close(self):
        if getattr(self, "tmp", None):
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
