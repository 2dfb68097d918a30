"""HF model directories: config.json, safetensors (single or sharded), tokenizer.json.

Weights stream shard by shard into the model's fused parameters, so peak memory is the model
plus one tensor. Every failure names the file it came from.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Iterator

import tokenizers
import torch
from safetensors import safe_open

from specinfer.loader.loaded import LoadedModel
from specinfer.models.config import ModelConfig
from specinfer.models.llama import LlamaForCausalLM


MAX_JSON_BYTES = 64 * 2**20  # config / index / tokenizer_config files: far above any real one


def _read_json(path: str, *, required: bool) -> dict | None:
    """A model directory's JSON file, read with a size limit (model files are untrusted: a
    config.json that is /dev/zero or gigabytes long is refused, not read until memory runs out)."""
    if not os.path.exists(path):
        if required:
            raise FileNotFoundError(f"missing {os.path.basename(path)}: {path}")
        return None
    if not os.path.isfile(path):
        raise ValueError(f"{path}: not a regular file")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
        if len(raw) > MAX_JSON_BYTES:
            raise ValueError(f"{path}: larger than {MAX_JSON_BYTES} bytes (not a model's JSON file)")
        obj = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object (got {type(obj).__name__})")
    return obj


def _shard_files(model_dir: str) -> list[str]:
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    index = _read_json(index_path, required=False)
    if index is not None:
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path}: weight_map must be a non-empty object of tensor name -> shard file")
        bad = next((n for n in weight_map.values() if not isinstance(n, str) or not n), None)
        if bad is not None or any(not isinstance(n, str) for n in weight_map.values()):
            raise ValueError(f"{index_path}: weight_map shard names must be file names (got {bad!r})")
        root = os.path.realpath(model_dir)
        files = []
        for name in sorted(set(weight_map.values())):
            f = os.path.realpath(os.path.join(root, name))
            if os.path.isabs(name) or os.path.commonpath([root, f]) != root or f == root:
                raise ValueError(f"{index_path}: weight_map shard {name!r} resolves outside the model directory")
            if not os.path.isfile(f):
                raise FileNotFoundError(
                    f"missing safetensors shard listed in the index: {os.path.join(model_dir, name)}")
            files.append(f)
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def _safetensors_weights(files: list[str], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name).to(dtype)
        except Exception as e:  # safetensors raises its own SafetensorError (an Exception)
            raise ValueError(f"{file}: corrupted or truncated safetensors file ({type(e).__name__}: {e})") from e


def _check_config_against_weights(cfg, files: list[str], config_json: str) -> None:
    """Refuse a config whose sizes the weights present cannot back (an absurd hidden_size or
    layer count would otherwise reach torch.empty as an out-of-memory "internal error")."""
    present = 0
    for file in files:
        try:
            with safe_open(file, framework="np") as f:
                for name in f.keys():
                    n = 1
                    for d in f.get_slice(name).get_shape():
                        n *= int(d)
                    present += n
        except Exception as e:  # noqa: BLE001 - safetensors' own error type
            raise ValueError(f"{file}: corrupted or truncated safetensors file ({type(e).__name__}: {e})") from e
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    per_layer = H * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * H * I
    implied = cfg.vocab_size * H + cfg.num_layers * per_layer
    if implied > 2 * present + 2**20:
        raise ValueError(f"{config_json}: describes a model of {implied:,} parameters (vocab_size {cfg.vocab_size}, "
                         f"hidden_size {H}, intermediate_size {I}, {cfg.num_layers} layers) but the weights hold "
                         f"{present:,} values: the config does not belong to these weights")


def _token_id(tokenizer: tokenizers.Tokenizer, token) -> int | None:
    if isinstance(token, dict):  # serialized AddedToken
        token = token.get("content")
    return tokenizer.token_to_id(token) if isinstance(token, str) else None


def _ids(value, where: str) -> list[int]:
    """A token id or a list of them (HF writes both) -> list[int]; anything else names `where`."""
    if value is None:
        return []
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if any(not isinstance(v, int) or isinstance(v, bool) for v in values):
        raise ValueError(f"{where} must be a token id or a list of token ids (got {value!r})")
    return values


def check_special_ids(ids, vocab_size: int, where: str) -> None:
    """Every id in [0, vocab_size), or ValueError naming where it came from."""
    for i in ids:
        if not 0 <= i < vocab_size:
            raise ValueError(f"{where} = {i} is outside the vocabulary [0, {vocab_size})")


def ensure_bos(tokenizer: tokenizers.Tokenizer, bos_token_id: int | None, wanted: bool) -> bool:
    """Make `tokenizer.encode` prepend BOS when `wanted`; -> whether encode adds BOS now."""
    if bos_token_id is None:
        return False

    def adds() -> bool:
        ids = tokenizer.encode("a").ids
        return bool(ids) and ids[0] == bos_token_id

    if wanted and not adds():
        bos = tokenizer.id_to_token(bos_token_id)
        tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_token_id)]
        )
    return adds()


def load_hf_dir(model_dir: str, *, dtype: torch.dtype, device, quantization: str | None = None) -> LoadedModel:
    hf_config = _read_json(os.path.join(model_dir, "config.json"), required=True)
    try:
        cfg = ModelConfig.from_hf_config(hf_config)
    except KeyError as e:
        raise ValueError(f"{model_dir}/config.json: missing field {e}") from e
    except (ValueError, TypeError) as e:  # TypeError: a field of the wrong JSON type
        raise ValueError(f"{model_dir}/config.json: {e}") from e
    gen_config = _read_json(os.path.join(model_dir, "generation_config.json"), required=False) or {}
    tok_config = _read_json(os.path.join(model_dir, "tokenizer_config.json"), required=False) or {}

    tok_path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(tok_path):
        raise FileNotFoundError(f"missing tokenizer.json (only fast tokenizers are supported): {tok_path}")
    try:
        tokenizer = tokenizers.Tokenizer.from_file(tok_path)
    except Exception as e:
        raise ValueError(f"{tok_path}: unreadable tokenizer ({e})") from e

    config_json = os.path.join(model_dir, "config.json")
    gen_json = os.path.join(model_dir, "generation_config.json")
    V = cfg.vocab_size
    check_special_ids([] if cfg.bos_token_id is None else [cfg.bos_token_id], V, f"{config_json}: bos_token_id")
    check_special_ids(cfg.eos_token_ids, V, f"{config_json}: eos_token_id")
    gen_bos = _ids(gen_config.get("bos_token_id"), f"{gen_json}: bos_token_id")
    gen_eos = _ids(gen_config.get("eos_token_id"), f"{gen_json}: eos_token_id")
    check_special_ids(gen_bos, V, f"{gen_json}: bos_token_id")
    check_special_ids(gen_eos, V, f"{gen_json}: eos_token_id")
    bos = cfg.bos_token_id
    if bos is None:
        bos = (gen_bos or [None])[0]
    if bos is None:
        bos = _token_id(tokenizer, tok_config.get("bos_token"))
    eos: list[int] = []
    for i in list(cfg.eos_token_ids) + gen_eos:
        if i not in eos:
            eos.append(i)
    if not eos and (tok_eos := _token_id(tokenizer, tok_config.get("eos_token"))) is not None:
        eos.append(tok_eos)
    tok_json = os.path.join(model_dir, "tokenizer_config.json")
    check_special_ids(eos, V, f"{tok_json}: eos_token")
    check_special_ids([] if bos is None else [bos], V, f"{tok_json}: bos_token")

    shards = _shard_files(model_dir)
    _check_config_against_weights(cfg, shards, config_json)  # before anything is allocated from it
    model = LlamaForCausalLM(cfg, dtype=dtype, device=device, quantization=quantization)
    # int8: tensors arrive in float32 and are quantized one by one (never a whole float copy)
    model.load_weights(_safetensors_weights(shards, torch.float32 if model.quantization else dtype), source=model_dir)
    model.eval()

    add_bos = ensure_bos(tokenizer, bos, bool(tok_config.get("add_bos_token", False)))

    chat_template = tok_config.get("chat_template")
    jinja = os.path.join(model_dir, "chat_template.jinja")
    if chat_template is None and os.path.exists(jinja):
        with open(jinja, encoding="utf-8") as f:
            chat_template = f.read()
    if isinstance(chat_template, list):  # [{"name": "default", "template": ...}, ...]
        by_name = {t.get("name"): t.get("template") for t in chat_template}
        chat_template = by_name.get("default") or next(iter(by_name.values()), None)

    return LoadedModel(
        model=model, config=cfg, tokenizer=tokenizer, bos_token_id=bos, eos_token_ids=tuple(eos),
        add_bos_token=add_bos, chat_template=chat_template, source=model_dir,
    )
